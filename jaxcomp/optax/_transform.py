"""``compress_gradients``: the compressed gradient all-reduce as an optax
transformation (error feedback, tensor fusion, a per-leaf codec policy,
warm-up, telemetry), its state, and the checks that a state fits the
gradients."""

from __future__ import annotations

import contextvars
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._axes import describe_bound_axes
from jaxcomp.codecs.base import as_codec
from jaxcomp.collectives import ALGORITHMS, recompression_warning, state_size
from jaxcomp.optax._plan import Plan, Policy, gradient_shapes, is_codec_like, make_plan
from jaxcomp.optax._step import all_finite, pack, reduce, unpack
from jaxcomp.optax._telemetry import (
    Telemetry,
    count_skipped,
    global_norm,
    step_telemetry,
    zero_telemetry,
)

_WHO = "jc.optax.compress_gradients"
# Fusion saves collectives (their latency) at the cost of copying every fused
# leaf into one buffer. Past a few MiB a leaf's transfer dwarfs a
# collective's latency, and the copy (a pass writing the leaf's bytes) is
# what costs (docs/benchmarks.md, "The optimizer step": the fused copy was
# the step's costliest operation).
DEFAULT_FUSION_BYTES = 4 << 20
DEFAULT_MIN_COMPRESS_SIZE = 1024
# What update returns for a step whose mean gradient is not finite: "pass"
# returns that mean (optax.apply_if_finite and loss-scaling logic downstream
# see it), "skip" returns zeros. The state is left as it was either way.
NONFINITE_MODES = ("pass", "skip")


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
        (the chunk this device owns in the two-phase all-reduce, 0 for an
        algorithm that compresses once). Like ``residuals``, one row per
        device. ``()`` without error feedback or with
        ``server_error_feedback=False``.
      telemetry: :class:`Telemetry` of the last step (replicated), with the
        running count of skipped (non-finite) steps.
    """

    step: jax.Array
    key: jax.Array
    residuals: Any
    server_residuals: tuple
    telemetry: Telemetry


# Codecs below this many wire bits per element train Adam-family optimizers
# placed after compress_gradients worse than float32 (Adam divides by a
# second moment that sees the compression noise): measured on the LM example
# (docs/accuracy.md, "Adam on the LM": QSGD-4 +3.5% held-out loss, OneBit,
# SignSGD, 3LC, top-k, TernGrad and QSGD-2 +6% to +26%; Int8 and bfloat16
# within 0.1%, Natural +1.1%).
ADAM_COARSE_BITS = 8.0
# Set by jc.optax.init while it traces tx.init: every compress_gradients of
# the chain appends the codecs it compresses with below ADAM_COARSE_BITS, in
# chain order, so that init can tell whether an Adam-family state follows.
INIT_RECORDS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "jaxcomp_init_records", default=None
)


def coarse_for_adam(plan: Plan) -> tuple:
    """The plan's codecs that send fewer than ADAM_COARSE_BITS bits per element."""
    return tuple(
        dict.fromkeys(
            b.codec for b in plan.buckets if b.codec.bits_per_element() < ADAM_COARSE_BITS
        )
    )


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


_WARNED: set[tuple] = set()


def _warn_unsafe(plan: Plan, algorithm: str) -> None:
    """Warns once per (codec, algorithm) that error feedback cannot train."""
    for b in plan.buckets:
        why = recompression_warning(b.codec, algorithm)
        if why and (b.codec, algorithm) not in _WARNED:
            _WARNED.add((b.codec, algorithm))
            warnings.warn(f"{_WHO}: {why}", RuntimeWarning, stacklevel=4)


def _bound_axis_sizes(axis_name, who: str = _WHO) -> tuple[int, ...]:
    """The sizes of the mapped axes ``axis_name``, or an error (from ``who``)
    that says how to bind them."""
    sizes = []
    for a in _axis_names(axis_name):
        try:
            sizes.append(int(lax.axis_size(a)))
        except NameError as e:
            raise ValueError(
                f"{who}: update must run inside jax.shard_map or jax.pmap over the axis "
                f"{a!r}, which is not bound here. Put the optimizer update inside the mapped "
                "train step (see docs/training.md), or pass the axis_name of your mesh / pmap."
                + describe_bound_axes()
            ) from e
    return tuple(sizes)


