"""TernGrad: stochastic ternary quantization, base-3^5 packed.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
Distributed Deep Learning" (NeurIPS 2017), section 3 (per-bucket scaling as
in the paper's layer-wise scaler, without gradient clipping); packing of
Lim et al., "3LC" (SysML 2019), section 3.2.
Kernels: ffi/include/jaxcomp/terngrad.h (bodies), ffi/terngrad.cc, cuda/terngrad.cu.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketedCodec, Kernels, array, num_buckets, register
from jaxcomp.ops import bucket as bk
from jaxcomp.ops import ieee, ternary
from jaxcomp.ops.rng import rng_uniform


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class TernGrad(BucketedCodec):
    """Each value becomes ``sign(v) * s * b`` with ``s`` the bucket's max|v|
    and ``b = 1`` with probability ``|v| / s`` (else 0): unbiased, with
    per-element variance ``s^2 p (1 - p)``, ``p = |v| / s``. The trits are
    base-3^5 packed over the whole tensor (1.6 bits per value), plus one
    float32 per bucket.

    Args:
      bucket_size: a power of two in [8, 65536].

    References:
      Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
      Distributed Deep Learning" (NeurIPS 2017), section 3; the base-3^5
      packing of Lim et al., "3LC" (SysML 2019), section 3.2.
    """

    bucket_size: int = 512

    name: ClassVar[str] = "terngrad"
    recompression: ClassVar[str] = "unsafe"  # see Codec.recompression
    codec_id: ClassVar[int] = 5
    stochastic: ClassVar[bool] = True
    seeded: ClassVar[bool] = True
    # The kernels of ffi/terngrad.cc and cuda/terngrad.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=(),
    )

    def arrays(self, n, dtype):
        return {
            "trits": array(ternary.num_bytes(n), np.uint8),
            "scales": array(num_buckets(n, self.bucket_size), np.float32),
        }

    def split_granularity(self):
        return None  # the trits are packed over the whole tensor

    def twin_encode(self, flat, seed):
        return encode_ref(flat, seed, self.bucket_size)

    def twin_decode(self, trits, scales, *, n, dtype):
        return decode_ref(trits, scales, n, dtype, self.bucket_size)


# ---------------------------------------------------------------------------
# Pure-JAX twins (terngrad.h: terngrad_digit, terngrad_value; ternary.h)
# ---------------------------------------------------------------------------
def encode_ref(x: jax.Array, seed: jax.Array, bucket: int):
    n = x.size
    raw = bk.to_buckets(x, bucket)
    xb = ieee.daz(raw)  # the kernels' arithmetic reads subnormals as zeros
    scale = bk.max_abs(raw)
    inv = bk.safe_recip(scale, 1.0)  # terngrad.h: terngrad_inv
    r = jnp.abs(xb) * inv[:, None]
    index = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
    up = (rng_uniform(seed, index) < r).astype(jnp.uint32)
    neg = (xb < 0).astype(jnp.uint32)
    digits = np.uint32(1) + up - np.uint32(2) * (up & neg)
    return ternary.pack(digits.reshape(-1)[:n]), scale


def decode_ref(trits: jax.Array, scales: jax.Array, n: int, dtype, bucket: int):
    nb = num_buckets(n, bucket)
    digits = jnp.pad(ternary.unpack(trits, n), (0, nb * bucket - n), constant_values=1)
    t = (digits.astype(jnp.int32) - 1).astype(jnp.float32).reshape(nb, bucket)
    return bk.from_buckets(t * scales[:, None], n, dtype)
