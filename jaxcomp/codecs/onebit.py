"""1-bit SGD with per-bucket averages.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014), as
described in Grubic et al. (EDBT 2018), section 2.2, with the "reshaped"
bucketing of section 3.2.2 (1bitSGD*). Deterministic; it relies on error
feedback to converge.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketSizeWire, Codec, check_bucket_size, register
from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import onebit as ops


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBit(BucketSizeWire, Codec):
    """One bit per value: ``v >= 0`` decodes to the bucket's mean of its
    non-negative values (avg+), ``v < 0`` to the mean of its negatives (avg-).

    Args:
      bucket_size: a power of two in [8, 65536]; the study used 64.
    """

    bucket_size: int = 64

    name: ClassVar[str] = "onebit"
    codec_id: ClassVar[int] = 2

    def __post_init__(self):
        check_bucket_size("OneBit", self.bucket_size)

    def split_granularity(self):
        return self.bucket_size  # independent buckets

    def layout(self, shape, dtype=jnp.float32):
        nb = bk.num_buckets(int(np.prod(shape, dtype=np.int64)), self.bucket_size)
        return {
            "bits": jax.ShapeDtypeStruct((nb * self.bucket_size // 8,), jnp.uint8),
            "means": jax.ShapeDtypeStruct((2 * nb,), jnp.float32),
        }

    def _encode(self, flat, seed, backend):
        bits, means = ops.encode(flat, bucket=self.bucket_size, backend=backend)
        return {"bits": bits, "means": means}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["bits"],
            payload["means"],
            n=n,
            dtype=dtype,
            bucket=self.bucket_size,
            backend=backend,
        )
