"""PowerSGD: low-rank gradient compression by one step of power iteration.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization" (NeurIPS 2019), Algorithms 1 and
2. Each matrix-shaped gradient M (n x m; a kernel of higher rank is viewed as
prod(shape[:-1]) x shape[-1]) is approximated by P Q^T of rank r: with Q from
the previous step (warm start), P = M Q is averaged over the devices,
orthogonalized, Q = M^T P is averaged, and every device applies the same
P Q^T. Both messages are linear in M, so they travel in plain all-reduces
(one for every matrix's P together, one for every Q), and the approximation
error of each device, M - P Q^T, is fed back into the next step's M.

It is a transformation of its own rather than a codec: its message is made
in two rounds with an orthogonalization between them and needs state (Q)
that a codec's ``encode(x, key)`` cannot carry (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp._axes import names_of
from jaxcomp.collectives import after, all_finite, feedback, uncompressed_send_nbytes
from jaxcomp.optax._config import CommConfig, axis_sizes_or_none, bound_axis_sizes
from jaxcomp.optax._plan import Policy, has_residual
from jaxcomp.optax._state import all_reduce_state, check_type, read_factors
from jaxcomp.optax._step import nonfinite_updates
from jaxcomp.optax._telemetry import Telemetry, count_skipped, first_telemetry
from jaxcomp.optax._transform import compress_gradients

_WHO = "jc.optax.powersgd"


@all_reduce_state(per_device=("residuals",), nested=("rest",))
class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Attributes:
      step: int32[]: updates applied so far (replicated).
      qs: the warm-start factors, a pytree with the parameters' structure:
        float32[m, rank] for every leaf PowerSGD compresses (the previous
        step's all-reduced Q, identical on every device; standard normal at
        the start, as the paper), ``optax.MaskedNode()`` for the others.
      residuals: this device's error feedback, with the parameters'
        structure: float32[1, *leaf.shape] for every compressed leaf (the
        leading axis is the device's row, as in ``CompressState``),
        ``optax.MaskedNode()`` for the others.
      rest: the ``compress_gradients`` state of the leaves PowerSGD does not
        compress, when ``rest`` names a codec; ``()`` when they are
        averaged exactly.
      telemetry: :class:`Telemetry` of the last step (replicated).
    """

    step: jax.Array
    qs: Any
    residuals: Any
    rest: Any
    telemetry: Telemetry


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
    """Which leaves are low-rank compressed, as what matrices."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    matrices: dict[int, tuple[int, int, int]]  # leaf -> (n, m, rank)
    rest: tuple[int, ...]  # floating leaves sent otherwise
    passthrough: tuple[int, ...]  # float0 gradients of integer parameters

    @property
    def num_elements(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def make_low_rank_plan(tree, rank: int, min_compression_rate: float) -> LowRankPlan:
    """The plan for gradients shaped like ``tree``: a floating leaf of rank
    >= 2 is a matrix ``prod(shape[:-1]) x shape[-1]`` if its factors are
    ``min_compression_rate`` times smaller than it."""
    leaves, treedef = jax.tree.flatten(tree)
    shapes = tuple(tuple(int(d) for d in a.shape) for a in leaves)
    dtypes = tuple(np.dtype(a.dtype) for a in leaves)
    matrices, rest, passthrough = {}, [], []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        if dtype == jax.dtypes.float0 or not jnp.issubdtype(dtype, jnp.inexact):
            passthrough.append(i)
            continue
        if has_residual(dtype) and len(shape) >= 2:
            n, m = math.prod(shape[:-1]), shape[-1]
            r = min(rank, n, m)
            if n * m >= min_compression_rate * (n + m) * r:
                matrices[i] = (n, m, r)
                continue
        rest.append(i)
    return LowRankPlan(treedef, shapes, dtypes, matrices, tuple(rest), tuple(passthrough))


def orthogonalize(p: jax.Array) -> jax.Array:
    """The columns of ``p`` [n, r], orthonormalized in order (Gram-Schmidt,
    twice per column for float32 accuracy); a column with nothing left
    after removing the previous ones (a zero or rank-deficient P) becomes 0,
    so P P^T stays a projection."""
    cols = []
    tiny = jnp.finfo(jnp.float32).tiny
    for j in range(p.shape[1]):
        v = p[:, j]
        for _ in range(2):
            for c in cols:
                v = v - jnp.dot(c, v) * c
        norm = jnp.sqrt(jnp.dot(v, v))
        cols.append(jnp.where(norm > tiny, v / jnp.where(norm > tiny, norm, 1.0), 0.0))
    return jnp.stack(cols, axis=1)


def _flat_mean(parts: list[jax.Array], axes) -> list[jax.Array]:
    """One ``lax.pmean`` of every array of ``parts`` together."""
    if not parts:
        return []
    flat = lax.pmean(jnp.concatenate([a.reshape(-1) for a in parts]), axes)
    out, start = [], 0
    for a in parts:
        out.append(flat[start : start + a.size].reshape(a.shape))
        start += a.size
    return out


def _mean_with(parts: list, rest: list, axes) -> tuple[list, list]:
    """The means of ``parts`` and of ``rest``, in one ``lax.pmean``."""
    means = _flat_mean(list(parts) + list(rest), axes)
    return means[: len(parts)], means[len(parts) :]


def _outer(p: jax.Array, q: jax.Array) -> jax.Array:
    """``p @ q.T`` for a small rank: as a sum of r outer products written
    element-wise, XLA fuses it with what consumes it (the residual, the
    cast), where a dot would write it to memory first."""
    if p.shape[1] > 8:
        return p @ q.T
    out = p[:, 0, None] * q[None, :, 0]
    for k in range(1, p.shape[1]):
        out = out + p[:, k, None] * q[None, :, k]
    return out


def _matmul(g: jax.Array, e: jax.Array | None, x: jax.Array, transpose: bool) -> jax.Array:
    """``M @ x`` (or ``M.T @ x``) for ``M = g + e``, without writing M:
    two products that read g and e where they are."""
    if transpose:  # as (x^T M)^T: XLA:CPU is slow to write M^T's product (docs/benchmarks.md)

        def mm(a):
            return jnp.einsum("nm,nk->km", a, x).T
    else:

        def mm(a):
            return a @ x

    return mm(g) if e is None else mm(g) + mm(e)


def _compressed(gs, es, qs, rest, axes):
    """PowerSGD's Algorithm 1 on every matrix at once: (approximations,
    new Qs, new residuals, finite, the means of ``rest``), identical on
    every device but the residuals. A step whose factors are not finite
    keeps the residuals. ``rest`` (float32 leaves averaged exactly) goes in
    the all-reduce of the Ps: one collective, one latency, less a step."""
    ps, rest_means = _mean_with(
        [_matmul(g, e, q, False) for g, e, q in zip(gs, es, qs, strict=True)], rest, axes
    )
    ps = [orthogonalize(p) for p in ps]
    new_qs = _flat_mean([_matmul(g, e, p, True) for g, e, p in zip(gs, es, ps, strict=True)], axes)
    ok = all_finite(ps + new_qs)  # a non-finite M makes its factors non-finite
    approx = [_outer(p, q) for p, q in zip(ps, new_qs, strict=True)]
    res = [
        None if e is None else jnp.where(ok, feedback.kept(feedback.accumulate(g, e), a), e)
        for g, e, a in zip(gs, es, approx, strict=True)
    ]
    return approx, new_qs, res, ok, rest_means


def _exact(gs, es, qs, rest, axes):
    """A warm-up step: the exact means, the Qs kept, no residual left (and
    the means of ``rest``, in the same all-reduce)."""
    means, rest_means = _mean_with(
        [g if e is None else g + e for g, e in zip(gs, es, strict=True)], rest, axes
    )
    ok = all_finite(means)
    res = [None if e is None else jnp.where(ok, 0.0, e) for e in es]
    return means, qs, res, ok, rest_means


class Matrices(NamedTuple):
    """The compressed leaves as matrices, in ``plan.matrices`` order: this
    step's gradients (float32 [n, m]), residuals ([n, m], or None without
    error feedback) and the Qs the power iteration starts from ([m, r])."""

    gs: list
    es: list
    qs: list


class LowRankMean(NamedTuple):
    """What :func:`_compressed` (or :func:`_exact`) returns, in
    ``plan.matrices`` order: the approximations, the new Qs, the new
    residuals, and whether the factors were finite; then the exact means
    of the other leaves that went in the same all-reduce (``PowerSGD.folded``)."""

    approx: list
    qs: list
    residuals: list
    ok: jax.Array
    rest: list


class LeafState(NamedTuple):
    """The state's Q and residual of every leaf, in flatten order
    (``optax.MaskedNode()`` for the leaves PowerSGD does not compress;
    ``residuals`` None without error feedback)."""

    qs: list
    residuals: list | None


def _payloads(plan: LowRankPlan) -> tuple[int, int, int]:
    """Bytes of the factors, of the full matrices and of the other leaves."""
    factors = sum((n + m) * r for n, m, r in plan.matrices.values()) * 4
    full = sum(n * m for n, m, _ in plan.matrices.values()) * 4
    exact = sum(math.prod(plan.shapes[i]) * plan.dtypes[i].itemsize for i in plan.rest)
    return factors, full, exact


def _telemetry(plan: LowRankPlan, p: int, in_warmup, rest: Telemetry | None, skipped) -> Telemetry:
    """The step's :class:`Telemetry`: the factors (or, in a warm-up step,
    the full matrices) and the other leaves, exact or as ``rest``'s state
    counted them."""
    factors, full, exact = _payloads(plan)
    num = max(plan.num_elements, 1)
    matrices = jnp.where(in_warmup, jnp.float32(full), jnp.float32(factors))
    payload, wire = matrices + exact, uncompressed_send_nbytes(matrices + exact, p)
    if rest is not None:  # the rest's bits are per rest element
        n_rest = sum(math.prod(plan.shapes[i]) for i in plan.rest)
        payload = matrices + rest.bits_per_element * n_rest / 8.0
        wire = uncompressed_send_nbytes(matrices, p) + rest.wire_bytes
    bits = 8.0 * payload / num
    if p > 1:
        ratio = uncompressed_send_nbytes(4.0 * num, p) / jnp.maximum(wire, 1e-30)
    else:
        ratio = 32.0 / jnp.maximum(bits, 1e-30)
    zero = jnp.zeros((), jnp.float32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return Telemetry(f32(bits), f32(wire), f32(ratio), zero, skipped)


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """``powersgd`` for validated options (see :func:`powersgd`); ``rest``
    is the ``compress_gradients`` of the other leaves, or None."""

    config: CommConfig
    rank: int
    min_compression_rate: float
    warm_start: bool
    rest: optax.GradientTransformation | None

    @property
    def slow(self):
        return names_of(self.config.axis_name)[0]

    @property
    def fast(self):
        names = names_of(self.config.axis_name)
        return names[1] if len(names) == 2 else None

    def transformation(self) -> optax.GradientTransformation:
        # Named init_fn and update_fn, as the other transformations' are:
        # jax.jit names the compiled module after the function.
        return optax.GradientTransformation(self.init_fn, self.update_fn)

    def plan(self, tree) -> LowRankPlan:
        return make_low_rank_plan(tree, self.rank, self.min_compression_rate)

    def random_q(self, i: int, m: int, r: int, step) -> jax.Array:
        """A standard normal Q for leaf ``i`` at ``step``, the same on every device."""
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.seed), i), step)
        return jax.random.normal(key, (m, r), jnp.float32)

    def init_fn(self, params) -> PowerSGDState:
        plan = self.plan(params)
        qs, residuals = [], []
        for i, shape in enumerate(plan.shapes):
            if i in plan.matrices:
                _, m, r = plan.matrices[i]
                qs.append(self.random_q(i, m, r, 0))
                residuals.append(jnp.zeros((1, *shape), jnp.float32))
            else:
                qs.append(optax.MaskedNode())
                residuals.append(optax.MaskedNode())
        rest_leaves = [jax.tree.leaves(params)[i] for i in plan.rest]
        rest = self.rest.init(rest_leaves) if self.rest is not None else ()
        in_warmup = jnp.asarray(self.config.warmup_steps) > 0
        rest_tel = rest.telemetry if self.rest is not None else None
        skipped = jnp.zeros((), jnp.int32)
        tel = first_telemetry(
            axis_sizes_or_none(self.config.axis_name),
            lambda s: _telemetry(plan, s[0], in_warmup, rest_tel, skipped),
        )
        return PowerSGDState(
            step=jnp.zeros((), jnp.int32),
            qs=plan.treedef.unflatten(qs),
            residuals=plan.treedef.unflatten(residuals) if self.config.error_feedback else (),
            rest=rest,
            telemetry=tel,
        )

    def update_fn(self, grads, state: PowerSGDState, params=None):
        """One step: plan, read the state, pack the matrices, reduce them
        (or, in a warm-up step, their exact means), unpack, the other
        leaves' mean, feedback, telemetry."""
        del params
        check_type(state, PowerSGDState, _WHO)
        sizes = bound_axis_sizes(self.config.axis_name, self.config.who)
        plan = self.plan(grads)
        old = LeafState(*read_factors(plan, state.qs, self.residuals(state), _WHO))
        leaves = self.exact_over_fast(plan, plan.treedef.flatten_up_to(grads))
        matrices = self.pack(plan, leaves, old, state.step)
        in_warmup = state.step < self.config.warmup_steps
        folded = [leaves[i] for i in plan.rest] if self.folded(plan, leaves) else []
        low = self.reduce(matrices, in_warmup, folded)
        out, new = self.unpack(plan, leaves, low, old)
        rest_out, rest_state = self.reduce_rest(plan, leaves, low, state.rest)
        for i, v in zip(plan.rest, rest_out, strict=True):
            out[i] = v
        ok, new, rest_state = self.feedback(plan, rest_out, low.ok, old, new, rest_state, state)
        out = nonfinite_updates(self.config.on_nonfinite, ok, out)
        return plan.treedef.unflatten(out), self.next_state(
            plan, state, ok, new, rest_state, in_warmup, sizes
        )

    def residuals(self, state: PowerSGDState):
        """The state's residuals, or None without error feedback."""
        return state.residuals if self.config.error_feedback else None

    def exact_over_fast(self, plan: LowRankPlan, leaves: list) -> list:
        """On a ``(slow, fast)`` mesh, the exact mean over ``fast`` first."""
        if self.fast is None:
            return leaves
        return [
            g if i in plan.passthrough else lax.pmean(g, self.fast) for i, g in enumerate(leaves)
        ]

    def pack(self, plan: LowRankPlan, leaves: list, old: LeafState, step) -> Matrices:
        """The compressed leaves as float32 matrices, their residuals and
        the Qs to start from (the state's, or fresh ones without warm start)."""
        items = plan.matrices.items()
        gs = [leaves[i].astype(jnp.float32).reshape(n, m) for i, (n, m, _) in items]
        es = [None] * len(gs)
        if old.residuals is not None:
            es = [old.residuals[i][0].reshape(n, m) for i, (n, m, _) in items]
        qs = [
            old.qs[i] if self.warm_start else self.random_q(i, m, r, step + 1)
            for i, (_, m, r) in plan.matrices.items()
        ]
        return Matrices(gs, es, qs)

    def folded(self, plan: LowRankPlan, leaves: list) -> bool:
        """Whether the other leaves are averaged in the matrices' first
        all-reduce: exactly (no ``rest`` codec), all float32."""
        return (
            self.rest is None
            and bool(plan.rest)
            and all(leaves[i].dtype == jnp.float32 for i in plan.rest)
        )

    def reduce(self, matrices: Matrices, in_warmup, folded: list) -> LowRankMean:
        """PowerSGD's all-reduces of the factors, or in a warm-up step the
        exact means of the matrices; ``folded``'s exact means in the first."""
        compressed = functools.partial(_compressed, axes=self.slow)
        if self.config.never_warm:
            return LowRankMean(*compressed(*matrices, folded))
        exact = functools.partial(_exact, axes=self.slow)
        return LowRankMean(*lax.cond(in_warmup, exact, compressed, *matrices, folded))

    def unpack(self, plan: LowRankPlan, leaves: list, low: LowRankMean, old: LeafState):
        """The updates (the approximations in the matrices' places, the
        other leaves as they came) and the new :class:`LeafState`."""
        out = list(leaves)
        qs = list(old.qs)
        res = None if old.residuals is None else list(old.residuals)
        for i, a, e, q in zip(plan.matrices, low.approx, low.residuals, low.qs, strict=True):
            out[i] = a.reshape(plan.shapes[i]).astype(plan.dtypes[i])
            if res is not None:
                res[i] = e.reshape(1, *plan.shapes[i])
            if self.warm_start:
                qs[i] = jnp.where(low.ok, q, old.qs[i])
        return out, LeafState(qs, res)

    def reduce_rest(self, plan: LowRankPlan, leaves: list, low: LowRankMean, rest_state):
        """The other leaves' mean and ``rest``'s state: exact, one
        ``lax.pmean`` per dtype, or through ``rest``'s codec. After the
        matrices' collectives: one order of collectives on every device
        (``jc.collectives.after``). Folded into the first all-reduce
        (:meth:`folded`), they are already there."""
        if low.rest:
            return list(low.rest), rest_state
        rest_in = after([leaves[i] for i in plan.rest], (low.approx, low.qs))
        if self.rest is not None and plan.rest:
            return self.rest.update(rest_in, rest_state)
        return _flat_mean_by_dtype(rest_in, self.slow), rest_state

    def feedback(self, plan, rest_out, ok, old: LeafState, new: LeafState, rest_state, state):
        """``(ok, state lists, rest's state)``: a non-finite value in the
        other leaves skips the whole step, as one in the matrices does:
        nothing of the state moves."""
        if not plan.rest:
            return ok, new, rest_state
        rest_ok = all_finite(rest_out)  # identical on every device
        ok = ok & rest_ok
        qs = list(new.qs)
        res = None if new.residuals is None else list(new.residuals)
        for i in plan.matrices:
            if self.warm_start:
                qs[i] = jnp.where(rest_ok, new.qs[i], old.qs[i])
            if res is not None:
                res[i] = jnp.where(rest_ok, new.residuals[i], old.residuals[i])
        if self.rest is not None:
            rest_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), rest_state, state.rest)
        return ok, LeafState(qs, res), rest_state

    def next_state(self, plan, state, ok, new: LeafState, rest_state, in_warmup, sizes):
        """The state after the step, with its telemetry."""
        skipped = count_skipped(state.telemetry, ok)
        rest_telemetry = rest_state.telemetry if self.rest is not None else None
        tel = _telemetry(plan, sizes[0], in_warmup, rest_telemetry, skipped)
        residuals = () if new.residuals is None else plan.treedef.unflatten(new.residuals)
        return PowerSGDState(
            step=jnp.where(ok, state.step + 1, state.step),
            qs=plan.treedef.unflatten(new.qs),
            residuals=residuals,
            rest=rest_state,
            telemetry=tel,
        )


