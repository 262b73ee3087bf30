"""QSGD: stochastic, unbiased quantization with bucketing.

Alistarh et al., "QSGD" (NeurIPS 2017), as described in Grubic et al.,
"Synchronous Multi-GPU Deep Learning with Low-Precision Communication: An
Experimental Study" (EDBT 2018), section 2.3 and the bucketing of 3.2.2.
Kernels: ffi/include/jaxcomp/qsgd.h (bodies), ffi/qsgd.cc, cuda/qsgd.cu.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import (
    BucketedCodec,
    Kernels,
    array,
    check_bucket_size,
    check_int,
    register,
)
from jaxcomp.ops import bucket as bk
from jaxcomp.ops import ieee
from jaxcomp.ops.packing import pack, unpack
from jaxcomp.ops.rng import rng_uniform

_NORMS = ("max", "l2")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class QSGD(BucketedCodec):
    """Stochastic quantization to ``s = 2^(bits-1) - 1`` levels per sign.

    Each bucket of ``bucket_size`` consecutive values is scaled by its max
    norm (default) or L2 norm; ``|v| / scale * s`` is rounded down or up at
    random with the probabilities that make the result unbiased
    (``E[decode(encode(v))] = v``), with per-element variance at most
    ``(scale / s)^2 / 4``. Each value costs ``bits`` bits (sign + level),
    bit-packed, plus one float32 per bucket.

    Args:
      bits: 2, 3, 4 or 8.
      bucket_size: a power of two in [8, 65536]; the study used 512 for 4 and
        8 bits and 128 for 2 bits.
      norm: "max" or "l2".

    References:
      Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
      Quantization and Encoding" (NeurIPS 2017); Grubic et al., "Synchronous
      Multi-GPU Deep Learning with Low-Precision Communication: An
      Experimental Study" (EDBT 2018), sections 2.3 and 3.2.2.
    """

    bits: int = 4
    bucket_size: int = 512
    norm: str = "max"

    name: ClassVar[str] = "qsgd"
    codec_id: ClassVar[int] = 1
    stochastic: ClassVar[bool] = True
    seeded: ClassVar[bool] = True
    # The kernels of ffi/qsgd.cc and cuda/qsgd.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda_auto=("encode", "decode_sum", "encode_feedback"),
    )

    @property
    def recompression(self) -> str:  # type: ignore[override]
        """Codec.recompression: 2 bits is one level per sign, the stochastic
        ternary rounding of TernGrad, and like it not a contraction: a second
        compression of a reduced chunk (two-phase, ring) lets the server
        residual grow without bound, and training diverges (docs/accuracy.md,
        "Adam on the LM"). Finer QSGD recompresses fine."""
        return "unsafe" if self.bits == 2 else "fine"

    def __post_init__(self):
        check_int("QSGD", "bits", self.bits, "one of 2, 3, 4, 8", self.bits in (2, 3, 4, 8))
        check_bucket_size("QSGD", self.bucket_size)
        if self.norm not in _NORMS:
            raise ValueError(f"QSGD: norm must be one of {_NORMS}, got {self.norm!r}")

    @classmethod
    def examples(cls, *, coverage=False):
        users = (
            cls(bits=4),
            cls(bits=2, bucket_size=128),
            cls(bits=8),
            cls(bits=4, norm="l2"),
        )
        more = (
            cls(bits=3, bucket_size=64),
            cls(bits=4, bucket_size=16, norm="l2"),
            cls(bits=8, bucket_size=8),
        )
        return users + more if coverage else users

    @property
    def levels(self) -> int:
        """Levels per sign, ``s = 2^(bits-1) - 1``."""
        return (1 << (self.bits - 1)) - 1

    def arrays(self, n, dtype):
        nb = self.num_buckets(n)
        return {
            "codes": array(nb * self.bucket_size // 8 * self.bits, np.uint8),
            "scales": array(nb, np.float32),
        }

    def kernel_attrs(self, decode):
        attrs = {"bits": self.bits, "bucket_size": self.bucket_size}
        return attrs if decode else {**attrs, "l2": int(self.norm == "l2")}

    def twin_encode(self, flat, seed):
        return encode_ref(flat, seed, self.bits, self.bucket_size, self.norm == "l2")

    def twin_decode(self, codes, scales, *, n, dtype):
        return decode_ref(codes, scales, n, dtype, self.bits, self.bucket_size)

    def wire_params(self):
        return (self.bits, self.bucket_size, _NORMS.index(self.norm))

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        bits, bucket_size, norm = params
        if not 0 <= norm < len(_NORMS):
            raise ValueError(f"QSGD: norm code must be 0 (max) or 1 (l2), got {norm}")
        return cls(bits=bits, bucket_size=bucket_size, norm=_NORMS[norm])


# ---------------------------------------------------------------------------
# Pure-JAX twins (qsgd.h: qsgd_code, qsgd_value)
# ---------------------------------------------------------------------------
def encode_ref(x: jax.Array, seed: jax.Array, bits: int, bucket: int, l2: bool):
    s = (1 << (bits - 1)) - 1
    raw = bk.to_buckets(x, bucket)
    xb = ieee.daz(raw)  # the kernels' arithmetic reads subnormals as zeros
    if l2:
        scale = ieee.sqrt(bk.tree_sum(bk.exact_square(xb)))  # correctly rounded: ops/ieee.py
    else:
        scale = bk.max_abs(raw)
    inv = bk.safe_recip(scale, s)
    r = jnp.abs(xb) * inv[:, None]
    r = jnp.where(r < s, r, np.float32(s))
    fl = r.astype(jnp.int32).astype(jnp.uint32)
    frac = r - fl.astype(jnp.float32)
    index = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
    up = (rng_uniform(seed, index) < frac).astype(jnp.uint32)
    level = jnp.minimum(fl + up, np.uint32(s))
    sign = (xb < 0).astype(jnp.uint32)
    codes = (sign << (bits - 1)) | level
    return pack(codes.astype(jnp.uint8).reshape(-1), bits), scale


def decode_ref(packed: jax.Array, scales: jax.Array, n: int, dtype, bits: int, bucket: int):
    s = (1 << (bits - 1)) - 1
    codes = unpack(packed, bits).reshape(-1, bucket).astype(jnp.uint32)
    step = scales * (np.float32(1) / np.float32(s))  # qsgd.h: qsgd_step
    level = codes & np.uint32(s)
    mag = level.astype(jnp.float32) * step[:, None]
    values = jnp.where((codes >> (bits - 1)) != 0, -mag, mag)
    return bk.from_buckets(values, n, dtype)
