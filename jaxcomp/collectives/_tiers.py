"""Capacity tiers: variable-rate payloads on the wire at the size the data
needs, with static shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.codecs.base import Codec, Rate
from jaxcomp.collectives._exchange import exchange
from jaxcomp.payload import Payload


def tier_capacities(codec: Codec, n: int) -> tuple[int, ...]:
    """The static buffer capacities a variable-rate payload may travel in.

    Args:
      codec: a variable-rate codec.
      n: elements of the tensor.
    Returns:
      Capacities in bytes, ascending (the codec's ``capacity_tiers``).
    """
    if codec.rate is not Rate.VARIABLE:
        raise ValueError(f"tier_capacities: {codec!r} is not a variable-rate codec")
    return codec.capacity_tiers(n)


def tier_nbytes(codec: Codec, n: int, dtype: Any, bits: float | None) -> int:
    """The operand bytes of a variable-rate payload of ``n`` values in the
    capacity tier it travels in (:func:`transfer`): the smallest tier that
    holds the stream the data needs, ``bits`` per element (None: unknown,
    the largest tier), plus the payload's other arrays (scale, length),
    which do not change with the capacity."""
    tiers = codec.capacity_tiers(n)
    fixed = codec.wire_nbytes((n,), dtype) - codec.stream_capacity(n)
    if bits is None:
        return fixed + tiers[-1]
    need = bits * n / 8
    return fixed + next((t for t in tiers if t >= need), tiers[-1])


def tier_index(need: jax.Array, caps: tuple[int, ...]) -> jax.Array | int:
    """The index of the smallest of the ascending capacities ``caps`` that
    holds ``need`` bytes (the last one holds anything), for ``lax.switch``."""
    return jnp.sum(need > jnp.asarray(caps[:-1], jnp.int32)) if len(caps) > 1 else 0


def own_capacity(codec: Codec, payload: Payload) -> Payload:
    """A payload received in a capacity tier, back at ``codec``'s own
    capacity (to forward it, as the ring does)."""
    if payload.codec == codec:
        return payload
    full = payload.codec.with_capacity(payload, codec.stream_capacity(payload.size))
    return Payload(codec, payload.shape, payload.dtype, full.arrays)


def transfer(
    payload: Payload, kind: str, axis, consume: Callable[[Payload], Any], all_to_all: str = "auto"
) -> Any:
    """Moves a payload (possibly stacked) with the collective ``kind`` over
    ``axis`` and hands what arrives to ``consume``.

    Fixed-size payloads: exactly that. Variable-rate codecs: a ``pmax`` over
    the axis agrees on the longest stream, and ``lax.switch`` picks the
    smallest capacity tier that holds it, so the bytes on the wire follow
    the data while every shape stays static; nothing is ever truncated
    (the last tier is the full size, which every stream fits). ``consume``
    must then return the same structure whatever the tier. ``all_to_all``:
    how an all-to-all travels (``_exchange.collective``).
    """
    codec = payload.codec
    if codec.rate is not Rate.VARIABLE:
        return consume(exchange(payload, kind, axis, all_to_all))
    caps = codec.capacity_tiers(payload.size)
    need = lax.pmax(jnp.max(codec.stream_length(payload)), axis)
    index = tier_index(need, caps)

    def branch(cap):
        return lambda p: consume(exchange(codec.with_capacity(p, cap), kind, axis, all_to_all))

    return lax.switch(index, [branch(c) for c in caps], payload)
