"""Natural compression: rounding to signed powers of two.

Horvath et al., "Natural Compression for Distributed Deep Learning" (the
IntML workshop paper and its technical report): C_nat rounds |t| in
[2^a, 2^(a+1)) to 2^(a+1) with probability (|t| - 2^a) / 2^a, else 2^a;
unbiased, with E[(C(t) - t)^2] <= t^2 / 8.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, check_bucket_size, register
from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import natural as ops


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Natural(Codec):
    """One byte per value (sign, zero/special flag, 6-bit exponent below the
    bucket's top exponent), plus one byte per bucket (the top).

    ``stochastic=True`` is C_nat (unbiased, variance <= t^2 / 8);
    ``stochastic=False`` rounds to the nearer power of two, the midpoint
    ``1.5 * 2^a`` up. Values more than 63 binades below their bucket's largest
    value round to 0 or the smallest representable power (stochastically and
    unbiased, or to the nearer one). Zeros and float32 subnormals give 0;
    NaN and +-inf are kept at their position. See docs/codecs.md.

    Args:
      stochastic: unbiased random rounding (True) or nearest (False).
      bucket_size: a power of two in [8, 65536].
    """

    stochastic: bool = True  # type: ignore[misc]  # per instance, not per class
    bucket_size: int = 512

    name: ClassVar[str] = "natural"
    codec_id: ClassVar[int] = 6

    def __post_init__(self):
        if not isinstance(self.stochastic, (bool, np.bool_)):
            raise ValueError(f"Natural: stochastic must be True or False, got {self.stochastic!r}")
        check_bucket_size("Natural", self.bucket_size)

    def split_granularity(self):
        return self.bucket_size  # independent buckets

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        return {
            "codes": jax.ShapeDtypeStruct((n,), jnp.uint8),
            "tops": jax.ShapeDtypeStruct((bk.num_buckets(n, self.bucket_size),), jnp.uint8),
        }

    def _encode(self, flat, seed, backend):
        if seed is None:  # deterministic: the kernel takes (and ignores) a seed
            seed = jnp.zeros((2,), jnp.uint32)
        codes, tops = ops.encode(
            flat, seed, bucket=self.bucket_size, stochastic=bool(self.stochastic), backend=backend
        )
        return {"codes": codes, "tops": tops}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["codes"],
            payload["tops"],
            n=n,
            dtype=dtype,
            bucket=self.bucket_size,
            backend=backend,
        )

    def wire_params(self):
        return (int(bool(self.stochastic)), self.bucket_size)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        stochastic, bucket_size = params
        if stochastic not in (0, 1):
            raise ValueError(
                f"Natural: stochastic code must be 0 (nearest) or 1 (stochastic), got {stochastic}"
            )
        return cls(stochastic=bool(stochastic), bucket_size=bucket_size)
