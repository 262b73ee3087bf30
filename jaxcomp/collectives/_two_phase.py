"""The two-phase algorithm: a reduce-scatter of compressed chunks, then an
all-gather of the re-compressed reduced chunks (and its pipelined form, for
large tensors)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.collectives._algorithm import Algorithm, Collective, Context, KernelCall, register
from jaxcomp.collectives._chunks import chunk_len, chunked, padded, split
from jaxcomp.collectives._decode import decode_own, decode_rows, decode_sum
from jaxcomp.collectives._exchange import exchange
from jaxcomp.collectives._feedback import charge, compress_kept, owner_stage
from jaxcomp.collectives._keys import fold
from jaxcomp.collectives._order import after
from jaxcomp.collectives._tiers import tier_nbytes, transfer
from jaxcomp.payload import Payload

# Two-phase may cut a tensor into up to this many segments, each a two-phase
# all-reduce of its own, so that one segment's decoding and second
# compression run while another's payloads are on the wire (see
# pipeline_depth). 1, the default, turns the pipeline off: where it was
# measured, on the CPU, it did not pay (docs/benchmarks.md, "Compressed
# all-reduce over emulated links"), and no GPU has measured it.
PIPELINE_MAX_DEPTH = 1
# ... and only where every owner's part of a segment keeps this many values
# (below it a collective's fixed cost outweighs what the overlap saves).
PIPELINE_MIN_VALUES = 1 << 18


def pipeline_depth(codec: Codec, n: int, size: int) -> int:
    """How many segments the two-phase all-reduce of ``n`` values over
    ``size`` devices is pipelined in (1: not pipelined).

    Only fixed-rate codecs that split at a granularity (one encoding of a
    tensor cut into per-chunk payloads; variable-rate payloads travel in
    capacity tiers chosen per call) are pipelined, in the deepest of
    :data:`PIPELINE_MAX_DEPTH`, ..., 2 segments that divides every owner's
    chunk into whole granules of at least :data:`PIPELINE_MIN_VALUES`
    values. The chunks, and so the server residual's layout, are those of
    the unpipelined algorithm.
    """
    g = codec.split_granularity()
    if not g or codec.rate is Rate.VARIABLE or size < 2:
        return 1
    c = chunk_len(codec, n, size)
    for depth in range(PIPELINE_MAX_DEPTH, 1, -1):
        if c % (depth * g) == 0 and c // depth >= PIPELINE_MIN_VALUES:
            return depth
    return 1


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
        return self._run(ctx, flat, None, state)

    def run_feedback(self, ctx, flat, residual, state):
        """Where the first compression is one encoding of the tensor (codecs
        that split at a granularity), it makes the payloads and the new
        residual together (:func:`compress_kept`)."""
        if not ctx.codec.split_granularity():
            return super().run_feedback(ctx, flat, residual, state)
        return self._run(ctx, flat, residual, state)

    @staticmethod
    def _run(ctx, flat, residual, state):
        depth = pipeline_depth(ctx.codec, flat.size, ctx.size)
        if depth > 1:
            return _pipelined(ctx, flat, residual, state, depth)
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
    """The unpipelined steps: first compression, reduce-scatter (the
    all-to-all of every owner's chunk, decoded and summed by its owner), the
    owner's second compression, all-gather. With a ``residual``, what the
    input kept comes back in ``sent``'s place (``Algorithm.run_feedback``)."""
    me = lax.axis_index(ctx.axis)
    n, dtype = flat.size, flat.dtype
    payloads, stage1, c = _first_compression(ctx, flat, residual)
    # My chunk, summed over the devices.
    mine = transfer(payloads, "all-to-all", ctx.axis, decode_sum)
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


def _pipelined(ctx: Context, flat: jax.Array, residual, state, depth: int):
    """Two-phase in ``depth`` segments. The tensor is encoded once and its
    payload cut per owner, as in :func:`_two_phase`; each owner's chunk is
    then viewed as ``depth`` parts, and segment ``s`` (the ``s``-th part of
    every owner's chunk) goes through its own all-to-all, decode-and-sum,
    second compression and all-gather.

    XLA runs a program's operations as their inputs become ready (on the
    CPU, the thunk executor hands independent ones to its thread pool; on
    GPUs, collectives run on their own stream), so one segment's decoding
    and second compression overlap the next one's transfer. The collectives
    go in one fixed order on every device (all-to-all 0, all-to-all 1,
    all-gather 0, all-to-all 2, ...), each one's operand tied to the
    previous one's result (:func:`after`).

    The first compression, ``sent`` and the server residual's layout are
    the unpipelined algorithm's. For deterministic codecs the result and the
    new state are too, bit for bit (the codec splits at the part
    boundaries), and so is ``sent`` but on the owner's chunk under one-level
    error feedback, where XLA may fuse the added error differently (the last
    bit); stochastic codecs draw the second compression's bits from one key
    per segment: other bits, of the same distribution.
    """
    me = lax.axis_index(ctx.axis)
    n = flat.size
    c = chunk_len(ctx.codec, n, ctx.size)
    # my chunks as their owners see them (or what my input kept)
    p, sent = _encode_whole(ctx, flat, residual, ctx.size * c)
    # [size * depth] payloads of ``c / depth`` values, owner-major.
    pieces = split(p, ctx.size * depth)
    states = None if state is None else state.reshape(depth, c // depth)
    totals, new_states, errors = _segments(ctx, pieces, states, depth, flat.dtype)
    total = jnp.stack(totals, axis=1).reshape(-1)[:n]
    if state is not None:
        return total, sent[:n], jnp.concatenate(new_states)
    errors = jnp.concatenate(errors)
    return total, charge(sent, me, c, errors, kept=residual is not None)[:n], None


def _segments(ctx: Context, pieces: Payload, states, depth: int, dtype):
    """The segments' all-to-alls, owner stages and all-gathers, in the
    pipeline's order: ``(totals, new_states, errors)``, per segment (the
    total ``[size, part]``, the owner stage's new state and error)."""
    size = ctx.size
    totals, new_states, errors = [], [], []
    last = None  # the result of the latest collective, to order the next one
    pending = None  # the previous segment's reduced part, compressed again
    for s in range(depth):
        segment = pieces.map(lambda a, s=s: a.reshape(size, depth, *a.shape[1:])[:, s])
        received = exchange(after(segment, last), "all-to-all", ctx.axis)
        last = received.arrays
        if pending is not None:
            last = _gather_segment(ctx, pending, last, totals)
        p2, _, new_state, error = owner_stage(
            ctx.codec,
            decode_sum(received),
            ctx.div,
            None if states is None else states[s],
            fold(fold(ctx.key, size), s),
            dtype,
        )
        new_states.append(new_state)
        errors.append(error)
        pending = p2
    _gather_segment(ctx, pending, last, totals)
    return totals, new_states, errors


def _gather_segment(ctx: Context, p2: Payload, last, totals: list) -> dict:
    """All-gathers a segment's reduced parts (after the collective whose
    result is ``last``) and appends them, decoded, to ``totals``; returns
    what arrived, to order the next collective."""
    got = exchange(after(p2, last), "all-gather", ctx.axis)
    totals.append(decode_rows(got, fused=True))  # [size, part]
    return got.arrays
