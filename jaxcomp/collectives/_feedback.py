"""Error feedback of the last compression, made by the device that owns a
reduced chunk (two-phase, the ring's last scatter-reduce step, the sparse
split's dense stage)."""

from __future__ import annotations

import jax
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.collectives._decode import decode_own


def owner_stage(codec: Codec, reduced: jax.Array, div: int, state, key, dtype):
    """The last compression of a reduced chunk, by the device that owns it.

    With a server residual ``state`` (float32, the chunk's length, in units
    of the result: of the mean for ``pmean``), the owner compresses
    ``reduced / div + state`` and keeps what that compression missed as the
    new state: two-level error feedback, each residual at the scale of what
    it compresses (DeepSpeed's compressed all-reduce for 1-bit Adam keeps a
    worker and a server error the same way). Without one (``state`` None)
    the error is returned in units of the sum, for the caller to charge to
    the owner's ``sent`` (:func:`charge`: one-level error feedback).

    Returns:
      ``(payload, decoded float32, new_state, error)``: ``new_state`` None
      without a state, ``error`` None with one.
    """
    target = reduced if div == 1 else reduced / div
    if state is not None:
        target = target + state
    payload = codec.encode(target.astype(dtype), key)
    hat = decode_own(payload)
    if state is not None:
        return payload, hat, target - hat, None
    error = hat - reduced if div == 1 else hat * div - reduced
    return payload, hat, None, error


def charge(sent: jax.Array, owner: jax.Array, c: int, error: jax.Array) -> jax.Array:
    """``sent`` (flat, chunks of ``c``) with the owner stage's ``error``
    added to chunk ``owner``: one-level error feedback, the error of the
    compression of my reduced chunk (in units of the sum) is mine."""
    start = owner * c
    return lax.dynamic_update_slice(sent, lax.dynamic_slice(sent, (start,), (c,)) + error, (start,))
