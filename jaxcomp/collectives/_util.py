"""Helpers shared by the all-reduce algorithms.

Payloads travel as :class:`~jaxcomp.Payload` objects whose arrays may carry
leading axes (one per stacked tensor); the metadata describes one tensor.
Everything here reads the codec protocol (:mod:`jaxcomp.codecs.base`), never
a particular codec.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._axes import describe_bound_axes
from jaxcomp._ffi import cpu_available, cuda_available, resolve_backend
from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.payload import Payload


def axis_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"jc.psum: axis name {axis_name!r} is not bound here; call it inside jax.shard_map "
            "or jax.pmap over a mesh axis of that name." + describe_bound_axes()
        ) from e


def device_key(codec: Codec, key, axis_name) -> jax.Array | None:
    """The key a device encodes with (stochastic codecs): the caller's key
    folded with the device's index, so devices draw independent bits; for a
    linear codec the caller's key itself, since the payloads of all devices
    must be drawn alike to be summed."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(f"jc.psum: {codec!r} is stochastic and needs key=")
    if codec.rate is Rate.LINEAR:
        return key
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def fold(key, i: int | jax.Array):
    return None if key is None else jax.random.fold_in(key, i)


def after(x, dep):
    """``x`` (a pytree of arrays), made to wait for ``dep`` (a pytree) on
    XLA:CPU.

    XLA:CPU's thunk executor runs independent operations in whatever order
    they become ready, device by device, handing some to a small thread
    pool. Two independent chains of collectives (two buckets' all-reduces,
    one with its collectives nested in a conditional: the capacity tiers of
    :func:`transfer`) can then be entered in different orders by different
    devices, each waiting in a rendezvous its peers do not reach while the
    pool's threads are taken: XLA aborts the process after its rendezvous
    timeout (seen under load in about 1 run in 4 of a hierarchical 3LC step
    with two buckets). A data dependency from the previous chain's outputs
    gives every device the same order. ``lax.optimization_barrier`` does not
    serve: XLA:CPU removes it after scheduling, and its thunk executor
    follows data dependencies, not the schedule. So every element of ``x``
    gets ``-0.0`` added (the identity, bit for bit, for every float), a
    ``-0.0`` computed from a bit of each leaf of ``dep`` that XLA cannot
    fold away (integers get 0); it fuses into whatever computes ``x``. Other platforms issue
    collectives in program order, and keep the freedom to overlap chains.
    """
    deps = [d for d in map(jnp.asarray, jax.tree.leaves(dep)) if d.size]
    if not deps:
        return x

    def tie(x, *deps):
        # popcount of 32 bits >> 6 is 0: -0.0's bits, from data at run time.
        count = sum(
            lax.population_count(
                lax.bitcast_convert_type(d.reshape(-1)[0].astype(jnp.float32), jnp.uint32)
            )
            for d in deps
        )
        zero = lax.bitcast_convert_type(jnp.uint32(0x80000000) | (count >> 6), jnp.float32)
        return jax.tree.map(lambda a: a + zero.astype(a.dtype), x)

    return lax.platform_dependent(x, *deps, cpu=tie, default=lambda x, *deps: x)


def decode_f32(payload: Payload, backend: str = "auto") -> jax.Array:
    """One tensor's payload decoded, flat, in float32. ``backend`` as for
    ``Codec.decode``, or "fused" (:func:`fused_backend`)."""
    if backend == "fused":
        arrays = tuple(payload.arrays.values())

        def run(b):
            return lambda *a: decode_f32(payload.codec.payload(a, payload.shape, payload.dtype), b)

        # The kernel on the CPU, the twin (fused by XLA) elsewhere; either
        # way "auto" still honours JAXCOMP_BACKEND=xla.
        return lax.platform_dependent(*arrays, cpu=run("auto"), default=run("xla"))
    return payload.codec.decode(payload, backend=backend).reshape(-1).astype(jnp.float32)


