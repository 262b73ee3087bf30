"""The allgather algorithm: every device's payload to every device."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxcomp.codecs.base import Rate
from jaxcomp.collectives._algorithm import Algorithm, Collective, KernelCall, register
from jaxcomp.collectives._decode import decode_own, decode_sum
from jaxcomp.collectives._order import after
from jaxcomp.collectives._tiers import tier_nbytes, transfer
from jaxcomp.collectives.feedback import compress_kept

# Up to this many devices, codecs whose second compression is "coarse" go
# through allgather: (P - 1) C(n) bytes per device against about 2 C(n) for
# two-phase, at most 3.5x at 8 devices, for accuracy that two-phase loses
# (docs/accuracy.md). Beyond it allgather's bytes grow with P, and the
# two-phase all-reduce (with its server residual) is chosen.
COARSE_ALLGATHER_MAX_DEVICES = 8


@register
@dataclasses.dataclass(frozen=True)
class Allgather(Algorithm):
    """Encode once, all-gather the payloads, decode them and sum: one
    compression, so no server residual."""

    name: ClassVar[str] = "allgather"
    auto_rank: ClassVar[int | None] = 2
    planned_rates: ClassVar[frozenset[Rate]] = frozenset({Rate.FIXED, Rate.VARIABLE})

    def run(self, ctx, flat, state):
        p = ctx.codec.encode(flat, ctx.key)
        return self._gather(ctx, p), decode_own(p), state

    def run_feedback(self, ctx, flat, residual, state):
        """The one compression makes the payload and the new residual
        together (:func:`compress_kept`)."""
        p, kept = compress_kept(ctx.codec, flat, residual, ctx.key, flat.dtype)
        return self._gather(ctx, after(p, ctx.dep)), kept, state

    @staticmethod
    def _gather(ctx, p):
        total = transfer(p, "all-gather", ctx.axis, decode_sum)
        return total if ctx.div == 1 else total / ctx.div

    def chosen(self, codec, n, axes):
        """Two devices or fewer values than devices (the same bytes as
        two-phase, one compression instead of two); codecs that cannot take
        a second compression under error feedback (``codec.recompression ==
        "unsafe"``: TernGrad); and those that lose accuracy to it
        (``"coarse"``: OneBit, SignSGD, 3LC with sparsity above 1) up to
        :data:`COARSE_ALLGATHER_MAX_DEVICES` devices."""
        p = axes.size
        if p <= 2 or n < p or codec.recompression == "unsafe":
            return True
        return codec.recompression == "coarse" and p <= COARSE_ALLGATHER_MAX_DEVICES

    def operand_nbytes(self, codec, n, dtype, axes):
        return {"all-gather": codec.wire_nbytes((n,), dtype)}

    def collectives(self, codec, n, dtype, axes, bits=None):
        """A variable-rate payload travels in the capacity tier a ``pmax``
        (a 4-byte all-reduce) agreed on."""
        if codec.rate is Rate.VARIABLE:
            tier = tier_nbytes(codec, n, dtype, bits)
            return [Collective("all-reduce", 4), Collective("all-gather", tier)]
        return super().collectives(codec, n, dtype, axes, bits)

    def kernel_calls(self, codec, n, dtype, axes):
        """Encode the tensor; decode all P payloads (a decode-and-sum
        kernel, or decoded rows then summed)."""
        return [KernelCall("encode", n, codec), KernelCall("decode", axes.size * n, codec)]
