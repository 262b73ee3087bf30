"""``compress_gradients``: the compressed gradient all-reduce as an optax
transformation (error feedback, tensor fusion, a per-leaf codec policy,
warm-up, telemetry) and its state.

Its update is the step of docs/training.md ("What one step does") written
as its steps: plan the fused buckets, read this device's residuals from
the state, ``pack`` them with the gradients, ``reduce`` the buffers over
the devices, ``unpack`` the means and what was not sent, ``feedback`` (the
residuals kept unless the step was not finite), and the new state with
the step's telemetry.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp.collectives import all_finite, recompression_warning

# planning.py imports the defaults from this module.
from jaxcomp.optax._config import CommConfig, axis_sizes_or_none, bound_axis_sizes
from jaxcomp.optax._overlap import in_backward
from jaxcomp.optax._plan import Plan, Policy, gradient_shapes, make_plan, resolve_policy
from jaxcomp.optax._state import (
    Comm,
    all_reduce_state,
    check_type,
    read_residuals,
    read_servers,
    write_residuals,
    write_servers,
    zero_residuals,
    zero_servers,
)
from jaxcomp.optax._step import Unpacked, nonfinite_updates, pack, reduce, unpack
from jaxcomp.optax._telemetry import (
    Telemetry,
    count_skipped,
    first_step_telemetry,
    global_norm,
    step_telemetry,
)


@all_reduce_state(per_device=("residuals", "server_residuals"))
class CompressState(NamedTuple):
    """State of :func:`compress_gradients`.

    Attributes:
      step: int32[]: updates applied so far (replicated).
      key: uint32[2]: the raw PRNG key of the next step, split every step
        (replicated; each device's draws differ because ``jc.pmean`` folds
        in the device index).
      residuals: this device's error-feedback residuals (what compression
        has not yet got across: Seide et al. 2014's quantization error, 3LC's
        error accumulation buffers, SparCML's residual), a pytree with the
        parameters' structure: residual_dtype[1, *leaf.shape] for every
        floating-point leaf (the leading axis of size 1 is the device's row
        of a [devices, *leaf.shape] array, see ``state_specs``), and
        ``optax.MaskedNode()`` for the others (integer parameters, whose
        gradients are float0, and complex ones). ``()`` without error
        feedback.
      server_residuals: this device's server residuals (two-level error
        feedback): a tuple with one float32[1, m] array per compressed
        fused bucket, ``m`` = ``jc.collectives.state_size`` of the bucket
        (the chunk this device owns in the two-phase all-reduce); a
        float32[1, 1] placeholder of zeros where the algorithm keeps none
        (it compresses once), since checkpointers refuse empty arrays and
        the structure must not depend on the device count. Like
        ``residuals``, one row per device. ``()`` without error feedback or with
        ``server_error_feedback=False``.
      telemetry: :class:`Telemetry` of the last step (replicated), with the
        running count of skipped (non-finite) steps.
      comm: static (no leaves): the plan, algorithm and axes the state was
        made for (``jc.optax.init`` and ``relayout`` read them).
    """

    step: jax.Array
    key: jax.Array
    residuals: Any
    server_residuals: tuple
    telemetry: Telemetry
    comm: Comm | None = None


_WARNED: set[tuple] = set()


def warn_unsafe(plan: Plan, config: CommConfig) -> None:
    """Warns once per (codec, algorithm) that error feedback cannot train."""
    for b in plan.buckets:
        why = recompression_warning(b.codec, config.algorithm)
        if why and (b.codec, config.algorithm) not in _WARNED:
            _WARNED.add((b.codec, config.algorithm))
            warnings.warn(f"{config.who}: {why}", RuntimeWarning, stacklevel=4)


class StepInputs(NamedTuple):
    """What a step reads: the gradient leaves, this device's residual of
    every leaf (None where it has none) and server residual of every
    bucket (None without), the step's PRNG keys and warm-up flag."""

    leaves: list
    residuals: list
    servers: tuple | None
    next_key: jax.Array
    step_key: jax.Array
    in_warmup: jax.Array


def read_inputs(plan: Plan, grads, state: CompressState, config: CommConfig, sizes) -> StepInputs:
    """The step's :class:`StepInputs`, the state checked against the gradients."""
    leaves = plan.treedef.flatten_up_to(grads)
    residuals = [None] * len(leaves)
    if config.error_feedback:
        residuals = read_residuals(plan, state.residuals, config.residual_dtype, config.who)
    servers = None
    if config.two_level:
        servers = read_servers(plan, state.server_residuals, sizes, config.algorithm, config.who)
    next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
    in_warmup = state.step < config.warmup_steps
    return StepInputs(leaves, residuals, servers, next_key, step_key, in_warmup)


