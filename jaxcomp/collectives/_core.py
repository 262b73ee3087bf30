"""Compressed psum/pmean: the allgather, two-phase and ring algorithms."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.payload import Payload

ALGORITHMS = ("auto", "allgather", "two_phase", "ring", "hierarchical")


class Reduced(NamedTuple):
    """Result of a compressed all-reduce.

    Attributes:
      value: the sum (or mean) over the axis, in the input's shape and dtype,
        identical on every device.
      sent: float32, the input's shape: what this device's input became
        after compression, every stage included; summed over the devices it
        equals ``value`` (times the axis size, for ``pmean``) up to float
        rounding.
    """

    value: jax.Array
    sent: jax.Array


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------
def _axis_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(
            f"jc.psum: axis name {axis_name!r} is not bound here; call it inside jax.shard_map "
            "or jax.pmap over a mesh axis of that name"
        ) from e


def _device_key(codec: Codec, key, axis_name) -> jax.Array | None:
    """A key per device (stochastic codecs): the caller's key folded with the
    device's index, so devices draw independent bits."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(f"jc.psum: {codec!r} is stochastic and needs key=")
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def _fold(key, i: int | jax.Array):
    return None if key is None else jax.random.fold_in(key, i)


def _decode_all(codec: Codec, arrays: dict[str, jax.Array], n: int, dtype) -> jax.Array:
    """Decodes a stack of payloads (leading axis) into float32 [stack, n]."""

    def one(arrs):
        return codec.decode(Payload(codec, (n,), dtype, arrs)).astype(jnp.float32)

    return jax.vmap(one)(arrays)


def _ordered_sum(rows: jax.Array) -> jax.Array:
    """Sum over the leading axis, left to right: the same order everywhere."""
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


def _chunked(flat: jax.Array, parts: int) -> tuple[jax.Array, int]:
    c = -(-flat.size // parts) if flat.size else 0
    return jnp.pad(flat, (0, parts * c - flat.size)).reshape(parts, c), c


# ---------------------------------------------------------------------------
# Algorithms. Each takes the flat input and returns (sum float32, sent float32).
# ---------------------------------------------------------------------------
def _allgather(codec, flat, axis_name, size, key):
    p = codec.encode(flat, key)
    gathered = {k: lax.all_gather(a, axis_name) for k, a in p.arrays.items()}
    total = _ordered_sum(_decode_all(codec, gathered, flat.size, flat.dtype))
    sent = codec.decode(p).astype(jnp.float32)
    return total, sent


def _two_phase(codec, flat, axis_name, size, key):
    """Reduce-scatter of compressed chunks (all_to_all), then an allgather of
    the re-compressed reduced chunks: DeepSpeed's compressed allreduce, and
    the reduce-and-broadcast of the low-precision study (section 2.4.1)."""
    me = lax.axis_index(axis_name)
    chunks, c = _chunked(flat, size)
    if key is None:
        payloads = jax.vmap(lambda x: codec.encode(x).arrays)(chunks)
    else:
        keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(size))
        payloads = jax.vmap(lambda x, k: codec.encode(x, k).arrays)(chunks, keys)
    stage1 = _decode_all(codec, payloads, c, flat.dtype)  # [P, c]: my chunks as the owners see them
    received = {k: lax.all_to_all(a, axis_name, 0, 0) for k, a in payloads.items()}
    mine = _ordered_sum(_decode_all(codec, received, c, flat.dtype))  # my chunk, reduced
    p2 = codec.encode(mine.astype(flat.dtype), _fold(key, size))
    final_mine = codec.decode(p2).astype(jnp.float32)
    gathered = {k: lax.all_gather(a, axis_name) for k, a in p2.arrays.items()}
    total = _decode_all(codec, gathered, c, flat.dtype).reshape(-1)[: flat.size]
    # Error feedback: the second stage's error on my chunk is mine to carry.
    correction = jnp.zeros_like(stage1).at[me].set(final_mine - mine)
    sent = (stage1 + correction).reshape(-1)[: flat.size]
    return total, sent


