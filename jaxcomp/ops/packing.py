"""Bit packing twin of ``pack8``/``unpack_code`` (ffi/include/jaxcomp/common.h):
groups of 8 codes of ``bits`` bits (1..4) become ``bits`` bytes, code j of a
group at bit offset j*bits, little-endian; 8-bit codes are stored as they are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _or_fields(groups: jax.Array, width: int) -> jax.Array:
    """``OR_j groups[:, j] << (j * width)``, written element-wise (no
    reduction), so that XLA fuses it into whatever consumes the words."""
    word = groups[:, 0]
    for j in range(1, groups.shape[1]):
        word = word | (groups[:, j] << np.uint32(j * width))
    return word


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """uint8 codes (length a multiple of 8) -> packed uint8 bytes."""
    if bits == 8:
        return codes.astype(jnp.uint8)
    groups = codes.reshape(-1, 8).astype(jnp.uint32)
    word = _or_fields(groups, bits)
    byte_shifts = jnp.asarray(np.arange(bits, dtype=np.uint32) * 8)
    return ((word[:, None] >> byte_shifts) & 0xFF).astype(jnp.uint8).reshape(-1)


def unpack(packed: jax.Array, bits: int) -> jax.Array:
    """Packed uint8 bytes -> uint8 codes (8 per ``bits`` bytes)."""
    if bits == 8:
        return packed.astype(jnp.uint8)
    if 8 % bits == 0:
        # Codes never straddle a byte: each byte holds 8 / bits of them,
        # code j at bit j * bits (the same layout, read byte by byte).
        shifts = jnp.asarray(np.arange(0, 8, bits, dtype=np.uint8))
        mask = np.uint8((1 << bits) - 1)
        return ((packed[:, None] >> shifts) & mask).reshape(-1)
    groups = packed.reshape(-1, bits).astype(jnp.uint32)
    word = _or_fields(groups, 8)
    shifts = jnp.asarray(np.arange(8, dtype=np.uint32) * bits)
    mask = np.uint32((1 << bits) - 1)
    return ((word[:, None] >> shifts) & mask).astype(jnp.uint8).reshape(-1)
