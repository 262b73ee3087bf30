"""Scaled sign (EF-SignSGD): one bit per value and the bucket's mean magnitude.

Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes" (ICML 2019), Algorithm 1 (EF-SIGNSGD): the
compressed step is ``||p||_1 / d * sign(p)``, which with error feedback
converges where plain signSGD does not. Applied per bucket of consecutive
values as in the blockwise variant of Zheng, Huang, Kwok, "Communication-
Efficient Distributed Blockwise Momentum SGD with Error-Feedback" (NeurIPS
2019). Kernels: ffi/include/jaxcomp/signsgd.h (bodies), ffi/signsgd.cc,
cuda/signsgd.cu.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import BucketedCodec, Kernels, array, register
from jaxcomp.ops import bucket as bk
from jaxcomp.ops import ieee
from jaxcomp.ops.packing import pack, unpack


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class SignSGD(BucketedCodec):
    """One bit per value, its sign, and one float32 per bucket: the mean of
    the bucket's magnitudes, ``scale = sum(|v|) / count``. Decodes to
    ``-scale`` where ``v < 0`` and ``+scale`` elsewhere (zeros included), so
    every bucket keeps its L1 norm. Deterministic and biased: use it with
    error feedback (``jc.optax.compress_gradients``, the default), as the
    paper does. A NaN or infinite value makes its bucket's scale non-finite.

    Args:
      bucket_size: a power of two in [8, 65536].

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
      Compression Schemes" (ICML 2019), Algorithm 1; blockwise scaling of
      Zheng et al. (NeurIPS 2019).
    """

    bucket_size: int = 512

    name: ClassVar[str] = "signsgd"
    recompression: ClassVar[str] = "coarse"  # see Codec.recompression
    codec_id: ClassVar[int] = 9
    # The kernels of ffi/signsgd.cc and cuda/signsgd.cu. On GPUs "auto" runs only
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
            "signs": array(nb * self.bucket_size // 8, np.uint8),  # a bit per element
            "scales": array(nb, np.float32),  # the bucket's mean magnitude
        }

    def twin_encode(self, x):
        n, b = x.size, self.bucket_size
        xb = ieee.daz(bk.to_buckets(x, b))  # as the kernels' arithmetic reads it
        # signsgd.h: the halving-tree sum of |v| times 1 / count, each rounded
        # once (a quotient by a constant count would not survive XLA, which
        # may turn it into a product by the rounded reciprocal).
        counts = np.minimum(b, n - np.arange(self.num_buckets(n)) * b).astype(np.float32)
        scales = bk.tree_sum(jnp.abs(xb)) * (np.float32(1) / counts)
        return pack((xb < 0).astype(jnp.uint8).reshape(-1), 1), scales

    def twin_decode(self, signs, scales, *, n, dtype):
        neg = unpack(signs, 1).reshape(-1, self.bucket_size) != 0
        values = jnp.where(neg, -scales[:, None], scales[:, None])
        return bk.from_buckets(values, n, dtype)