def _ring(codec, flat, axis_name, size, key):
    """The ring all-reduce of Gibiansky's "Bringing HPC techniques to deep
    learning": P-1 scatter-reduce steps, then P-1 allgather steps, with
    ppermute to the next device; each hop's chunk is compressed. In the
    scatter-reduce a device compresses its running partial sum, and the
    compression error is charged to its ``sent``; in the allgather each
    reduced chunk is compressed once by its owner and forwarded as is."""
    me = lax.axis_index(axis_name)
    chunks, c = _chunked(flat, size)
    acc = chunks.astype(jnp.float32)
    sent = acc
    perm = [(d, (d + 1) % size) for d in range(size)]
    for s in range(size - 1):
        j = (me - s) % size  # chunk I send
        partial = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        p = codec.encode(partial.astype(flat.dtype), _fold(key, s))
        hat = codec.decode(p).astype(jnp.float32)
        sent = lax.dynamic_update_index_in_dim(
            sent, lax.dynamic_index_in_dim(sent, j, keepdims=False) + (hat - partial), j, 0
        )
        recv = {k: lax.ppermute(a, axis_name, perm) for k, a in p.arrays.items()}
        r = (me - 1 - s) % size  # chunk I receive
        got = codec.decode(Payload(codec, (c,), flat.dtype, recv)).astype(jnp.float32)
        acc = lax.dynamic_update_index_in_dim(
            acc, lax.dynamic_index_in_dim(acc, r, keepdims=False) + got, r, 0
        )
    own = (me + 1) % size
    reduced = lax.dynamic_index_in_dim(acc, own, keepdims=False)
    p = codec.encode(reduced.astype(flat.dtype), _fold(key, size))
    hat = codec.decode(p).astype(jnp.float32)
    sent = lax.dynamic_update_index_in_dim(
        sent, lax.dynamic_index_in_dim(sent, own, keepdims=False) + (hat - reduced), own, 0
    )
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(acc), hat, own, 0)
    arrays = p.arrays
    for s in range(size - 1):
        arrays = {k: lax.ppermute(a, axis_name, perm) for k, a in arrays.items()}
        r = (me - s) % size  # the owner of this payload is me - 1 - s; it owns chunk me - s
        got = codec.decode(Payload(codec, (c,), flat.dtype, arrays)).astype(jnp.float32)
        out = lax.dynamic_update_index_in_dim(out, got, r, 0)
    return out.reshape(-1)[: flat.size], sent.reshape(-1)[: flat.size]


_IMPLS = {"allgather": _allgather, "two_phase": _two_phase, "ring": _ring}


def _reduce(codec, flat, axis_name, algorithm, key):
    """(sum float32, sent float32) of ``flat`` over one axis; ``algorithm``
    may be "auto". One device: encode and decode locally."""
    size = _axis_size(axis_name)
    if size == 1:
        sent = codec.decode(codec.encode(flat, key)).astype(jnp.float32)
        return sent, sent
    if algorithm == "auto":
        algorithm = choose_algorithm(codec, flat.size, size)
    return _IMPLS[algorithm](codec, flat, axis_name, size, key)


def _hierarchical(codec, flat, slow, fast, key):
    """Full precision over the fast axis, compression only over the slow one:
    reduce-scatter over ``fast`` (``psum_scatter``), a compressed all-reduce
    of this device's chunk over ``slow`` (by the ``auto`` rule), then an
    all-gather over ``fast``. The slow stage's error on a chunk is charged to
    the device that owns the chunk within its node."""
    chunks, _ = _chunked(flat.astype(jnp.float32), _axis_size(fast))
    mine = lax.psum_scatter(chunks, fast, scatter_dimension=0, tiled=True)[0]  # summed over fast
    reduced, sent_mine = _reduce(codec, mine.astype(flat.dtype), slow, "auto", key)
    total = lax.all_gather(reduced, fast, tiled=True)[: flat.size]
    error = jnp.zeros_like(chunks).at[lax.axis_index(fast)].set(sent_mine - mine)
    return total, (chunks + error).reshape(-1)[: flat.size]