class Feedback(NamedTuple):
    """What the step leaves for the next: ``ok`` (bool[], the mean was
    finite), the state's residuals and server residuals, their norm."""

    ok: jax.Array
    residuals: Any
    server_residuals: tuple
    norm: jax.Array


def feedback(
    plan: Plan, state: CompressState, config: CommConfig, ok, out: Unpacked, servers, sizes
) -> Feedback:
    """The new residuals and server residuals, kept as they were unless
    the mean is finite, and element by element where the new value is not
    (``keep_finite``: no reduction over them, docs/benchmarks.md)."""
    server_residuals = ()
    if config.two_level:
        server_residuals = write_servers(state.server_residuals, servers, ok)
    residuals = ()
    if config.error_feedback:
        residuals = write_residuals(plan, state.residuals, out.residuals, ok)
    norm = jnp.zeros((), jnp.float32)
    if config.residual_norm:
        norm = global_norm(residuals, config.axes(sizes))
    return Feedback(ok, residuals, server_residuals, norm)


def next_state(
    plan: Plan, state: CompressState, config: CommConfig, inputs: StepInputs, kept: Feedback, sizes
) -> CompressState:
    """The state after the step: ``step`` and ``key`` move on only after a
    finite one; the telemetry is the plan's, chosen by the warm-up flag."""
    skipped = count_skipped(state.telemetry, kept.ok)
    step = jnp.where(kept.ok, state.step + 1, state.step)
    key = jnp.where(kept.ok, jax.random.key_data(inputs.next_key), state.key)
    tel = step_telemetry(plan, sizes, config.algorithm, inputs.in_warmup, kept.norm, skipped)
    return CompressState(step, key, kept.residuals, kept.server_residuals, tel, state.comm)


class Reduced(NamedTuple):
    """What ``update`` gets in place of its :class:`CompressState` once the
    backward pass has reduced the gradients (:class:`InBackward`): the
    state, and the new residual of every leaf (None where none) and server
    residuals, kept unless the mean is not finite. The gradients given
    with it are the means."""

    state: CompressState
    residuals: list
    servers: tuple | None


class InBackward:
    """``compress_gradients``' reduction, run from inside the backward pass
    (``jc.data_parallel``'s overlapped step; docs/training-loop.md).

    ``wrap, extra = hooks(params, state, first_use)`` before the loss;
    the loss of ``wrap(params, extra)``; then its gradients ``(means,
    new_extra)`` and ``reduced(state, new_extra)`` go to ``update``.
    """

    def __init__(self, plan_for: Callable, config: CommConfig):
        self._plan_for = plan_for
        self._config = config

    def hooks(self, params, state: CompressState, first_use: list):
        """``(wrap, extra)`` for this step (``first_use``: per parameter
        leaf, where the loss first uses it)."""
        check_type(state, CompressState, self._config.who)
        plan = self._plan_for(gradient_shapes(params))
        sizes = bound_axis_sizes(self._config.axis_name, self._config.who)
        inputs = read_inputs(plan, params, state, self._config, sizes)
        return in_backward(plan, inputs, self._config, sizes, first_use)

    @staticmethod
    def reduced(state: CompressState, new_extra) -> Reduced:
        residuals, servers = new_extra
        return Reduced(state, residuals, servers)


def initial_servers(plan: Plan, config: CommConfig) -> tuple:
    """The server residuals of a new state (none with one-level error feedback)."""
    if not config.two_level:
        return ()
    return zero_servers(plan, axis_sizes_or_none(config.axis_name), config.algorithm)