def fused_backend(codec: Codec) -> str:
    """The backend the collectives decode with: "fused" where the codec's
    decode is element-wise (``Codec.elementwise_decode``), "auto" (the
    kernel) otherwise.

    "fused" is the pure-JAX twin on GPUs (and wherever no kernel is built
    for the platform), so that XLA fuses the decode into what consumes it
    (a sum over the received payloads, the residual update, the split into
    leaves) instead of the kernel writing a full-size float32 tensor that
    is read again; and the kernel on the CPU, where XLA's fused loops of
    the twins run several times slower than the kernels (the optimizer step
    and the emulated-link all-reduce measured both ways: docs/benchmarks.md,
    "The optimizer step" and "Compressed all-reduce over emulated links").
    The twin gives the kernel's bits
    (the contract suite checks it); fused, XLA may contract a decoded
    product and the add it feeds into one FMA, so sums and residuals can
    differ from the kernel path's in the last bit, never more (every
    device runs the same program, so the result is still identical on
    every device)."""
    return "fused" if codec.elementwise_decode else "auto"


def decode_sum(payload: Payload) -> jax.Array:
    """Stacked payloads (one leading axis) decoded and summed in row order
    (float32), writing only the sum, not a float32 row per device: through
    the codec's decode-and-accumulate kernel where it has one
    (``Codec.decode_sum_kernel``) and the kernels are built, else through
    :func:`fused_backend` (on GPUs, an element-wise twin decode fused into
    the sum, one pass)."""
    codec = payload.codec
    if (
        codec.decode_sum_kernel
        and payload.dtype == jnp.float32
        and resolve_backend("auto") != "xla"
        and (cpu_available() or cuda_available())
    ):
        return codec.decode_sum(payload)
    return ordered_sum(decode_rows(payload, fused_backend(codec)))


def decode_own(payload: Payload) -> jax.Array:
    """A payload this device made, decoded (flat, float32) for what it
    keeps: ``sent``, or a server residual ``target - decoded``.

    With :func:`fused_backend`: on GPUs XLA fuses the decode into the
    residual update, so error feedback costs one pass over the gradient
    instead of a full-size decoded tensor written and read again."""
    return decode_f32(payload, fused_backend(payload.codec))


def decode_rows(payload: Payload, backend: str = "auto") -> jax.Array:
    """Stacked payloads (one leading axis) of ``n`` values each -> float32
    ``[rows, n]``: one decode of the joined payload where the codec splits
    at ``n``, else one batched decode."""
    codec, n = payload.codec, payload.size
    rows = next(iter(payload.arrays.values())).shape[0]
    g = codec.split_granularity()
    if g and n % g == 0:
        joined = payload.map(lambda a: a.reshape(rows * a.shape[1], *a.shape[2:]))
        joined = Payload(codec, (rows * n,), payload.dtype, joined.arrays)
        return decode_f32(joined, backend).reshape(rows, n)
    return jax.vmap(lambda p: decode_f32(p, backend))(payload)


