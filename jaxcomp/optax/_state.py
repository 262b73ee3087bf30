"""Where the per-device parts of an optimizer state live: telemetry lookup,
PartitionSpecs for ``jax.shard_map``, and initialization on a mesh."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.optax._adam import OneBitAdamState
from jaxcomp.optax._pmean import PmeanState
from jaxcomp.optax._powersgd import PowerSGDState
from jaxcomp.optax._transform import INIT_RECORDS, CompressState

# States of optimizers that divide by a running second moment of what they
# are given (Adam and its family, RMSProp, Adagrad, Adafactor).
_SECOND_MOMENT_STATES = tuple(
    t
    for t in (
        getattr(optax, n, None)
        for n in (
            "ScaleByAdamState",
            "ScaleByAmsgradState",
            "ScaleByBeliefState",
            "ScaleByRmsState",
            "ScaleByRStdDevState",
            "ScaleByRssState",
            "FactoredState",
        )
    )
    if t is not None
)
_WARNED_ADAM: set = set()
# States of transformations that keep statistics of the gradients they are
# given (moments, traces): before the compressed all-reduce they would see
# each device's local gradient.
_GRADIENT_STATISTICS = _SECOND_MOMENT_STATES + tuple(
    t
    for t in (
        getattr(optax, n, None)
        for n in ("TraceState", "ScaleByLionState", "ScaleByNovogradState", "EmaState")
    )
    if t is not None
)


# The states of the transformations that all-reduce the gradients (the
# uncompressed baseline included): telemetry reads them, and they decide
# which leaves are laid out per device.
_ALL_REDUCE_STATES = (CompressState, PowerSGDState, PmeanState)


def _is_compress(x) -> bool:
    return isinstance(x, _ALL_REDUCE_STATES)


def _find(opt_state) -> list:
    return [s for s in jax.tree.leaves(opt_state, is_leaf=_is_compress) if _is_compress(s)]


def telemetry(opt_state) -> dict[str, jax.Array]:
    """The last step's telemetry of a ``compress_gradients`` state.

    Args:
      opt_state: an optimizer state holding a :class:`CompressState`
        (or a ``powersgd`` or ``pmean`` state) anywhere (a chain,
        ``inject_hyperparams``, ``MultiSteps``, ...; the first one counts
        if there are several). The uncompressed ``jc.optax.pmean``
        reports the gradients' own bits per element and the bytes its
        all-reduce sends (see :class:`PmeanState`).
    Returns:
      ``{"step", "bits_per_element", "wire_bytes", "compression_ratio",
      "residual_norm", "skipped_steps"}``: scalars for a shard_map state,
      arrays with the leading device axis for a pmap state (the same value
      on every device). ``residual_norm`` is 0 unless the transformation was
      built with ``residual_norm=True``; ``skipped_steps`` counts the steps
      whose mean gradient was not finite (see :class:`Telemetry`).
    Raises:
      ValueError: ``opt_state`` holds no ``compress_gradients`` state.
    """
    found = _find(opt_state)
    if not found:
        raise ValueError(
            "jc.optax.telemetry: no jc.optax.compress_gradients (or powersgd, pmean) state "
            "inside this optimizer state; pass the whole opt_state of a chain that contains "
            "one"
        )
    s = found[0]
    return {"step": s.step, **s.telemetry._asdict()}


def _spec(axis_name):
    return P(tuple(axis_name)) if isinstance(axis_name, (tuple, list)) else P(axis_name)


def state_specs(opt_state, axis_name) -> Any:
    """PartitionSpecs for an optimizer state under ``jax.shard_map``.

    Per-device leaves get ``P(axis_name)`` (sharded along the data axis, one
    row per device), everything else ``P()`` (replicated). Per-device are:
    the residuals of every :class:`CompressState` (one
    ``[devices, *leaf.shape]`` array per floating-point parameter leaf) and
    its server residuals (one ``[devices, m]`` array per fused bucket), and
    the accumulated gradients of an ``optax.MultiSteps`` whose inner state
    holds a ``compress_gradients`` (or ``pmean``) state (they are summed
    before the all-reduce, so they differ per device; they are stored
    concatenated along their first axis). A ``jc.optax.pmean`` state is
    replicated.

    Args:
      opt_state: the optimizer state, or its ``jax.eval_shape``.
      axis_name: the data-parallel mesh axis (or the pair of hierarchical axes).
    Returns:
      A pytree of ``PartitionSpec`` with ``opt_state``'s structure, for the
      ``in_specs`` / ``out_specs`` of ``jax.shard_map``.
    Raises:
      ValueError: ``opt_state`` holds no ``compress_gradients``,
        ``powersgd`` or ``pmean`` state (a chain whose all-reduce jaxcomp
        does not know, or a container hiding it, such as an
        NNX ``nnx.State``): every leaf would silently be replicated; or it
        was made by a plain ``tx.init`` outside the mesh (one residual row
        on one device).
    """
    if not _find(opt_state):
        raise ValueError(
            "jc.optax.state_specs: no jc.optax.compress_gradients (or onebit_adam, powersgd, "
            "pmean) state inside "
            f"this optimizer state (a {type(opt_state).__name__}), so no leaf would be laid out "
            "per device. Pass the optax state itself, as tx.init or jc.optax.init returned it "
            "(a container that wraps its leaves, such as a Flax NNX optimizer's nnx.State, "
            "hides the compress state). A chain without compression is replicated: "
            "jax.tree.map(lambda _: P(), opt_state)."
        )
    _check_laid_out(opt_state)
    return _specs(opt_state, axis_name)


def _check_laid_out(opt_state) -> None:
    """Raises for a state made by a plain ``tx.init`` outside the mesh: its
    per-device residuals are one row on one device, where ``jc.optax.init``
    gives one row per device, sharded over the mesh (shard_map would fail
    with a bare "does not evenly divide" error)."""
    if jax.device_count() < 2:
        return
    for s in _find(opt_state):
        for r in jax.tree.leaves(getattr(s, "residuals", ())):
            sharding = getattr(r, "sharding", None)
            if (
                isinstance(r, jax.Array)
                and isinstance(sharding, jax.sharding.SingleDeviceSharding)
                and r.ndim
                and r.shape[0] == 1
            ):
                raise ValueError(
                    "jc.optax.state_specs: this state holds one residual row on one device: it "
                    "was made by tx.init outside the mesh, where each device needs its own row. "
                    "Create it with jc.optax.init(tx, params, mesh, axis_name) (under jax.pmap: "
                    "jax.pmap(tx.init, axis_name=...))."
                )


def _specs(opt_state, axis_name) -> Any:
    spec = _spec(axis_name)

    def is_node(x):
        return _is_compress(x) or isinstance(x, optax.MultiStepsState)

    def walk(x):
        if isinstance(x, PowerSGDState):
            rep = jax.tree.map(lambda _: P(), x._replace(rest=()))
            return rep._replace(
                residuals=jax.tree.map(lambda _: spec, x.residuals),
                rest=jax.tree.map(walk, x.rest, is_leaf=is_node),
            )
        if isinstance(x, PmeanState):
            return jax.tree.map(lambda _: P(), x)
        if isinstance(x, CompressState):
            rep = jax.tree.map(lambda _: P(), x)
            return rep._replace(
                residuals=jax.tree.map(lambda _: spec, x.residuals),
                server_residuals=jax.tree.map(lambda _: spec, x.server_residuals),
            )
        if isinstance(x, optax.MultiStepsState):
            inner = jax.tree.map(walk, x.inner_opt_state, is_leaf=is_node)
            rest = jax.tree.map(lambda _: P(), x._replace(inner_opt_state=None))
            if _find(x.inner_opt_state):

                def acc_spec(a):
                    if not jnp.ndim(a):
                        raise ValueError(
                            "jc.optax.state_specs: optax.MultiSteps accumulates a scalar "
                            "gradient per device, which cannot be stored sharded; give that "
                            "parameter a leading axis of size 1"
                        )
                    return spec

                rest = rest._replace(acc_grads=jax.tree.map(acc_spec, x.acc_grads))
            return rest._replace(inner_opt_state=inner)
        return P()

    return jax.tree.map(walk, opt_state, is_leaf=is_node)


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
    records: list = []
    token = INIT_RECORDS.set(records)
    try:
        shapes = jax.eval_shape(tx.init, params)
    finally:
        INIT_RECORDS.reset(token)
    _check_order(shapes)
    _warn_coarse_before_adam(shapes, records)
    specs = _specs(shapes, axis_name)  # a chain without one: replicated
    f = jax.shard_map(
        tx.init,
        mesh=mesh,
        in_specs=(jax.tree.map(lambda _: P(), params),),
        out_specs=specs,
        check_vma=False,
    )
    return jax.jit(f)(params)


def _warn_coarse_before_adam(opt_state, records: list) -> None:
    """Warns once when a compress_gradients that sends fewer than
    ADAM_COARSE_BITS bits per element comes before an optimizer that
    divides by a second moment (``records``: what each compress_gradients
    init reported, in chain order)."""

    def is_node(x):
        return isinstance(x, (CompressState, OneBitAdamState, *_SECOND_MOMENT_STATES))

    coarse: tuple = ()
    pending = iter(records)
    for x in jax.tree.leaves(opt_state, is_leaf=is_node):
        if isinstance(x, OneBitAdamState):
            next(pending, None)  # its own compress state sends the momentum
        elif isinstance(x, CompressState):
            coarse = coarse + tuple(next(pending, ()) or ())
        elif isinstance(x, _SECOND_MOMENT_STATES) and coarse:
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


def _check_order(opt_state) -> None:
    """Raises if a transformation that keeps gradient statistics comes
    before the compressed all-reduce: it would run on each device's local
    gradient, and its state (laid out as replicated) would differ per
    device."""

    def is_node(x):
        return isinstance(x, (*_ALL_REDUCE_STATES, OneBitAdamState, *_GRADIENT_STATISTICS))

    finite_check = getattr(optax, "ApplyIfFiniteState", None)
    if finite_check is not None:
        for x in jax.tree.leaves(opt_state, is_leaf=lambda y: isinstance(y, finite_check)):
            if isinstance(x, finite_check) and _find(x.inner_state):
                raise ValueError(
                    "jc.optax.init: optax.apply_if_finite wraps the compressed all-reduce. It "
                    "decides on each device's own gradient, so a device whose gradient "
                    "overflowed skips the all-reduce that the others enter, and the job "
                    "deadlocks. Put it after the all-reduce: optax.chain("
                    "jc.optax.compress_gradients(codec, axis), optax.apply_if_finite(opt, k)) "
                    "(compress_gradients leaves its state alone on a non-finite step; "
                    "docs/training.md)."
                )
    before = None
    for x in jax.tree.leaves(opt_state, is_leaf=is_node):
        if isinstance(x, _GRADIENT_STATISTICS) and before is None:
            before = type(x).__name__
        elif isinstance(x, (*_ALL_REDUCE_STATES, OneBitAdamState)) and before:
            raise ValueError(
                f"jc.optax.init: the chain runs an optimizer with gradient statistics "
                f"({before}: momentum, Adam, ...) before the compressed all-reduce "
                f"({type(x).__name__}), so it would see each device's local gradient and its "
                "state would silently differ per device. Put the all-reduce first: "
                "optax.chain(jc.optax.compress_gradients(codec, axis), optax.adamw(...))."
            )
