"""``diloco``: data parallelism that communicates every ``sync_every`` steps.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
Training of Language Models", arXiv 2311.08105, Algorithm 1): every replica
runs an inner optimizer on its own data with no communication; every H
steps the replicas average their pseudo-gradient, the anchor (the
parameters at the last synchronization) minus their local parameters, and
an outer optimizer (SGD with Nesterov momentum, lr 0.7 and momentum 0.9 in
the paper) applies it to the anchor, which every replica then restarts
from. The average goes through ``jc.pmean`` with any jaxcomp codec
(INTELLECT-1, arXiv 2412.01152, sends it as int8; Streaming DiLoCo, arXiv
2501.18512, as 4-bit floats), optionally with error feedback.

The parameters differ between replicas during a round, so they are laid out
per replica (one copy per device along the data axis), not replicated; the
anchor and the outer optimizer's state are the same on every replica.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import collectives
from jaxcomp.codecs import Codec
from jaxcomp.codecs import get as get_codec
from jaxcomp.optax._config import axis_sizes_or_none, bound_axis_sizes, check_static_int
from jaxcomp.optax._state import all_reduce_state, check_type
from jaxcomp.optax._telemetry import (
    Telemetry,
    exact_stats,
    first_telemetry,
    static_telemetry,
    zero_telemetry,
)

_WHO = "jc.optax.diloco"


@all_reduce_state(per_device=("inner", "residual"))
class DiLoCoState(NamedTuple):
    """State of :func:`diloco`.

    Attributes:
      step: int32[]: inner steps taken so far (replicated); a round ends
        after every ``sync_every``-th (a fragment's, on its offset).
      anchor: the parameters at the last synchronization (the initial ones
        before the first), identical on every replica.
      outer: the outer optimizer's states, one per fragment (a tuple of
        one without ``fragments``), identical on every replica.
      inner: the inner optimizer's state, per replica (each leaf with a
        leading axis of one row per device, like the residuals of
        ``compress_gradients``).
      residual: float32 ``[1, n]`` per device: what the codec dropped from
        this replica's pseudo-gradients (n parameters), carried to the next
        synchronization; ``()`` without error feedback.
      key: the PRNG key data of stochastic codecs.
      telemetry: :class:`Telemetry`, amortized over a round: the bytes a
        synchronization sends per device divided by ``sync_every``, their
        bits per parameter, and the ratio to a float32 ``lax.pmean`` of the
        gradients at every step; ``residual_norm`` and ``skipped_steps``
        are 0.
    """

    step: jax.Array
    anchor: Any
    outer: Any
    inner: Any
    residual: jax.Array | tuple
    key: jax.Array
    telemetry: Telemetry


def _check_unit(who: str, name: str, value) -> None:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not ok or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{who}: {name} must be a number in [0, 1], got {value!r}")


def _float_leaves(tree) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _size(tree) -> int:
    """How many floating-point elements ``tree`` holds (static)."""
    return sum(int(np.prod(jnp.shape(x), dtype=np.int64)) for x in _float_leaves(tree))


def _flatten(tree) -> jax.Array:
    """The floating-point leaves of ``tree`` as one float32 vector."""
    leaves = _float_leaves(tree)
    if not leaves:
        return jnp.zeros((0,), jnp.float32)
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _unflatten(flat: jax.Array, like) -> Any:
    """``flat`` back into the floating-point leaves of ``like`` (at their
    dtypes); the other leaves as zeros (an update that leaves them)."""
    leaves, treedef = jax.tree.flatten(like)
    out, at = [], 0
    for x in leaves:
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            size = int(np.prod(jnp.shape(x), dtype=np.int64))
            out.append(flat[at : at + size].reshape(jnp.shape(x)).astype(jnp.result_type(x)))
            at += size
        else:
            out.append(jnp.zeros_like(x))
    return treedef.unflatten(out)


def diloco(
    inner: optax.GradientTransformation,
    axis_name="data",
    *,
    sync_every: int,
    outer: optax.GradientTransformation | None = None,
    codec: Codec | str | None = None,
    error_feedback: bool = False,
    error_decay: float = 1.0,
    fragments: int = 1,
    overlap_steps: int = 0,
    alpha: float = 0.0,
    algorithm: str = "auto",
    seed: int = 0,
) -> optax.GradientTransformation:
    """DiLoCo: ``inner`` on every replica alone, an outer step every
    ``sync_every`` steps on the average of the pseudo-gradients.

    Inside a ``jax.shard_map`` over ``axis_name``, with this replica's own
    gradients and parameters (laid out ``P(axis_name)``, one copy per
    device). At the end of a round the pseudo-gradient ``anchor - local`` is
    averaged (``lax.pmean``, or ``jc.pmean`` with ``codec``), ``outer``
    applies it to the anchor, and every replica moves to the new anchor;
    the other steps run no collective. Douillard et al. 2023, Algorithm 1;
    docs/diloco.md has the layout, SparseLoCo and Streaming DiLoCo.

    Args:
      inner: the local optimizer (the paper: AdamW).
      axis_name: the mesh axis the replicas span.
      sync_every: H, the inner steps of a round (a Python int >= 1).
      outer: the outer optimizer; None: the paper's Nesterov SGD (0.7, momentum 0.9).
      codec: a codec (or spec string) for the average; None: float32.
      error_feedback: with a codec, carry what it dropped to the next round.
      error_decay: beta of ``e <- beta e + delta`` with error feedback.
      fragments: Streaming DiLoCo's fragments, each synchronized once a
        round on its own offset (a Python int that divides ``sync_every``).
      overlap_steps: tau, steps from a fragment's synchronization to its
        merge (a Python int in ``[0, sync_every)``).
      alpha: the merge's mixing factor in [0, 1]: ``alpha local + (1 - alpha) anchor``.
      algorithm: ``jc.pmean``'s algorithm for the codec.
      seed: seeds the PRNG key of stochastic codecs.
    Returns:
      An ``optax.GradientTransformation`` whose ``update`` needs ``params``
      (this replica's); its state is a :class:`DiLoCoState`.
    """
    config = _Config(
        inner=inner,
        outer=optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None else outer,
        axis_name=axis_name,
        sync_every=sync_every,
        codec=codec,
        error_feedback=error_feedback,
        error_decay=error_decay,
        fragments=fragments,
        overlap_steps=overlap_steps,
        alpha=alpha,
        algorithm=algorithm,
        seed=seed,
    )
    return optax.GradientTransformation(
        functools.partial(_init, config), functools.partial(_update, config)
    )


@dataclasses.dataclass(frozen=True)
class _Config:
    """:func:`diloco`'s arguments, checked."""

    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    axis_name: Any
    sync_every: int
    codec: Codec | str | None  # a spec string becomes its codec
    error_feedback: bool
    error_decay: float
    fragments: int
    overlap_steps: int
    alpha: float
    algorithm: str
    seed: int

    def __post_init__(self):
        """Checks the arguments; normalizes the codec and the numbers."""
        sync_every = check_static_int(_WHO, "sync_every", self.sync_every, 1)
        codec = get_codec(self.codec) if isinstance(self.codec, str) else self.codec
        if codec is not None and not isinstance(codec, Codec):
            raise TypeError(
                f"{_WHO}: codec must be a jaxcomp codec, a spec string or None, got {codec!r}"
            )
        if self.error_feedback and codec is None:
            raise ValueError(
                f"{_WHO}: error_feedback=True needs a codec (None sends the exact mean)"
            )
        _check_unit(_WHO, "error_decay", self.error_decay)
        if float(self.error_decay) != 1.0 and not self.error_feedback:
            raise ValueError(
                f"{_WHO}: error_decay needs error_feedback=True (it decays the residual)"
            )
        if isinstance(self.axis_name, (tuple, list)):
            raise ValueError(f"{_WHO}: axis_name must be one mesh axis, got {self.axis_name!r}")
        fragments = check_static_int(_WHO, "fragments", self.fragments, 1)
        if sync_every % fragments:
            raise ValueError(
                f"{_WHO}: fragments={fragments} must divide sync_every={sync_every} (each "
                f"fragment synchronizes on its own offset, sync_every / fragments apart)"
            )
        overlap = check_static_int(_WHO, "overlap_steps", self.overlap_steps, 0)
        if overlap >= sync_every:
            raise ValueError(
                f"{_WHO}: overlap_steps={overlap} must be below sync_every={sync_every} "
                f"(a fragment's merge comes before its next synchronization)"
            )
        _check_unit(_WHO, "alpha", self.alpha)
        normal = dict(
            sync_every=sync_every,
            codec=codec,
            error_feedback=bool(self.error_feedback),
            error_decay=float(self.error_decay),
            fragments=fragments,
            overlap_steps=overlap,
            alpha=float(self.alpha),
        )
        for name, value in normal.items():
            object.__setattr__(self, name, value)

    @property
    def span(self) -> int:
        """Steps between two synchronizations (of successive fragments)."""
        return self.sync_every // self.fragments

    def fragment(self, tree, f: int):
        """Fragment ``f`` of ``tree``: its leaves ``f, f + fragments, ...``,
        None in place of the others (a pytree that optax takes as is)."""
        leaves, treedef = jax.tree.flatten(tree)
        picked = [x if i % self.fragments == f else None for i, x in enumerate(leaves)]
        return treedef.unflatten(picked)

    def merge(self, tree, part, f: int):
        """``tree`` with the leaves of fragment ``f`` taken from ``part``."""
        leaves, treedef = jax.tree.flatten(tree)
        new = jax.tree.leaves(part)
        out = [new.pop(0) if i % self.fragments == f else x for i, x in enumerate(leaves)]
        return treedef.unflatten(out)

    def sizes(self, params) -> list[int]:
        """Floating-point elements per fragment (static)."""
        return [_size(self.fragment(params, f)) for f in range(self.fragments)]


def _init(config: _Config, params) -> DiLoCoState:
    sizes = config.sizes(params)
    if 0 in sizes:
        raise ValueError(
            f"{_WHO}: fragments={config.fragments} leaves fragment {sizes.index(0)} without "
            f"a floating-point parameter ({len(jax.tree.leaves(params))} leaves)"
        )
    # Nothing to keep without error feedback: no leaf (orbax cannot save an
    # empty array), rather than an empty one.
    residual = jnp.zeros((1, sum(sizes)), jnp.float32) if config.error_feedback else ()
    return DiLoCoState(
        step=jnp.zeros((), jnp.int32),
        anchor=jax.tree.map(jnp.asarray, params),
        outer=tuple(config.outer.init(config.fragment(params, f)) for f in range(config.fragments)),
        inner=jax.tree.map(lambda x: jnp.asarray(x)[None], config.inner.init(params)),
        residual=residual,
        key=jax.random.key_data(jax.random.key(config.seed)),
        telemetry=first_telemetry(
            axis_sizes_or_none(config.axis_name),
            lambda s: _telemetry(config, sizes, s[0], zero_telemetry()),
        ),
    )


def _due(config: _Config, step: jax.Array, delay: int) -> jax.Array:
    """1 + the fragment whose synchronization came ``delay`` steps before
    ``step``, or 0 if none did (a ``lax.switch`` index)."""
    t = step - delay
    phase = t % config.sync_every
    f = (phase // config.span - 1) % config.fragments
    return jnp.where((t >= config.span) & (phase % config.span == 0), f + 1, 0)


def _update(config: _Config, grads, state: DiLoCoState, params=None):
    check_type(state, DiLoCoState, _WHO)
    if params is None:
        raise ValueError(f"{_WHO}: update needs params (this replica's parameters)")
    (p,) = bound_axis_sizes(config.axis_name, _WHO)
    sizes = config.sizes(params)
    offsets = np.cumsum([0, *sizes])
    inner_state = jax.tree.map(lambda x: x[0], state.inner)
    u, inner_state = config.inner.update(grads, inner_state, params)
    step = state.step + 1
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), step)

    def carry_on(*args):
        return args

    # Branch 0 is the step within a round (no collective); branch 1 + f
    # synchronizes fragment f.
    sync = functools.partial(_synchronize, config, offsets, key)
    branches = [carry_on] + [functools.partial(sync, f) for f in range(config.fragments)]
    local, anchor, outer_state, residual = lax.switch(
        _due(config, step, 0),
        branches,
        optax.apply_updates(params, u),
        state.anchor,
        state.outer,
        state.residual,
    )
    if config.overlap_steps:
        local = lax.switch(
            _due(config, step, config.overlap_steps),
            [lambda local, anchor: local]
            + [functools.partial(_mix, config, f) for f in range(config.fragments)],
            local,
            anchor,
        )
    updates = jax.tree.map(lambda new, old: new - old, local, params)
    return updates, DiLoCoState(
        step=step,
        anchor=anchor,
        outer=outer_state,
        inner=jax.tree.map(lambda x: x[None], inner_state),
        residual=residual,
        key=state.key,
        telemetry=_telemetry(config, sizes, p, state.telemetry),
    )


