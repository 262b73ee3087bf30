"""Compressed all-reduce over a named mesh axis, for use inside
``jax.shard_map`` (or ``jax.pmap``).

Every algorithm is built from ordinary JAX collectives (``all_gather``,
``all_to_all``, ``ppermute``) over encoded payloads, so XLA schedules the
communication and the bytes on the wire can be read from the compiled HLO.
Kernels only ever see this device's data.

``psum`` returns :class:`Reduced`: ``value`` is the (approximate) sum,
identical on every device of the axis, and ``sent`` is what this device's
input became after compression, in float32: summed over the devices, the
``sent`` of every device equals ``value`` up to float rounding, which is what
lets error feedback (``residual = x - sent``) lose nothing. Algorithms that
compress twice can keep their second stage's error in an explicit per-device
``state`` (a server residual: two-level error feedback, see ``psum``).
"""

from __future__ import annotations

from jaxcomp.collectives._core import (
    ALGORITHMS,
    COARSE_ALLGATHER_MAX_DEVICES,
    PIPELINE_MAX_DEPTH,
    PIPELINE_MIN_VALUES,
    Reduced,
    choose_algorithm,
    init_state,
    operand_nbytes,
    pipeline_depth,
    pmean,
    psum,
    recompression_warning,
    send_nbytes,
    state_positions,
    state_size,
    uncompressed_send_nbytes,
)
from jaxcomp.collectives._util import after, tier_capacities, wire_log

__all__ = [
    "ALGORITHMS",
    "COARSE_ALLGATHER_MAX_DEVICES",
    "PIPELINE_MAX_DEPTH",
    "PIPELINE_MIN_VALUES",
    "Reduced",
    "after",
    "choose_algorithm",
    "init_state",
    "operand_nbytes",
    "pipeline_depth",
    "pmean",
    "psum",
    "recompression_warning",
    "send_nbytes",
    "state_positions",
    "state_size",
    "tier_capacities",
    "uncompressed_send_nbytes",
    "wire_log",
]
