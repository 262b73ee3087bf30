"""1-bit SGD encode/decode: FFI targets ``jaxcomp_onebit_encode``/``_decode``
and their twins (cpu_kernels.inc: onebit_encode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _bucket as bk
from jaxcomp.ops._dispatch import dispatch, ffi_call
from jaxcomp.ops.packing import pack, unpack


def _mean(total: jax.Array, count: jax.Array) -> jax.Array:
    positive = count > 0
    return jnp.where(positive, total / jnp.where(positive, count, 1).astype(jnp.float32), 0.0)


def encode_ref(x: jax.Array, *, bucket: int):
    n = x.size
    xb = bk.to_buckets(x, bucket)
    p = xb >= 0  # NaN goes to the negative side and poisons avg-
    valid = jnp.arange(xb.size).reshape(xb.shape) < n
    npos = jnp.sum(p & valid, axis=1, dtype=jnp.uint32)
    nneg = jnp.sum(valid, axis=1, dtype=jnp.uint32) - npos
    zero = np.float32(0)
    hi = _mean(bk.tree_sum(jnp.where(p, xb, zero)), npos)
    lo = _mean(bk.tree_sum(jnp.where(p, zero, xb)), nneg)
    return pack(p.astype(jnp.uint8).reshape(-1), 1), jnp.stack([hi, lo], axis=1).reshape(-1)


def decode_ref(bits: jax.Array, means: jax.Array, *, n: int, dtype, bucket: int):
    codes = unpack(bits, 1).reshape(-1, bucket)
    m = means.reshape(-1, 2)
    values = jnp.where(codes != 0, m[:, :1], m[:, 1:])
    return bk.from_buckets(values, n, dtype)


def encode(x, *, bucket: int, backend: str = "auto"):
    """Flat x -> (packed sign bits, float32 (avg+, avg-) per bucket)."""
    x = x.reshape(-1)
    nb = bk.num_buckets(x.size, bucket)
    shapes = (
        jax.ShapeDtypeStruct((nb * bucket // 8,), jnp.uint8),
        jax.ShapeDtypeStruct((2 * nb,), jnp.float32),
    )

    def kernel(x):
        return ffi_call("jaxcomp_onebit_encode", shapes, x, bucket_size=bucket)

    return dispatch(backend, kernel, lambda x: encode_ref(x, bucket=bucket), x)


def decode(bits, means, *, n: int, dtype, bucket: int, backend: str = "auto"):
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))

    def kernel(bits, means):
        return ffi_call("jaxcomp_onebit_decode", (out,), bits, means, bucket_size=bucket)

    def twin(bits, means):
        return (decode_ref(bits, means, n=n, dtype=dtype, bucket=bucket),)

    return dispatch(backend, kernel, twin, bits, means)[0]
