"""SparCML's sparse all-reduce algorithms for sparse (index/value) payloads.

Renggli et al., "SparCML: High-Performance Sparse Communication for Machine
Learning" (SC19), section 5: the static sparse all-reduce (every device's
index/value pairs go to everyone, who sum them into a dense result) and
DSAR_Split_allgather (each device owns a range of indices: a sparse
reduce-scatter by all_to_all of the pairs in each range, then a dense
all_gather of the owned ranges, optionally quantized as in section 6). The
choice between them follows the density rule of section 5.1: stay sparse
while the pairs are fewer bytes than the dense result.

Everything here reads the :class:`~jaxcomp.codecs.base.SparseCodec`
protocol: ``entries(n)``, ``pairs(payload)`` and ``value_codec``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec, Rate, index_dtype
from jaxcomp.codecs.identity import Identity
from jaxcomp.collectives._algorithm import Algorithm, Collective, Context, KernelCall, register
from jaxcomp.collectives._decode import decode_own, decode_rows
from jaxcomp.collectives._exchange import as_bits, collective, exchange, record
from jaxcomp.collectives._keys import fold
from jaxcomp.collectives._order import after
from jaxcomp.collectives._tiers import tier_index, transfer
from jaxcomp.collectives.feedback import charge, compress_kept, owner_stage
from jaxcomp.payload import Payload


def _check(codec: Codec) -> None:
    if codec.rate is not Rate.SPARSE:
        raise ValueError(
            f"jc.psum: algorithm='sparse' carries index/value pairs (a codec with "
            f"rate Rate.SPARSE, such as TopK), got {codec!r}"
        )


def static_fits(codec: Codec, n: int, dtype, size: int) -> bool:
    """SparCML section 5.1's rule: the sum of ``size`` payloads may hold up
    to ``size`` times their pairs; keep it sparse (the static sparse
    all-reduce, which all-gathers the payloads) while those bytes are fewer
    than the dense result's."""
    return size * codec.wire_nbytes((n,), dtype) < n * np.dtype(dtype).itemsize


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


