"""Int8: deterministic 255-level quantization per bucket.

The "8-bit int" baseline of Lim et al., "3LC: Lightweight and Effective
Traffic Compression for Distributed Machine Learning" (SysML 2019),
section 5.1: scale = max|v| / 127, round to nearest.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketSizeWire, Codec, check_bucket_size, register
from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import int8 as ops


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Int8(BucketSizeWire, Codec):
    """``q = round(v * 127 / max|v|)`` in [-127, 127] (ties to even), one
    float32 ``max|v|`` per bucket; decodes to ``q * max|v| / 127``.

    Args:
      bucket_size: a power of two in [8, 65536].
    """

    bucket_size: int = 512

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3

    def __post_init__(self):
        check_bucket_size("Int8", self.bucket_size)

    def split_granularity(self):
        return self.bucket_size  # independent buckets

    def layout(self, shape, dtype=jnp.float32):
        nb = bk.num_buckets(int(np.prod(shape, dtype=np.int64)), self.bucket_size)
        return {
            "q": jax.ShapeDtypeStruct((nb * self.bucket_size,), jnp.int8),
            "scales": jax.ShapeDtypeStruct((nb,), jnp.float32),
        }

    def _encode(self, flat, seed, backend):
        q, scales = ops.encode(flat, bucket=self.bucket_size, backend=backend)
        return {"q": q, "scales": scales}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["q"],
            payload["scales"],
            n=n,
            dtype=dtype,
            bucket=self.bucket_size,
            backend=backend,
        )