def _check_static_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        hint = ""
        if isinstance(value, (jax.Array, np.ndarray)):
            hint = (
                " (under optax.inject_hyperparams, list it in static_args: it fixes "
                "the shapes of the state)"
            )
        raise ValueError(f"{_WHO}: {name} must be a Python int >= {lo}, got {value!r}{hint}")
    return int(value)


def check_nonfinite(who: str, on_nonfinite) -> str:
    """``on_nonfinite``, checked against ``NONFINITE_MODES``."""
    if on_nonfinite not in NONFINITE_MODES:
        raise ValueError(
            f"{who}: on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}"
        )
    return on_nonfinite


def _check_options(algorithm, fusion_bytes, min_compress_size, warmup_steps, residual_dtype):
    """Validates the options; returns (fusion_bytes, min_compress_size, residual_dtype)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{_WHO}: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    # None defaults keep these out of optax.inject_hyperparams' numeric
    # hyperparameters (which would turn them into arrays): they fix shapes.
    fusion_bytes = _check_static_int(
        "fusion_bytes", DEFAULT_FUSION_BYTES if fusion_bytes is None else fusion_bytes, 1
    )
    min_compress_size = _check_static_int(
        "min_compress_size",
        DEFAULT_MIN_COMPRESS_SIZE if min_compress_size is None else min_compress_size,
        0,
    )
    if isinstance(warmup_steps, (int, np.integer)) and not isinstance(warmup_steps, bool):
        if warmup_steps < 0:
            raise ValueError(f"{_WHO}: warmup_steps must be >= 0, got {warmup_steps}")
    residual_dtype = np.dtype(residual_dtype)
    if not jnp.issubdtype(residual_dtype, jnp.floating):
        raise ValueError(
            f"{_WHO}: residual_dtype must be a floating dtype, got {residual_dtype.name}"
        )
    return fusion_bytes, min_compress_size, residual_dtype


# ---------------------------------------------------------------------------
# The residuals in the state: one per leaf, [1, *leaf.shape] per device
# ---------------------------------------------------------------------------
def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _zero_residuals(plan: Plan, dtype) -> Any:
    leaves = [
        jnp.zeros((1, *shape), dtype) if carries else optax.MaskedNode()
        for shape, carries in zip(plan.shapes, plan.carries_residual, strict=True)
    ]
    return plan.treedef.unflatten(leaves)


def _replicated_error(path: str, rows: int) -> ValueError:
    return ValueError(
        f"{_WHO}: inside the mapped step each device must see its own residual "
        f"(leading axis 1), but for {path} it sees {rows} rows: the per-device "
        "state was passed as replicated. Under jax.shard_map give the optimizer "
        "state in_specs/out_specs=jc.optax.state_specs(opt_state, axis_name) "
        "(and create it with jc.optax.init); under jax.pmap, create it with "
        "jax.pmap(tx.init)."
    )


def _read_residuals(plan: Plan, residuals, dtype) -> list:
    """This device's residual of every leaf, shaped like the leaf (None for
    a leaf without one), after checking the state against the gradients."""
    found = jax.tree.structure(residuals, is_leaf=_is_masked)
    if found != plan.treedef:
        raise ValueError(
            f"{_WHO}: the state's residuals do not have the gradients' structure (one "
            "residual per gradient leaf, shaped like the parameters; a state whose residuals "
            "are one array per fused bucket predates that layout): was the state initialized "
            f"with parameters of another structure?\n  residuals: {found}\n  gradients: "
            f"{plan.treedef}"
        )
    leaves = plan.treedef.flatten_up_to(residuals)
    return [_read_residual(plan, i, r, dtype) for i, r in enumerate(leaves)]


def _read_residual(plan: Plan, i: int, r, dtype):
    """Leaf ``i``'s residual on this device (``r[0]``), or None, checked."""
    path, shape = plan.paths[i], plan.shapes[i]
    if not plan.carries_residual[i]:
        if _is_masked(r):
            return None
        raise ValueError(
            f"{_WHO}: gradient {path} of dtype {plan.dtypes[i].name} has no residual, but "
            f"the state holds a {type(r).__name__} for it (expected optax.MaskedNode()): was "
            "the state initialized with parameters of other dtypes?"
        )
    if _is_masked(r) or tuple(r.shape[1:]) != shape:
        got = "optax.MaskedNode()" if _is_masked(r) else f"shape {tuple(r.shape)}"
        raise ValueError(
            f"{_WHO}: the state's residual for {path} has {got}, but the gradient has shape "
            f"{shape} (expected (1, *shape) inside the mapped step): was the state initialized "
            "with other parameters?"
        )
    if r.shape[0] != 1:
        raise _replicated_error(path, r.shape[0])
    if r.dtype != dtype:
        raise ValueError(
            f"{_WHO}: the state's residual for {path} has dtype {r.dtype.name}, but "
            f"residual_dtype is {dtype.name}: build the transformation with the "
            "residual_dtype the state was created with"
        )
    return r[0]


