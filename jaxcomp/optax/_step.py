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


def pack_group(group: Bucket, grads: list, residuals: list) -> Packed:
    """One group's :class:`Packed` buffers from its leaves' gradients and
    residuals (None for leaves without one), in the group's order."""

    def joined(parts):
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    grad = joined([g.reshape(-1).astype(group.dtype) for g in grads])
    if any(r is None for r in residuals):
        return Packed(grad, None)
    dtype = _acc_dtype(group)
    return Packed(grad, joined([r.reshape(-1).astype(dtype) for r in residuals]))


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
    return tuple(
        pack_group(g, [leaves[i] for i in g.leaves], [residuals[i] for i in g.leaves])
        for g in plan.groups
    )


def _bucket_mean(b: Bucket, pk: Packed, server, *, axes, key, algorithm, previous):
    """One compressed bucket's mean: ``(value, kept, server)``; its first
    collective waits for ``previous`` (XLA:CPU, see ``after``)."""
    kw = dict(key=key, algorithm=algorithm, state=server)
    if pk.residual is None:
        r = pmean(after(pk.grad, previous), axes, b.codec, **kw)
        return r.value, None, r.state
    return pmean_feedback(pk.grad, pk.residual, axes, b.codec, after=previous, **kw)


def _compressed_mean(buckets, operands, *, axes, key, algorithm, first=0, previous=None):
    """The buckets' means, one bucket's collectives after the other's, on
    every device alike; bucket ``first + j`` draws from ``fold_in(key,
    first + j)``."""
    packs, servers = operands
    values, kept, new_servers = [], [], []
    for j, (b, pk) in enumerate(zip(buckets, packs, strict=True)):
        server = None if servers is None else servers[j]
        k = jax.random.fold_in(key, first + j)
        value, left, state = _bucket_mean(
            b, pk, server, axes=axes, key=k, algorithm=algorithm, previous=previous
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


def reduce_bucket(
    plan: Plan, j: int, pk: Packed, server, *, axes, key, algorithm, warmup, previous
):
    """Bucket ``j``'s mean of ``grad + residual``: ``(value, kept, server)``,
    compressed with the bucket's codec, or exactly in a warm-up step; its
    collectives wait for ``previous`` (every device issues the buckets in one
    order, see ``after``). A stacked bucket (:attr:`Bucket.layers`) is
    reduced one layer after the other, as :func:`reduce_layer` does."""
    b = plan.buckets[j]
    if not b.layers:
        return _reduce_one(b, j, pk, server, axes, key, algorithm, warmup, previous)

    def one_layer(_, xs):
        layer, grad, residual, server = xs
        out = reduce_layer(
            plan, j, Packed(grad, residual), server, layer_key(key, layer), axes, algorithm, warmup
        )
        return None, out

    by_layer = functools.partial(jnp.reshape, shape=(b.layers, -1))
    pk = after(pk, previous)
    xs = (jnp.arange(b.layers), *jax.tree.map(by_layer, (pk.grad, pk.residual, server)))
    _, out = lax.scan(one_layer, None, xs)
    return jax.tree.map(functools.partial(jnp.reshape, shape=(-1,)), out)


def layer_key(key, layer):
    """The key of one layer of a stacked bucket."""
    return jax.random.fold_in(key, layer)


def reduce_layer(plan: Plan, j: int, pk: Packed, server, key, axes, algorithm, warmup):
    """One layer's slice of stacked bucket ``j``: ``(value, kept, server)``
    of ``pk`` (that layer's buffers) and ``server`` (its server residual),
    drawing from ``key`` (:func:`layer_key` of the step's key)."""
    return _reduce_one(plan.buckets[j], j, pk, server, axes, key, algorithm, warmup, None)


def _reduce_one(b: Bucket, j: int, pk: Packed, server, axes, key, algorithm, warmup, previous):
    servers = None if server is None else (server,)
    compressed = functools.partial(
        _compressed_mean, (b,), axes=axes, key=key, algorithm=algorithm, first=j
    )
    if warmup is None:
        out = compressed(((pk,), servers), previous=previous)
    else:  # both branches' collectives after the previous bucket's
        pk = after(pk, previous)
        exact = functools.partial(_exact_mean, (b,), axes=axes)
        out = lax.cond(warmup, exact, compressed, ((pk,), servers))
    (value,), (left,), servers = out
    return value, left, None if servers is None else servers[0]


def reduce_exact(plan: Plan, packs, *, axes, previous):
    """The uncompressed groups' exact means (one ``lax.pmean``) and what
    each kept, after ``previous``."""
    groups = plan.groups[len(plan.buckets) :]
    means, kept, _ = _exact_mean(groups, (after(packs, previous), None), axes=axes)
    return means, kept


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
    means, kept, new_servers, previous = [], [], [], None
    for j in range(nb):
        server = None if servers is None else servers[j]
        value, left, server = reduce_bucket(
            plan,
            j,
            packs[j],
            server,
            axes=axes,
            key=key,
            algorithm=algorithm,
            warmup=warmup,
            previous=previous,
        )
        means.append(value)
        kept.append(left)
        new_servers.append(server)
        previous = (value, left, server)
    previous = (tuple(means), tuple(kept), tuple(new_servers))  # the exact all-reduce comes last
    exact_means, exact_kept = reduce_exact(plan, packs[nb:], axes=axes, previous=previous)
    servers = None if servers is None else tuple(new_servers)
    return tuple(means) + exact_means, tuple(kept) + exact_kept, servers


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
        n *= group.count
        out.append((i, buffer[offset : offset + n].reshape(plan.shapes[i])))
        offset += n
    return out


def unpack_group(plan: Plan, group: Bucket, mean, left, residual_dtype) -> tuple[list, list]:
    """One group's mean gradient leaves and new residual leaves (None
    without error feedback or a residual), in the group's leaf order."""
    means = [leaf.astype(plan.dtypes[i]) for i, leaf in _split(mean, group, plan)]
    if residual_dtype is None or left is None:
        return means, [None] * len(means)
    return means, [leaf for _, leaf in _split(left.astype(residual_dtype), group, plan)]


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
        ms, rs = unpack_group(plan, group, mean, left, residual_dtype)
        for i, m, r in zip(group.leaves, ms, rs, strict=True):
            updates[i], residuals[i] = m, r
    return Unpacked(updates, residuals)
