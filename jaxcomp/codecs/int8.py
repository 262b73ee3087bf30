"""Int8: deterministic 255-level quantization per bucket.

The "8-bit int" baseline of Lim et al., "3LC: Lightweight and Effective
Traffic Compression for Distributed Machine Learning" (SysML 2019),
section 5.1: scale = max|v| / 127, round to nearest.
Kernels: ffi/include/jaxcomp/int8.h (bodies), ffi/int8.cc, cuda/int8.cu.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import BucketedCodec, Kernels, array, register
from jaxcomp.ops import bucket as bk


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8(BucketedCodec):
    """``q = round(v * 127 / max|v|)`` in [-127, 127] (ties to even), one
    float32 ``max|v|`` per bucket; decodes to ``q * max|v| / 127``.

    Args:
      bucket_size: a power of two in [8, 65536].

    References:
      The "8-bit int" baseline of Lim et al., "3LC" (SysML 2019), section 5.1.
    """

    bucket_size: int = 512

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3
    # The kernels of ffi/int8.cc and cuda/int8.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=("encode", "encode_feedback"),
    )

    def arrays(self, n, dtype):
        nb = self.num_buckets(n)
        return {"q": array(nb * self.bucket_size, np.int8), "scales": array(nb, np.float32)}

    def twin_encode(self, x):
        xb = bk.to_buckets(x, self.bucket_size)
        m = bk.max_abs(xb)
        t = xb * bk.safe_recip(m, 127.0)[:, None]
        t = jnp.where(t < -127, np.float32(-127), t)
        t = jnp.where(t > 127, np.float32(127), t)
        t = jnp.where(t == t, t, np.float32(0))
        return jnp.round(t).astype(jnp.int8).reshape(-1), m

    def twin_decode(self, q, scales, *, n, dtype):
        step = scales * (np.float32(1) / np.float32(127))  # int8.h: int8_step
        hi, lo = exact_parts(step)
        qf = q.reshape(-1, self.bucket_size).astype(jnp.float32)
        # int8.h: int8_value, q * step rounded once, as a sum of two exact
        # products (exact_parts): XLA's CPU code contracts a product and
        # the add it feeds into one FMA (a decode fused into a sum over
        # rows, Codec.decode_sum, or into a residual), which would skip
        # the product's rounding; a sum of exact products has none to skip.
        values = qf * hi[:, None] + qf * lo[:, None]
        return bk.from_buckets(values, n, dtype)


def exact_parts(step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``step = hi + lo`` (float32, per bucket) such that ``q * hi`` and
    ``q * lo`` are exact for every int8 ``q`` (or past float32's range, where
    ``q * step`` is infinite too), whatever the CPU's flush of subnormals:
    then ``q * hi + q * lo`` rounds once to ``q * step``, the
    kernel's value, with or without a contraction into an FMA.

    ``hi`` keeps ``step``'s top 17 significant bits and ``lo`` the other 7;
    an int8 has at most 7 significant bits (-128 is -2^7), so both products
    fit in float32's 24. Where
    that split is not exact under XLA:CPU's flush of subnormal results
    (``|step| < 2^-100``: ``q * lo`` could be subnormal while ``q * step`` is
    not), or is empty (``lo == 0``), or ``step`` is not finite: ``hi = step``
    and ``lo`` a zero of ``step``'s sign, so ``q * lo`` is a zero of
    ``q * step``'s sign and adding it changes no bit (signed zeros and NaNs
    included).
    """
    bits = lax.bitcast_convert_type(step, jnp.uint32)
    hi = lax.bitcast_convert_type(bits & np.uint32(0xFFFFFF80), jnp.float32)
    lo = step - hi  # exact: hi and step share their exponent
    split = (jnp.abs(step) >= np.float32(2.0**-100)) & (jnp.abs(step) < np.inf) & (lo != 0)
    signed_zero = lax.bitcast_convert_type(bits & np.uint32(0x80000000), jnp.float32)
    return jnp.where(split, hi, step), jnp.where(split, lo, signed_zero)
