"""1-bit SGD with per-bucket averages.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to
Data-Parallel Distributed Training of Speech DNNs" (Interspeech 2014), as
described in Grubic et al. (EDBT 2018), section 2.2, with the "reshaped"
bucketing of section 3.2.2 (1bitSGD*). Deterministic; it relies on error
feedback to converge.
Kernels: ffi/include/jaxcomp/onebit.h (bodies), ffi/onebit.cc, cuda/onebit.cu.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketedCodec, Kernels, array, register
from jaxcomp.ops import bucket as bk
from jaxcomp.ops import ieee
from jaxcomp.ops.packing import pack, unpack


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class OneBit(BucketedCodec):
    """One bit per value: ``v >= 0`` decodes to the bucket's mean of its
    non-negative values (avg+), ``v < 0`` to the mean of its negatives (avg-).

    Args:
      bucket_size: a power of two in [8, 65536]; the study used 64.

    References:
      Seide et al., "1-Bit Stochastic Gradient Descent and its Application
      to Data-Parallel Distributed Training of Speech DNNs" (Interspeech
      2014); Grubic et al. (EDBT 2018), sections 2.2 and 3.2.2 (1bitSGD*).
    """

    bucket_size: int = 64

    name: ClassVar[str] = "onebit"
    recompression: ClassVar[str] = "coarse"  # see Codec.recompression
    codec_id: ClassVar[int] = 2
    # The kernels of ffi/onebit.cc and cuda/onebit.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=("encode", "encode_feedback"),
    )

    def arrays(self, n, dtype):
        nb = self.num_buckets(n)
        return {
            "bits": array(nb * self.bucket_size // 8, np.uint8),
            "means": array(2 * nb, np.float32),
        }

    def twin_encode(self, x):
        n = x.size
        xb = ieee.daz(bk.to_buckets(x, self.bucket_size))  # as the kernels' arithmetic reads it
        p = xb >= 0  # NaN goes to the negative side and poisons avg-
        valid = jnp.arange(xb.size).reshape(xb.shape) < n
        npos = jnp.sum(p & valid, axis=1, dtype=jnp.uint32)
        nneg = jnp.sum(valid, axis=1, dtype=jnp.uint32) - npos
        zero = np.float32(0)
        hi = _mean(bk.tree_sum(jnp.where(p, xb, zero)), npos)
        lo = _mean(bk.tree_sum(jnp.where(p, zero, xb)), nneg)
        return pack(p.astype(jnp.uint8).reshape(-1), 1), jnp.stack([hi, lo], axis=1).reshape(-1)

    def twin_decode(self, bits, means, *, n, dtype):
        codes = unpack(bits, 1).reshape(-1, self.bucket_size)
        m = means.reshape(-1, 2)
        values = jnp.where(codes != 0, m[:, :1], m[:, 1:])
        return bk.from_buckets(values, n, dtype)


# ---------------------------------------------------------------------------
# Pure-JAX twins (onebit.h)
# ---------------------------------------------------------------------------
def _mean(total: jax.Array, count: jax.Array) -> jax.Array:
    positive = count > 0
    # Correctly rounded on every platform (XLA's GPU division is not): ops/ieee.py.
    return jnp.where(
        positive, ieee.div(total, jnp.where(positive, count, 1).astype(jnp.float32)), 0.0
    )
