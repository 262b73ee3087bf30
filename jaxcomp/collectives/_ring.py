"""The ring algorithm: Gibiansky's ring all-reduce with compressed hops."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Rate
from jaxcomp.collectives._algorithm import Algorithm, Collective, Context, KernelCall, register
from jaxcomp.collectives._chunks import chunked
from jaxcomp.collectives._decode import decode_f32, decode_own
from jaxcomp.collectives._keys import fold
from jaxcomp.collectives._tiers import own_capacity, tier_nbytes, transfer
from jaxcomp.collectives.feedback import compress_kept, owner_stage
from jaxcomp.payload import Payload


@register
@dataclasses.dataclass(frozen=True)
class Ring(Algorithm):
    """The ring all-reduce of Gibiansky's "Bringing HPC techniques to deep
    learning": P-1 scatter-reduce steps, then P-1 allgather steps, with
    ppermute to the next device; each hop's chunk is compressed. In the
    allgather each reduced chunk is compressed once by its owner and
    forwarded as is.

    Each scatter-reduce step compresses a running partial sum, of a
    different chunk at every step (at step s, device d sends chunk d - s).
    With a server residual (``P`` rows of ``ceil(n / P)``, in units of the
    result) each of those compressions has a residual of its own, row s for
    step s and row P - 1 for the owner's last compression, so no error ever
    lands in a tensor of another scale; the input is divided by ``div``
    first, so every row is in the result's units, and ``sent`` is the input
    itself. Without one, every step's error is charged to the sender's
    ``sent`` (one-level error feedback). Never chosen by ``auto``, which
    does not know the transport; ranked by ``jaxcomp.planning``."""

    name: ClassVar[str] = "ring"
    recompresses: ClassVar[bool] = True
    # Ranked by the planner, which prices its hops, its P compressions and
    # XLA:CPU's copy of its accumulator at every hop: it wins only where the
    # codec computes little and the all-to-all is slow (docs/choosing.md).
    planned_rates: ClassVar[frozenset[Rate]] = frozenset({Rate.FIXED, Rate.VARIABLE})

    def run(self, ctx, flat, state):
        me = lax.axis_index(ctx.axis)
        chunks, c = chunked(flat, ctx.size)
        acc = chunks.astype(jnp.float32)
        rows = None if state is None else state.reshape(ctx.size, c)
        if rows is not None and ctx.div != 1:
            acc = acc / ctx.div
        sent = chunks.astype(jnp.float32)
        acc, sent, new_rows = _scatter_reduce(ctx, me, acc, sent, rows, flat.dtype)
        own = (me + 1) % ctx.size
        p, hat, sent, new_state = _owner_compression(
            ctx, acc, sent, rows, new_rows, own, flat.dtype
        )
        out = _allgather(ctx, me, p, hat, own, jnp.zeros_like(acc))
        return out.reshape(-1)[: flat.size], sent.reshape(-1)[: flat.size], new_state

    def state_size(self, codec, n, dtype, axes):
        """One chunk (``ceil(n / P)``) per scatter-reduce step and one for
        the owner's last compression, ``P`` chunks in all (about ``n``)."""
        p = axes.size
        return p * -(-n // p)

    def state_positions(self, codec, n, dtype, axes, m):
        """At step s a device sends chunk ``d - s``, so the rows cover every
        chunk once; its last row is its own chunk, ``d + 1``."""
        p = axes.size
        c = m // p
        order = [[(d - s) % p for s in range(p - 1)] + [(d + 1) % p] for d in range(p)]
        chunks = np.asarray(order, np.int64)[:, :, None] * c + np.arange(c)
        return chunks.reshape(p, m)

    def operand_nbytes(self, codec, n, dtype, axes):
        p = axes.size
        chunk = codec.wire_nbytes((-(-n // p) if n else 0,), dtype)
        return {"collective-permute": 2 * (p - 1) * chunk}

    def collectives(self, codec, n, dtype, axes, bits=None):
        """Its ``2 (P - 1)`` hops, one collective-permute each (a
        variable-rate payload in the capacity tier a ``pmax`` agreed on
        before each hop)."""
        p = axes.size
        hops = 2 * (p - 1)
        if codec.rate is Rate.VARIABLE:
            tier = tier_nbytes(codec, -(-n // p), dtype, bits)
            return [Collective("all-reduce", 4), Collective("collective-permute", tier)] * hops
        chunk = self.operand_nbytes(codec, n, dtype, axes)["collective-permute"] / hops
        return [Collective("collective-permute", chunk)] * hops

    def kernel_calls(self, codec, n, dtype, axes):
        """P encodes of a chunk (the P - 1 scatter-reduce hops and the
        owner's) and 2P - 1 decodes (every received hop, and the owner's
        own)."""
        p = axes.size
        c = -(-n // p)
        return [KernelCall("encode", c, codec)] * p + [KernelCall("decode", c, codec)] * (2 * p - 1)


def _hop(ctx: Context, p: Payload) -> tuple[jax.Array, Payload]:
    """One ppermute hop: (the received chunk decoded, its payload at the
    codec's own capacity, ready to forward)."""
    return transfer(
        p,
        "collective-permute",
        ctx.axis,
        lambda q: (decode_f32(q, fused=True), own_capacity(ctx.codec, q)),
    )


def _add_row(a: jax.Array, i: jax.Array, v: jax.Array) -> jax.Array:
    """``a`` with ``v`` added to its row ``i``."""
    return lax.dynamic_update_index_in_dim(
        a, lax.dynamic_index_in_dim(a, i, keepdims=False) + v, i, 0
    )


def _scatter_reduce(ctx: Context, me, acc, sent, rows, dtype):
    """The P-1 scatter-reduce steps: ``(acc, sent, new_rows)``, ``acc``
    holding my reduced chunk at ``me + 1``; ``new_rows`` the steps' new
    server residuals (with ``rows``: each step's compression of its partial
    sum and its row, by :func:`compress_kept`, in one pass where the codec
    has the kernel), else their errors are in ``sent``."""
    new_rows = []
    for s in range(ctx.size - 1):
        j = (me - s) % ctx.size  # chunk I send
        partial = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        if rows is not None:
            p, row = compress_kept(ctx.codec, partial, rows[s], fold(ctx.key, s), dtype)
            new_rows.append(row)
        else:
            p = ctx.codec.encode(partial.astype(dtype), fold(ctx.key, s))
            sent = _add_row(sent, j, decode_own(p) - partial)
        got, _ = _hop(ctx, p)
        acc = _add_row(acc, (me - 1 - s) % ctx.size, got)  # the chunk I receive
    return acc, sent, new_rows


def _owner_compression(ctx: Context, acc, sent, rows, new_rows, own, dtype):
    """The owner's compression of its reduced chunk ``own``: ``(payload,
    decoded, sent, new_state)``."""
    codec, size = ctx.codec, ctx.size
    reduced = lax.dynamic_index_in_dim(acc, own, keepdims=False)
    if rows is not None:
        p, hat, last, _ = owner_stage(
            codec, reduced, 1, rows[size - 1], fold(ctx.key, size), dtype, decoded=True
        )
        return p, hat, sent, jnp.stack([*new_rows, last]).reshape(-1)
    p, hat, new_state, error = owner_stage(
        codec, reduced, ctx.div, None, fold(ctx.key, size), dtype
    )
    return p, hat, _add_row(sent, own, error), new_state


def _allgather(ctx: Context, me, p: Payload, hat, own, zeros):
    """The P-1 allgather steps: every reduced chunk, forwarded as its owner
    compressed it; returns them decoded, ``[P, c]``."""
    out = lax.dynamic_update_index_in_dim(zeros, hat, own, 0)
    for s in range(ctx.size - 1):
        got, p = _hop(ctx, p)
        r = (me - s) % ctx.size  # the owner of this payload is me - 1 - s; it owns chunk me - s
        out = lax.dynamic_update_index_in_dim(out, got, r, 0)
    return out
