"""Compressed psum/pmean: the allgather, two-phase and ring algorithms."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.collectives import _sparse, _util
from jaxcomp.collectives._util import (
    axis_size,
    chunk_len,
    chunked,
    decode_f32,
    decode_rows,
    device_key,
    fold,
    ordered_sum,
    own_capacity,
    padded,
    split,
    transfer,
)

ALGORITHMS = ("auto", "allgather", "two_phase", "ring", "sparse", "allreduce", "hierarchical")


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
# Algorithms. Each takes the flat input and returns (sum float32, sent float32).
# ---------------------------------------------------------------------------
def _allgather(codec, flat, axis_name, size, key, div):
    p = codec.encode(flat, key)
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    total = transfer(p, axis_name, "all-gather", gather, lambda q: ordered_sum(decode_rows(q)))
    return (total if div == 1 else total / div), decode_f32(p)


def _allreduce(codec, flat, axis_name, size, key, div):
    """Linear codecs: the payloads themselves are summed by one ``psum``
    (every device encodes with the same key), then decoded once."""
    if codec.rate is not Rate.LINEAR:
        raise ValueError(
            f"jc.psum: algorithm='allreduce' sums payloads, which only linear codecs "
            f"(codec.rate is Rate.LINEAR) allow; {codec!r} is {codec.rate.value}-rate"
        )
    p = codec.encode(flat, key)
    arrays = p.arrays
    _util.record("all-reduce", arrays.values())
    summed = p.map(lambda a: lax.psum(a, axis_name))
    total = decode_f32(summed)
    return (total if div == 1 else total / div), decode_f32(p)


def _two_phase(codec, flat, axis_name, size, key, div):
    """Reduce-scatter of compressed chunks (all_to_all), then an allgather of
    the re-compressed reduced chunks: DeepSpeed's compressed allreduce, and
    the reduce-and-broadcast of the low-precision study (section 2.4.1)."""
    me = lax.axis_index(axis_name)
    n, dtype = flat.size, flat.dtype
    if codec.split_granularity():
        # One encoding of the whole tensor, cut into per-owner payloads.
        c = chunk_len(codec, n, size)
        p = codec.encode(padded(flat, size * c), key)
        payloads = split(p, size)
        stage1 = decode_f32(p)  # my chunks as their owners see them
    else:
        chunks, c = chunked(flat, size)
        keys = (
            None
            if key is None
            else jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(size))
        )
        payloads = jax.vmap(codec.encode)(chunks, keys)
        stage1 = decode_rows(payloads).reshape(-1)
    to_owner = lambda a: lax.all_to_all(a, axis_name, 0, 0)  # noqa: E731
    # My chunk, summed over the devices.
    mine = transfer(
        payloads, axis_name, "all-to-all", to_owner, lambda q: ordered_sum(decode_rows(q))
    )
    target = mine if div == 1 else mine / div
    p2 = codec.encode(target.astype(dtype), fold(key, size))
    final_mine = decode_f32(p2)
    gather = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    total = transfer(p2, axis_name, "all-gather", gather, lambda q: decode_rows(q).reshape(-1)[:n])
    # Error feedback: the second stage's error on my chunk (in units of the
    # sum) is mine to carry.
    error = final_mine - mine if div == 1 else final_mine * div - mine
    start = me * c
    sent = lax.dynamic_update_slice(
        stage1, lax.dynamic_slice(stage1, (start,), (c,)) + error, (start,)
    )
    return total, sent[:n]


def _ring(codec, flat, axis_name, size, key, div):
    """The ring all-reduce of Gibiansky's "Bringing HPC techniques to deep
    learning": P-1 scatter-reduce steps, then P-1 allgather steps, with
    ppermute to the next device; each hop's chunk is compressed. In the
    scatter-reduce a device compresses its running partial sum, and the
    compression error is charged to its ``sent``; in the allgather each
    reduced chunk is compressed once by its owner and forwarded as is."""
    me = lax.axis_index(axis_name)
    dtype = flat.dtype
    chunks, _ = chunked(flat, size)
    acc = chunks.astype(jnp.float32)
    sent = acc
    perm = [(d, (d + 1) % size) for d in range(size)]
    to_next = lambda a: lax.ppermute(a, axis_name, perm)  # noqa: E731

    def hop(p):
        """One ppermute hop: (the received chunk decoded, its payload at
        the codec's own capacity, ready to forward)."""
        return transfer(
            p,
            axis_name,
            "collective-permute",
            to_next,
            lambda q: (decode_f32(q), own_capacity(codec, q)),
        )

    for s in range(size - 1):
        j = (me - s) % size  # chunk I send
        partial = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        p = codec.encode(partial.astype(dtype), fold(key, s))
        hat = decode_f32(p)
        sent = lax.dynamic_update_index_in_dim(
            sent, lax.dynamic_index_in_dim(sent, j, keepdims=False) + (hat - partial), j, 0
        )
        got, _ = hop(p)
        r = (me - 1 - s) % size  # chunk I receive
        acc = lax.dynamic_update_index_in_dim(
            acc, lax.dynamic_index_in_dim(acc, r, keepdims=False) + got, r, 0
        )
    own = (me + 1) % size
    reduced = lax.dynamic_index_in_dim(acc, own, keepdims=False)
    target = reduced if div == 1 else reduced / div
    p = codec.encode(target.astype(dtype), fold(key, size))
    hat = decode_f32(p)
    error = hat - reduced if div == 1 else hat * div - reduced
    sent = lax.dynamic_update_index_in_dim(
        sent, lax.dynamic_index_in_dim(sent, own, keepdims=False) + error, own, 0
    )
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(acc), hat, own, 0)
    for s in range(size - 1):
        got, p = hop(p)
        r = (me - s) % size  # the owner of this payload is me - 1 - s; it owns chunk me - s
        out = lax.dynamic_update_index_in_dim(out, got, r, 0)
    return out.reshape(-1)[: flat.size], sent.reshape(-1)[: flat.size]


