"""The two-phase algorithm: a reduce-scatter of compressed chunks, then an
all-gather of the re-compressed reduced chunks."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.codecs.base import Rate
from jaxcomp.collectives._algorithm import Algorithm, Collective, Context, KernelCall, register
from jaxcomp.collectives._chunks import chunk_len, chunked, padded, split
from jaxcomp.collectives._decode import decode_own, decode_rows, decode_sum
from jaxcomp.collectives._keys import fold
from jaxcomp.collectives._order import after
from jaxcomp.collectives._tiers import tier_nbytes, transfer
from jaxcomp.collectives.feedback import charge, compress_kept, owner_stage


@register
@dataclasses.dataclass(frozen=True)
class TwoPhase(Algorithm):
    """Reduce-scatter of compressed chunks (all_to_all), then an allgather of
    the re-compressed reduced chunks: DeepSpeed's compressed allreduce, and
    the reduce-and-broadcast of the low-precision study (section 2.4.1).
    The server residual is the owned chunk's (``chunk_len`` values)."""

    name: ClassVar[str] = "two_phase"
    auto_rank: ClassVar[int | None] = 3
    recompresses: ClassVar[bool] = True
    planned_rates: ClassVar[frozenset[Rate]] = frozenset({Rate.FIXED, Rate.VARIABLE})

    def run(self, ctx, flat, state):
        return _two_phase(ctx, flat, None, state)

    def run_feedback(self, ctx, flat, residual, state):
        """Where the first compression is one encoding of the tensor (codecs
        that split at a granularity), it makes the payloads and the new
        residual together (:func:`compress_kept`)."""
        if not ctx.codec.split_granularity():
            return super().run_feedback(ctx, flat, residual, state)
        return _two_phase(ctx, flat, residual, state)

    def chosen(self, codec, n, axes):
        """Every other codec: bytes per device near 2 (P-1)/P of one
        compressed tensor where ``allgather`` sends (P-1) of them, with two
        compressions where the ring needs P. Variable-rate codecs (ThreeLC)
        too, whose payloads travel in capacity tiers."""
        return True

    def state_size(self, codec, n, dtype, axes):
        return chunk_len(codec, n, axes.size)

    def operand_nbytes(self, codec, n, dtype, axes):
        chunk = codec.wire_nbytes((chunk_len(codec, n, axes.size),), dtype)
        return {"all-to-all": axes.size * chunk, "all-gather": chunk}

    def collectives(self, codec, n, dtype, axes, bits=None):
        """A variable-rate payload travels in the capacity tier a ``pmax``
        (a 4-byte all-reduce) agreed on, in each phase."""
        if codec.rate is Rate.VARIABLE:
            p = axes.size
            tier = tier_nbytes(codec, chunk_len(codec, n, p), dtype, bits)
            pmax = Collective("all-reduce", 4)
            return [pmax, Collective("all-to-all", p * tier), pmax, Collective("all-gather", tier)]
        return super().collectives(codec, n, dtype, axes, bits)

    def kernel_calls(self, codec, n, dtype, axes):
        p = axes.size
        c = chunk_len(codec, n, p)
        return [
            KernelCall("encode", p * c, codec),  # the tensor, cut into P chunks
            KernelCall("decode", p * c, codec),  # the P received pieces of my chunk
            KernelCall("encode", c, codec),  # my reduced chunk
            KernelCall("decode", p * c, codec),  # the P gathered chunks
        ]


def _two_phase(ctx: Context, flat: jax.Array, residual, state):
    """The steps: first compression, reduce-scatter (the
    all-to-all of every owner's chunk, decoded and summed by its owner), the
    owner's second compression, all-gather. With a ``residual``, what the
    input kept comes back in ``sent``'s place (``Algorithm.run_feedback``)."""
    me = lax.axis_index(ctx.axis)
    n, dtype = flat.size, flat.dtype
    payloads, stage1, c = _first_compression(ctx, flat, residual)
    # My chunk, summed over the devices.
    mine = transfer(payloads, "all-to-all", ctx.axis, decode_sum, ctx.all_to_all)
    p2, _, new_state, error = owner_stage(
        ctx.codec, mine, ctx.div, state, fold(ctx.key, ctx.size), dtype
    )
    total = transfer(
        p2, "all-gather", ctx.axis, lambda q: decode_rows(q, fused=True).reshape(-1)[:n]
    )
    if error is None:
        return total, stage1[:n], new_state
    return total, charge(stage1, me, c, error, kept=residual is not None)[:n], None


def _first_compression(ctx: Context, flat: jax.Array, residual=None):
    """Every owner's chunk of ``flat`` (plus ``residual``), compressed:
    ``(payloads, own, c)``, the stacked payloads, what they decode to (my
    chunks as their owners see them, flat; with a ``residual``, what my
    input kept instead) and the chunk length."""
    codec, size = ctx.codec, ctx.size
    if codec.split_granularity():
        # One encoding of the whole tensor, cut into per-owner payloads.
        c = chunk_len(codec, flat.size, size)
        p, own = _encode_whole(ctx, flat, residual, size * c)
        return split(p, size), own, c
    chunks, c = chunked(flat, size)
    key = ctx.key
    keys = None if key is None else jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(size))
    payloads = jax.vmap(codec.encode)(chunks, keys)
    return payloads, decode_rows(payloads, fused=True).reshape(-1), c


def _encode_whole(ctx: Context, flat: jax.Array, residual, length: int):
    """``flat`` (plus ``residual``) zero padded to ``length`` and encoded
    once: ``(payload, own)``, ``own`` what the payload decodes to, or with a
    ``residual`` what the input kept (:func:`compress_kept`, the payload
    tied to ``ctx.dep``)."""
    if residual is None:
        p = ctx.codec.encode(padded(flat, length), ctx.key)
        return p, decode_own(p)
    p, kept = compress_kept(
        ctx.codec, padded(flat, length), padded(residual, length), ctx.key, flat.dtype
    )
    return after(p, ctx.dep), kept
