"""Compressed gradient all-reduce as an optax transformation.

``compress_gradients`` replaces the gradient ``lax.pmean`` of a
data-parallel train step (inside ``jax.shard_map`` or ``jax.pmap``). Its
state holds the error-feedback residuals, shaped like the parameters, and
the telemetry; tensor fusion, the per-leaf codec policy and warm-up decide
how each step sends the gradients, and the state does not depend on them.
``onebit_adam`` is Adam whose momentum is sent compressed after a warm-up
(1-bit Adam); ``powersgd`` sends a low-rank approximation of every
matrix-shaped gradient (PowerSGD); ``diloco`` synchronizes the replicas every H steps only
(DiLoCo), optionally through a codec with error feedback (SparseLoCo's
decaying accumulator included); ``uncompressed_mean`` is the uncompressed baseline
(``lax.pmean`` of the gradients, with telemetry). ``relayout`` moves a
saved state onto another number of devices or mesh. See docs/training.md.
"""

from jaxcomp.optax._adam import OneBitAdamState, onebit_adam, scale_by_onebit_adam
from jaxcomp.optax._chain import init
from jaxcomp.optax._config import DEFAULT_FUSION_BYTES, DEFAULT_MIN_COMPRESS_SIZE
from jaxcomp.optax._diloco import DiLoCoState, diloco
from jaxcomp.optax._overlap import LayerStack
from jaxcomp.optax._plan import Bucket, Plan, make_plan
from jaxcomp.optax._pmean import PmeanState, pmean, uncompressed_mean
from jaxcomp.optax._powersgd import PowerSGDState, powersgd
from jaxcomp.optax._relayout import relayout
from jaxcomp.optax._state import find_states as all_reduce_states
from jaxcomp.optax._state import state_specs, telemetry
from jaxcomp.optax._telemetry import Telemetry
from jaxcomp.optax._transform import CompressState, compress_gradients

__all__ = [
    "DEFAULT_FUSION_BYTES",
    "DEFAULT_MIN_COMPRESS_SIZE",
    "Bucket",
    "CompressState",
    "DiLoCoState",
    "LayerStack",
    "OneBitAdamState",
    "Plan",
    "PmeanState",
    "PowerSGDState",
    "Telemetry",
    "all_reduce_states",
    "compress_gradients",
    "diloco",
    "init",
    "make_plan",
    "onebit_adam",
    "pmean",
    "powersgd",
    "relayout",
    "scale_by_onebit_adam",
    "state_specs",
    "telemetry",
    "uncompressed_mean",
]
