"""Bucket helpers of the twins: the bucketing, max and halving-tree sums of
ffi/cpu_buckets.h and ffi/include/jaxcomp/common.h, in the same order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import ieee


def num_buckets(n: int, bucket: int) -> int:
    return -(-n // bucket)


def to_buckets(x: jax.Array, bucket: int) -> jax.Array:
    """Flat input -> float32 (num_buckets, bucket), zero padded."""
    n = x.size
    nb = num_buckets(n, bucket)
    flat = x.reshape(-1).astype(jnp.float32)
    return jnp.pad(flat, (0, nb * bucket - n)).reshape(nb, bucket)


def from_buckets(buckets: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
    """(num_buckets, bucket) float32 -> flat output of n elements in dtype."""
    return buckets.reshape(-1)[:n].astype(dtype)


def max_abs(buckets: jax.Array) -> jax.Array:
    """Exact per-bucket max|x| through the ordered integer bits (NaN wins)."""
    bits = lax.bitcast_convert_type(buckets, jnp.uint32) & np.uint32(0x7FFFFFFF)
    return lax.bitcast_convert_type(jnp.max(bits, axis=1), jnp.float32)


def tree_sum(a: jax.Array) -> jax.Array:
    """Per-row sum in the halving-tree order of common.h."""
    w = a.shape[1] // 2
    while w >= 1:
        a = a[:, :w] + a[:, w : 2 * w]
        w //= 2
    return a[:, 0]


def exact_square(x: jax.Array) -> jax.Array:
    """qsgd.h: exact_square. v = h + l with h = v's top 12 significant bits;
    h*h, h*l and l*l are exact, so XLA's FMA contraction cannot change it."""
    h = lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0xFFFFF000), jnp.float32
    )
    lo = x - h
    return (h * h + (h * lo) * np.float32(2)) + lo * lo


def safe_recip(scale: jax.Array, numerator: float) -> jax.Array:
    """numerator / scale where scale > 0, else 0 (qsgd.h: qsgd_inv, int8.h: int8_inv),
    correctly rounded on every platform (ops/ieee.py)."""
    positive = scale > 0
    return jnp.where(
        positive, ieee.div(np.float32(numerator), jnp.where(positive, scale, 1.0)), 0.0
    )
