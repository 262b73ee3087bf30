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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from jaxcomp.optax._plan import Policy
from jaxcomp.optax._transform import CompressState, compress_gradients

_WHO = "jc.optax.onebit_adam"


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
    """

    mu: Any
    nu: Any
    compress: CompressState


def scale_by_onebit_adam(
    axis_name: str | tuple[str, str],
    codec: Policy = "onebit",
    *,
    warmup_steps: int | jax.Array,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    algorithm: str = "auto",
    server_error_feedback: bool = True,
    fusion_bytes: int | None = None,
    min_compress_size: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformation:
    """Adam's scaling with 1-bit Adam's compressed momentum (no learning rate).

    Steps ``0 .. warmup_steps - 1`` are ``optax.scale_by_adam`` on the exact
    mean of the gradients (one uncompressed all-reduce). From step
    ``warmup_steps`` on, the variance ``nu`` (and its bias correction) stays
    as the warm-up left it, and each device's momentum
    ``(1 - b1) * grad + b1 * mu``, with ``mu`` the previous step's common
    momentum, is averaged by ``jc.pmean`` with ``codec``: worker and server
    error feedback (``compress_gradients``) carry what compression drops to
    the next step. The update is ``mu_hat / (sqrt(nu_hat + eps_root) + eps)``
    with Adam's bias corrections.

    A step whose mean is not finite leaves the state as it was (as
    ``compress_gradients`` does) and returns the non-finite update.

    Args:
      axis_name: the data-parallel mesh / pmap axis (or ``(slow, fast)``).
      codec: the momentum's codec (default OneBit, as the paper), a policy
        as ``compress_gradients`` takes.
      warmup_steps: steps of plain Adam before the variance is frozen (the
        paper uses 15-25% of training for BERT; at least 1). May be a traced
        int (``optax.inject_hyperparams``).
      b1, b2, eps, eps_root: as ``optax.scale_by_adam``.
      algorithm, server_error_feedback, fusion_bytes, min_compress_size,
        seed: as ``compress_gradients`` (error feedback is always on).
    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`OneBitAdamState`; place it first in the chain, in place of
      the gradient all-reduce.
    """
    if isinstance(warmup_steps, (int, np.integer)) and not isinstance(warmup_steps, bool):
        if warmup_steps < 1:
            raise ValueError(
                f"{_WHO}: warmup_steps must be at least 1 (the variance is frozen at the end "
                f"of the warm-up, and Adam's variance starts at 0), got {warmup_steps}"
            )
    inner = compress_gradients(
        codec,
        axis_name,
        error_feedback=True,
        server_error_feedback=server_error_feedback,
        algorithm=algorithm,
        fusion_bytes=fusion_bytes,
        min_compress_size=min_compress_size,
        warmup_steps=warmup_steps,
        seed=seed,
    )

    def init_fn(params) -> OneBitAdamState:
        return OneBitAdamState(
            mu=otu.tree_zeros_like(params),
            nu=otu.tree_zeros_like(params),
            compress=inner.init(params),
        )

    def update_fn(grads, state: OneBitAdamState, params=None):
        del params
        if not isinstance(state, OneBitAdamState):
            raise TypeError(f"{_WHO}: update got a {type(state).__name__}, not a OneBitAdamState")
        count = state.compress.step
        in_warmup = count < warmup_steps
        # What each device sends: its gradient during the warm-up, its
        # momentum after it.
        local = jax.tree.map(
            lambda g, m: jnp.where(in_warmup, g, ((1 - b1) * g + b1 * m).astype(g.dtype)),
            grads,
            state.mu,
        )
        mean, compress = inner.update(local, state.compress)
        ok = compress.step > count  # the mean was finite: the inner state moved on
        adam_mu = otu.tree_update_moment(mean, state.mu, b1, 1)
        adam_nu = otu.tree_update_moment_per_elem_norm(mean, state.nu, b2, 2)

        def pick(warm, frozen, old):
            return jnp.where(ok, jnp.where(in_warmup, warm, frozen), old)

        mu = jax.tree.map(lambda w, m, o: pick(w, m.astype(o.dtype), o), adam_mu, mean, state.mu)
        nu = jax.tree.map(lambda w, o: pick(w, o, o), adam_nu, state.nu)
        t = count + 1
        mu_hat = otu.tree_bias_correction(mu, b1, t)
        nu_hat = otu.tree_bias_correction(nu, b2, jnp.minimum(t, warmup_steps))
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
        # A non-finite mean reaches the update, so the training code sees it.
        updates = jax.tree.map(lambda u, a: jnp.where(ok, u, a.astype(u.dtype)), updates, mean)
        return updates, OneBitAdamState(mu=mu, nu=nu, compress=compress)

    return optax.GradientTransformation(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: str | tuple[str, str],
    codec: Policy = "onebit",
    *,
    warmup_steps: int | jax.Array,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
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
      axis_name, codec, warmup_steps, b1, b2, eps, eps_root: see
        :func:`scale_by_onebit_adam`.
      weight_decay, mask: decoupled weight decay, as ``optax.adamw``.
      algorithm, server_error_feedback, fusion_bytes, min_compress_size,
        seed: as ``compress_gradients``. Under ``optax.inject_hyperparams``
        give ``server_error_feedback`` and ``seed`` in ``static_args`` if
        you change them.
    Returns:
      An ``optax.GradientTransformation``.
    """
    parts = [
        scale_by_onebit_adam(
            axis_name,
            codec,
            warmup_steps=warmup_steps,
            b1=b1,
            b2=b2,
            eps=eps,
            eps_root=eps_root,
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
