"""QSGD: stochastic, unbiased quantization with bucketing.

Alistarh et al., "QSGD" (NeurIPS 2017), as described in Grubic et al.,
"Synchronous Multi-GPU Deep Learning with Low-Precision Communication: An
Experimental Study" (EDBT 2018), section 2.3 and the bucketing of 3.2.2.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, check_bucket_size, check_int, register
from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import qsgd as ops

_NORMS = ("max", "l2")


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class QSGD(Codec):
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
    """

    bits: int = 4
    bucket_size: int = 512
    norm: str = "max"

    name: ClassVar[str] = "qsgd"
    codec_id: ClassVar[int] = 1
    stochastic: ClassVar[bool] = True

    def __post_init__(self):
        check_int("QSGD", "bits", self.bits, "one of 2, 3, 4, 8", self.bits in (2, 3, 4, 8))
        check_bucket_size("QSGD", self.bucket_size)
        if self.norm not in _NORMS:
            raise ValueError(f"QSGD: norm must be one of {_NORMS}, got {self.norm!r}")

    @property
    def levels(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def split_granularity(self):
        return self.bucket_size  # independent buckets

    def layout(self, shape, dtype=jnp.float32):
        nb = bk.num_buckets(int(np.prod(shape, dtype=np.int64)), self.bucket_size)
        return {
            "codes": jax.ShapeDtypeStruct((nb * self.bucket_size // 8 * self.bits,), jnp.uint8),
            "scales": jax.ShapeDtypeStruct((nb,), jnp.float32),
        }

    def _encode(self, flat, seed, backend):
        codes, scales = ops.encode(
            flat,
            seed,
            bits=self.bits,
            bucket=self.bucket_size,
            l2=self.norm == "l2",
            backend=backend,
        )
        return {"codes": codes, "scales": scales}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["codes"],
            payload["scales"],
            n=n,
            dtype=dtype,
            bits=self.bits,
            bucket=self.bucket_size,
            backend=backend,
        )

    def wire_params(self):
        return (self.bits, self.bucket_size, _NORMS.index(self.norm))

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        bits, bucket_size, norm = params
        if not 0 <= norm < len(_NORMS):
            raise ValueError(f"QSGD: norm code must be 0 (max) or 1 (l2), got {norm}")
        return cls(bits=bits, bucket_size=bucket_size, norm=_NORMS[norm])