def powersgd(
    axis_name: str | tuple[str, str],
    rank: int = 4,
    *,
    warmup_steps: int | jax.Array = 0,
    min_compression_rate: float = 2.0,
    warm_start: bool = True,
    error_feedback: bool = True,
    rest: Policy | None = None,
    on_nonfinite: str = "pass",
    seed: int = 0,
) -> optax.GradientTransformation:
    """PowerSGD's compressed mean of the gradients, with error feedback.

    The first element of an ``optax.chain`` in place of ``lax.pmean(grads,
    axis_name)``, as ``compress_gradients``. Each matrix-shaped leaf whose
    rank-``rank`` factors are ``min_compression_rate`` times smaller than it
    is sent as one power-iteration step, ``P = mean(M Q)``, orthogonalized,
    ``Q = mean(M^T P)``, with ``M = grad + residual``; the update is
    ``P Q^T`` and the residual ``M - P Q^T``. The other leaves are averaged
    exactly, or by ``compress_gradients`` with ``rest``. Vogels et al. 2019,
    Algorithms 1 and 2; docs/training.md, "PowerSGD".

    Args:
      axis_name: the data-parallel mesh / pmap axis; ``(slow, fast)``
        averages exactly over ``fast`` and compresses over ``slow``.
      rank: the rank r of the approximation.
      warmup_steps: the first steps send the exact mean; may be traced.
      min_compression_rate: compress a leaf only if its factors are at least
        this many times smaller than it.
      warm_start: start each power iteration from the previous step's Q;
        False draws a fresh standard normal Q every step.
      error_feedback: keep ``M - P Q^T`` for the next step.
      rest: None (the other leaves averaged exactly) or a codec policy for
        them, as ``compress_gradients`` takes.
      on_nonfinite: as ``compress_gradients``: ``"pass"`` or ``"skip"``.
      seed: seeds the initial (and, without warm start, every) Q.
    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`PowerSGDState`.
    """
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ValueError(f"{_WHO}: rank must be a Python int >= 1, got {rank!r}")
    if not isinstance(min_compression_rate, (int, float)) or min_compression_rate < 0:
        raise ValueError(
            f"{_WHO}: min_compression_rate must be a number >= 0, got {min_compression_rate!r}"
        )
    config = CommConfig(
        axis_name,
        warmup_steps=warmup_steps,
        error_feedback=error_feedback,
        on_nonfinite=on_nonfinite,
        seed=seed,
        who=_WHO,
    )
    names = names_of(axis_name)
    if len(names) not in (1, 2):
        raise ValueError(f"{_WHO}: axis_name must be one axis or a (slow, fast) pair")
    inner = None
    if rest is not None:
        inner = compress_gradients(rest, names[0], warmup_steps=warmup_steps, seed=seed)
    tx = PowerSGD(config, int(rank), min_compression_rate, bool(warm_start), inner)
    return tx.transformation()


def _flat_mean_by_dtype(leaves: list[jax.Array], axes) -> list[jax.Array]:
    """The exact mean of every leaf, one ``lax.pmean`` per dtype."""
    out: list[jax.Array | None] = [None] * len(leaves)
    by_dtype: dict[Any, list[int]] = {}
    for i, a in enumerate(leaves):
        by_dtype.setdefault(a.dtype, []).append(i)
    for group in by_dtype.values():
        for i, v in zip(group, _flat_mean([leaves[i] for i in group], axes), strict=True):
            out[i] = v
    return out