def split(payload: Payload, parts: int) -> Payload:
    """One payload as ``parts`` stacked payloads of its consecutive chunks
    (the codec must split at ``size / parts``)."""
    stacked = payload.map(lambda a: a.reshape(parts, a.shape[0] // parts, *a.shape[1:]))
    return Payload(payload.codec, (payload.size // parts,), payload.dtype, stacked.arrays)


def ordered_sum(rows: jax.Array) -> jax.Array:
    """Sum over the leading axis, left to right: the same order everywhere."""
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


def chunked(flat: jax.Array, parts: int) -> tuple[jax.Array, int]:
    c = -(-flat.size // parts) if flat.size else 0
    return jnp.pad(flat, (0, parts * c - flat.size)).reshape(parts, c), c


def chunk_len(codec: Codec, n: int, parts: int) -> int:
    """Elements per chunk when ``n`` values are split over ``parts`` devices:
    ceil(n / parts), rounded up to the codec's split granularity, so that one
    encoding of the whole padded tensor splits into per-chunk payloads."""
    c = -(-n // parts) if n else 0
    g = codec.split_granularity()
    return -(-c // g) * g if g else c


def owner_stage(codec: Codec, reduced: jax.Array, div: int, state, key, dtype):
    """The last compression of a reduced chunk, by the device that owns it
    (two-phase, the ring's last scatter-reduce step, the sparse split's
    dense stage).

    With a server residual ``state`` (float32, the chunk's length, in units
    of the result: of the mean for ``pmean``), the owner compresses
    ``reduced / div + state`` and keeps what that compression missed as the
    new state: two-level error feedback, each residual at the scale of what
    it compresses (DeepSpeed's compressed all-reduce for 1-bit Adam keeps a
    worker and a server error the same way). Without one (``state`` None)
    the error is returned in units of the sum, for the caller to charge to
    the owner's ``sent`` (one-level error feedback).

    Returns:
      ``(payload, decoded float32, new_state, error)``: ``new_state`` None
      without a state, ``error`` None with one.
    """
    target = reduced if div == 1 else reduced / div
    if state is not None:
        target = target + state
    payload = codec.encode(target.astype(dtype), key)
    hat = decode_own(payload)
    if state is not None:
        return payload, hat, target - hat, None
    error = hat - reduced if div == 1 else hat * div - reduced
    return payload, hat, None, error


def padded(flat: jax.Array, total: int) -> jax.Array:
    return flat if flat.size == total else jnp.pad(flat, (0, total - flat.size))


def as_bits(a: jax.Array) -> jax.Array:
    # XLA's CPU backend widens 16-bit float collectives to float32 (twice the
    # bytes, plus conversion passes); payloads travel as their bit patterns.
    if a.dtype in (jnp.bfloat16, jnp.float16):
        return lax.bitcast_convert_type(a, jnp.uint16)
    return a


# ---------------------------------------------------------------------------
# What crossed the wire, observed at run time
# ---------------------------------------------------------------------------
_LOGS: list[list[tuple[str, int]]] = []


@contextlib.contextmanager
def wire_log() -> Iterator[list[tuple[str, int]]]:
    """Records the bytes each collective of ``jc.psum``/``jc.pmean`` hands
    over, as the program runs: ``(kind, operand bytes)`` per collective per
    device, kind as in :func:`operand_nbytes`. Only calls *traced* inside
    the ``with`` block record (jit a fresh function there); for capacity
    tiers the entry is the tier that was taken, so the log shows the bytes
    following the data. Costs a host callback per collective: for
    measurements and tests, not for training.
    """
    log: list[tuple[str, int]] = []
    _LOGS.append(log)
    try:
        yield log
    finally:
        _LOGS.remove(log)


def record(kind: str, arrays) -> None:
    """Logs (at run time) the operand bytes of one collective, if a
    :func:`wire_log` is open while this is traced."""
    if not _LOGS:
        return
    log = _LOGS[-1]
    nbytes = sum(int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in arrays)
    jax.debug.callback(lambda: log.append((kind, nbytes)))


def exchange(op: Callable[[jax.Array], jax.Array], payload: Payload, kind: str) -> Payload:
    """Applies a data-moving collective to a payload, moving raw bits.

    A payload of several arrays (codes and scales) travels as one byte
    buffer, their bytes side by side (per row for ``kind`` "all-to-all",
    whose arrays are stacked per destination): one collective instead of
    one per array. On the CPU test bed the second, small collective of each
    phase cost as much as a third of the first one's time (a rendezvous of
    every process, then gloo's rounds), for a few hundred KiB.
    """
    record(kind, payload.arrays.values())
    arrays = payload.arrays
    if len(arrays) == 1:
        return payload.map(lambda a: _move(op, a))
    stacked = kind == "all-to-all"
    rows = next(iter(arrays.values())).shape[0] if stacked else None
    parts, sizes = [], []
    for a in arrays.values():
        b = as_bytes(a)
        b = b.reshape(rows, b.size // rows) if stacked else b.reshape(-1)
        parts.append(b)
        sizes.append(b.shape[-1])
    moved = op(jnp.concatenate(parts, axis=-1))
    prefix = moved.shape[:-1]
    out, start = {}, 0
    for (name, a), size in zip(arrays.items(), sizes, strict=True):
        piece = lax.slice_in_dim(moved, start, start + size, axis=moved.ndim - 1)
        start += size
        inner = a.shape[1:] if stacked else a.shape
        out[name] = from_bytes(piece, prefix + inner, a.dtype)
    return Payload(payload.codec, payload.shape, payload.dtype, out)


def _move(op, a):
    b = op(as_bits(a))
    return b if b.dtype == a.dtype else lax.bitcast_convert_type(b, a.dtype)


def as_bytes(a: jax.Array) -> jax.Array:
    """``a``'s bytes, uint8 ``a.shape + (itemsize,)`` (itemsize 1: ``a.shape``)."""
    return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)


def from_bytes(b: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """Inverse of :func:`as_bytes`: uint8 bytes back to ``dtype[shape]``."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.uint8:
        return b.reshape(shape)
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(b.reshape(shape), dtype)
    return lax.bitcast_convert_type(b.reshape(*shape, dtype.itemsize), dtype)


# ---------------------------------------------------------------------------
# Variable-rate payloads: capacity tiers
# ---------------------------------------------------------------------------
def tier_capacities(codec: Codec, n: int) -> tuple[int, ...]:
    """The static buffer capacities a variable-rate payload may travel in.

    Args:
      codec: a variable-rate codec.
      n: elements of the tensor.
    Returns:
      Capacities in bytes, ascending (the codec's ``capacity_tiers``).
    """
    if codec.rate is not Rate.VARIABLE:
        raise ValueError(f"tier_capacities: {codec!r} is not a variable-rate codec")
    return codec.capacity_tiers(n)


def own_capacity(codec: Codec, payload: Payload) -> Payload:
    """A payload received in a capacity tier, back at ``codec``'s own
    capacity (to forward it, as the ring does)."""
    if payload.codec == codec:
        return payload
    full = payload.codec.with_capacity(payload, codec.stream_capacity(payload.size))
    return Payload(codec, payload.shape, payload.dtype, full.arrays)


def transfer(
    payload: Payload,
    axis_name,
    kind: str,
    op: Callable[[jax.Array], jax.Array],
    consume: Callable[[Payload], jax.Array | tuple],
):
    """Moves a payload (possibly stacked) with the collective ``op`` and
    hands what arrives to ``consume``.

    Fixed-size payloads: exactly that. Variable-rate codecs: a ``pmax`` over
    the axis agrees on the longest stream, and ``lax.switch`` picks the
    smallest capacity tier that holds it, so the bytes on the wire follow
    the data while every shape stays static; nothing is ever truncated
    (the last tier is the full size, which every stream fits). ``consume``
    must then return the same structure whatever the tier.
    """
    codec = payload.codec
    if codec.rate is not Rate.VARIABLE:
        return consume(exchange(op, payload, kind))
    caps = codec.capacity_tiers(payload.size)
    need = lax.pmax(jnp.max(codec.stream_length(payload)), axis_name)
    index = tier_index(need, caps)

    def branch(cap):
        return lambda p: consume(exchange(op, codec.with_capacity(p, cap), kind))

    return lax.switch(index, [branch(c) for c in caps], payload)


def tier_index(need: jax.Array, caps: tuple[int, ...]) -> jax.Array | int:
    """The index of the smallest of the ascending capacities ``caps`` that
    holds ``need`` bytes (the last one holds anything), for ``lax.switch``."""
    return jnp.sum(need > jnp.asarray(caps[:-1], jnp.int32)) if len(caps) > 1 else 0
