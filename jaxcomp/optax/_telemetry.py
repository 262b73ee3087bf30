"""What a step of ``compress_gradients`` communicated: bits per element,
bytes on the wire and the compression ratio are static accounting (from the
plan and the algorithms' send volumes); the residual norm is the only value
that needs a collective, and is computed only when asked for."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.collectives import send_nbytes, uncompressed_send_nbytes
from jaxcomp.optax._plan import Plan


class Telemetry(NamedTuple):
    """What the last step communicated (identical on every device).

    Attributes:
      bits_per_element: float32[]: payload bits per gradient element (the
        codecs' wire bits for the fused buckets, the uncompressed leaves at
        their own width; during warm-up, every leaf at its own width).
      wire_bytes: float32[]: bytes this device sent in the step's
        collectives (``jc.collectives.send_nbytes`` of each bucket, and the
        uncompressed all-reduce; for variable-rate codecs and the sparse
        algorithm, the largest capacity tier, an upper bound).
      compression_ratio: float32[]: the bytes a float32 ``lax.pmean`` of the
        gradients sends per device (ring all-reduce) over ``wire_bytes``;
        with one device, 32 / ``bits_per_element``.
      residual_norm: float32[]: the L2 norm of all devices' residuals after
        the step, with ``compress_gradients(..., residual_norm=True)``; else 0.
      skipped_steps: int32[]: the steps so far whose mean gradient was not
        finite, which left the state as it was (a running count).

    The first three are constants of the plan: reading them costs no
    communication. A state made where the mesh axes are bound
    (``jc.optax.init``, ``step.init``) holds its first step's; a plain
    ``tx.init`` outside the mesh holds zeros. docs/training.md, "Telemetry".
    """

    bits_per_element: jax.Array
    wire_bytes: jax.Array
    compression_ratio: jax.Array
    residual_norm: jax.Array
    skipped_steps: jax.Array


def zero_telemetry() -> Telemetry:
    """The telemetry of a state before its first step."""
    zero = jnp.zeros((), jnp.float32)
    return Telemetry(zero, zero, zero, zero, jnp.zeros((), jnp.int32))


def first_telemetry(sizes, figures) -> Telemetry:
    """The telemetry of a new state: ``figures(sizes)``, the static
    ``Telemetry`` of its first step, where the mesh axes are bound
    (``sizes`` their sizes), else (``sizes`` None) zeros."""
    return zero_telemetry() if sizes is None else figures(sizes)


def first_step_telemetry(plan: Plan, sizes, algorithm: str, warmup_steps) -> Telemetry:
    """``compress_gradients``' telemetry before its first step: the plan's
    constants, of a warm-up step if ``warmup_steps`` > 0 (may be traced);
    zeros where the axes are not bound (``sizes`` None)."""
    return first_telemetry(
        sizes,
        lambda sizes: step_telemetry(
            plan,
            sizes,
            algorithm,
            jnp.asarray(warmup_steps) > 0,
            jnp.zeros((), jnp.float32),
            jnp.zeros((), jnp.int32),
        ),
    )


def static_telemetry(bits: float, wire: float, ratio: float, previous: Telemetry) -> Telemetry:
    """A step's telemetry from its static accounting: no residual norm, and
    the skipped steps carried over from ``previous``."""
    return Telemetry(
        jnp.float32(bits),
        jnp.float32(wire),
        jnp.float32(ratio),
        jnp.zeros((), jnp.float32),
        previous.skipped_steps,
    )


def count_skipped(previous: Telemetry, ok) -> jax.Array:
    """int32[]: ``previous.skipped_steps``, plus one if this step's mean was
    not finite (``ok`` False)."""
    return previous.skipped_steps + jnp.logical_not(ok).astype(jnp.int32)


def _stats(payload: float, wire: float, elements: int, p: int) -> tuple[float, float, float]:
    """(bits_per_element, wire_bytes, compression_ratio) of a step."""
    bits = 8.0 * payload / max(elements, 1)
    if p > 1:
        ratio = uncompressed_send_nbytes(4 * elements, p) / wire if wire else 1.0
    else:
        ratio = 32.0 / bits if bits else 1.0
    return bits, wire, ratio


def exact_stats(payload: int, elements: int, p: int) -> tuple[float, float, float]:
    """(bits_per_element, wire_bytes, compression_ratio) of an uncompressed
    all-reduce of ``payload`` bytes holding ``elements`` gradient elements
    over ``p`` devices (``jc.optax.uncompressed_mean``): what a ring all-reduce sends."""
    return _stats(payload, uncompressed_send_nbytes(payload, p), elements, p)


def accounting(plan: Plan, sizes: tuple[int, ...], algorithm: str):
    """The static telemetry of a compressed step and of a warm-up step.

    Args:
      plan: the step's :class:`Plan`.
      sizes: the sizes of the reduced mesh axes (two for hierarchical).
      algorithm: ``compress_gradients``' algorithm.
    Returns:
      ``((bits, wire, ratio) compressed, (bits, wire, ratio) warm-up)``,
      Python floats.
    """
    p = int(np.prod(sizes))
    exact_payload = sum(g.size * g.dtype.itemsize for g in plan.groups if g.codec is None)
    exact_wire = uncompressed_send_nbytes(exact_payload, p)
    comp_payload = sum(b.count * b.codec.wire_nbytes((b.size,), b.dtype) for b in plan.buckets)
    comp_wire = sum(
        b.count * send_nbytes(b.codec, b.size, b.dtype, sizes, algorithm) for b in plan.buckets
    )
    raw_payload = sum(b.count * b.size * b.dtype.itemsize for b in plan.buckets)
    raw_wire = uncompressed_send_nbytes(raw_payload, p)
    return (
        _stats(comp_payload + exact_payload, comp_wire + exact_wire, plan.num_elements, p),
        _stats(raw_payload + exact_payload, exact_wire + raw_wire, plan.num_elements, p),
    )


def step_telemetry(
    plan: Plan, sizes, algorithm: str, in_warmup, residual_norm, skipped_steps
) -> Telemetry:
    """The telemetry of one step: the plan's constants, chosen by ``in_warmup``.

    Args:
      plan, sizes, algorithm: as for :func:`accounting`.
      in_warmup: bool[]: whether this step sent the exact mean.
      residual_norm: float32[]: the value to report (0 when not computed).
      skipped_steps: int32[]: the running count of non-finite steps.
    Returns:
      The :class:`Telemetry`.
    """
    compressed, warmup = accounting(plan, sizes, algorithm)
    stats = (
        jnp.where(in_warmup, jnp.float32(w), jnp.float32(c))
        for c, w in zip(compressed, warmup, strict=True)
    )
    return Telemetry(*stats, residual_norm, skipped_steps)


def global_norm(residuals, axes) -> jax.Array:
    """The L2 norm of every device's residuals together: one scalar ``psum``.

    Args:
      residuals: this device's residual arrays (any pytree).
      axes: the mesh axes the devices span.
    Returns:
      float32[], identical on every device.
    """
    squares = [jnp.sum(jnp.square(r.astype(jnp.float32))) for r in jax.tree.leaves(residuals)]
    if not squares:  # no residuals (no error feedback): no collective either
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(lax.psum(sum(squares), axes))
