"""Natural compression: rounding to signed powers of two.

Horvath et al., "Natural Compression for Distributed Deep Learning" (the
IntML workshop paper and its technical report): C_nat rounds |t| in
[2^a, 2^(a+1)) to 2^(a+1) with probability (|t| - 2^a) / 2^a, else 2^a;
unbiased, with E[(C(t) - t)^2] <= t^2 / 8.
Kernels: ffi/include/jaxcomp/natural.h (bodies), ffi/natural.cc, cuda/natural.cu.
The twins work on the float32 bits with integer arithmetic only, so they are
exact by construction.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import BucketedCodec, Kernels, array, check_bucket_size, register
from jaxcomp.ops import bucket as bk
from jaxcomp.ops.rng import rng_bits

_U = np.uint32
ZERO, INF, NAN = 0x40, 0x7E, 0x7F


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class Natural(BucketedCodec):
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

    References:
      Horvath et al., "Natural Compression for Distributed Deep Learning"
      (the IntML workshop paper and its technical report), C_nat.
    """

    stochastic: bool = True  # type: ignore[misc]  # per instance, not per class
    bucket_size: int = 512

    name: ClassVar[str] = "natural"
    codec_id: ClassVar[int] = 6
    seeded: ClassVar[bool] = True  # the kernel takes (and, deterministic, ignores) a seed
    # The kernels of ffi/natural.cc and cuda/natural.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=("encode_feedback",),
    )

    def __post_init__(self):
        if not isinstance(self.stochastic, (bool, np.bool_)):
            raise ValueError(f"Natural: stochastic must be True or False, got {self.stochastic!r}")
        object.__setattr__(self, "stochastic", bool(self.stochastic))
        check_bucket_size("Natural", self.bucket_size)

    @classmethod
    def examples(cls, *, coverage=False):
        users = (cls(), cls(stochastic=False))
        more = (cls(bucket_size=8), cls(stochastic=False, bucket_size=16))
        return users + more if coverage else users

    def arrays(self, n, dtype):
        return {"codes": array(n, np.uint8), "tops": array(self.num_buckets(n), np.uint8)}

    def kernel_attrs(self, decode):
        attrs = {"bucket_size": self.bucket_size}
        return attrs if decode else {**attrs, "stochastic": int(self.stochastic)}

    def twin_encode(self, flat, seed):
        return encode_ref(flat, seed, self.bucket_size, self.stochastic)

    def twin_decode(self, codes, tops, *, n, dtype):
        return decode_ref(codes, tops, n, dtype, self.bucket_size)


# ---------------------------------------------------------------------------
# Pure-JAX twins (natural.h: natural_code, natural_value)
# ---------------------------------------------------------------------------
def exponent_cap(dtype) -> int:
    """Largest biased float32 exponent a value may round up to: 2^15 for
    float16 (2^16 would overflow it), 2^127 otherwise."""
    return 142 if np.dtype(dtype) == np.dtype(jnp.float16) else 254


def encode_ref(x: jax.Array, seed: jax.Array, bucket: int, stochastic: bool):
    n = x.size
    cap = _U(exponent_cap(x.dtype))
    xb = bk.to_buckets(x, bucket)
    u = lax.bitcast_convert_type(xb, jnp.uint32)
    a = u & _U(0x7FFFFFFF)
    finite = jnp.where(a < _U(0x7F800000), a, _U(0))
    top = (jnp.max(finite, axis=1) >> 23) + _U(1)
    sign = u >> 31
    e = (u >> 23) & _U(0xFF)
    man = u & _U(0x7FFFFF)
    if stochastic:
        index = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
        rb = rng_bits(seed, index)
        up = ((rb >> 9) < man).astype(jnp.uint32)
    else:
        up = (man >= _U(0x400000)).astype(jnp.uint32)
    er = jnp.minimum(e + up, cap)
    emin = top.astype(jnp.int32)[:, None] - 63
    k = emin - e.astype(jnp.int32)
    sh = jnp.clip(k - 1, 0, 32).astype(jnp.uint32)
    t32 = jnp.where(sh >= 32, _U(0), (_U(0x80000000) | (man << 8)) >> (sh & _U(31)))
    up2 = (rb < t32) if stochastic else (k == 1)
    under = k >= 1
    d = jnp.where(under, _U(63), top[:, None] - er)
    zero = (e == 0) | (under & ~up2)
    code = (sign << 7) | (d & _U(63))
    code = jnp.where(zero, _U(ZERO), code)
    special = jnp.where(man != 0, _U(NAN), _U(INF) | (sign << 7))
    code = jnp.where(e == 0xFF, special, code)
    return code.astype(jnp.uint8).reshape(-1)[:n], top.astype(jnp.uint8)


def decode_ref(codes: jax.Array, tops: jax.Array, n: int, dtype, bucket: int):
    nb = bk.num_buckets(n, bucket)
    c = jnp.pad(codes.astype(jnp.uint32), (0, nb * bucket - n)).reshape(nb, bucket)
    sign = (c & _U(0x80)) << 24
    d = c & _U(63)
    ex = tops.astype(jnp.int32)[:, None] - d.astype(jnp.int32)
    normal = sign | (jnp.maximum(ex, 0).astype(jnp.uint32) << 23)
    special = jnp.where(d == 63, _U(0x7FC00000), sign | jnp.where(d == 62, _U(0x7F800000), _U(0)))
    bits = jnp.where((c & _U(0x40)) != 0, special, normal)
    return bk.from_buckets(lax.bitcast_convert_type(bits, jnp.float32), n, dtype)
