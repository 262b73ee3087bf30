"""Compressed psum/pmean: the allgather, two-phase and ring algorithms."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.collectives import _sparse
from jaxcomp.collectives._util import (
    axis_size,
    chunk_len,
    chunked,
    decode_all,
    decode_rows,
    device_key,
    fold,
    ordered_sum,
    padded,
    split,
    transfer,
)
from jaxcomp.payload import Payload

ALGORITHMS = ("auto", "allgather", "two_phase", "ring", "sparse", "hierarchical")


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
    n, dtype = flat.size, flat.dtype
    p = codec.encode(flat, key)
    total = transfer(
        codec,
        p.arrays,
        n,
        dtype,
        axis_name,
        "all-gather",
        lambda a: lax.all_gather(a, axis_name),
        lambda ck, arrs: ordered_sum(decode_rows(ck, arrs, n, dtype)),
    )
    sent = codec.decode(p).astype(jnp.float32)
    return (total if div == 1 else total / div), sent


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
        payloads = split(p.arrays, size)
        stage1 = codec.decode(p).astype(jnp.float32)  # my chunks as their owners see them
    else:
        chunks, c = chunked(flat, size)
        if key is None:
            payloads = jax.vmap(lambda x: codec.encode(x).arrays)(chunks)
        else:
            keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(size))
            payloads = jax.vmap(lambda x, k: codec.encode(x, k).arrays)(chunks, keys)
        stage1 = decode_all(codec, payloads, c, dtype).reshape(-1)
    mine = transfer(  # my chunk, summed over the devices
        codec,
        payloads,
        c,
        dtype,
        axis_name,
        "all-to-all",
        lambda a: lax.all_to_all(a, axis_name, 0, 0),
        lambda ck, arrs: ordered_sum(decode_rows(ck, arrs, c, dtype)),
    )
    target = mine if div == 1 else mine / div
    p2 = codec.encode(target.astype(dtype), fold(key, size))
    final_mine = codec.decode(p2).astype(jnp.float32)
    total = transfer(
        codec,
        p2.arrays,
        c,
        dtype,
        axis_name,
        "all-gather",
        lambda a: lax.all_gather(a, axis_name),
        lambda ck, arrs: decode_rows(ck, arrs, c, dtype).reshape(-1)[:n],
    )
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
    chunks, c = chunked(flat, size)
    acc = chunks.astype(jnp.float32)
    sent = acc
    perm = [(d, (d + 1) % size) for d in range(size)]

    def hop(arrays):
        """One ppermute hop: (the received chunk decoded, its payload arrays
        at the codec's own capacity, ready to forward)."""

        def consume(ck, arrs):
            got = ck.decode(Payload(ck, (c,), dtype, arrs)).astype(jnp.float32)
            if ck != codec:  # a capacity tier: back to the codec's own buffer size
                arrs = ck.with_capacity(Payload(ck, (c,), dtype, arrs), codec.stream_capacity(c))
                arrs = arrs.arrays
            return got, arrs

        return transfer(
            codec,
            arrays,
            c,
            dtype,
            axis_name,
            "collective-permute",
            lambda a: lax.ppermute(a, axis_name, perm),
            consume,
        )

    for s in range(size - 1):
        j = (me - s) % size  # chunk I send
        partial = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        p = codec.encode(partial.astype(dtype), fold(key, s))
        hat = codec.decode(p).astype(jnp.float32)
        sent = lax.dynamic_update_index_in_dim(
            sent, lax.dynamic_index_in_dim(sent, j, keepdims=False) + (hat - partial), j, 0
        )
        got, _ = hop(p.arrays)
        r = (me - 1 - s) % size  # chunk I receive
        acc = lax.dynamic_update_index_in_dim(
            acc, lax.dynamic_index_in_dim(acc, r, keepdims=False) + got, r, 0
        )
    own = (me + 1) % size
    reduced = lax.dynamic_index_in_dim(acc, own, keepdims=False)
    target = reduced if div == 1 else reduced / div
    p = codec.encode(target.astype(dtype), fold(key, size))
    hat = codec.decode(p).astype(jnp.float32)
    error = hat - reduced if div == 1 else hat * div - reduced
    sent = lax.dynamic_update_index_in_dim(
        sent, lax.dynamic_index_in_dim(sent, own, keepdims=False) + error, own, 0
    )
    out = lax.dynamic_update_index_in_dim(jnp.zeros_like(acc), hat, own, 0)
    arrays = p.arrays
    for s in range(size - 1):
        got, arrays = hop(arrays)
        r = (me - s) % size  # the owner of this payload is me - 1 - s; it owns chunk me - s
        out = lax.dynamic_update_index_in_dim(out, got, r, 0)
    return out.reshape(-1)[: flat.size], sent.reshape(-1)[: flat.size]


_IMPLS = {
    "allgather": _allgather,
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
            sent = codec.decode(codec.encode(flat, key)).astype(jnp.float32)
            return sent, sent
        hat = codec.decode(codec.encode((flat.astype(jnp.float32) / div).astype(flat.dtype), key))
        hat = hat.astype(jnp.float32)
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
    """The rule behind ``algorithm="auto"``.

    - Sparse codecs (TopK): ``sparse``, SparCML's algorithms (static sparse
      all-reduce or DSAR_Split_allgather by the density rule of its section
      5.1: see :func:`jaxcomp.collectives._sparse.static_fits`).
    - Otherwise, two devices, or fewer values than devices: ``allgather``
      (the same bytes as two-phase, one compression instead of two).
    - Otherwise ``two_phase``, whose bytes per device stay near 2 (P-1)/P of
      one compressed tensor where ``allgather`` receives (P-1) of them, with
      two compressions where the ring needs P. This holds for variable-rate
      codecs (ThreeLC) too, whose payloads travel in capacity tiers.
    """
    if axis_size > 1 and n > 0 and _sparse.is_sparse(codec):
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
    """Compressed mean over ``axis_name``: like :func:`psum`, with the sum
    divided by the number of devices before its last compression (so the
    mean costs no extra pass). ``sent`` is, as in :func:`psum`, this device's
    compressed contribution to the sum."""
    return _all_reduce(x, axis_name, codec, key, algorithm, mean=True)


def operand_nbytes(codec: Codec, shape, dtype, axis_size: int, algorithm: str) -> dict[str, int]:
    """Bytes this device hands to each kind of collective, as the compiled
    HLO shows them (the operands of all-gather / all-to-all /
    collective-permute), for an input of ``shape`` and ``dtype``.

    Variable-rate codecs and the split sparse algorithm move their payloads
    in capacity tiers chosen at run time; for them this is the largest tier
    (an upper bound; :func:`tier_capacities` lists the tiers)."""
    n = int(np.prod(shape, dtype=np.int64))
    if algorithm == "auto":
        algorithm = choose_algorithm(codec, n, axis_size)
    if axis_size == 1:
        return {}
    if algorithm == "sparse":
        if _sparse.static_fits(codec, n, dtype, axis_size):
            return {"all-gather": codec.wire_nbytes((n,), dtype)}
        c = -(-n // axis_size)
        m = _sparse.entries(codec, n)
        pair = _sparse.topk_ops.index_dtype(c + 1).itemsize + np.dtype(dtype).itemsize
        vc = codec.value_codec
        dense = c * np.dtype(dtype).itemsize if vc is None else vc.wire_nbytes((c,), dtype)
        return {"all-to-all": axis_size * m * pair, "all-gather": dense}
    c = -(-n // axis_size) if n else 0
    if algorithm == "two_phase":
        c = chunk_len(codec, n, axis_size)
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