_IMPLS = {
    "allgather": _allgather,
    "allreduce": _allreduce,
    "two_phase": _two_phase,
    "ring": _ring,
    "sparse": _sparse.sparse,
}


def _reduce(codec, flat, axis_name, algorithm, key, div=1):
    """(sum / div float32, sent float32) of ``flat`` over one axis;
    ``algorithm`` may be "auto". One device: encode and decode locally.

    ``div`` (pmean) is applied before the last compression, where the
    algorithm has one, so the mean costs no extra pass; ``sent`` stays in
    units of the sum."""
    size = axis_size(axis_name)
    if size == 1:
        if div == 1:
            sent = decode_f32(codec.encode(flat, key))
            return sent, sent
        hat = decode_f32(codec.encode((flat.astype(jnp.float32) / div).astype(flat.dtype), key))
        return hat, hat * div
    if algorithm == "auto":
        algorithm = choose_algorithm(codec, flat.size, size)
    return _IMPLS[algorithm](codec, flat, axis_name, size, key, div)


def _hierarchical(codec, flat, slow, fast, key, div=1):
    """Full precision over the fast axis, compression only over the slow one:
    reduce-scatter over ``fast`` (``psum_scatter``), a compressed all-reduce
    of this device's chunk over ``slow`` (by the ``auto`` rule), then an
    all-gather over ``fast``. The slow stage's error on a chunk is charged to
    the device that owns the chunk within its node."""
    chunks, _ = chunked(flat.astype(jnp.float32), axis_size(fast))
    mine = lax.psum_scatter(chunks, fast, scatter_dimension=0, tiled=True)[0]  # summed over fast
    reduced, sent_mine = _reduce(codec, mine.astype(flat.dtype), slow, "auto", key, div)
    total = lax.all_gather(reduced, fast, tiled=True)[: flat.size]
    error = jnp.zeros_like(chunks).at[lax.axis_index(fast)].set(sent_mine - mine)
    return total, (chunks + error).reshape(-1)[: flat.size]