def _owned_len(n: int, size: int) -> int:
    return -(-n // size)


@register
@dataclasses.dataclass(frozen=True)
class Sparse(Algorithm):
    """The ``sparse`` algorithm: the static sparse all-reduce or
    DSAR_Split_allgather, by :func:`static_fits`. Its server residual is the
    owned range of the split algorithm's dense stage (none for the static
    sparse all-reduce)."""

    name: ClassVar[str] = "sparse"
    auto_rank: ClassVar[int | None] = 1
    planned_rates: ClassVar[frozenset[Rate]] = frozenset({Rate.SPARSE})

    def run(self, ctx, flat, state):
        _check(ctx.codec)
        p = ctx.codec.encode(flat, ctx.key)
        return self._reduce(ctx, p, flat.dtype, state, decode_own(p), kept=False)

    def run_feedback(self, ctx, flat, residual, state):
        """The one compression makes the payload and the new residual
        together (:func:`compress_kept`: TopK's one-pass kernel on the CPU
        where the values are sent as they are)."""
        _check(ctx.codec)
        p, kept = compress_kept(ctx.codec, flat, residual, ctx.key, flat.dtype)
        return self._reduce(ctx, after(p, ctx.dep), flat.dtype, state, kept, kept=True)

    @staticmethod
    def _reduce(ctx, p, dtype, state, own, *, kept):
        """The all-reduce of this device's payload ``p``; ``own`` is what
        its input became (``sent``) or, with ``kept``, what it kept."""
        if static_fits(ctx.codec, p.size, dtype, ctx.size):
            return static_allreduce(ctx, p), own, state
        return split_allgather(ctx, p, dtype, state, own, kept=kept)

    def chosen(self, codec, n, axes):
        """Sparse codecs (``Rate.SPARSE``, TopK) over more than one device."""
        return axes.size > 1 and n > 0 and codec.rate is Rate.SPARSE

    def state_size(self, codec, n, dtype, axes):
        return 0 if static_fits(codec, n, dtype, axes.size) else _owned_len(n, axes.size)

    def operand_nbytes(self, codec, n, dtype, axes):
        """The payload all-gathered as it is, or the split algorithm's
        largest pair tier (pairs of a local index, in the smallest integer
        type, and a raw value) and its dense stage (raw, or through the
        codec's ``value_codec``)."""
        _check(codec)
        size = axes.size
        if static_fits(codec, n, dtype, size):
            return {"all-gather": codec.wire_nbytes((n,), dtype)}
        c = _owned_len(n, size)
        pair = index_dtype(c + 1).itemsize + np.dtype(dtype).itemsize
        vc = codec.value_codec
        dense = c * np.dtype(dtype).itemsize if vc is None else vc.wire_nbytes((c,), dtype)
        return {"all-to-all": size * codec.entries(n) * pair, "all-gather": dense}

    def collectives(self, codec, n, dtype, axes, bits=None):
        """The split algorithm's pairs travel in the tier a ``pmax`` (a
        4-byte all-reduce) agreed on; counted here at the largest."""
        out = [
            Collective(kind, b) for kind, b in self.operand_nbytes(codec, n, dtype, axes).items()
        ]
        if static_fits(codec, n, dtype, axes.size):
            return out
        return [Collective("all-reduce", 4), *out]

    def kernel_calls(self, codec, n, dtype, axes):
        """The top-k selection (XLA sums the pairs), and for the split
        algorithm the dense stage's ``value_codec`` where it has one."""
        vc = codec.value_codec
        if vc is None or static_fits(codec, n, dtype, axes.size):
            return [KernelCall("encode", n, codec)]
        c = _owned_len(n, axes.size)
        return [
            KernelCall("encode", n, codec),
            KernelCall("encode", c, vc),
            KernelCall("decode", axes.size * c, vc),
        ]


def scatter_add(indices: jax.Array, values: jax.Array, n: int) -> jax.Array:
    """Sums sparse pairs (any matching leading axes) into a dense float32[n];
    indices outside ``[0, n)`` (padding) are dropped. The order in which
    duplicate indices are added is unspecified (float sums may differ in the
    last bit between orders), and the additions follow the platform's float
    rules (XLA's CPU flushes subnormal values to zero)."""
    return (
        jnp.zeros((n,), jnp.float32)
        .at[indices.reshape(-1)]
        .add(values.reshape(-1).astype(jnp.float32), mode="drop")
    )


def static_allreduce(ctx: Context, p: Payload) -> jax.Array:
    """Every device's pairs to everyone (``all_gather`` of the payloads as
    they are), summed into a dense tensor (one compression: no server
    residual); the sum divided by ``ctx.div``."""
    n = p.size

    def consume(q: Payload):
        return scatter_add(*q.codec.pairs(q), n)

    total = transfer(p, "all-gather", ctx.axis, consume)
    return total if ctx.div == 1 else total / ctx.div


def _route(idx, vals, start, end, c, size, cap, dtype):
    """The pairs of every owner's range, ``cap`` per owner (local indices,
    ``c`` marking an empty slot), as ``[size, cap]`` arrays."""
    m = idx.shape[0]
    pos = start[:, None] + jnp.arange(cap, dtype=jnp.int32)[None, :]
    valid = pos < end[:, None]
    pos = jnp.clip(pos, 0, max(m - 1, 0))
    owner_base = (jnp.arange(size, dtype=jnp.int32) * c)[:, None]
    local = jnp.where(valid, idx[pos] - owner_base, c).astype(index_dtype(c + 1))
    v = jnp.where(valid, vals[pos], jnp.zeros((), dtype))
    return local, v


def split_allgather(ctx: Context, p: Payload, dtype, state, own: jax.Array, *, kept: bool):
    """DSAR_Split_allgather of this device's payload ``p``: device j owns
    indices [j c, (j+1) c). The pairs of each range go to their owner
    (``all_to_all`` in a static capacity tier agreed by ``pmax``, as for
    variable-rate codecs), the owner sums them densely, and the owned
    ranges are all-gathered dense: raw, or through the codec's
    ``value_codec`` where it has one (SparCML section 6). That stage's error
    stays in the owner's server residual (``state``, the owned range) or,
    without one, is charged to the owner's ``own`` (its ``sent``, or with
    ``kept`` what its input kept: :func:`charge`)."""
    n, size = p.size, ctx.size
    me = lax.axis_index(ctx.axis)
    c = _owned_len(n, size)
    owned = _reduce_scatter_pairs(ctx, p, c, dtype)
    dense = ctx.codec.value_codec or Identity()  # the dense stage: quantized, or raw
    p2, _, new_state, error = owner_stage(dense, owned, ctx.div, state, fold(ctx.key, size), dtype)
    gathered = exchange(p2, "all-gather", ctx.axis)
    total = decode_rows(gathered).reshape(-1)[:n]
    if error is None:
        return total, own, new_state
    own = charge(jnp.pad(own, (0, size * c - n)), me, c, error, kept=kept)[:n]
    return total, own, None


def _reduce_scatter_pairs(ctx: Context, p: Payload, c: int, dtype) -> jax.Array:
    """Every device's pairs of my range ``[me c, (me + 1) c)``, summed
    densely (float32 ``[c]``): the pairs of each range to their owner, in
    the smallest capacity tier that holds the most pairs any device has for
    one range."""
    n, size = p.size, ctx.size
    idx, vals = ctx.codec.pairs(p)  # ascending; padding reads n
    m = idx.shape[0]
    bounds = jnp.arange(size + 1, dtype=jnp.int32) * c
    edges = jnp.searchsorted(idx, jnp.minimum(bounds, n), side="left").astype(jnp.int32)
    start, end = edges[:-1], edges[1:]
    need = lax.pmax(jnp.max(end - start), ctx.axis)
    caps = split_tiers(m, size)
    vals = vals.astype(dtype)

    def branch(cap):
        def run(_):
            local, v = _route(idx, vals, start, end, c, size, cap, dtype)
            record("all-to-all", (local, v))
            to_owner = collective("all-to-all", ctx.axis, ctx.all_to_all)
            gi = to_owner(local)
            gv = to_owner(as_bits(v))
            gv = lax.bitcast_convert_type(gv, dtype) if gv.dtype != dtype else gv
            return scatter_add(gi.astype(jnp.int32), gv, c)

        return run

    if m == 0:
        return jnp.zeros((c,), jnp.float32)
    return lax.switch(tier_index(need, caps), [branch(cap) for cap in caps], None)