def choose_algorithm(codec: Codec, n: int, axis_size: int) -> str:
    """The rule behind ``algorithm="auto"``.

    Two devices: ``allgather`` (the same bytes as two-phase, one compression
    instead of two). More: ``two_phase``, whose bytes per device stay near
    2 (P-1)/P of one compressed tensor where ``allgather`` receives (P-1)
    of them, with two compressions where the ring needs P. Tiny tensors
    (fewer values than devices) use ``allgather``.
    """
    del codec
    if axis_size <= 2 or n < axis_size:
        return "allgather"
    return "two_phase"


def psum(
    x: jax.Array,
    axis_name,
    codec: Codec,
    *,
    key: jax.Array | None = None,
    algorithm: str = "auto",
) -> Reduced:
    """Compressed sum of ``x`` over the mesh axis ``axis_name``.

    Call inside ``jax.shard_map`` (or ``jax.pmap``).

    Args:
      x: this device's tensor (float32, bfloat16 or float16, any shape).
      axis_name: the mesh axis to reduce over.
      codec: a :mod:`jaxcomp.codecs` codec.
      key: a PRNG key, required by stochastic codecs; it is folded with the
        device index, so pass the same key on every device.
      algorithm: "auto" (see :func:`choose_algorithm`), "allgather",
        "two_phase" or "ring".
    Returns:
      :class:`Reduced` (value, sent).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"jc.psum: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(codec, Codec):
        raise TypeError(f"jc.psum: codec must be a jaxcomp codec, got {type(codec).__name__}")
    x = codec.check_input(x)
    flat = x.reshape(-1)
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 2 or algorithm not in ("auto", "hierarchical"):
            raise ValueError(
                "jc.psum: a tuple of axis names means the hierarchical algorithm over "
                "(slow, fast) axes, e.g. ('node', 'local'); got "
                f"axis_name={axis_name!r}, algorithm={algorithm!r}"
            )
        slow, fast = axis_name
        for name in axis_name:  # a clear error for an unbound name, before axis_index
            _axis_size(name)
        total, sent = _hierarchical(codec, flat, slow, fast, _device_key(codec, key, axis_name))
    elif algorithm == "hierarchical":
        raise ValueError(
            "jc.psum: algorithm='hierarchical' needs axis_name=(slow_axis, fast_axis), "
            "e.g. ('node', 'local')"
        )
    else:
        _axis_size(axis_name)  # a clear error for an unbound name, before axis_index
        total, sent = _reduce(codec, flat, axis_name, algorithm, _device_key(codec, key, axis_name))
    return Reduced(total.astype(x.dtype).reshape(x.shape), sent.reshape(x.shape))


def pmean(x, axis_name, codec: Codec, *, key=None, algorithm: str = "auto") -> Reduced:
    """Compressed mean over ``axis_name``: :func:`psum`'s value divided by the
    axis size (``sent`` is unchanged: this device's compressed contribution)."""
    r = psum(x, axis_name, codec, key=key, algorithm=algorithm)
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    size = int(np.prod([_axis_size(a) for a in names]))
    return Reduced((r.value.astype(jnp.float32) / size).astype(r.value.dtype), r.sent)


def operand_nbytes(codec: Codec, shape, dtype, axis_size: int, algorithm: str) -> dict[str, int]:
    """Bytes this device hands to each kind of collective, as the compiled
    HLO shows them (the operands of all-gather / all-to-all /
    collective-permute), for an input of ``shape`` and ``dtype``."""
    n = int(np.prod(shape, dtype=np.int64))
    if algorithm == "auto":
        algorithm = choose_algorithm(codec, n, axis_size)
    if axis_size == 1:
        return {}
    c = -(-n // axis_size) if n else 0
    chunk = codec.wire_nbytes((c,), dtype)
    if algorithm == "hierarchical":
        raise ValueError(
            "operand_nbytes: the hierarchical algorithm has two axes; not supported here"
        )
    if algorithm == "allgather":
        return {"all-gather": codec.wire_nbytes((n,), dtype)}
    if algorithm == "two_phase":
        return {"all-to-all": axis_size * chunk, "all-gather": chunk}
    if algorithm == "ring":
        return {"collective-permute": 2 * (axis_size - 1) * chunk}
    raise ValueError(f"unknown algorithm {algorithm!r}")
