"""QSGD encode/decode: FFI targets ``jaxcomp_qsgd_encode``/``_decode`` and
their twins (codecs.h: qsgd_code, qsgd_value)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _bucket as bk
from jaxcomp.ops._dispatch import dispatch, ffi_call
from jaxcomp.ops.packing import pack, unpack
from jaxcomp.ops.rng import rng_uniform


def _shapes(n: int, bits: int, bucket: int):
    nb = bk.num_buckets(n, bucket)
    return (
        jax.ShapeDtypeStruct((nb * bucket // 8 * bits,), jnp.uint8),
        jax.ShapeDtypeStruct((nb,), jnp.float32),
    )


def encode_ref(x: jax.Array, seed: jax.Array, *, bits: int, bucket: int, l2: bool):
    s = (1 << (bits - 1)) - 1
    xb = bk.to_buckets(x, bucket)
    if l2:
        scale = jnp.sqrt(bk.tree_sum(bk.exact_square(xb)))
    else:
        scale = bk.max_abs(xb)
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


def decode_ref(packed: jax.Array, scales: jax.Array, *, n: int, dtype, bits: int, bucket: int):
    s = (1 << (bits - 1)) - 1
    codes = unpack(packed, bits).reshape(-1, bucket).astype(jnp.uint32)
    step = scales * (np.float32(1) / np.float32(s))  # codecs.h: qsgd_step
    level = codes & np.uint32(s)
    mag = level.astype(jnp.float32) * step[:, None]
    values = jnp.where((codes >> (bits - 1)) != 0, -mag, mag)
    return bk.from_buckets(values, n, dtype)


def encode(x, seed, *, bits: int, bucket: int, l2: bool, backend: str = "auto"):
    """Flat x (f32/bf16/f16) -> (packed uint8 codes, float32 scale per bucket)."""
    x = x.reshape(-1)

    def kernel(x, seed):
        return ffi_call(
            "jaxcomp_qsgd_encode",
            _shapes(x.size, bits, bucket),
            x,
            seed,
            bits=bits,
            bucket_size=bucket,
            l2=int(l2),
        )

    def twin(x, seed):
        return encode_ref(x, seed, bits=bits, bucket=bucket, l2=l2)

    return dispatch(backend, kernel, twin, x, seed)


def decode(packed, scales, *, n: int, dtype, bits: int, bucket: int, backend: str = "auto"):
    """(packed, scales) -> flat array of n elements in dtype."""
    out = jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))

    def kernel(packed, scales):
        return ffi_call(
            "jaxcomp_qsgd_decode", (out,), packed, scales, bits=bits, bucket_size=bucket
        )

    def twin(packed, scales):
        return (decode_ref(packed, scales, n=n, dtype=dtype, bits=bits, bucket=bucket),)

    return dispatch(backend, kernel, twin, packed, scales)[0]
