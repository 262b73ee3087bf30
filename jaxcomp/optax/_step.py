"""One step of ``compress_gradients`` in named pieces.

``pack`` fuses the leaves and their residuals into one buffer per group of
the plan (``acc = grad + residual``), ``reduce`` averages the buffers over
the devices (compressed, or exactly during warm-up), and ``unpack`` splits
the means back into gradient leaves and what each device did not get across
(``acc - sent``) into residual leaves. The buffers exist only within a step:
the state holds one residual per leaf, so fusion does not shape it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.collectives import after, pmean
from jaxcomp.optax._plan import Bucket, Plan


def _acc_dtype(group: Bucket):
    """Residuals are added in float32 (or wider); a group without residuals
    (complex leaves) keeps its dtype."""
    if not group.carries_residual:
        return group.dtype
    return jnp.promote_types(group.dtype, jnp.float32)


def pack(plan: Plan, leaves: list, residuals: list) -> tuple[jax.Array, ...]:
    """The fused buffer ``acc = grad + residual`` of every group of the plan.

    Args:
      plan: the step's :class:`Plan`.
      leaves: the gradient leaves, in flatten order.
      residuals: this device's residual of every leaf, shaped like it (None
        for a leaf without one, and for every leaf without error feedback).
    Returns:
      One flat buffer per ``plan.groups`` entry: float32 for floating-point
      leaves (float64 ones stay float64), the leaves' dtype for complex ones.
    """

    def fused(group):
        dtype = _acc_dtype(group)
        parts = []
        for i in group.leaves:
            part = leaves[i].reshape(-1).astype(dtype)
            r = residuals[i]
            parts.append(part if r is None else part + r.reshape(-1).astype(dtype))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    return tuple(fused(g) for g in plan.groups)


def _compressed_mean(buckets, operands, *, axes, key, algorithm):
    accs, servers = operands
    values, sent, new_servers = [], [], []
    previous = None
    for j, (b, acc) in enumerate(zip(buckets, accs, strict=True)):
        # One bucket's collectives after the other's, on every device alike
        # (XLA:CPU, see ``after``).
        acc = after(acc, previous)
        r = pmean(
            acc.astype(b.dtype),
            axes,
            b.codec,
            key=jax.random.fold_in(key, j),
            algorithm=algorithm,
            state=None if servers is None else servers[j],
        )
        values.append(r.value)
        sent.append(r.sent)
        new_servers.append(r.state)
        previous = (r.value, r.sent, r.state)
    return tuple(values), tuple(sent), None if servers is None else tuple(new_servers)


def _exact_mean(groups, operands, *, axes):
    """The exact mean; server residuals (if any) pass through unchanged."""
    accs, servers = operands
    sent = tuple(acc.astype(g.dtype) for g, acc in zip(groups, accs, strict=True))
    if not sent:
        return (), (), servers
    values = lax.pmean(sent, axes)  # one all-reduce for all the groups
    sent = tuple(s.astype(a.dtype) for s, a in zip(sent, accs, strict=True))
    return tuple(values), sent, servers


def reduce(plan: Plan, accs, axes, *, key, algorithm: str, warmup, servers=None):
    """The mean over the devices of every group's buffer.

    The compressed buckets go through ``jc.pmean`` with their codec (one
    key per bucket, folded from ``key``), or, in a warm-up step, through one
    exact ``lax.pmean``; the uncompressed groups through one exact
    ``lax.pmean``, in their dtype.

    Args:
      plan: the step's :class:`Plan`.
      accs: the buffers of :func:`pack`.
      axes: the mesh axis (or the pair of hierarchical axes).
      key: the step's PRNG key.
      algorithm: ``jc.pmean``'s algorithm.
      warmup: bool[], whether this step sends the buckets exactly; None when
        it never does (no ``lax.cond`` is traced then).
      servers: this device's server residual of every compressed bucket
        (``jc.pmean``'s ``state``), or None (one-level error feedback).
    Returns:
      ``(means, sent, servers)``: per group, the mean, in the group's
      dtype and identical on every device, and what this device's buffer
      became on the wire, in the buffer's dtype; the new server residuals
      (None without).
    """
    nb = len(plan.buckets)
    compressed = functools.partial(
        _compressed_mean, plan.buckets, axes=axes, key=key, algorithm=algorithm
    )
    if warmup is None or not nb:
        means, sent, servers = compressed((accs[:nb], servers))
    else:
        exact = functools.partial(_exact_mean, plan.buckets, axes=axes)
        means, sent, servers = lax.cond(warmup, exact, compressed, (accs[:nb], servers))
    rest = after(accs[nb:], (means, sent, servers))  # the exact all-reduce comes last
    exact_means, exact_sent, _ = _exact_mean(plan.groups[nb:], (rest, None), axes=axes)
    return means + exact_means, sent + exact_sent, servers


def _finite(a: jax.Array) -> jax.Array:
    """bool[]: whether every element of ``a`` is finite.

    For real floats as ``max|a|`` being finite (XLA's max propagates NaN):
    a reduction XLA fuses with whatever computes ``a``, reading it once and
    writing nothing, where ``all(isfinite(a))`` first materializes a mask of
    ``a``'s size."""
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.all(jnp.isfinite(a))
    return jnp.isfinite(jnp.max(jnp.abs(a), initial=0))


def all_finite(arrays) -> jax.Array:
    """bool[]: whether every element of every array is finite."""
    flags = [_finite(a) for a in arrays if a is not None]
    return functools.reduce(jnp.logical_and, flags, jnp.bool_(True))


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
        in ``residual_dtype`` (None where a leaf has none).
      residuals_finite: bool[], whether every new residual is finite,
        provided the means are (see :func:`unpack`).
    """

    updates: list
    residuals: list
    residuals_finite: jax.Array


def _split(buffer, group: Bucket, plan: Plan) -> list[tuple[int, jax.Array]]:
    out, offset = [], 0
    for i, n in zip(group.leaves, group.sizes, strict=True):
        out.append((i, buffer[offset : offset + n].reshape(plan.shapes[i])))
        offset += n
    return out


def unpack(plan: Plan, leaves: list, accs, means, sent, residual_dtype) -> Unpacked:
    """Splits the means into gradient leaves and ``acc - sent`` into
    residual leaves.

    Args:
      plan: the step's :class:`Plan`.
      leaves: the gradient leaves (float0 ones are passed through).
      accs, means, sent: the buffers of :func:`pack` and :func:`reduce`.
      residual_dtype: the residuals' dtype; None without error feedback.
    Returns:
      The :class:`Unpacked` leaves. ``residuals_finite`` checks ``acc``
      (and the residuals themselves only in a narrower ``residual_dtype``):
      with finite means, that is every residual being finite, since a
      non-finite value in what this device sent reaches the sum.
    """
    updates, residuals = list(leaves), [None] * len(leaves)
    finite = []
    for group, acc, mean, s in zip(plan.groups, accs, means, sent, strict=True):
        for i, leaf in _split(mean, group, plan):
            updates[i] = leaf.astype(plan.dtypes[i])
        if residual_dtype is None or not group.carries_residual:
            continue
        error = (acc - s).astype(residual_dtype)
        # A residual is finite where acc is and the mean is (a non-finite
        # decoded value of this device's payload reaches the sum, and so the
        # mean, which the caller checks): checking acc, already in memory,
        # lets XLA fuse the residual into the leaves it is written to. A
        # narrower residual dtype can overflow on its own: check it then.
        narrower = jnp.dtype(residual_dtype).itemsize < jnp.dtype(acc.dtype).itemsize
        finite.append(error if narrower else acc)
        for i, leaf in _split(error, group, plan):
            residuals[i] = leaf
    return Unpacked(updates, residuals, all_finite(finite))