def _write_residuals(plan: Plan, state_residuals, new: list, keep) -> Any:
    """The state's residuals after a step: the new ones where ``keep``,
    else the old ones (a step that made one non-finite changes nothing).

    The select is taken on the state's own ``(1, *shape)`` arrays, not on
    the leaf-shaped ones and then expanded: XLA then needs one temporary
    less, and on the CPU each temporary costs page faults at every step
    (docs/benchmarks.md, "The optimizer step")."""
    raw = plan.treedef.flatten_up_to(state_residuals)
    leaves = [
        optax.MaskedNode() if n is None else jnp.where(keep, n[None], o)
        for o, n in zip(raw, new, strict=True)
    ]
    return plan.treedef.unflatten(leaves)


def zero_unless(ok, u):
    """``u`` where ``ok``, else zeros (float0 gradients pass through)."""
    if u.dtype == jax.dtypes.float0:
        return u
    return jnp.where(ok, u, jnp.zeros((), u.dtype))


def _axis_sizes_or_none(axis_name) -> tuple[int, ...] | None:
    """The sizes of the axes where they are bound (inside the mapped
    function), else None."""
    try:
        return _bound_axis_sizes(axis_name)
    except ValueError:
        return None


# ---------------------------------------------------------------------------
# The server residuals: one [1, m] row per compressed bucket per device
# ---------------------------------------------------------------------------
def _server_sizes(plan: Plan, sizes: tuple[int, ...], algorithm: str) -> tuple[int, ...]:
    axis_sizes = sizes[0] if len(sizes) == 1 else sizes
    return tuple(state_size(b.codec, b.size, b.dtype, axis_sizes, algorithm) for b in plan.buckets)


def _zero_servers(plan: Plan, sizes, algorithm: str) -> tuple:
    """Zero server residuals; where the axes are not bound (``tx.init``
    outside the mapped function, or ``jax.eval_shape`` of it), empty rows
    that ``update`` rejects with a message saying how to create the state."""
    if sizes is None:
        return tuple(jnp.zeros((1, 0), jnp.float32) for _ in plan.buckets)
    return tuple(jnp.zeros((1, m), jnp.float32) for m in _server_sizes(plan, sizes, algorithm))


def _read_servers(plan: Plan, servers, sizes, algorithm: str) -> list:
    """This device's server residual of every bucket, checked."""
    want = _server_sizes(plan, sizes, algorithm)
    got = (
        tuple(tuple(getattr(s, "shape", ())) for s in servers)
        if isinstance(servers, tuple)
        else None
    )
    if got is None or len(got) != len(want):
        raise ValueError(
            f"{_WHO}: the state holds {len(servers) if got is not None else 'no'} server "
            f"residuals, but this step has {len(want)} compressed buckets: was the state "
            "initialized with other parameters, codecs, fusion_bytes or min_compress_size, "
            "or with server_error_feedback=False?"
        )
    for b, m, shape, s in zip(plan.buckets, want, got, servers, strict=True):
        if shape == (1, 0) and m:
            raise ValueError(
                f"{_WHO}: the state's server residuals are empty: it was initialized outside "
                "the mapped function, where the number of devices is unknown. Create it with "
                "jc.optax.init(tx, params, mesh, axis_name) under jax.shard_map, or "
                "jax.pmap(tx.init, axis_name=...) under jax.pmap."
            )
        if len(shape) == 2 and shape[0] != 1 and shape[1] == m:
            raise _replicated_error(f"the server residual of the bucket of {b.codec!r}", shape[0])
        if shape != (1, m) or s.dtype != jnp.float32:
            raise ValueError(
                f"{_WHO}: the state's server residual for the bucket of {b.codec!r} "
                f"({b.size} values) has shape {shape}, expected (1, {m}) for "
                f"algorithm={algorithm!r} on axes of sizes {sizes}: the server residuals "
                "depend on the fused buckets, the algorithm and the number of devices, so "
                "restore a state under the same fusion_bytes, codec policy, algorithm and "
                "mesh (the per-leaf residuals do not)"
            )
    return tuple(s[0] for s in servers)


