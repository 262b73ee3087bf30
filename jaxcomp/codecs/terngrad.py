"""TernGrad: stochastic ternary quantization, base-3^5 packed.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning" (NeurIPS 2017), section 3 (per-bucket scaling as
in the paper's layer-wise scaler, without gradient clipping); packing of
Lim et al., "3LC" (SysML 2019), section 3.2.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketSizeWire, Codec, check_bucket_size, register
from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import ternary
from jaxcomp.ops import terngrad as ops


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TernGrad(BucketSizeWire, Codec):
    """Each value becomes ``sign(v) * s * b`` with ``s`` the bucket's max|v|
    and ``b = 1`` with probability ``|v| / s`` (else 0): unbiased, with
    per-element variance ``s^2 p (1 - p)``, ``p = |v| / s``. The trits are
    base-3^5 packed over the whole tensor (1.6 bits per value), plus one
    float32 per bucket.

    Args:
      bucket_size: a power of two in [8, 65536].
    """

    bucket_size: int = 512

    name: ClassVar[str] = "terngrad"
    codec_id: ClassVar[int] = 5
    stochastic: ClassVar[bool] = True

    def __post_init__(self):
        check_bucket_size("TernGrad", self.bucket_size)

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        return {
            "trits": jax.ShapeDtypeStruct((ternary.num_bytes(n),), jnp.uint8),
            "scales": jax.ShapeDtypeStruct((bk.num_buckets(n, self.bucket_size),), jnp.float32),
        }

    def _encode(self, flat, seed, backend):
        trits, scales = ops.encode(flat, seed, bucket=self.bucket_size, backend=backend)
        return {"trits": trits, "scales": scales}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["trits"],
            payload["scales"],
            n=n,
            dtype=dtype,
            bucket=self.bucket_size,
            backend=backend,
        )
