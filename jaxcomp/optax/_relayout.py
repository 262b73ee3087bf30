"""``jc.optax.relayout``: an optimizer state saved on P devices, laid out
for Q devices (or a two-level mesh), with nothing that the residuals owe
lost.

A state's per-device parts are one row per device (``state_specs``). The
replicated parts (step, key, telemetry, Adam's moments, PowerSGD's Q, the
DiLoCo anchor) carry over as they are; the per-device parts are re-laid by
the rule of :func:`relayout`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from jaxcomp._axes import names_of
from jaxcomp.collectives import state_positions
from jaxcomp.optax._chain import init
from jaxcomp.optax._diloco import DiLoCoState
from jaxcomp.optax._powersgd import PowerSGDState
from jaxcomp.optax._state import find_states, is_masked
from jaxcomp.optax._transform import CompressState

_WHO = "jc.optax.relayout"


def relayout(
    opt_state,
    tx: optax.GradientTransformation,
    params,
    mesh: jax.sharding.Mesh,
    axis_name,
    *,
    from_axis_sizes: int | tuple[int, int] | None = None,
) -> Any:
    """A jaxcomp optimizer state saved on P devices, laid out for ``mesh``.

    For a checkpoint restored on another number of devices, or onto a
    two-level mesh: the result is the state ``jc.optax.init(tx, params,
    mesh, axis_name)`` would make, holding what ``opt_state`` held. The
    replicated leaves carry over as they are; the error-feedback residuals
    are re-laid so that, for every parameter element, what all of them owe
    the mean is kept, up to one float32 rounding (docs/training.md, "On
    another number of devices").

    Args:
      opt_state: the saved state (of ``tx``, on P devices; host arrays, or
        arrays in any layout, as orbax restores them).
      tx: the optimizer, built for ``mesh``'s axes as it was built when the
        state was saved (the same codecs, algorithm, fusion and the rest).
      params: the parameters (or their shapes), as ``jc.optax.init`` takes them.
      mesh: the mesh to train on now.
      axis_name: its data axis, or the ``(slow, fast)`` pair.
      from_axis_sizes: None for a state saved on one axis of P devices, or
        the ``(slow, fast)`` sizes of the two-level mesh it was saved on.
    Returns:
      The state on ``mesh``, laid out as ``jc.optax.init`` lays it out.
    Raises:
      ValueError: the state does not fit ``tx`` and ``params`` (another
        structure, shapes, or server residuals of another layout).
    """
    if getattr(opt_state, "_fields", None) == ("opt_state", "residuals", "step"):
        raise ValueError(
            f"{_WHO}: this is the state of a sharded step (jc.fsdp.ShardedState); move it with "
            "the step's own relayout: step = jc.data_parallel(loss_fn, tx, mesh, "
            "shard_params=...); params, _ = step.init(params); state = step.relayout(saved, "
            "from_shard_params=...) (docs/fsdp.md, 'Another mesh')"
        )
    fresh = init(tx, params, mesh, axis_name)
    # The states' static plans are the new mesh's (what the old ones were made
    # for may differ: another pair of axes), so the structures compare without.
    opt_state = _without_comm(opt_state)
    if jax.tree.structure(opt_state) != jax.tree.structure(_without_comm(fresh)):
        raise ValueError(
            f"{_WHO}: the state does not have the structure of tx.init(params): was it made "
            "by another optimizer, or for other parameters?\n"
            f"  state: {jax.tree.structure(opt_state)}\n  tx:    {jax.tree.structure(fresh)}"
        )
    q = int(np.prod([mesh.shape[a] for a in names_of(axis_name)]))
    walker = _Walker(q, from_axis_sizes)
    return jax.tree.map(walker.node, opt_state, fresh, is_leaf=_is_node)


def _without_comm(opt_state):
    """``opt_state`` with every compress state's static plan removed."""

    def strip(x):
        return x._replace(comm=None) if isinstance(x, CompressState) else x

    return jax.tree.map(strip, opt_state, is_leaf=lambda x: isinstance(x, CompressState))


def _is_node(x) -> bool:
    return isinstance(x, (CompressState, PowerSGDState, DiLoCoState, optax.MultiStepsState))


def _host(x) -> np.ndarray:
    return np.asarray(x)


def _put(value: np.ndarray, like) -> jax.Array:
    """``value`` with ``like``'s dtype and sharding (its shape, checked)."""
    if tuple(value.shape) != tuple(like.shape):
        raise ValueError(
            f"{_WHO}: a leaf of shape {tuple(value.shape)} does not fit the new state's "
            f"{tuple(like.shape)}: was the state made for other parameters?"
        )
    return jax.device_put(np.asarray(value).astype(like.dtype), like.sharding)


def rows_map(p: int, q: int, *, keep_sum: bool) -> np.ndarray:
    """The float64 ``[q, p]`` matrix taking P device rows to Q (the rule of
    :func:`relayout`): with ``keep_sum``, ``sum_e new_e / q == sum_d old_d /
    p``; else every new row a mean of old ones."""
    w = np.zeros((q, p))
    if q <= p:
        for d in range(p):
            w[d % q, d] = 1.0
    else:
        for e in range(q):
            w[e, e % p] = 1.0
    if keep_sum:
        w *= (q / p) / w.sum(axis=0, keepdims=True)
    else:
        w /= w.sum(axis=1, keepdims=True)
    return w


class _Walker:
    """Maps every node of a saved state onto the fresh one's (whose compress
    states carry their plans)."""

    def __init__(self, q: int, from_axis_sizes):
        self.q = q
        self.from_axis_sizes = from_axis_sizes

    def node(self, old, new):
        if isinstance(new, CompressState):
            return self.compress(old, new)
        if isinstance(new, PowerSGDState):
            return new._replace(
                step=self.same(old.step, new.step),
                qs=self.same(old.qs, new.qs),
                residuals=self.owed(old.residuals, new.residuals),
                rest=jax.tree.map(self.node, old.rest, new.rest, is_leaf=_is_node),
                telemetry=self.telemetry(old.telemetry, new.telemetry),
            )
        if isinstance(new, DiLoCoState):
            return new._replace(
                step=self.same(old.step, new.step),
                anchor=self.same(old.anchor, new.anchor),
                outer=self.same(old.outer, new.outer),
                inner=jax.tree.map(self.averaged, old.inner, new.inner),
                residual=self.owed(old.residual, new.residual),
                key=self.same(old.key, new.key),
                telemetry=self.telemetry(old.telemetry, new.telemetry),
            )
        if isinstance(new, optax.MultiStepsState):
            inner = jax.tree.map(
                self.node, old.inner_opt_state, new.inner_opt_state, is_leaf=_is_node
            )
            rest = self.same(old._replace(inner_opt_state=()), new._replace(inner_opt_state=()))
            if find_states(new.inner_opt_state):  # accumulated per device, concatenated
                rest = rest._replace(
                    acc_grads=self.owed(old.acc_grads, new.acc_grads, stacked=True)
                )
            return rest._replace(inner_opt_state=inner)
        return self.same(old, new)

    def telemetry(self, old, new):
        """The new mesh's figures (bytes depend on the device count), with
        the running count of skipped steps and the residuals' norm carried."""
        return new._replace(
            skipped_steps=self.same(old.skipped_steps, new.skipped_steps),
            residual_norm=self.same(old.residual_norm, new.residual_norm),
        )

    def same(self, old, new):
        """Replicated leaves, as they were."""
        return jax.tree.map(lambda o, n: _put(_host(o), n), old, new)

    def rows(self, x: np.ndarray, stacked: bool) -> tuple[int, np.ndarray]:
        """The old device count and ``x`` as ``[P, ...]`` rows."""
        if stacked:  # MultiSteps: [P * d0, ...]
            p = self.p_of(x.shape[0], stacked=True)
            return p, x.reshape(p, x.shape[0] // p, *x.shape[1:])
        return x.shape[0], x

    def p_of(self, rows: int, stacked: bool = False) -> int:
        if self.from_axis_sizes is not None:
            return int(np.prod(self.from_axis_sizes))
        if stacked:
            raise ValueError(
                f"{_WHO}: an optax.MultiSteps state stores its per-device gradients "
                "concatenated; pass from_axis_sizes (the saved device count)"
            )
        return rows

    def owed(self, old, new, *, stacked: bool = False):
        """Per-device leaves whose sum over the devices / P is what they owe
        (residuals): re-laid keeping it."""
        return jax.tree.map(lambda o, n: self.owed_leaf(o, n, stacked=stacked), old, new)

    def owed_leaf(self, old, new, *, stacked: bool = False, extra=None):
        """One leaf of :meth:`owed`, with ``extra`` (float64, shaped like a
        row) added to every new row."""
        p, x = self.rows(_host(old).astype(np.float64), stacked)
        y = np.tensordot(rows_map(p, self.q, keep_sum=True), x, axes=1)
        if extra is not None:
            y = y + extra[None]
        return _put(y.reshape(new.shape) if stacked else y, new)

    def averaged(self, old, new):
        """A per-replica optimizer state leaf: each new row a mean of old ones."""
        x = _host(old)
        if not np.issubdtype(x.dtype, np.inexact):
            return _put(np.repeat(x[:1], self.q, axis=0), new)
        w = rows_map(x.shape[0], self.q, keep_sum=False)
        return _put(np.tensordot(w, x.astype(np.float64), axes=1), new)

    def compress(self, old: CompressState, new: CompressState) -> CompressState:
        plan, algorithm, axis_name = new.comm.plan, new.comm.algorithm, new.comm.axis_name
        servers: dict = {}
        if old.server_residuals:
            servers = self.server_owed(old.server_residuals, plan, algorithm, axis_name)
        residuals = new.residuals
        if not (isinstance(new.residuals, tuple) and not new.residuals):  # () without feedback
            olds = plan.treedef.flatten_up_to(old.residuals)
            news = plan.treedef.flatten_up_to(new.residuals)
            residuals = plan.treedef.unflatten(
                [
                    n if is_masked(n) else self.owed_leaf(o, n, extra=servers.get(i))
                    for i, (o, n) in enumerate(zip(olds, news, strict=True))
                ]
            )
        return new._replace(
            step=self.same(old.step, new.step),
            key=self.same(old.key, new.key),
            residuals=residuals,
            telemetry=self.telemetry(old.telemetry, new.telemetry),
        )

    def server_owed(self, servers, plan, algorithm: str, axis_name) -> dict:
        """What the old server residuals hold back, per leaf (float64,
        shaped like it): every row's values added at their positions."""
        rows = _host(servers[0]).shape[0] if servers else 0
        sizes = self.from_axis_sizes if self.from_axis_sizes is not None else rows
        two = isinstance(sizes, (tuple, list))
        if two != (len(names_of(axis_name)) == 2):
            algorithm = "auto"  # the algorithm of the old axes (hierarchical for a pair)
        out: dict = {}
        for b, s in zip(plan.buckets, servers, strict=True):
            s = _host(s).astype(np.float64)
            pos = state_positions(b.codec, b.size, b.dtype, sizes, algorithm)
            if not pos.shape[1]:
                continue  # none kept: a placeholder row
            if b.layers:  # one row per layer, side by side; each layer's values after the last's
                shift = b.size * np.arange(b.layers)[:, None]
                pos = np.where(pos[:, None, :] >= 0, pos[:, None, :] + shift, -1)
                pos = pos.reshape(pos.shape[0], -1)
            if s.shape != pos.shape:
                raise ValueError(
                    f"{_WHO}: the server residual of the bucket of {b.codec!r} ({b.size} "
                    f"values) has shape {s.shape}, but on axes of sizes {sizes} with "
                    f"algorithm={algorithm!r} it has {pos.shape}: pass from_axis_sizes (the "
                    "(slow, fast) sizes of a two-level mesh), and build tx as it was built "
                    "when the state was saved"
                )
            fused = np.zeros(b.size * b.count)
            np.add.at(fused, pos[pos >= 0], s[pos >= 0])
            at = 0
            for i, n in zip(b.leaves, b.sizes, strict=True):
                n *= b.count
                part = fused[at : at + n].reshape(plan.shapes[i])
                out[i] = out.get(i, 0.0) + part
                at += n
        return out
