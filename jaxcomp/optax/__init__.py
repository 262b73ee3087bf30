"""Compressed gradient all-reduce as an optax transformation.

``compress_gradients`` replaces the gradient ``lax.pmean`` of a
data-parallel train step (inside ``jax.shard_map`` or ``jax.pmap``): error
feedback, tensor fusion, per-leaf codec policy, warm-up and telemetry live in
its state. See docs/training.md.
"""

from jaxcomp.optax._plan import Bucket, Plan, make_plan
from jaxcomp.optax._state import init, state_specs, telemetry
from jaxcomp.optax._telemetry import Telemetry
from jaxcomp.optax._transform import CompressState, compress_gradients

__all__ = [
    "Bucket",
    "CompressState",
    "Plan",
    "Telemetry",
    "compress_gradients",
    "init",
    "make_plan",
    "state_specs",
    "telemetry",
]
