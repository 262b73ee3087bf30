"""Int8 encode/decode: FFI targets ``jaxcomp_int8_encode``/``_decode`` and
their twins (codecs.h: int8_code, int8_value)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _bucket as bk
from jaxcomp.ops._dispatch import dispatch, ffi_call


def encode_ref(x: jax.Array, *, bucket: int):
    xb = bk.to_buckets(x, bucket)
    m = bk.max_abs(xb)
    t = xb * bk.safe_recip(m, 127.0)[:, None]
    t = jnp.where(t < -127, np.float32(-127), t)
    t = jnp.where(t > 127, np.float32(127), t)
    t = jnp.where(t == t, t, np.float32(0))
    return jnp.round(t).astype(jnp.int8).reshape(-1), m


def decode_ref(q: jax.Array, scales: jax.Array, *, n: int, dtype, bucket: int):
    step = scales * (np.float32(1) / np.float32(127))  # codecs.h: int8_step
    values = q.reshape(-1, bucket).astype(jnp.float32) * step[:, None]
    return bk.from_buckets(values, n, dtype)


def encode(x, *, bucket: int, backend: str = "auto"):
    """Flat x -> (int8 codes, float32 max|x| per bucket)."""
    x = x.reshape(-1)
    nb = bk.num_buckets(x.size, bucket)
    shapes = (
        jax.ShapeDtypeStruct((nb * bucket,), jnp.int8),
        jax.ShapeDtypeStruct((nb,), jnp.float32),
    )

    def kernel(x):
        return ffi_call("jaxcomp_int8_encode", shapes, x, bucket_size=bucket)

    return dispatch(backend, kernel, lambda x: encode_ref(x, bucket=bucket), x)


def decode(q, scales, *, n: int, dtype, bucket: int, backend: str = "auto"):
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))

    def kernel(q, scales):
        return ffi_call("jaxcomp_int8_decode", (out,), q, scales, bucket_size=bucket)

    def twin(q, scales):
        return (decode_ref(q, scales, n=n, dtype=dtype, bucket=bucket),)

    return dispatch(backend, kernel, twin, q, scales)[0]
