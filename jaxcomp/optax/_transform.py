"""``compress_gradients``: the compressed gradient all-reduce as an optax
transformation, with error feedback, tensor fusion, a per-leaf codec policy,
warm-up and telemetry in its state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.codecs.base import Codec
from jaxcomp.collectives import choose_algorithm, operand_nbytes, pmean
from jaxcomp.collectives._core import ALGORITHMS
from jaxcomp.optax._plan import Plan, Policy, make_plan

_WHO = "jc.optax.compress_gradients"
DEFAULT_FUSION_BYTES = 64 << 20
DEFAULT_MIN_COMPRESS_SIZE = 1024


class Telemetry(NamedTuple):
    """What the last step communicated (identical on every device).

    Attributes:
      bits_per_element: float32[]: payload bits per gradient element: the
        codecs' wire bits for the fused bucket sizes, plus the uncompressed
        leaves at their own width (8 x itemsize); during warm-up, every leaf
        at its own width.
      wire_bytes: float32[]: bytes this device sent in the step's
        collectives (the algorithms' per-device send volume: (P-1) x C(n) for
        an allgather, 2 (P-1)/P x C(n) for two-phase and ring, and
        2 (P-1)/P x n x itemsize for an uncompressed all-reduce; for
        variable-rate codecs and the sparse algorithm, the largest capacity
        tier, an upper bound).
      compression_ratio: float32[]: the bytes a float32 ``lax.pmean`` of all
        the gradients sends per device (ring all-reduce, 2 (P-1)/P x 4 N)
        over ``wire_bytes``; with one device, 32 / ``bits_per_element``.
      residual_norm: float32[]: the L2 norm of the error-feedback residuals
        of all devices together after the step (0 without error feedback).
    """

    bits_per_element: jax.Array
    wire_bytes: jax.Array
    compression_ratio: jax.Array
    residual_norm: jax.Array


class CompressState(NamedTuple):
    """State of :func:`compress_gradients`.

    Attributes:
      step: int32[]: updates applied so far (replicated).
      key: uint32[2]: the raw PRNG key of the next step, split every step
        (replicated; each device's draws differ because ``jc.pmean`` folds
        in the device index).
      residuals: tuple, one per fused compressed bucket, of
        residual_dtype[1, bucket elements]: this device's error-feedback
        residual (per device: the leading axis of size 1 is the device's row
        of a [devices, bucket elements] array, see ``state_specs``). Empty
        without error feedback.
      telemetry: :class:`Telemetry` of the last step (replicated).
    """

    step: jax.Array
    key: jax.Array
    residuals: tuple
    telemetry: Telemetry


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _bound_axis_sizes(axis_name) -> tuple[int, ...]:
    sizes = []
    for a in _axis_names(axis_name):
        try:
            sizes.append(int(lax.axis_size(a)))
        except NameError as e:
            raise ValueError(
                f"{_WHO}: update must run inside jax.shard_map or jax.pmap over the axis "
                f"{a!r}, which is not bound here. Put the optimizer update inside the mapped "
                "train step (see docs/training.md), or pass the axis_name of your mesh / pmap."
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


# ---------------------------------------------------------------------------
# Bytes on the wire (static)
# ---------------------------------------------------------------------------
def _allreduce_bytes(nbytes: int, p: int) -> float:
    """Per-device send volume of an uncompressed ring all-reduce."""
    return 2.0 * (p - 1) / p * nbytes if p > 1 else 0.0


def _sent_bytes(codec: Codec, n: int, dtype, sizes: tuple[int, ...], algorithm: str) -> float:
    """Per-device send volume of ``jc.pmean`` of ``n`` values."""
    if len(sizes) == 2:  # hierarchical: float32 over the fast axis, compressed over the slow one
        slow, fast = sizes
        chunk = -(-n // fast)
        return 2.0 * (fast - 1) / fast * 4 * n + _sent_bytes(codec, chunk, dtype, (slow,), "auto")
    (p,) = sizes
    if p == 1:
        return 0.0
    alg = choose_algorithm(codec, n, p) if algorithm == "auto" else algorithm
    total = 0.0
    for kind, op in operand_nbytes(codec, (n,), dtype, p, alg).items():
        if kind == "all-gather":
            total += (p - 1) * op
        elif kind == "all-to-all":
            total += (p - 1) / p * op
        else:  # collective-permute: every operand byte is sent
            total += op
    return total


def _telemetry_constants(plan: Plan, sizes, algorithm) -> tuple[tuple[float, float], ...]:
    """(bits_per_element, wire_bytes) for a compressed step and a warm-up step."""
    p = int(np.prod(sizes))
    n_all = max(plan.num_elements, 1)
    exact_payload = sum(
        len(ix) and sum(int(np.prod(plan.shapes[i], dtype=np.int64)) for i in ix) * d.itemsize
        for d, ix in plan.exact
    )
    exact_wire = _allreduce_bytes(exact_payload, p)
    comp_payload = sum(b.codec.wire_nbytes((b.size,), b.dtype) for b in plan.buckets)
    comp_wire = sum(_sent_bytes(b.codec, b.size, b.dtype, sizes, algorithm) for b in plan.buckets)
    raw_payload = sum(b.size * b.dtype.itemsize for b in plan.buckets)
    return (
        (8.0 * (comp_payload + exact_payload) / n_all, comp_wire + exact_wire),
        (
            8.0 * (raw_payload + exact_payload) / n_all,
            exact_wire + _allreduce_bytes(raw_payload, p),
        ),
    )


def _ratio(bits: float, wire: float, plan: Plan, p: int) -> float:
    if p > 1:
        base = _allreduce_bytes(4 * plan.num_elements, p)
        return base / wire if wire else 1.0
    return 32.0 / bits if bits else 1.0


# ---------------------------------------------------------------------------
# The transformation
# ---------------------------------------------------------------------------
def compress_gradients(
    codec: Policy,
    axis_name: str | tuple[str, str],
    *,
    error_feedback: bool = True,
    algorithm: str = "auto",
    fusion_bytes: int | None = None,
    min_compress_size: int | None = None,
    warmup_steps: int | jax.Array = 0,
    residual_dtype: Any = "float32",
    seed: int = 0,
) -> optax.GradientTransformation:
    """Compressed mean of the gradients over ``axis_name``, with error feedback.

    The first element of an ``optax.chain`` inside a ``jax.shard_map``'d (or
    ``jax.pmap``'d) train step, in place of ``lax.pmean(grads, axis_name)``.
    Each step, on every device: the leaves are packed into fused buckets
    (per codec and dtype, up to ``fusion_bytes``); for each bucket,
    ``acc = grad + residual``, ``jc.pmean(acc)`` gives the compressed mean
    and what this device sent, and ``residual = acc - sent`` is carried to
    the next step. This is the error feedback of 1-bit SGD (Seide et al.
    2014, section 3; the low-precision study, Grubic et al. 2018, section
    2.2), 3LC's error accumulation buffers (section 3.1) and SparCML's
    Algorithm 1: over any number of steps, what was applied (times the number
    of devices) plus the residuals equals the sum of the gradients.

    Args:
      codec: a :mod:`jaxcomp.codecs` codec for every leaf; or a callable
        ``(path, leaf) -> codec | None``; or a pytree of codecs and ``None``
        with the gradients' structure (``None``: uncompressed).
      axis_name: the data-parallel mesh / pmap axis; a pair
        ``(slow, fast)`` selects the hierarchical algorithm.
      error_feedback: carry what compression dropped to the next step.
      algorithm: passed to ``jc.pmean`` (``jc.collectives.ALGORITHMS``).
      fusion_bytes: the largest fused bucket, in gradient bytes (a leaf
        larger than this is a bucket of its own); None: 64 MiB.
      min_compress_size: leaves with fewer elements are averaged
        uncompressed, all in one fused ``lax.pmean``; None: 1024.
      warmup_steps: the first steps use the exact (uncompressed) mean, as in
        PowerSGD's ``start_powerSGD_iter`` and 1-bit Adam's warm-up. May be
        a traced int (``optax.inject_hyperparams``).
      residual_dtype: dtype of the residuals (float32 by default).
      seed: seeds the PRNG key of stochastic codecs.
    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`CompressState`.
    """
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
    error_feedback = bool(error_feedback)

    def plan_for(tree) -> Plan:
        return make_plan(
            codec, tree, min_compress_size=min_compress_size, fusion_bytes=fusion_bytes
        )

    def init_fn(params) -> CompressState:
        plan = plan_for(params)
        residuals = (
            tuple(jnp.zeros((1, b.size), residual_dtype) for b in plan.buckets)
            if error_feedback
            else ()
        )
        zero = jnp.zeros((), jnp.float32)
        return CompressState(
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            residuals=residuals,
            telemetry=Telemetry(zero, zero, zero, zero),
        )

    def update_fn(grads, state: CompressState, params=None):
        del params
        if not isinstance(state, CompressState):
            raise TypeError(f"{_WHO}: update got a {type(state).__name__}, not a CompressState")
        sizes = _bound_axis_sizes(axis_name)
        p = int(np.prod(sizes))
        axes = axis_name if len(sizes) == 1 else tuple(axis_name)
        plan = plan_for(grads)
        leaves = plan.treedef.flatten_up_to(grads)
        nb = len(plan.buckets)
        if error_feedback:
            if len(state.residuals) != nb or any(
                tuple(r.shape[1:]) != (b.size,)
                for r, b in zip(state.residuals, plan.buckets, strict=True)
            ):
                raise ValueError(
                    f"{_WHO}: the state's residuals "
                    f"{[tuple(r.shape) for r in state.residuals]} do not fit the gradients' "
                    f"buckets {[(1, b.size) for b in plan.buckets]}: was the state initialized "
                    "with parameters of another structure?"
                )
            for r in state.residuals:
                if r.shape[0] != 1:
                    raise ValueError(
                        f"{_WHO}: inside the mapped step each device must see its own residual "
                        f"row (leading axis 1), but it sees {r.shape[0]} rows: the per-device "
                        "state was passed as replicated. Under jax.shard_map give the optimizer "
                        "state in_specs/out_specs=jc.optax.state_specs(opt_state, axis_name) "
                        "(and create it with jc.optax.init); under jax.pmap, create it with "
                        "jax.pmap(tx.init)."
                    )

        key = jax.random.wrap_key_data(state.key)
        next_key, step_key = jax.random.split(key)

        # The buckets' flat buffers, with the residuals added (float32 sums).
        flats = []
        for b in plan.buckets:
            parts = [leaves[i].reshape(-1) for i in b.leaves]
            flat = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            flats.append(flat)
        accs = []
        for j, flat in enumerate(flats):
            if error_feedback:
                accs.append(flat.astype(jnp.float32) + state.residuals[j][0].astype(jnp.float32))
            else:
                accs.append(flat.astype(jnp.float32))

        def compressed(accs):
            values, residuals = [], []
            for j, (b, acc) in enumerate(zip(plan.buckets, accs, strict=True)):
                r = pmean(
                    acc.astype(b.dtype),
                    axes,
                    b.codec,
                    key=jax.random.fold_in(step_key, j),
                    algorithm=algorithm,
                )
                values.append(r.value)
                residuals.append(acc - r.sent)
            return tuple(values), tuple(residuals)

        def exact(accs):
            sent = [acc.astype(b.dtype) for b, acc in zip(plan.buckets, accs, strict=True)]
            values = lax.pmean(tuple(sent), axes)
            return tuple(values), tuple(
                a - s.astype(jnp.float32) for a, s in zip(accs, sent, strict=True)
            )

        in_warmup = state.step < warmup_steps
        if isinstance(warmup_steps, (int, np.integer)) and warmup_steps == 0:
            values, residuals = compressed(accs)
        elif nb:
            values, residuals = lax.cond(in_warmup, exact, compressed, tuple(accs))
        else:
            values, residuals = (), ()

        out: list[Any] = list(leaves)
        for b, v in zip(plan.buckets, values, strict=True):
            off = 0
            for i, n in zip(b.leaves, b.sizes, strict=True):
                out[i] = v[off : off + n].reshape(plan.shapes[i]).astype(plan.dtypes[i])
                off += n
        if plan.exact:
            bufs = {}
            for d, ix in plan.exact:
                parts = [leaves[i].reshape(-1) for i in ix]
                bufs[d.name] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            means = lax.pmean(bufs, axes)
            for d, ix in plan.exact:
                off = 0
                for i in ix:
                    n = int(np.prod(plan.shapes[i], dtype=np.int64))
                    out[i] = means[d.name][off : off + n].reshape(plan.shapes[i])
                    off += n

        if error_feedback:
            sq = sum((jnp.sum(jnp.square(r)) for r in residuals), jnp.zeros((), jnp.float32))
            norm = jnp.sqrt(lax.psum(sq, axes)) if nb else jnp.zeros((), jnp.float32)
            new_residuals = tuple(r.astype(residual_dtype)[None] for r in residuals)
        else:
            norm = jnp.zeros((), jnp.float32)
            new_residuals = ()

        (bits_c, wire_c), (bits_w, wire_w) = _telemetry_constants(plan, sizes, algorithm)
        stats_c = (bits_c, wire_c, _ratio(bits_c, wire_c, plan, p))
        stats_w = (bits_w, wire_w, _ratio(bits_w, wire_w, plan, p))
        bits, wire, ratio = (
            jnp.where(in_warmup, jnp.float32(w), jnp.float32(c))
            for c, w in zip(stats_c, stats_w, strict=True)
        )
        new_state = CompressState(
            step=state.step + 1,
            key=jax.random.key_data(next_key),
            residuals=new_residuals,
            telemetry=Telemetry(bits, wire, ratio, norm),
        )
        return jax.tree.unflatten(plan.treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)