# ---------------------------------------------------------------------------
# The transformation
# ---------------------------------------------------------------------------
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
) -> optax.GradientTransformation:
    """Compressed mean of the gradients over ``axis_name``, with error feedback.

    The first element of an ``optax.chain`` inside a ``jax.shard_map``'d (or
    ``jax.pmap``'d) train step, in place of ``lax.pmean(grads, axis_name)``.
    Each step, on every device: the leaves and their residuals are packed
    into fused buffers (per codec and dtype, up to ``fusion_bytes``) as
    ``acc = grad + residual``; ``jc.pmean(acc)`` gives the compressed mean
    and what this device sent; ``residual = acc - sent`` is unpacked into
    one residual per leaf and carried to the next step. This is the error
    feedback of 1-bit SGD (Seide et al. 2014, section 3), 3LC's error
    accumulation buffers (Lim et al. 2019, section 3.1) and SparCML's
    Algorithm 1 (Renggli et al. 2019); Karimireddy et al. 2019 ("Error
    Feedback Fixes SignSGD") show why it restores the convergence of the
    uncompressed method. Over any number of steps, what was applied (times
    the number of devices) plus the residuals equals the sum of the
    gradients.

    The residuals are shaped like the parameters, one per floating-point
    leaf whatever its codec: a leaf sent uncompressed this step sends
    ``grad + residual`` exactly and keeps what its dtype's rounding left (0
    in float32). So a state saved under one ``fusion_bytes``, policy or
    ``min_compress_size`` restores under another. They cost
    ``residual_dtype``'s size (4 bytes in float32) per floating-point
    parameter per device. A step whose mean gradient is not finite (a NaN
    or an inf in any device's gradient reaches the mean, for every codec
    and algorithm: tested) leaves the residuals, the server residuals,
    ``step`` and ``key`` as they were, so the next step is the one that
    would have come had this gradient never been given, and counts itself
    in ``Telemetry.skipped_steps``; the flag is read from the mean, which
    is identical on every device, so it costs no collective. A step that
    would make one device's residual non-finite in a narrower
    ``residual_dtype`` leaves that device's residuals as they were.

    Args:
      codec: a :mod:`jaxcomp.codecs` codec for every leaf (or its spec
        string, ``"qsgd:bits=4"``, or its class, for its defaults); or a
        callable ``(path, leaf) -> codec | None``; or a pytree of codecs
        and ``None`` with the gradients' structure (``None``: uncompressed).
        Wherever a codec goes, a spec string does too.
      axis_name: the data-parallel mesh / pmap axis; a pair
        ``(slow, fast)`` selects the hierarchical algorithm.
      error_feedback: carry what compression dropped to the next step.
      server_error_feedback: with ``error_feedback``, also keep the error of
        the algorithm's second stage (two-phase, ring, the sparse split)
        where it was made, in per-device server residuals at the scale of
        what that stage compresses (two-level error feedback, as DeepSpeed's
        1-bit Adam does). False charges it to the chunk owner's residual at
        the scale of the sum (one-level), which needs no extra memory but
        makes some codecs train worse or diverge (docs/collectives.md).
      algorithm: passed to ``jc.pmean`` (``jc.collectives.ALGORITHMS``).
      fusion_bytes: the largest fused bucket, in gradient bytes (a leaf
        larger than this is a bucket of its own, and costs no copy); None:
        4 MiB.
      min_compress_size: leaves with fewer elements are averaged
        uncompressed, all in one fused ``lax.pmean``; None: 1024.
      warmup_steps: the first steps use the exact (uncompressed) mean, as in
        PowerSGD's ``start_powerSGD_iter`` and 1-bit Adam's warm-up. May be
        a traced int (``optax.inject_hyperparams``).
      residual_dtype: dtype of the residuals (float32 by default).
      residual_norm: also report the residuals' global L2 norm in the
        telemetry, at the cost of one scalar all-reduce per step; if False,
        ``Telemetry.residual_norm`` is 0.
      on_nonfinite: what ``update`` returns for a step whose mean gradient
        is not finite: ``"pass"`` (the default) returns that mean, so that
        ``optax.apply_if_finite`` or a loss scaler after it sees the
        overflow and skips the step; ``"skip"`` returns zero updates (plain
        SGD then leaves the parameters as they were; a later stateful
        transformation still counts a step).
      seed: seeds the PRNG key of stochastic codecs.
    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`CompressState`.
    """
    on_nonfinite = check_nonfinite(_WHO, on_nonfinite)
    fusion_bytes, min_compress_size, residual_dtype = _check_options(
        algorithm, fusion_bytes, min_compress_size, warmup_steps, residual_dtype
    )
    if is_codec_like(codec):  # a spec string or a codec class: read it now, errors included
        codec = as_codec(codec, _WHO)
    error_feedback, residual_norm = bool(error_feedback), bool(residual_norm)
    two_level = error_feedback and bool(server_error_feedback)
    no_warmup = isinstance(warmup_steps, (int, np.integer)) and warmup_steps == 0

    def plan_for(tree) -> Plan:
        return make_plan(
            codec, tree, min_compress_size=min_compress_size, fusion_bytes=fusion_bytes
        )

    def init_fn(params) -> CompressState:
        plan = plan_for(gradient_shapes(params))
        records = INIT_RECORDS.get()
        if records is not None:
            records.append(coarse_for_adam(plan))
        return CompressState(
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            residuals=_zero_residuals(plan, residual_dtype) if error_feedback else (),
            server_residuals=(
                _zero_servers(plan, _axis_sizes_or_none(axis_name), algorithm) if two_level else ()
            ),
            telemetry=zero_telemetry(),
        )

    def update_fn(grads, state: CompressState, params=None):
        del params
        if not isinstance(state, CompressState):
            raise TypeError(f"{_WHO}: update got a {type(state).__name__}, not a CompressState")
        plan = plan_for(grads)
        sizes = _bound_axis_sizes(axis_name)
        axes = axis_name if len(sizes) == 1 else tuple(axis_name)
        if error_feedback:
            _warn_unsafe(plan, algorithm)
        leaves = plan.treedef.flatten_up_to(grads)
        old = [None] * len(leaves)
        if error_feedback:
            old = _read_residuals(plan, state.residuals, residual_dtype)
        servers = None
        if two_level:
            servers = _read_servers(plan, state.server_residuals, sizes, algorithm)
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        in_warmup = state.step < warmup_steps

        accs = pack(plan, leaves, old)
        warmup = None if no_warmup else in_warmup
        means, sent, new_servers = reduce(
            plan, accs, axes, key=step_key, algorithm=algorithm, warmup=warmup, servers=servers
        )
        out = unpack(plan, leaves, accs, means, sent, residual_dtype if error_feedback else None)

        # Identical on every device, as the means are; and a non-finite value
        # in any device's acc reaches the mean for every codec (decoding
        # multiplies by a scale computed from it, or sends it) and algorithm:
        # tests/test_nonfinite.py checks both.
        ok = all_finite(means)
        keep = ok & out.residuals_finite
        if two_level:
            keep = keep & all_finite(new_servers)
            server_residuals = tuple(
                jnp.where(keep, n[None], o)
                for o, n in zip(state.server_residuals, new_servers, strict=True)
            )
        residuals = ()
        if error_feedback:
            residuals = _write_residuals(plan, state.residuals, out.residuals, keep)
        norm = global_norm(residuals, axes) if residual_norm else jnp.zeros((), jnp.float32)
        updates = out.updates
        if on_nonfinite == "skip":
            updates = [zero_unless(ok, u) for u in updates]
        skipped = count_skipped(state.telemetry, ok)
        return plan.treedef.unflatten(updates), CompressState(
            step=jnp.where(ok, state.step + 1, state.step),
            key=jnp.where(ok, jax.random.key_data(next_key), state.key),
            residuals=residuals,
            server_residuals=server_residuals if two_level else (),
            telemetry=step_telemetry(plan, sizes, algorithm, in_warmup, norm, skipped),
        )

    return optax.GradientTransformation(init_fn, update_fn)
