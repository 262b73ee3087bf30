"""1-bit Adam: Adam whose momentum, not its gradient, is sent compressed.

Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with
Adam's Convergence Speed" (ICML 2021), Algorithm 1. Error feedback fixes
what compression drops only for updates linear in the gradient; Adam divides
by the square root of a variance that would see the compression noise, and
error-compensated compressed gradients fed to Adam train far worse
(docs/training.md, "Adam and compression"). The paper's observation is that
Adam's variance becomes stable early: after a warm-up of plain Adam (the
exact mean of the gradients), the variance is frozen, and from then on the
update is linear in the momentum, which each device computes from its own
gradient and sends through the compressed all-reduce with error feedback.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from optax import tree_utils as otu

from jaxcomp.codecs.base import Rate
from jaxcomp.optax._config import CommConfig
from jaxcomp.optax._plan import Policy, leaf_codecs, resolve_policy
from jaxcomp.optax._state import check_type
from jaxcomp.optax._transform import CompressState, compressed_mean

_WHO = "jc.optax.onebit_adam"
# Seide's 1-bit codec with one (avg+, avg-) pair per 256 values (1.25 bits
# per element), as DeepSpeed's 1-bit Adam keeps one scale per worker chunk;
# docs/training.md compares it with finer buckets.
DEFAULT_CODEC = "onebit:bucket_size=256"
SEND_MODES = ("auto", "momentum", "gradient")
# The frozen variance of every element is at least this fraction of its
# leaf's mean (an RMS gradient 10% of the leaf's), and at least its square
# times the mean over all the parameters: below it, the codec's noise, which
# every element of a bucket gets at the bucket's scale, divided by the
# element's own near-zero variance, runs the parameter away
# (docs/training.md, "A floor under the frozen variance").
DEFAULT_VARIANCE_FLOOR = 1e-2
# A leaf whose mean variance is below this fraction of the mean over all the
# parameters (an RMS gradient under 0.1% of the model's) has none of its own
# to scale a floor by (the key bias of an attention layer, whose gradient is
# zero up to rounding): it is floored at the overall mean's
# fraction. A leaf whose gradients are merely small keeps its own scale.
NO_VARIANCE = 1e-6


class OneBitAdamState(NamedTuple):
    """The state of :func:`scale_by_onebit_adam`.

    Attributes:
      mu: the momentum, shaped like the parameters and identical on every
        device (during the warm-up Adam's first moment of the mean gradient;
        after it the compressed mean of the devices' momenta).
      nu: Adam's second moment, frozen at the end of the warm-up.
      compress: the ``compress_gradients`` state that sends the momentum:
        its per-device residuals (error feedback of the momentum) and
        server residuals, its step count (the optimizer's) and telemetry.
      frozen_at: int32[]: the step at which the freeze rule
        (``freeze_tolerance``) froze the variance, or ``NOT_FROZEN`` while it
        has not (the warm-up then ends at ``warmup_steps``).
      variance_norm: float32[]: the sum of the bias-corrected variance at
        the freeze rule's last check (0 before the first, or without the rule).
    """

    mu: Any
    nu: Any
    compress: CompressState
    frozen_at: jax.Array
    variance_norm: jax.Array


NOT_FROZEN = np.iinfo(np.int32).max


class AdamHyperparams(NamedTuple):
    """``b1, b2, eps, eps_root`` as ``optax.scale_by_adam`` takes them
    (floats, or arrays under ``optax.inject_hyperparams``)."""

    b1: Any
    b2: Any
    eps: Any
    eps_root: Any


class FreezeRule(NamedTuple):
    """The rule that may end the warm-up early: freeze the variance at the
    first check (every ``interval`` steps) where its sum changed by less
    than ``tolerance`` (relative); ``tolerance`` None: no rule."""

    tolerance: Any
    interval: Any


def freeze_step(state: OneBitAdamState, warmup_steps) -> jax.Array:
    """int32[]: the step from which the variance is frozen: ``warmup_steps``,
    or the earlier step at which the freeze rule fired."""
    return jnp.minimum(state.frozen_at, jnp.asarray(warmup_steps, jnp.int32))


def _check_warmup_steps(warmup_steps: Any) -> None:
    """The errors a Python ``warmup_steps`` can get (a traced one, under
    ``optax.inject_hyperparams``, is used as it is)."""
    how = (
        "the number of steps of plain Adam (exact mean gradients, nothing compressed) "
        "before the variance is frozen and the momentum goes through the codec. It "
        "depends on the run's length: the paper (Tang et al. 2021) warms up for 15-25% "
        "of training, e.g. warmup_steps=2000 for 10000 steps; freeze_tolerance=0.1 can "
        "end the warm-up earlier, once the variance is stable (docs/training.md, "
        '"When to freeze")'
    )
    if warmup_steps is None:
        raise TypeError(f"{_WHO}: warmup_steps is required: {how}")
    if isinstance(warmup_steps, (bool, np.bool_, float, np.floating)):
        raise ValueError(
            f"{_WHO}: warmup_steps must be an int (a number of steps), got {warmup_steps!r}; "
            "for a fraction of the run write int(fraction * total_steps) (the paper warms "
            "up for 15-25% of training)"
        )
    if isinstance(warmup_steps, (int, np.integer)) and warmup_steps < 1:
        raise ValueError(
            f"{_WHO}: warmup_steps must be at least 1 (the variance is frozen at the end "
            f"of the warm-up, and Adam's variance starts at 0), got {warmup_steps}"
        )


def _check_freeze_rule(freeze_tolerance, freeze_interval) -> FreezeRule:
    """The rule, checked (Python numbers only: under
    ``optax.inject_hyperparams`` they arrive traced, and are used as they are)."""
    if isinstance(freeze_tolerance, (int, float)) and not 0 < freeze_tolerance < 1:
        raise ValueError(
            f"{_WHO}: freeze_tolerance must be None or in (0, 1), got {freeze_tolerance!r}"
        )
    if freeze_interval is None:
        freeze_interval = 10
    elif isinstance(freeze_interval, (int, np.integer)) and freeze_interval < 1:
        raise ValueError(f"{_WHO}: freeze_interval must be >= 1, got {freeze_interval}")
    return FreezeRule(freeze_tolerance, freeze_interval)


def sends_momentum(policy: Policy, send: str, grads) -> list[bool]:
    """Per leaf: whether it sends its whole momentum after the warm-up
    (else only the momentum's new part)."""
    if send != "auto":
        return [send == "momentum"] * len(jax.tree.leaves(grads))
    return [
        c is None or c.rate not in (Rate.SPARSE, Rate.VARIABLE) for c in leaf_codecs(policy, grads)
    ]


def device_values(grads, mu, full: list[bool], in_warmup, b1):
    """What each device sends: its gradient during the warm-up; after it,
    its momentum ``(1 - b1) g + b1 mu``, or only the new part ``(1 - b1) g``."""
    g_leaves, treedef = jax.tree.flatten(grads)
    m_leaves = treedef.flatten_up_to(mu)
    return treedef.unflatten(
        [
            jnp.where(in_warmup, g, ((1 - b1) * g + (b1 * m if f else 0)).astype(g.dtype))
            for g, m, f in zip(g_leaves, m_leaves, full, strict=True)
        ]
    )


def common_momentum(mean, mu, full: list[bool], b1):
    """The common momentum after the warm-up: the mean, plus ``b1 mu``
    where only the new part was sent."""
    treedef = jax.tree.structure(mean)
    m_leaves = treedef.flatten_up_to(mu)
    return treedef.unflatten(
        [
            a if f else a + b1 * m
            for a, m, f in zip(treedef.flatten_up_to(mean), m_leaves, full, strict=True)
        ]
    )


def floored_variance(nu, floor):
    """``nu`` with every element raised to at least ``floor`` times the mean
    of its leaf; a leaf whose mean is below ``NO_VARIANCE`` times the mean
    over all the parameters (its gradients were zero, or nearly) counts as
    having none, and gets ``floor`` times the overall mean. Means in float32."""
    leaves, treedef = jax.tree.flatten(nu)
    sizes = [int(np.prod(v.shape)) for v in leaves]
    if not sum(sizes):
        return nu
    sums = [jnp.sum(v, dtype=jnp.float32) for v in leaves]
    overall = sum(sums) / sum(sizes)

    def floored(v, total, n):
        if not n:
            return v
        own = total / n
        least = floor * jnp.where(own < NO_VARIANCE * overall, overall, own)
        return jnp.maximum(v, least.astype(v.dtype))

    return treedef.unflatten(
        [floored(v, t, n) for v, t, n in zip(leaves, sums, sizes, strict=True)]
    )


def frozen_variance(state: OneBitAdamState, count, freeze, floor):
    """The variance the steps after the warm-up divide by: the warm-up's,
    floored (:func:`floored_variance`) at the first of them (``count ==
    freeze``) and stored so; ``floor`` 0: as the warm-up left it."""
    if isinstance(floor, (int, float)) and floor == 0:
        return state.nu
    return lax.cond(
        count == freeze,
        lambda nu: floored_variance(nu, floor),
        lambda nu: nu,
        state.nu,
    )


def next_moments(
    mean, state: OneBitAdamState, frozen_mu, frozen_nu, ok, in_warmup, adam: AdamHyperparams
):
    """``(mu, nu)`` after the step: Adam's moments of the exact mean during
    the warm-up; after it the common momentum and the frozen variance
    (``frozen_nu``); as they were after a non-finite step."""
    adam_mu = otu.tree_update_moment(mean, state.mu, adam.b1, 1)
    adam_nu = otu.tree_update_moment_per_elem_norm(mean, state.nu, adam.b2, 2)

    def pick(warm, frozen, old):
        return jnp.where(ok, jnp.where(in_warmup, warm, frozen), old)

    mu = jax.tree.map(lambda w, m, o: pick(w, m.astype(o.dtype), o), adam_mu, frozen_mu, state.mu)
    nu = jax.tree.map(pick, adam_nu, frozen_nu, state.nu)
    return mu, nu


def scaled_updates(mu, nu, t, freeze, ok, mean, adam: AdamHyperparams):
    """``(updates, nu_hat)``: Adam's bias-corrected ``mu_hat / (sqrt(nu_hat
    + eps_root) + eps)``, the variance corrected up to the freeze; a
    non-finite mean passes through, so the training code sees it."""
    mu_hat = otu.tree_bias_correction(mu, adam.b1, t)
    nu_hat = otu.tree_bias_correction(nu, adam.b2, jnp.minimum(t, freeze))
    updates = jax.tree.map(
        lambda m, v: m / (jnp.sqrt(v + adam.eps_root) + adam.eps), mu_hat, nu_hat
    )
    updates = jax.tree.map(lambda u, a: jnp.where(ok, u, a.astype(u.dtype)), updates, mean)
    return updates, nu_hat


def apply_freeze_rule(state: OneBitAdamState, nu_hat, t, warming, rule: FreezeRule):
    """``(frozen_at, variance_norm)`` after the check of step ``t`` (if any)."""
    if rule.tolerance is None:
        return state.frozen_at, state.variance_norm
    check = warming & (t % rule.interval == 0)
    total = sum(jnp.sum(v, dtype=jnp.float32) for v in jax.tree.leaves(nu_hat))
    prev = state.variance_norm
    stable = (prev > 0) & (jnp.abs(total - prev) < rule.tolerance * prev)
    frozen_at = jnp.where(check & stable, t, state.frozen_at).astype(jnp.int32)
    return frozen_at, jnp.where(check, total, prev)


def onebit_transformation(
    policy: Policy,
    config: CommConfig,
    send: str,
    adam: AdamHyperparams,
    rule: FreezeRule,
    variance_floor=DEFAULT_VARIANCE_FLOOR,
) -> optax.GradientTransformation:
    """``scale_by_onebit_adam`` for a codec policy and a validated config
    (``config.warmup_steps``: the longest warm-up)."""

    def init_fn(params) -> OneBitAdamState:
        return OneBitAdamState(
            mu=otu.tree_zeros_like(params),
            nu=otu.tree_zeros_like(params),
            compress=compressed_mean(policy, config).init(params),
            frozen_at=jnp.asarray(NOT_FROZEN, jnp.int32),
            variance_norm=jnp.zeros((), jnp.float32),
        )

    def update_fn(grads, state: OneBitAdamState, params=None):
        del params
        check_type(state, OneBitAdamState, _WHO)
        count = state.compress.step
        freeze = freeze_step(state, config.warmup_steps)
        in_warmup = count < freeze
        full = sends_momentum(policy, send, grads)
        local = device_values(grads, state.mu, full, in_warmup, adam.b1)
        momentum = compressed_mean(policy, dataclasses.replace(config, warmup_steps=freeze))
        mean, compress = momentum.update(local, state.compress)
        frozen_mu = common_momentum(mean, state.mu, full, adam.b1)
        ok = compress.step > count  # the mean was finite: the inner state moved on
        frozen_nu = frozen_variance(state, count, freeze, variance_floor)
        mu, nu = next_moments(mean, state, frozen_mu, frozen_nu, ok, in_warmup, adam)
        t = count + 1
        updates, nu_hat = scaled_updates(mu, nu, t, freeze, ok, mean, adam)
        frozen_at, norm = apply_freeze_rule(state, nu_hat, t, in_warmup & ok, rule)
        return updates, OneBitAdamState(mu, nu, compress, frozen_at, norm)

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_onebit_adam(
    axis_name: str | tuple[str, str],
    codec: Policy = DEFAULT_CODEC,
    *,
    warmup_steps: int | jax.Array | None = None,
    freeze_tolerance: float | None = None,
    freeze_interval: int | None = None,
    send: str = "auto",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    variance_floor: float = DEFAULT_VARIANCE_FLOOR,
    algorithm: str = "auto",
    server_error_feedback: bool = True,
    fusion_bytes: int | None = None,
    min_compress_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """Adam's scaling with 1-bit Adam's compressed momentum (no learning rate).

    Steps ``0 .. warmup_steps - 1`` are ``optax.scale_by_adam`` on the exact
    mean gradient. Then the variance freezes, floored at ``variance_floor``
    times its leaf's mean, and each device's momentum is averaged by
    ``jc.pmean`` with ``codec`` and error feedback; the update is
    ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``. Tang et al. 2021,
    Algorithm 1; docs/training.md, "Adam and compression".

    Args:
      axis_name: the data-parallel mesh / pmap axis (or ``(slow, fast)``).
      codec: the momentum's codec policy, as ``compress_gradients`` takes
        (default OneBit with 256-value buckets, 1.25 bits per element).
      warmup_steps: steps of plain Adam before the freeze (>= 1; may be
        traced). Required: None raises a ``TypeError`` saying how to choose.
      freeze_tolerance: None, or freeze at the first check where the
        variance's sum moved by less than this (relative).
      freeze_interval: steps between two such checks; None: 10.
      send: ``"momentum"`` (the paper's), ``"gradient"`` (only ``(1 - b1)
        grad``) or ``"auto"`` (``"gradient"`` for sparse and variable-rate codecs).
      b1, b2, eps, eps_root: as ``optax.scale_by_adam``.
      variance_floor: the least frozen variance, a fraction of its leaf's
        mean (default 1e-2); 0 is the paper's rule.
      algorithm, server_error_feedback, fusion_bytes, seed: as
        ``compress_gradients`` (error feedback is always on).
      min_compress_size: as ``compress_gradients``; None: 0 (every leaf).
    Returns:
      An ``optax.GradientTransformation`` with a :class:`OneBitAdamState`;
      place it first in the chain, in place of the gradient all-reduce.
    """
    _check_warmup_steps(warmup_steps)
    rule = _check_freeze_rule(freeze_tolerance, freeze_interval)
    config = CommConfig(
        axis_name,
        algorithm=algorithm,
        fusion_bytes=fusion_bytes,
        min_compress_size=0 if min_compress_size is None else min_compress_size,
        warmup_steps=warmup_steps,
        server_error_feedback=server_error_feedback,
        seed=seed,
        who=_WHO,
    )
    policy = resolve_policy(codec, config.who)
    if send not in SEND_MODES:
        raise ValueError(f"{_WHO}: send must be one of {SEND_MODES}, got {send!r}")
    if isinstance(variance_floor, (int, float)) and not 0 <= variance_floor < 1:
        raise ValueError(
            f"{_WHO}: variance_floor must be in [0, 1) (a fraction of the mean frozen "
            f"variance; 0 turns the floor off), got {variance_floor!r}"
        )
    adam = AdamHyperparams(b1, b2, eps, eps_root)
    return onebit_transformation(policy, config, send, adam, rule, variance_floor)


# The parameter list repeats scale_by_onebit_adam's, as optax.adam repeats
# scale_by_adam's: optax.inject_hyperparams finds the hyperparameters it can
# schedule in this function's own signature.
def onebit_adam(  # long: the public signature; the body is a chain
    learning_rate: optax.ScalarOrSchedule,
    axis_name: str | tuple[str, str],
    codec: Policy = DEFAULT_CODEC,
    *,
    warmup_steps: int | jax.Array | None = None,
    freeze_tolerance: float | None = None,
    freeze_interval: int | None = None,
    send: str = "auto",
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    variance_floor: float = DEFAULT_VARIANCE_FLOOR,
    weight_decay: float = 0.0,
    mask: Any = None,
    algorithm: str = "auto",
    server_error_feedback: bool = True,
    fusion_bytes: int | None = None,
    min_compress_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """1-bit Adam (AdamW form with ``weight_decay``): the whole optimizer.

    ``optax.chain(scale_by_onebit_adam(...), optax.add_decayed_weights(
    weight_decay, mask), optax.scale_by_learning_rate(learning_rate))``, as
    ``optax.adamw`` is built; it replaces both the gradient all-reduce and
    ``optax.adam``/``adamw`` in a data-parallel step. The learning rate may
    be a schedule, and the function works with ``optax.inject_hyperparams``.

    Args:
      learning_rate: a float or an optax schedule.
      axis_name, codec, warmup_steps, freeze_tolerance, freeze_interval,
        send, b1, b2, eps, eps_root, variance_floor, min_compress_size: see
        :func:`scale_by_onebit_adam`.
      weight_decay, mask: decoupled weight decay, as ``optax.adamw``.
      algorithm, server_error_feedback, fusion_bytes, seed: as
        ``compress_gradients``. Under ``optax.inject_hyperparams`` give
        ``server_error_feedback``, ``seed``, ``min_compress_size``,
        ``freeze_tolerance`` and ``freeze_interval`` in ``static_args`` if
        you change them.
    Returns:
      An ``optax.GradientTransformation``.
    """
    parts = [
        scale_by_onebit_adam(
            axis_name,
            codec,
            warmup_steps=warmup_steps,
            freeze_tolerance=freeze_tolerance,
            freeze_interval=freeze_interval,
            send=send,
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
            variance_floor=variance_floor,
            algorithm=algorithm,
            server_error_feedback=server_error_feedback,
            fusion_bytes=fusion_bytes,
            min_compress_size=min_compress_size,
            seed=seed,
        )
    ]
    if not (isinstance(weight_decay, (int, float)) and weight_decay == 0):
        parts.append(optax.add_decayed_weights(weight_decay, mask))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
