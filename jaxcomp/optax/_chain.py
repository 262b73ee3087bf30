"""``jc.optax.init``: an optimizer state created on a mesh, laid out for
``jax.shard_map``, after the checks of the chain's order that only the
whole chain's state can show (gradient statistics before the all-reduce,
``optax.apply_if_finite`` around it, a coarse codec before Adam)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.optax._adam import OneBitAdamState
from jaxcomp.optax._state import LAYOUTS, coarse_for_adam, find_states, partition_specs
from jaxcomp.optax._transform import CompressState


def _optax_states(*names: str) -> tuple[type, ...]:
    """The optax state classes of these names that this optax version has."""
    return tuple(t for t in (getattr(optax, n, None) for n in names) if t is not None)


# States of optimizers that divide by a running second moment of what they
# are given (Adam and its family, RMSProp, Adagrad, Adafactor).
SECOND_MOMENT_STATES = _optax_states(
    "ScaleByAdamState",
    "ScaleByAmsgradState",
    "ScaleByBeliefState",
    "ScaleByRmsState",
    "ScaleByRStdDevState",
    "ScaleByRssState",
    "FactoredState",
)
# States of transformations that keep statistics of the gradients they are
# given (moments, traces): before the compressed all-reduce they would see
# each device's local gradient.
GRADIENT_STATISTICS = SECOND_MOMENT_STATES + _optax_states(
    "TraceState", "ScaleByLionState", "ScaleByNovogradState", "EmaState"
)
_WARNED_ADAM: set = set()


def init(tx: optax.GradientTransformation, params, mesh: jax.sharding.Mesh, axis_name) -> Any:
    """Initializes an optimizer state on a mesh, laid out for ``jax.shard_map``.

    Runs ``tx.init(params)`` on every device of ``mesh``: the per-device
    leaves of :func:`state_specs` come out sharded along ``axis_name`` (each
    error-feedback residual a ``[devices, *leaf.shape]`` array), the rest
    replicated.

    Args:
      tx: the optimizer (a chain containing ``compress_gradients``).
      params: the (replicated) parameters.
      mesh: the device mesh of the train step.
      axis_name: its data-parallel axis.
    Returns:
      The optimizer state, global arrays on ``mesh``.
    Raises:
      ValueError: an optimizer that keeps statistics of the gradients
        (momentum, Adam's moments, ...) comes before the compressed
        all-reduce in the chain.
    """
    shapes = jax.eval_shape(tx.init, params)
    check_order(shapes)
    warn_coarse_before_adam(shapes)
    specs = partition_specs(shapes, axis_name)  # a chain without one: replicated
    f = jax.shard_map(
        tx.init,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params),),
        out_specs=specs,
        check_vma=False,
    )
    return jax.jit(f)(params)


def warn_coarse_before_adam(opt_state) -> None:
    """Warns once when a compress_gradients that sends fewer than
    ADAM_COARSE_BITS bits per element comes before an optimizer that
    divides by a second moment (each compress state's plan says its codecs)."""

    def is_node(x):
        return isinstance(x, (CompressState, OneBitAdamState, *SECOND_MOMENT_STATES))

    coarse: tuple = ()
    for x in jax.tree.leaves(opt_state, is_leaf=is_node):
        if isinstance(x, OneBitAdamState):
            continue  # its own compress state sends the momentum
        if isinstance(x, CompressState):
            coarse = coarse + coarse_for_adam(x.comm.plan)
        elif isinstance(x, SECOND_MOMENT_STATES) and coarse:
            key = (coarse, type(x).__name__)
            if key in _WARNED_ADAM:
                continue
            _WARNED_ADAM.add(key)
            names = ", ".join(str(c) for c in coarse)
            warnings.warn(
                f"jc.optax.init: compress_gradients with {names} (fewer than 8 bits per "
                f"element) comes before an optimizer with a second moment ({type(x).__name__}: "
                "Adam, AdamW, LAMB, RMSProp, Adagrad, Adafactor). That optimizer divides by a "
                "variance that sees the compression noise, and error feedback cannot undo it: "
                "such codecs train Adam far worse than float32 (docs/training.md, 'Adam and "
                "compression'; a warm-up of exact steps does not help once it ends). Use "
                "jc.optax.onebit_adam(learning_rate, axis_name, codec, ...), which sends "
                "Adam's momentum compressed after freezing its variance, or a codec of 8 bits "
                "or more (int8, cast:dtype=bfloat16).",
                RuntimeWarning,
                stacklevel=3,
            )


def check_order(opt_state) -> None:
    """Raises if a transformation that keeps gradient statistics comes
    before the compressed all-reduce (it would run on each device's local
    gradient, and its state, laid out as replicated, would differ per
    device), or if ``optax.apply_if_finite`` wraps it."""
    _check_not_inside_apply_if_finite(opt_state)
    all_reduce = (*LAYOUTS, OneBitAdamState)

    def is_node(x):
        return isinstance(x, (*all_reduce, *GRADIENT_STATISTICS))

    before = None
    for x in jax.tree.leaves(opt_state, is_leaf=is_node):
        if isinstance(x, GRADIENT_STATISTICS) and before is None:
            before = type(x).__name__
        elif isinstance(x, all_reduce) and before:
            raise ValueError(
                f"jc.optax.init: the chain runs an optimizer with gradient statistics "
                f"({before}: momentum, Adam, ...) before the compressed all-reduce "
                f"({type(x).__name__}), so it would see each device's local gradient and its "
                "state would silently differ per device. Put the all-reduce first: "
                "optax.chain(jc.optax.compress_gradients(codec, axis), optax.adamw(...))."
            )


def _check_not_inside_apply_if_finite(opt_state) -> None:
    finite_check = getattr(optax, "ApplyIfFiniteState", None)
    if finite_check is None:
        return
    for x in jax.tree.leaves(opt_state, is_leaf=lambda y: isinstance(y, finite_check)):
        if isinstance(x, finite_check) and find_states(x.inner_state):
            raise ValueError(
                "jc.optax.init: optax.apply_if_finite wraps the compressed all-reduce. It "
                "decides on each device's own gradient, so a device whose gradient "
                "overflowed skips the all-reduce that the others enter, and the job "
                "deadlocks. Put it after the all-reduce: optax.chain("
                "jc.optax.compress_gradients(codec, axis), optax.apply_if_finite(opt, k)) "
                "(compress_gradients leaves its state alone on a non-finite step; "
                "docs/training.md)."
            )