def choose_algorithm(codec: Codec, n: int, axis_size: int) -> str:
    """The rule behind ``algorithm="auto"`` (one axis).

    - Linear codecs (``Rate.LINEAR``, e.g. Identity): ``allreduce``, one
      ``psum`` of the payloads.
    - Sparse codecs (``Rate.SPARSE``, TopK): ``sparse``, SparCML's algorithms
      (static sparse all-reduce or DSAR_Split_allgather by the density rule
      of its section 5.1: see :func:`jaxcomp.collectives._sparse.static_fits`).
    - Otherwise, two devices, or fewer values than devices: ``allgather``
      (the same bytes as two-phase, one compression instead of two).
    - Otherwise ``two_phase``, whose bytes per device stay near 2 (P-1)/P of
      one compressed tensor where ``allgather`` receives (P-1) of them, with
      two compressions where the ring needs P. This holds for variable-rate
      codecs (ThreeLC) too, whose payloads travel in capacity tiers.

    Args:
      codec: the codec.
      n: elements of the tensor.
      axis_size: devices on the axis.
    Returns:
      The algorithm's name.
    """
    if codec.rate is Rate.LINEAR:
        return "allreduce"
    if axis_size > 1 and n > 0 and codec.rate is Rate.SPARSE:
        return "sparse"
    if axis_size <= 2 or n < axis_size:
        return "allgather"
    return "two_phase"


def _all_reduce(x, axis_name, codec, key, algorithm, mean: bool) -> Reduced:
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
        sizes = [axis_size(name) for name in axis_name]  # clear error for an unbound name
        div = int(np.prod(sizes)) if mean else 1
        key = device_key(codec, key, axis_name)
        total, sent = _hierarchical(codec, flat, slow, fast, key, div)
    elif algorithm == "hierarchical":
        raise ValueError(
            "jc.psum: algorithm='hierarchical' needs axis_name=(slow_axis, fast_axis), "
            "e.g. ('node', 'local')"
        )
    else:
        size = axis_size(axis_name)  # a clear error for an unbound name
        div = size if mean else 1
        key = device_key(codec, key, axis_name)
        total, sent = _reduce(codec, flat, axis_name, algorithm, key, div)
    return Reduced(total.astype(x.dtype).reshape(x.shape), sent.reshape(x.shape))


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
      axis_name: the mesh axis to reduce over, or ``(slow, fast)`` axes for
        the hierarchical algorithm.
      codec: a :mod:`jaxcomp.codecs` codec.
      key: a PRNG key, required by stochastic codecs; it is folded with the
        device index, so pass the same key on every device.
      algorithm: "auto" (see :func:`choose_algorithm`), "allgather",
        "two_phase", "ring" or "hierarchical".
    Returns:
      :class:`Reduced` (value, sent).
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, mean=False)


def pmean(x, axis_name, codec: Codec, *, key=None, algorithm: str = "auto") -> Reduced:
    """Compressed mean of ``x`` over the mesh axis ``axis_name``.

    Like :func:`psum`, with the sum divided by the number of devices before
    its last compression (so the mean costs no extra pass).

    Args:
      x: this device's tensor (float32, bfloat16 or float16, any shape).
      axis_name: the mesh axis, or ``(slow, fast)`` axes (hierarchical).
      codec: a :mod:`jaxcomp.codecs` codec.
      key: a PRNG key, required by stochastic codecs (the same on every
        device).
      algorithm: as in :func:`psum`.
    Returns:
      :class:`Reduced`: ``value`` the mean, ``sent`` (as in :func:`psum`)
      this device's compressed contribution to the *sum*.
    """
    return _all_reduce(x, axis_name, codec, key, algorithm, mean=True)


