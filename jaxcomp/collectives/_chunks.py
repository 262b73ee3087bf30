"""Cutting a flat tensor, or one payload, into per-device chunks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.codecs.base import Codec
from jaxcomp.payload import Payload


def chunk_len(codec: Codec, n: int, parts: int) -> int:
    """Elements per chunk when ``n`` values are split over ``parts`` devices:
    ceil(n / parts), rounded up to the codec's split granularity, so that one
    encoding of the whole padded tensor splits into per-chunk payloads.

    Args:
      codec: the codec.
      n: elements of the tensor.
      parts: devices.
    Returns:
      The chunk length (0 for an empty tensor).
    """
    c = -(-n // parts) if n else 0
    g = codec.split_granularity()
    return -(-c // g) * g if g else c


def chunked(flat: jax.Array, parts: int) -> tuple[jax.Array, int]:
    """``flat`` zero padded to ``parts`` rows of ``ceil(n / parts)``: the
    rows, and their length."""
    c = -(-flat.size // parts) if flat.size else 0
    return jnp.pad(flat, (0, parts * c - flat.size)).reshape(parts, c), c


def padded(flat: jax.Array, total: int) -> jax.Array:
    """``flat`` zero padded to ``total`` elements."""
    return flat if flat.size == total else jnp.pad(flat, (0, total - flat.size))


def split(payload: Payload, parts: int) -> Payload:
    """One payload as ``parts`` stacked payloads of its consecutive chunks
    (the codec must split at ``size / parts``)."""
    stacked = payload.map(lambda a: a.reshape(parts, a.shape[0] // parts, *a.shape[1:]))
    return Payload(payload.codec, (payload.size // parts,), payload.dtype, stacked.arrays)
