"""SparCML's sparse all-reduce algorithms for TopK payloads.

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine
Learning" (SC19), section 5: the static sparse all-reduce (every device's
index/value pairs go to everyone, who sum them into a dense result) and
DSAR_Split_allgather (each device owns a range of indices: a sparse
reduce-scatter by all_to_all of the pairs in each range, then a dense
all_gather of the owned ranges, optionally quantized as in section 6). The
choice between them follows the density rule of section 5.1: stay sparse
while the pairs are fewer bytes than the dense result.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.collectives._util import as_bits, decode_rows, exchange, fold, transfer
from jaxcomp.ops import topk as topk_ops
from jaxcomp.payload import Payload


def is_sparse(codec: Codec) -> bool:
    """Whether the codec's payload is index/value pairs (TopK)."""
    return callable(getattr(codec, "selection", None))


def entries(codec: Codec, n: int) -> int:
    """Index/value pairs in one device's payload."""
    k, bucket = codec.selection(n)
    return topk_ops.num_entries(n, k, bucket)


def static_fits(codec: Codec, n: int, dtype, size: int) -> bool:
    """SparCML section 5.1's rule: the sum of ``size`` payloads may hold up
    to ``size * m`` pairs; keep it sparse (the static sparse all-reduce)
    while those pairs take fewer bytes than the dense result."""
    m = entries(codec, n)
    pair = topk_ops.index_dtype(n).itemsize + np.dtype(dtype).itemsize
    return size * m * pair < n * np.dtype(dtype).itemsize


def split_tiers(m: int, size: int) -> tuple[int, ...]:
    """Static capacities for the pairs one device sends to one owner: from
    about a quarter of the even share ``m / size`` up to all ``m`` pairs
    (when they all fall in one range), doubling."""
    caps = {m}
    c = m
    while c > max(1, m // (4 * size)):
        c = -(-c // 2)
        caps.add(c)
    return tuple(sorted(caps))


def static_allreduce(codec, flat, axis_name, size, key, div):
    """Every device's pairs to everyone (``all_gather`` of the TopK
    payloads as they are), summed into a dense tensor."""
    del size
    n, dtype = flat.size, flat.dtype
    p = codec.encode(flat, key)

    def consume(ck, arrs):
        idx, vals = topk_ops.sparse_pairs(Payload(ck, (n,), dtype, arrs))
        return topk_ops.scatter_add(idx, vals, n)

    op = lambda a: lax.all_gather(a, axis_name)  # noqa: E731
    total = transfer(codec, p.arrays, n, dtype, axis_name, "all-gather", op, consume)
    sent = codec.decode(p).astype(jnp.float32)
    return (total if div == 1 else total / div), sent


def split_allgather(codec, flat, axis_name, size, key, div):
    """DSAR_Split_allgather: device j owns indices [j c, (j+1) c). The pairs
    of each range go to their owner (``all_to_all`` in a static capacity
    tier agreed by ``pmax``, as for variable-rate codecs), the owner sums
    them densely, and the owned ranges are all-gathered dense: raw, or
    through the TopK's ``value_codec`` where it has one (SparCML section 6),
    the owner carrying that stage's error in its ``sent``."""
    n, dtype = flat.size, flat.dtype
    me = lax.axis_index(axis_name)
    c = -(-n // size)
    p = codec.encode(flat, key)
    sent = codec.decode(p).astype(jnp.float32)
    idx, vals = topk_ops.sparse_pairs(p)  # ascending; padding reads n
    m = idx.shape[0]
    bounds = jnp.arange(size + 1, dtype=jnp.int32) * c
    edges = jnp.searchsorted(idx, jnp.minimum(bounds, n), side="left").astype(jnp.int32)
    start, end = edges[:-1], edges[1:]
    need = lax.pmax(jnp.max(end - start), axis_name)
    caps = split_tiers(m, size)
    local_dtype = topk_ops.index_dtype(c + 1)  # local indices, c marks padding
    vals = vals.astype(dtype)

    def branch(cap):
        def run(_):
            pos = start[:, None] + jnp.arange(cap, dtype=jnp.int32)[None, :]
            valid = pos < end[:, None]
            pos = jnp.clip(pos, 0, max(m - 1, 0))
            owner_base = (jnp.arange(size, dtype=jnp.int32) * c)[:, None]
            local = jnp.where(valid, idx[pos] - owner_base, c).astype(local_dtype)
            v = jnp.where(valid, vals[pos], jnp.zeros((), dtype))
            got = exchange(
                lambda a: lax.all_to_all(a, axis_name, 0, 0),
                {"i": local, "v": as_bits(v)},
                "all-to-all",
            )
            gv = lax.bitcast_convert_type(got["v"], dtype) if got["v"].dtype != dtype else got["v"]
            return (
                jnp.zeros((c,), jnp.float32)
                .at[got["i"].reshape(-1).astype(jnp.int32)]
                .add(gv.reshape(-1).astype(jnp.float32), mode="drop")
            )

        return run

    if m == 0:
        owned = jnp.zeros((c,), jnp.float32)
    else:
        index = jnp.sum(need > jnp.asarray(caps[:-1], jnp.int32)) if len(caps) > 1 else 0
        owned = lax.switch(index, [branch(cap) for cap in caps], None)
    target = owned if div == 1 else owned / div
    vc = codec.value_codec
    if vc is None:
        final_mine = target.astype(dtype)
        gathered = exchange(
            lambda a: lax.all_gather(a, axis_name), {"v": final_mine}, "all-gather"
        )["v"]
        total = gathered.astype(jnp.float32).reshape(-1)[:n]
        final_mine = final_mine.astype(jnp.float32)
    else:
        p2 = vc.encode(target.astype(dtype), fold(key, size))
        final_mine = vc.decode(p2).astype(jnp.float32)
        gathered = exchange(lambda a: lax.all_gather(a, axis_name), p2.arrays, "all-gather")
        total = decode_rows(vc, gathered, c, dtype).reshape(-1)[:n]
    # The dense stage's error on my range (in units of the sum) is mine.
    error = final_mine - owned if div == 1 else final_mine * div - owned
    full = jnp.pad(sent, (0, size * c - n))
    start_me = me * c
    full = lax.dynamic_update_slice(
        full, lax.dynamic_slice(full, (start_me,), (c,)) + error, (start_me,)
    )
    return total, full[:n]


def sparse(codec, flat, axis_name, size, key, div):
    """The ``sparse`` algorithm: static sparse all-reduce or
    DSAR_Split_allgather, by :func:`static_fits`."""
    if not is_sparse(codec):
        raise ValueError(
            f"jc.psum: algorithm='sparse' carries TopK payloads (index/value pairs), got {codec!r}"
        )
    if static_fits(codec, flat.size, flat.dtype, size):
        return static_allreduce(codec, flat, axis_name, size, key, div)
    return split_allgather(codec, flat, axis_name, size, key, div)