def operand_nbytes(codec: Codec, shape, dtype, axis_size: int, algorithm: str) -> dict[str, int]:
    """Bytes this device hands to each kind of collective, as the compiled
    HLO shows them.

    Every size comes from the codec's layout
    (:meth:`~jaxcomp.codecs.Codec.wire_nbytes`). Variable-rate codecs and the
    split sparse algorithm move their payloads in capacity tiers chosen at
    run time; for them this is the largest tier (an upper bound;
    :func:`tier_capacities` lists the tiers).

    Args:
      codec: the codec.
      shape: the tensor's shape.
      dtype: its dtype.
      axis_size: devices on the axis.
      algorithm: one of :data:`ALGORITHMS` but "hierarchical".
    Returns:
      ``{kind: bytes}`` with kind "all-gather", "all-to-all",
      "collective-permute" or "all-reduce" (empty for one device).
    """
    n = int(np.prod(shape, dtype=np.int64))
    if algorithm == "auto":
        algorithm = choose_algorithm(codec, n, axis_size)
    if axis_size == 1:
        return {}
    if algorithm == "hierarchical":
        raise ValueError(
            "operand_nbytes: the hierarchical algorithm has two axes; not supported here"
        )
    if algorithm == "sparse":
        return _sparse.operand_nbytes(codec, n, dtype, axis_size)
    if algorithm in ("allgather", "allreduce"):
        kind = "all-gather" if algorithm == "allgather" else "all-reduce"
        return {kind: codec.wire_nbytes((n,), dtype)}
    if algorithm == "two_phase":
        chunk = codec.wire_nbytes((chunk_len(codec, n, axis_size),), dtype)
        return {"all-to-all": axis_size * chunk, "all-gather": chunk}
    if algorithm == "ring":
        chunk = codec.wire_nbytes((-(-n // axis_size) if n else 0,), dtype)
        return {"collective-permute": 2 * (axis_size - 1) * chunk}
    raise ValueError(f"unknown algorithm {algorithm!r}")


def send_nbytes(codec: Codec, n: int, dtype, axis_sizes, algorithm: str = "auto") -> float:
    """Bytes one device sends over the network in a compressed all-reduce.

    ``(P-1)`` times an all-gather operand, ``(P-1)/P`` of an all-to-all
    operand, every byte of a collective-permute, and ``2 (P-1)/P`` of an
    all-reduce operand (a ring all-reduce); an upper bound for capacity
    tiers.

    Args:
      codec: the codec.
      n: elements of the tensor.
      dtype: its dtype.
      axis_sizes: the axis size, or ``(slow, fast)`` sizes for the
        hierarchical algorithm (float32 over the fast axis, compressed over
        the slow one).
      algorithm: one of :data:`ALGORITHMS` ("auto" by default).
    Returns:
      Bytes (a float: the all-to-all share is fractional).
    """
    sizes = tuple(axis_sizes) if isinstance(axis_sizes, (tuple, list)) else (axis_sizes,)
    if len(sizes) == 2:
        slow, fast = sizes
        chunk = -(-n // fast)
        return uncompressed_send_nbytes(4 * n, fast) + send_nbytes(codec, chunk, dtype, slow)
    (p,) = sizes
    total = 0.0
    for kind, op in operand_nbytes(codec, (n,), dtype, p, algorithm).items():
        if kind == "all-gather":
            total += (p - 1) * op
        elif kind == "all-to-all":
            total += (p - 1) / p * op
        elif kind == "all-reduce":
            total += uncompressed_send_nbytes(op, p)
        else:  # collective-permute: every operand byte is sent
            total += op
    return total


def uncompressed_send_nbytes(nbytes: int, axis_size: int) -> float:
    """Bytes one device sends in a ring all-reduce, what ``lax.psum`` costs
    on the network.

    Args:
      nbytes: bytes of the tensor.
      axis_size: devices on the axis.
    Returns:
      ``2 (P-1)/P * nbytes`` (0 for one device).
    """
    p = axis_size
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0
