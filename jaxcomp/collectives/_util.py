"""Helpers shared by the all-reduce algorithms."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.payload import Payload


def axis_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"jc.psum: axis name {axis_name!r} is not bound here; call it inside jax.shard_map "
            "or jax.pmap over a mesh axis of that name"
        ) from e


def device_key(codec: Codec, key, axis_name) -> jax.Array | None:
    """A key per device (stochastic codecs): the caller's key folded with the
    device's index, so devices draw independent bits."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(f"jc.psum: {codec!r} is stochastic and needs key=")
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def fold(key, i: int | jax.Array):
    return None if key is None else jax.random.fold_in(key, i)


def decode_all(codec: Codec, arrays: dict[str, jax.Array], n: int, dtype) -> jax.Array:
    """Decodes a stack of payloads (leading axis) into float32 [stack, n]."""

    def one(arrs):
        return codec.decode(Payload(codec, (n,), dtype, arrs)).astype(jnp.float32)

    return jax.vmap(one)(arrays)


def ordered_sum(rows: jax.Array) -> jax.Array:
    """Sum over the leading axis, left to right: the same order everywhere."""
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


def chunked(flat: jax.Array, parts: int) -> tuple[jax.Array, int]:
    c = -(-flat.size // parts) if flat.size else 0
    return jnp.pad(flat, (0, parts * c - flat.size)).reshape(parts, c), c


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


def record(kind: str, arrays: dict[str, jax.Array]) -> None:
    """Logs (at run time) the operand bytes of one collective, if a
    :func:`wire_log` is open while this is traced."""
    if not _LOGS:
        return
    log = _LOGS[-1]
    nbytes = sum(int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in arrays.values())
    jax.debug.callback(lambda: log.append((kind, nbytes)))


def exchange(op, arrays: dict[str, jax.Array], kind: str | None = None) -> dict[str, jax.Array]:
    """Applies a collective to every payload array, moving raw bits."""
    if kind is not None:
        record(kind, arrays)
    out = {}
    for k, a in arrays.items():
        b = op(as_bits(a))
        out[k] = b if b.dtype == a.dtype else lax.bitcast_convert_type(b, a.dtype)
    return out


def chunk_len(codec: Codec, n: int, parts: int) -> int:
    """Elements per chunk when ``n`` values are split over ``parts`` devices:
    ceil(n / parts), rounded up to the codec's split granularity, so that one
    encoding of the whole padded tensor splits into per-chunk payloads."""
    c = -(-n // parts) if n else 0
    g = codec.split_granularity()
    return -(-c // g) * g if g else c


def padded(flat: jax.Array, total: int) -> jax.Array:
    return flat if flat.size == total else jnp.pad(flat, (0, total - flat.size))


def split(arrays: dict[str, jax.Array], parts: int) -> dict[str, jax.Array]:
    """One payload's arrays as ``parts`` stacked payloads (leading axis)."""
    return {k: a.reshape(parts, a.shape[0] // parts, *a.shape[1:]) for k, a in arrays.items()}


def join(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Stacked payloads (leading axis) as the arrays of one payload."""
    return {k: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for k, a in arrays.items()}


def decode_rows(codec: Codec, arrays: dict[str, jax.Array], n: int, dtype) -> jax.Array:
    """Decodes stacked payloads of ``n`` values each into float32 [stack, n]:
    one decode of the joined payload where the codec splits at ``n``, else
    one decode per payload."""
    g = codec.split_granularity()
    if g and n % g == 0:
        rows = next(iter(arrays.values())).shape[0]
        joined = Payload(codec, (rows * n,), dtype, join(arrays))
        return codec.decode(joined).astype(jnp.float32).reshape(rows, n)
    return decode_all(codec, arrays, n, dtype)


# ---------------------------------------------------------------------------
# Variable-rate payloads: capacity tiers
# ---------------------------------------------------------------------------
# Capacities tried, as divisors of the no-ZRE size: the smallest that holds
# every device's stream is used. 3LC's zero-run encoding shrinks a stream at
# most 14-fold (14 bytes of 121 become one), so no tier below 1/14 could
# ever be taken; between 1/14 and the full size the steps waste at most
# about 40% of a tier.
TIER_DIVISORS = (14, 10, 7, 5, 4, 3, 2, 1)


def variable_rate(codec: Codec) -> bool:
    """Whether the codec's payload is a fixed-capacity buffer of a
    variable-length stream (it then provides ``stream_capacity(n)``,
    ``stream_length(payload)`` and ``with_capacity(payload, nbytes)``)."""
    return callable(getattr(codec, "with_capacity", None))


def tier_capacities(codec: Codec, n: int) -> tuple[int, ...]:
    """The static buffer capacities a variable-rate payload of ``n`` values
    may travel in, ascending; the last is the codec's own (no-ZRE) size."""
    full = codec.stream_capacity(n)
    return tuple(sorted({-(-full // d) for d in TIER_DIVISORS}))


def transfer(
    codec: Codec,
    arrays: dict[str, jax.Array],
    n: int,
    dtype,
    axis_name,
    kind: str,
    op: Callable[[jax.Array], jax.Array],
    consume: Callable[[Codec, dict[str, jax.Array]], jax.Array],
) -> jax.Array:
    """Moves a payload (``arrays``, possibly stacked) with the collective
    ``op`` and hands the result to ``consume(codec, arrays)``.

    Fixed-rate codecs: exactly that. Variable-rate codecs: a ``pmax`` over
    the axis agrees on the longest stream, and ``lax.switch`` picks the
    smallest capacity tier that holds it, so the bytes on the wire follow
    the data while every shape stays static; nothing is ever truncated
    (the last tier is the full size, which every stream fits).
    """
    if not variable_rate(codec):
        return consume(codec, exchange(op, arrays, kind))
    caps = tier_capacities(codec, n)
    payload = Payload(codec, (n,), dtype, arrays)
    need = lax.pmax(jnp.max(codec.stream_length(payload)), axis_name)
    index = jnp.sum(need > jnp.asarray(caps[:-1], jnp.int32)) if len(caps) > 1 else 0

    def branch(cap):
        def run(arrs):
            p = codec.with_capacity(Payload(codec, (n,), dtype, arrs), cap)
            return consume(p.codec, exchange(op, p.arrays, kind))

        return run

    return lax.switch(index, [branch(c) for c in caps], arrays)
