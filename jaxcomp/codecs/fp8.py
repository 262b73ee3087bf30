"""FP8: 8-bit floating point (E4M3 or E5M2) with a float32 scale per block.

Each block (bucket) of ``bucket_size`` values is scaled so that its largest magnitude
maps to the format's largest finite value (448 for E4M3, 57344 for E5M2),
then every value is rounded to the nearest FP8 value (ties to even) or,
with ``stochastic=True``, stochastically (unbiased), saturating. The
formats are those of the OCP 8-bit Floating Point Specification (OFP8,
2023; Micikevicius et al., "FP8 Formats for Deep Learning", 2022). Per-block
scaling as in the FP8 training recipes of NVIDIA's Transformer Engine.
Kernels: ffi/include/jaxcomp/minifloat.h (the rounding, shared with MX),
ffi/fp8.cc, cuda/fp8.cu; twin: jaxcomp/codecs/_minifloat.py.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs import _minifloat as mf
from jaxcomp.codecs.base import BucketedCodec, Kernels, array, check_bucket_size, register
from jaxcomp.ops import bucket as bk

_FORMATS = ("e4m3", "e5m2")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class FP8(BucketedCodec):
    """One FP8 code per value and the block's ``max|v|`` (float32) per block.

    Encode: ``code = round(v * (fmax / max|v|))`` to the format (ties to
    even, or stochastic), saturating at ``±fmax``; decode: ``value(code) *
    (max|v| * (1 / fmax))``. Relative error per value about 2^-4 (E4M3) or
    2^-3 (E5M2) of its own magnitude, down to the format's subnormals (2^-9
    and 2^-16 of the block max). A NaN or infinite value makes its block
    decode to NaN (±inf where the code is not zero), as Int8's does.

    Args:
      format: ``"e4m3"`` (3 mantissa bits, max 448) or ``"e5m2"`` (2
        mantissa bits, max 57344, more range).
      bucket_size: values per scale (the block), a power of two in [8, 65536].
      stochastic: unbiased stochastic rounding instead of round to nearest
        even.

    References:
      OCP 8-bit Floating Point Specification (OFP8) rev. 1.0 (2023);
      Micikevicius et al., "FP8 Formats for Deep Learning" (2022).
    """

    format: str = "e4m3"
    bucket_size: int = 256
    stochastic: bool = False  # type: ignore[misc]  # per instance, not per class

    name: ClassVar[str] = "fp8"
    codec_id: ClassVar[int] = 10
    seeded: ClassVar[bool] = True  # the kernel takes (and, nearest, ignores) a seed
    # The kernels of ffi/fp8.cc and cuda/fp8.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=("encode", "encode_feedback"),
    )

    def __post_init__(self):
        mf.format_named("FP8", "format", self.format, _FORMATS)
        mf.check_stochastic(self)
        check_bucket_size("FP8", self.bucket_size)

    @classmethod
    def examples(cls, *, coverage=False):
        users = (cls(), cls(format="e5m2"))
        more = (cls(stochastic=True, bucket_size=8), cls(format="e5m2", stochastic=True))
        return users + more if coverage else users

    def arrays(self, n, dtype):
        nb = self.num_buckets(n)
        return {"codes": array(nb * self.bucket_size, np.uint8), "scales": array(nb, np.float32)}

    def kernel_attrs(self, decode):
        f = mf.FORMATS[self.format]
        attrs = {"bucket_size": self.bucket_size, "format": f.wire_id}
        return attrs if decode else {**attrs, "stochastic": int(self.stochastic)}

    def wire_params(self):
        return (mf.FORMATS[self.format].wire_id, self.bucket_size, int(self.stochastic))

    @classmethod
    def from_wire_params(cls, params):
        if len(params) != 3 or params[0] not in (0, 1) or params[2] not in (0, 1):
            raise ValueError(
                f"FP8: expected (format 0|1, bucket_size, stochastic 0|1), got {params}"
            )
        fmt, block, stochastic = params
        return cls(
            format=mf.BY_WIRE_ID[fmt].name, bucket_size=int(block), stochastic=bool(stochastic)
        )

    def twin_encode(self, x, seed):
        f = mf.FORMATS[self.format]
        xb = bk.to_buckets(x, self.bucket_size)
        m = bk.max_abs(xb)
        t = xb * bk.safe_recip(m, f.max_value)[:, None]  # fp8.h: fmax / max|v|
        u = mf.uniforms(seed, xb.shape) if self.stochastic else None
        return mf.encode(t, f, u).astype(jnp.uint8).reshape(-1), m

    def twin_decode(self, codes, scales, *, n, dtype):
        f = mf.FORMATS[self.format]
        step = scales * (np.float32(1) / np.float32(f.max_value))
        values = mf.value(codes.reshape(-1, self.bucket_size), f) * step[:, None]
        # A NaN scale: the canonical NaN (fp8.cc), not whichever NaN operand.
        values = jnp.where(jnp.isnan(step)[:, None], np.float32(np.nan), values)
        return bk.from_buckets(values, n, dtype)
