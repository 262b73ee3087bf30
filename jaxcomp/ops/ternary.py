"""Base-3^5 packing of trits, twin of ffi/include/jaxcomp/ternary.h (the 3LC
paper, section 3.2): digits t + 1 in {0, 1, 2}, zero-padded (digit 1) to 5m
values, m = ceil(n / 5), split into five planes of m; byte i =
P0[i]*81 + P1[i]*27 + P2[i]*9 + P3[i]*3 + P4[i]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def num_bytes(n: int) -> int:
    return -(-n // 5)


def pack(digits: jax.Array) -> jax.Array:
    """Flat digits (0, 1 or 2) of n trits -> uint8[ceil(n / 5)]."""
    n = digits.size
    m = num_bytes(n)
    d = jnp.pad(digits.astype(jnp.uint32), (0, 5 * m - n), constant_values=1).reshape(5, m)
    return (d[0] * 81 + d[1] * 27 + d[2] * 9 + d[3] * 3 + d[4]).astype(jnp.uint8)


def unpack(packed: jax.Array, n: int) -> jax.Array:
    """uint8[ceil(n / 5)] -> flat uint32 digits of n trits.

    Digit j of byte b is (b // 3^(4-j)) % 3, computed as in ternary.h with
    multiply-shifts (exact for every byte value; much faster than XLA's
    integer division on CPU)."""
    b = packed.astype(jnp.uint32)[None, :]
    mul = jnp.asarray(np.array([810, 2428, 7282, 21846, 65536], np.uint32)[:, None])
    q = (b * mul) >> 16
    digits = q - np.uint32(3) * ((q * np.uint32(21846)) >> 16)
    return digits.reshape(-1)[:n]
