"""Int8: deterministic 255-level quantization per bucket.

The "8-bit int" baseline of Lim et al., "3LC: Lightweight and Effective
Traffic Compression for Distributed Machine Learning" (SysML 2019),
section 5.1: scale = max|v| / 127, round to nearest.
Kernels: ffi/include/jaxcomp/int8.h (bodies), ffi/int8.cc, cuda/int8.cu.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

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
    # The kernels of ffi/int8.cc and cuda/int8.cu, and the CUDA ones "auto"
    # runs, measured against the twins (docs/gpu.md).
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
        values = q.reshape(-1, self.bucket_size).astype(jnp.float32) * step[:, None]
        return bk.from_buckets(values, n, dtype)
