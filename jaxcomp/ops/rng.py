"""The counter-based random bits shared with the kernels (twin of
``rng_bits``/``rng_uniform`` in ffi/include/jaxcomp/common.h)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32


def mix32(x: jax.Array) -> jax.Array:
    """The "lowbias32" integer hash on uint32 lanes."""
    x = x ^ (x >> 16)
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * _U32(0x846CA68B)
    return x ^ (x >> 16)


def rng_bits(seed: jax.Array, index: jax.Array) -> jax.Array:
    """32 random bits for each uint32 element index, a pure function of seed.

    The seed words are mixed first, so no two seeds give shifted copies of
    one stream.
    """
    a = mix32(seed[0])
    b = mix32(seed[1] ^ a)
    return mix32((index + a) ^ b)


def rng_uniform(seed: jax.Array, index: jax.Array) -> jax.Array:
    """Uniform float32 in [0, 1) on the 2^-24 grid (exact)."""
    return (rng_bits(seed, index) >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def seed_words(key: jax.Array) -> jax.Array:
    """Two uint32 seed words from a JAX PRNG key.

    A typed key or a raw ``uint32[2]`` key of the default (threefry) kind gives
    its own two key words, so payload bytes depend only on the key, not on the
    jax version. Other key kinds are reduced to two words with ``random.bits``.
    """
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise ValueError(f"expected a single PRNG key, got a key array of shape {key.shape}")
        data = jax.random.key_data(key)
        if data.shape == (2,) and data.dtype == jnp.uint32:
            return data
        return jax.random.bits(key, (2,), jnp.uint32)
    if key.shape == (2,) and key.dtype == jnp.uint32:
        return key
    raise TypeError(
        "key must be a JAX PRNG key (jax.random.key(...)) or a raw uint32[2] key, "
        f"got an array of shape {key.shape} and dtype {key.dtype}"
    )