def _mix(config: _Config, f: int, local, anchor):
    """The merge of fragment ``f``'s anchor into the local values."""
    if config.alpha == 0.0:
        return config.merge(local, config.fragment(anchor, f), f)
    mixed = jax.tree.map(
        lambda x, a: config.alpha * x + (1.0 - config.alpha) * a,
        config.fragment(local, f),
        config.fragment(anchor, f),
    )
    return config.merge(local, mixed, f)


def _synchronize(config: _Config, offsets, key, f: int, local, anchor, outer_state, residual):
    """Fragment ``f``'s outer step (and, without overlap, its merge)."""
    a, frag = config.fragment(anchor, f), config.fragment(local, f)
    lo, hi = int(offsets[f]), int(offsets[f + 1])
    part = residual[:, lo:hi] if config.error_feedback else residual
    mean, r = _average(config, _flatten(a) - _flatten(frag), part, key)
    outer_updates, o = config.outer.update(_unflatten(mean, a), outer_state[f], a)
    anchor = config.merge(anchor, optax.apply_updates(a, outer_updates), f)
    outer_state = (*outer_state[:f], o, *outer_state[f + 1 :])
    residual = residual.at[:, lo:hi].set(r) if config.error_feedback else residual
    if config.overlap_steps == 0:
        local = _mix(config, f, local, anchor)
    return local, anchor, outer_state, residual


