"""The PRNG keys of an all-reduce: one per device, then one per compression."""

from __future__ import annotations

import jax

from jaxcomp._axes import Axes
from jaxcomp.codecs.base import Codec, Rate


def device_key(codec: Codec, key: jax.Array | None, axes: Axes) -> jax.Array | None:
    """The key a device encodes with (stochastic codecs): the caller's key
    folded with the device's index, so devices draw independent bits; for a
    linear codec the caller's key itself, since the payloads of all devices
    must be drawn alike to be summed."""
    if not codec.stochastic:
        return None
    if key is None:
        raise ValueError(f"jc.psum: {codec!r} is stochastic and needs key=")
    if codec.rate is Rate.LINEAR:
        return key
    return jax.random.fold_in(key, axes.index())


def fold(key: jax.Array | None, i: int | jax.Array) -> jax.Array | None:
    """The key of one compression of an all-reduce (``key`` folded with
    its step), None for deterministic codecs."""
    return None if key is None else jax.random.fold_in(key, i)
