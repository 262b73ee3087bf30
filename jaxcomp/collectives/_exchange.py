"""Moving payloads with JAX collectives, and the log of what crossed the wire.

A collective is named by its kind, as the compiled HLO names it and as
:func:`jaxcomp.collectives.operand_nbytes` counts it: "all-gather",
"all-to-all", "collective-permute" (to the next device of a ring) or
"all-reduce".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives._order import after
from jaxcomp.payload import Payload


def _to_next(a: jax.Array, axis) -> jax.Array:
    size = lax.axis_size(axis)
    return lax.ppermute(a, axis, [(d, (d + 1) % size) for d in range(size)])


def pairwise(a: jax.Array, axis) -> jax.Array:
    """``lax.all_to_all(a, axis, 0, 0)`` as ``size - 1`` rounds of
    ``ppermute``: in round ``k`` every device sends its row for device
    ``me + k`` there and receives the row device ``me - k`` has for it,
    the pairwise exchange of MPICH's all-to-all for long messages (Thakur,
    Rabenseifner and Gropp, 2005). Each device has one flow in flight at a
    time where the all-to-all posts its ``size - 1`` sends at once; over
    TCP into a shallow queue those overflow it and lose packets
    (docs/choosing.md, "The all-to-all loses packets"). The same bytes
    arrive in the same places, bit for bit. Each round waits for the
    previous one's result (:func:`~jaxcomp.collectives.after`), so that
    every device enters them in one order on XLA:CPU."""
    size = lax.axis_size(axis)
    if size == 1:
        return a
    me = lax.axis_index(axis)
    got = [lax.dynamic_index_in_dim(a, me, 0, keepdims=False)]  # got[k]: from me - k
    for k in range(1, size):
        row = lax.dynamic_index_in_dim(a, (me + k) % size, 0, keepdims=False)
        got.append(
            lax.ppermute(after(row, got[-1]), axis, [(d, (d + k) % size) for d in range(size)])
        )
    # row j of the result came from device j, in round (me - j) mod size
    return jnp.take(jnp.stack(got), (me - jnp.arange(size)) % size, axis=0)


#: How the all-to-all may travel (``jc.psum``'s ``all_to_all``).
ALL_TO_ALL = ("auto", "native", "pairwise")


def check_all_to_all(how: str, who: str) -> str:
    """``how``, one of :data:`ALL_TO_ALL`, or a ValueError from ``who``."""
    if how not in ALL_TO_ALL:
        raise ValueError(f"{who}: all_to_all must be one of {ALL_TO_ALL}, got {how!r}")
    return how


def _all_to_all(how: str) -> Callable[[jax.Array, object], jax.Array]:
    """The all-to-all of row ``j`` of an array to device ``j``: XLA's own
    ("native") or :func:`pairwise`; "auto" is pairwise where the devices
    belong to several processes of the CPU backend, whose collectives go
    over TCP (docs/collectives.md, "How the all-to-all travels"), XLA's
    elsewhere."""
    if how == "auto":
        how = "pairwise" if jax.process_count() > 1 and jax.default_backend() == "cpu" else "native"
    if how == "pairwise":
        return pairwise
    return lambda a, axis: lax.all_to_all(a, axis, 0, 0)


# The data-moving collective of each kind but the all-to-all, over one axis.
_MOVES: dict[str, Callable[[jax.Array, object], jax.Array]] = {
    "all-gather": lambda a, axis: lax.all_gather(a, axis),
    "collective-permute": _to_next,
}


def collective(kind: str, axis, all_to_all: str = "auto") -> Callable[[jax.Array], jax.Array]:
    """The data-moving collective ``kind`` over ``axis``, on one array:
    all-gather (every device's operand to every device, stacked), all-to-all
    (row j of the operand to device j, as ``all_to_all`` says, one of
    :data:`ALL_TO_ALL`) or collective-permute (to the next device of the
    ring)."""
    move = _all_to_all(all_to_all) if kind == "all-to-all" else _MOVES[kind]
    return lambda a: move(a, axis)


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


# ---------------------------------------------------------------------------
# Payloads through a collective, as raw bits
# ---------------------------------------------------------------------------
def exchange(payload: Payload, kind: str, axis, all_to_all: str = "auto") -> Payload:
    """Applies the data-moving collective ``kind`` over ``axis`` to a
    payload, moving raw bits.

    A payload of several arrays (codes and scales) travels as one byte
    buffer, their bytes side by side (per row for ``kind`` "all-to-all",
    whose arrays are stacked per destination): one collective instead of
    one per array, since each collective costs a rendezvous of every
    process on top of its bytes (docs/benchmarks.md, "Compressed all-reduce
    over emulated links"). ``all_to_all``: as in
    :func:`collective`.
    """
    op = collective(kind, axis, all_to_all)
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


def as_bits(a: jax.Array) -> jax.Array:
    """16-bit floats as their bit patterns (uint16), other arrays as they
    are: XLA's CPU backend widens 16-bit float collectives to float32 (twice
    the bytes, plus conversion passes)."""
    if a.dtype in (jnp.bfloat16, jnp.float16):
        return lax.bitcast_convert_type(a, jnp.uint16)
    return a


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