def _average(config: _Config, delta: jax.Array, residual: jax.Array, key):
    """The mean pseudo-gradient over the replicas, and the new residual."""
    if config.codec is None:
        return lax.pmean(delta, config.axis_name), residual
    kw = dict(key=key, algorithm=config.algorithm)
    if not config.error_feedback:
        return collectives.pmean(delta, config.axis_name, config.codec, **kw).value, residual
    # With the default decay of 1 the multiply is skipped: the residual as kept.
    kept = residual[0] if config.error_decay == 1.0 else config.error_decay * residual[0]
    value, left, _ = collectives.pmean_feedback(delta, kept, config.axis_name, config.codec, **kw)
    return value, left[None]


def _telemetry(config: _Config, sizes: list[int], p: int, previous: Telemetry) -> Telemetry:
    """A round's traffic (every fragment once), amortized over its steps
    (static)."""
    n = sum(sizes)
    if config.codec is None:
        bits, wire, _ = exact_stats(4 * n, n, p)
    else:
        wire = sum(
            collectives.send_nbytes(config.codec, m, jnp.float32, (p,), config.algorithm)
            for m in sizes
        )
        wire_bits = sum(8.0 * config.codec.wire_nbytes((m,), jnp.float32) for m in sizes)
        bits = wire_bits / max(n, 1)
    wire, bits = wire / config.sync_every, bits / config.sync_every
    every_step = collectives.uncompressed_send_nbytes(4 * n, p)
    ratio = every_step / wire if wire else 32.0 / bits if bits else 1.0
    return static_telemetry(bits, wire, ratio, previous)