def compressed_mean(
    policy: Policy, config: CommConfig, layers: Callable | None = None
) -> optax.GradientTransformation:
    """``compress_gradients`` for a codec policy and a validated config."""

    def plan_for(tree) -> Plan:
        return make_plan(
            policy,
            tree,
            min_compress_size=config.min_compress_size,
            fusion_bytes=config.fusion_bytes,
            layers=layers,
        )

    reducer = InBackward(plan_for, config)

    def init_fn(params) -> CompressState:
        plan = plan_for(gradient_shapes(params))
        return CompressState(
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key_data(jax.random.key(config.seed)),
            residuals=zero_residuals(plan, config.residual_dtype) if config.error_feedback else (),
            server_residuals=initial_servers(plan, config),
            telemetry=first_step_telemetry(
                plan, axis_sizes_or_none(config.axis_name), config.algorithm, config.warmup_steps
            ),
            comm=Comm(plan, config.algorithm, config.axis_name, reducer),
        )

    def update_fn(grads, state: CompressState, params=None):
        del params
        reduced = state if isinstance(state, Reduced) else None
        if reduced is not None:
            state = reduced.state
        check_type(state, CompressState, config.who)
        plan = plan_for(grads)
        sizes = bound_axis_sizes(config.axis_name, config.who)
        if config.error_feedback:
            warn_unsafe(plan, config)
        inputs = read_inputs(plan, grads, state, config, sizes)
        if reduced is None:
            packs = pack(plan, inputs.leaves, inputs.residuals)
            warmup = None if config.never_warm else inputs.in_warmup
            means, kept, servers = reduce(
                plan,
                packs,
                config.axes(sizes),
                key=inputs.step_key,
                algorithm=config.algorithm,
                warmup=warmup,
                servers=inputs.servers,
            )
            out = unpack(plan, inputs.leaves, means, kept, config.feedback_dtype)
        else:  # the backward pass reduced the buckets (InBackward): grads are the means
            means = [inputs.leaves[i] for g in plan.groups for i in g.leaves]
            out, servers = Unpacked(inputs.leaves, reduced.residuals), reduced.servers
        # The means are identical on every device, and a non-finite value in
        # any device's acc reaches them, for every codec and algorithm
        # (tests/test_nonfinite.py): one flag, no collective.
        kept = feedback(plan, state, config, all_finite(means), out, servers, sizes)
        updates = nonfinite_updates(config.on_nonfinite, kept.ok, out.updates)
        return plan.treedef.unflatten(updates), next_state(plan, state, config, inputs, kept, sizes)

    return optax.GradientTransformation(init_fn, update_fn)


def compress_gradients(
    codec: Policy,
    axis_name: str | tuple[str, str],
    *,
    error_feedback: bool = True,
    server_error_feedback: bool = True,
    algorithm: str = "auto",
    fusion_bytes: int | None = None,
    min_compress_size: int | None = None,
    warmup_steps: int | jax.Array = 0,
    residual_dtype: Any = "float32",
    residual_norm: bool = False,
    on_nonfinite: str = "pass",
    seed: int = 0,
    layers: Callable[[tuple, Any], bool] | None = None,
) -> optax.GradientTransformation:
    """Compressed mean of the gradients over ``axis_name``, with error feedback.

    The first element of an ``optax.chain`` inside a ``jax.shard_map``'d (or
    ``jax.pmap``'d) train step, in place of ``lax.pmean(grads, axis_name)``.
    Each step averages ``acc = grad + residual`` with ``jc.pmean``, in fused
    buckets, and keeps ``acc - sent`` as the next residual, one per
    floating-point leaf (Seide et al. 2014, section 3). A step whose mean is
    not finite leaves the state as it was. docs/training.md has the details.

    Args:
      codec: a :mod:`jaxcomp.codecs` codec (or its spec string or class) for
        every leaf; a callable ``(path, leaf) -> codec | None``; or a pytree
        of codecs and ``None`` (uncompressed) with the gradients' structure.
      axis_name: the data-parallel axis; ``(slow, fast)``: hierarchical.
      error_feedback: carry what compression dropped to the next step.
      server_error_feedback: also keep the error of the algorithm's second
        stage in per-device server residuals (two-level error feedback).
      algorithm: passed to ``jc.pmean`` (``jc.collectives.ALGORITHMS``).
      fusion_bytes: the largest fused bucket, in gradient bytes; None: 4 MiB.
      min_compress_size: smaller leaves are averaged uncompressed; None: 1024.
      warmup_steps: the first steps send the exact mean; may be traced.
      residual_dtype: dtype of the residuals (float32 by default).
      residual_norm: also report the residuals' L2 norm (a scalar all-reduce a step).
      on_nonfinite: what a non-finite step returns: ``"pass"`` (its mean) or ``"skip"``.
      seed: seeds the PRNG key of stochastic codecs.
      layers: ``layers(path, leaf) -> bool``: the leaves that are stacks of
        layers (a model scanned over them), each compressed one layer at a
        time; in ``jc.data_parallel``'s overlapped step each layer's is
        sent from inside the backward scan (``jc.fsdp.gather`` in the layer).
    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`CompressState`.
    """
    config = CommConfig(
        axis_name,
        algorithm=algorithm,
        fusion_bytes=fusion_bytes,
        min_compress_size=min_compress_size,
        warmup_steps=warmup_steps,
        error_feedback=error_feedback,
        server_error_feedback=server_error_feedback,
        residual_dtype=residual_dtype,
        residual_norm=residual_norm,
        on_nonfinite=on_nonfinite,
        seed=seed,
    )
    return compressed_mean(resolve_policy(codec, config.who), config, layers)
