"""One step of ``compress_gradients`` in named pieces.

``pack`` joins the leaves of every group of the plan into one gradient
buffer and their residuals into one float32 buffer, ``reduce`` averages
``acc = grad + residual`` over the devices (compressed, or exactly during
warm-up) and returns, besides the means, what each device's ``acc`` did
not get across (``acc - sent``, its new residual), and ``unpack`` splits
both back into leaves. The compressed buckets form ``acc`` inside their
first compression (``jc.collectives``' ``pmean_feedback``): where the codec has
a one-pass kernel, on the CPU, neither ``acc`` nor ``sent`` is written out.
The buffers exist only within a step: the state holds one residual per
leaf, so fusion does not shape it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import after, feedback, pmean, pmean_feedback
from jaxcomp.optax._plan import Bucket, Plan


def _acc_dtype(group: Bucket):
    """Residuals are added in float32 (or wider); a group without residuals
    (complex leaves) keeps its dtype."""
    if not group.carries_residual:
        return group.dtype
    return jnp.promote_types(group.dtype, jnp.float32)


class Packed(NamedTuple):
    """One group's buffers: ``grad`` in the group's dtype, ``residual`` in
    its accumulation dtype (float32, or float64 for float64 leaves), None
    where the group has no residuals (complex leaves, or no error
    feedback)."""

    grad: jax.Array
    residual: jax.Array | None

    def acc(self) -> jax.Array:
        """``grad + residual`` in the accumulation dtype (``grad`` without
        a residual)."""
        if self.residual is None:
            return self.grad
        return feedback.accumulate(self.grad, self.residual)


def pack(plan: Plan, leaves: list, residuals: list) -> tuple[Packed, ...]:
    """The gradient and residual buffers of every group of the plan.

    Args:
      plan: the step's :class:`Plan`.
      leaves: the gradient leaves, in flatten order.
      residuals: this device's residual of every leaf, shaped like it (None
        for a leaf without one, and for every leaf without error feedback).
    Returns:
      One :class:`Packed` per ``plan.groups`` entry, flat.
    """

    def joined(parts):
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    def packed(group):
        grad = joined([leaves[i].reshape(-1).astype(group.dtype) for i in group.leaves])
        rs = [residuals[i] for i in group.leaves]
        if any(r is None for r in rs):
            return Packed(grad, None)
        dtype = _acc_dtype(group)
        return Packed(grad, joined([r.reshape(-1).astype(dtype) for r in rs]))

    return tuple(packed(g) for g in plan.groups)


def _compressed_mean(buckets, operands, *, axes, key, algorithm):
    packs, servers = operands
    values, kept, new_servers = [], [], []
    previous = None
    for j, (b, pk) in enumerate(zip(buckets, packs, strict=True)):
        # One bucket's collectives after the other's, on every device alike
        # (XLA:CPU, see ``after``).
        kw = dict(
            key=jax.random.fold_in(key, j),
            algorithm=algorithm,
            state=None if servers is None else servers[j],
        )
        if pk.residual is None:
            r = pmean(after(pk.grad, previous), axes, b.codec, **kw)
            value, left, state = r.value, None, r.state
        else:
            value, left, state = pmean_feedback(
                pk.grad, pk.residual, axes, b.codec, after=previous, **kw
            )
        values.append(value)
        kept.append(left)
        new_servers.append(state)
        previous = (value, left, state)
    return tuple(values), tuple(kept), None if servers is None else tuple(new_servers)


def _exact_mean(groups, operands, *, axes):
    """The exact mean; server residuals (if any) pass through unchanged."""
    packs, servers = operands
    accs = [pk.acc() for pk in packs]
    sent = tuple(acc.astype(g.dtype) for g, acc in zip(groups, accs, strict=True))
    if not sent:
        return (), (), servers
    values = lax.pmean(sent, axes)  # one all-reduce for all the groups
    kept = tuple(
        None if pk.residual is None else feedback.kept(acc, s)
        for pk, acc, s in zip(packs, accs, sent, strict=True)
    )
    return tuple(values), kept, servers


def reduce(plan: Plan, packs, axes, *, key, algorithm: str, warmup, servers=None):
    """The mean over the devices of every group's ``grad + residual``.

    The compressed buckets go through ``jc.pmean`` with their codec (one
    key per bucket, folded from ``key``), or, in a warm-up step, through one
    exact ``lax.pmean``; the uncompressed groups through one exact
    ``lax.pmean``, in their dtype.

    Args:
      plan: the step's :class:`Plan`.
      packs: the buffers of :func:`pack`.
      axes: the mesh axis (or the pair of hierarchical axes).
      key: the step's PRNG key.
      algorithm: ``jc.pmean``'s algorithm.
      warmup: bool[], whether this step sends the buckets exactly; None when
        it never does (no ``lax.cond`` is traced then).
      servers: this device's server residual of every compressed bucket
        (``jc.pmean``'s ``state``), or None (one-level error feedback).
    Returns:
      ``(means, kept, servers)``: per group, the mean, in the group's dtype
      and identical on every device, and what this device's ``acc`` kept
      (``acc - sent``, its new residual; None without a residual); the new
      server residuals (None without).
    """
    nb = len(plan.buckets)
    compressed = functools.partial(
        _compressed_mean, plan.buckets, axes=axes, key=key, algorithm=algorithm
    )
    if warmup is None or not nb:
        means, kept, servers = compressed((packs[:nb], servers))
    else:
        exact = functools.partial(_exact_mean, plan.buckets, axes=axes)
        means, kept, servers = lax.cond(warmup, exact, compressed, (packs[:nb], servers))
    rest = after(packs[nb:], (means, kept, servers))  # the exact all-reduce comes last
    exact_means, exact_kept, _ = _exact_mean(plan.groups[nb:], (rest, None), axes=axes)
    return means + exact_means, kept + exact_kept, servers


def zero_unless(ok, u):
    """``u`` where ``ok``, else zeros (float0 gradients pass through)."""
    if u.dtype == jax.dtypes.float0:
        return u
    return jnp.where(ok, u, jnp.zeros((), u.dtype))


def nonfinite_updates(on_nonfinite: str, ok, updates: list) -> list:
    """The updates a step returns: as they are, or, with ``on_nonfinite``
    ``"skip"``, zeros unless ``ok`` (the mean was finite)."""
    if on_nonfinite == "skip":
        return [zero_unless(ok, u) for u in updates]
    return updates


class Unpacked(NamedTuple):
    """What :func:`unpack` returns.

    Attributes:
      updates: the mean gradient leaves, in flatten order (float0 leaves as
        they came).
      residuals: this device's new residual of every leaf, shaped like it,
        in ``residual_dtype`` (None where a leaf has none), as computed:
        the caller keeps the old value where one is not finite.
    """

    updates: list
    residuals: list


def _split(buffer, group: Bucket, plan: Plan) -> list[tuple[int, jax.Array]]:
    out, offset = [], 0
    for i, n in zip(group.leaves, group.sizes, strict=True):
        out.append((i, buffer[offset : offset + n].reshape(plan.shapes[i])))
        offset += n
    return out


def unpack(plan: Plan, leaves: list, means, kept, residual_dtype) -> Unpacked:
    """Splits the means into gradient leaves and what each buffer kept into
    residual leaves.

    Args:
      plan: the step's :class:`Plan`.
      leaves: the gradient leaves (float0 ones are passed through).
      means, kept: the buffers of :func:`reduce`.
      residual_dtype: the residuals' dtype; None without error feedback.
    Returns:
      The :class:`Unpacked` leaves.
    """
    updates, residuals = list(leaves), [None] * len(leaves)
    for group, mean, left in zip(plan.groups, means, kept, strict=True):
        for i, leaf in _split(mean, group, plan):
            updates[i] = leaf.astype(plan.dtypes[i])
        if residual_dtype is None or left is None:
            continue
        for i, leaf in _split(left.astype(residual_dtype), group, plan):
            residuals[i] = leaf
    return Unpacked(updates, residuals)
