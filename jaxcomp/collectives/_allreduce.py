"""The allreduce algorithm: linear codecs' payloads summed on the wire."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jax import lax

from jaxcomp.codecs.base import Rate
from jaxcomp.collectives._algorithm import Algorithm, KernelCall, register
from jaxcomp.collectives._decode import decode_f32, decode_own
from jaxcomp.collectives._exchange import record


@register
@dataclasses.dataclass(frozen=True)
class AllReduce(Algorithm):
    """Linear codecs (``codec.rate is Rate.LINEAR``, e.g. Identity): every
    device encodes with the same key, one ``psum`` sums the payloads, one
    decode."""

    name: ClassVar[str] = "allreduce"
    auto_rank: ClassVar[int | None] = 0
    planned_rates: ClassVar[frozenset[Rate]] = frozenset({Rate.LINEAR})

    def run(self, ctx, flat, state):
        codec = ctx.codec
        if codec.rate is not Rate.LINEAR:
            raise ValueError(
                f"jc.psum: algorithm='allreduce' sums payloads, which only linear codecs "
                f"(codec.rate is Rate.LINEAR) allow; {codec!r} is {codec.rate.value}-rate"
            )
        p = codec.encode(flat, ctx.key)
        record("all-reduce", p.arrays.values())
        summed = p.map(lambda a: lax.psum(a, ctx.axis))
        total = decode_f32(summed)
        return (total if ctx.div == 1 else total / ctx.div), decode_own(p), state

    def chosen(self, codec, n, axes):
        """Linear codecs, always (whatever the devices)."""
        return codec.rate is Rate.LINEAR

    def operand_nbytes(self, codec, n, dtype, axes):
        return {"all-reduce": codec.wire_nbytes((n,), dtype)}

    def kernel_calls(self, codec, n, dtype, axes):
        return [KernelCall("encode", n, codec), KernelCall("decode", n, codec)]
