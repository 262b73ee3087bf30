"""Natural compression encode/decode: FFI targets ``jaxcomp_natural_encode``/
``_decode`` and their twins (codecs.h: natural_code, natural_value). All
integer arithmetic on the float32 bits, so the twin is exact by construction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import _bucket as bk
from jaxcomp.ops._dispatch import dispatch, ffi_call
from jaxcomp.ops.rng import rng_bits

_U = np.uint32
ZERO, INF, NAN = 0x40, 0x7E, 0x7F


def exponent_cap(dtype) -> int:
    """Largest biased float32 exponent a value may round up to: 2^15 for
    float16 (2^16 would overflow it), 2^127 otherwise."""
    return 142 if np.dtype(dtype) == np.dtype(jnp.float16) else 254


def encode_ref(x: jax.Array, seed: jax.Array, *, bucket: int, stochastic: bool):
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


def decode_ref(codes: jax.Array, tops: jax.Array, *, n: int, dtype, bucket: int):
    nb = bk.num_buckets(n, bucket)
    c = jnp.pad(codes.astype(jnp.uint32), (0, nb * bucket - n)).reshape(nb, bucket)
    sign = (c & _U(0x80)) << 24
    d = c & _U(63)
    ex = tops.astype(jnp.int32)[:, None] - d.astype(jnp.int32)
    normal = sign | (jnp.maximum(ex, 0).astype(jnp.uint32) << 23)
    special = jnp.where(d == 63, _U(0x7FC00000), sign | jnp.where(d == 62, _U(0x7F800000), _U(0)))
    bits = jnp.where((c & _U(0x40)) != 0, special, normal)
    return bk.from_buckets(lax.bitcast_convert_type(bits, jnp.float32), n, dtype)


def encode(x, seed, *, bucket: int, stochastic: bool, backend: str = "auto"):
    """Flat x (f32/bf16/f16) -> (uint8 code per element, uint8 top exponent per bucket)."""
    x = x.reshape(-1)
    shapes = (
        jax.ShapeDtypeStruct((x.size,), jnp.uint8),
        jax.ShapeDtypeStruct((bk.num_buckets(x.size, bucket),), jnp.uint8),
    )

    def kernel(x, seed):
        return ffi_call(
            "jaxcomp_natural_encode",
            shapes,
            x,
            seed,
            bucket_size=bucket,
            stochastic=int(stochastic),
        )

    def twin(x, seed):
        return encode_ref(x, seed, bucket=bucket, stochastic=stochastic)

    return dispatch(backend, kernel, twin, x, seed)


def decode(codes, tops, *, n: int, dtype, bucket: int, backend: str = "auto"):
    """(codes, tops) -> flat array of n elements in dtype."""
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))

    def kernel(codes, tops):
        return ffi_call("jaxcomp_natural_decode", (out,), codes, tops, bucket_size=bucket)

    def twin(codes, tops):
        return (decode_ref(codes, tops, n=n, dtype=dtype, bucket=bucket),)

    return dispatch(backend, kernel, twin, codes, tops)[0]
