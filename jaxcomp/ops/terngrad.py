"""TernGrad encode/decode: FFI targets ``jaxcomp_terngrad_encode``/``_decode``
and their twins (codecs.h: terngrad_digit, terngrad_value; ternary.h)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _bucket as bk
from jaxcomp.ops import ternary
from jaxcomp.ops._dispatch import dispatch, ffi_call
from jaxcomp.ops.rng import rng_uniform


def encode_ref(x: jax.Array, seed: jax.Array, *, bucket: int):
    n = x.size
    xb = bk.to_buckets(x, bucket)
    scale = bk.max_abs(xb)
    inv = bk.safe_recip(scale, 1.0)  # codecs.h: terngrad_inv
    r = jnp.abs(xb) * inv[:, None]
    index = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
    up = (rng_uniform(seed, index) < r).astype(jnp.uint32)
    neg = (xb < 0).astype(jnp.uint32)
    digits = np.uint32(1) + up - np.uint32(2) * (up & neg)
    return ternary.pack(digits.reshape(-1)[:n]), scale


def decode_ref(trits: jax.Array, scales: jax.Array, *, n: int, dtype, bucket: int):
    nb = bk.num_buckets(n, bucket)
    digits = jnp.pad(ternary.unpack(trits, n), (0, nb * bucket - n), constant_values=1)
    t = (digits.astype(jnp.int32) - 1).astype(jnp.float32).reshape(nb, bucket)
    return bk.from_buckets(t * scales[:, None], n, dtype)


def _shapes(n: int, bucket: int):
    return (
        jax.ShapeDtypeStruct((ternary.num_bytes(n),), jnp.uint8),
        jax.ShapeDtypeStruct((bk.num_buckets(n, bucket),), jnp.float32),
    )


def encode(x, seed, *, bucket: int, backend: str = "auto"):
    """Flat x (f32/bf16/f16) -> (base-3^5 bytes, float32 max|x| per bucket)."""
    x = x.reshape(-1)

    def kernel(x, seed):
        return ffi_call(
            "jaxcomp_terngrad_encode", _shapes(x.size, bucket), x, seed, bucket_size=bucket
        )

    def twin(x, seed):
        return encode_ref(x, seed, bucket=bucket)

    return dispatch(backend, kernel, twin, x, seed)


def decode(trits, scales, *, n: int, dtype, bucket: int, backend: str = "auto"):
    """(trits, scales) -> flat array of n elements in dtype."""
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))

    def kernel(trits, scales):
        return ffi_call("jaxcomp_terngrad_decode", (out,), trits, scales, bucket_size=bucket)

    def twin(trits, scales):
        return (decode_ref(trits, scales, n=n, dtype=dtype, bucket=bucket),)

    return dispatch(backend, kernel, twin, trits, scales)[0]
