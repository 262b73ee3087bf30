"""``compress_gradients``' all-reduce run from inside the backward pass.

PyTorch DDP launches a bucket's all-reduce from an autograd hook as soon as
the bucket's gradients exist (Li et al., VLDB 2020), so that communication
overlaps the rest of the backward pass. Here the hook is an identity
``jax.custom_vjp`` on the bucket's parameters: its backward rule gets the
bucket's gradient when the backward pass has passed the bucket's earliest
use, and returns the mean over the devices in its place. The bucket's
residuals (and server residual) are inputs of the identity too, and their
cotangents are the new residuals, so the state flows through ``jax.grad``
with no side channel. Each bucket runs the same :func:`reduce_bucket` as the
post-backward step, with the same key, so the two give the same bits.

The buckets are issued in the order their gradients complete (the reverse
of their earliest use in the loss), the uncompressed groups last, and a
token ties each bucket's collectives to the previous bucket's results: its
forward value flows from the last-issued hook to the first, so that its
cotangent flows the other way. Every device then enters the collectives in
one order (see ``jaxcomp.collectives.after``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxcomp.collectives import after
from jaxcomp.optax._plan import Plan
from jaxcomp.optax._step import pack_group, reduce_bucket, reduce_exact, unpack_group


def issue_order(plan: Plan, first_use: list) -> list[int]:
    """The compressed buckets in the order the backward pass completes
    their gradients: latest earliest use first (``first_use``: per leaf,
    the position of its first use in the loss; ties in reverse plan order)."""
    ready = [min(first_use[i] for i in b.leaves) for b in plan.buckets]
    return sorted(range(len(plan.buckets)), key=lambda j: (-ready[j], -j))


def _identity_hook(reduce_fn: Callable) -> Callable:
    """``hook(grads, residuals, server, token, key_data, warm) -> (grads,
    token)``, whose backward rule is ``reduce_fn(cotangents, residuals,
    server, previous, key_data, warm) -> (means, residuals, server, done)``."""

    @jax.custom_vjp
    def hook(leaves, residuals, server, token, key_data, warm):
        return leaves, token

    def fwd(leaves, residuals, server, token, key_data, warm):
        return (leaves, token), (residuals, server, key_data, warm)

    def bwd(saved, cotangents):
        residuals, server, key_data, warm = saved
        grads, previous = cotangents
        means, kept, server, done = reduce_fn(grads, residuals, server, previous, key_data, warm)
        return means, kept, server, done, None, None

    hook.defvjp(fwd, bwd)
    return hook


def _done(outputs) -> jax.Array:
    """The token the next bucket waits for: zero, computed from ``outputs``."""
    return after(jnp.zeros((), jnp.float32), outputs)


def in_backward(plan: Plan, inputs, config, sizes, first_use: list):
    """``(wrap, extra)``: ``wrap(params, extra)`` is ``params``, with the
    mean over the devices as its gradient; the gradient with respect to
    ``extra`` (this device's residuals and server residuals, from
    ``inputs``, a ``StepInputs``) is their new value, as the post-backward
    step computes them."""
    axes = config.axes(sizes)
    warm = None if config.never_warm else inputs.in_warmup
    key_data = jax.random.key_data(inputs.step_key)
    nb = len(plan.buckets)
    order = issue_order(plan, first_use)
    exact_groups = plan.groups[nb:]

    def bucket_hook(j: int, first: bool):
        group = plan.buckets[j]

        def reduce_fn(grads, residuals, server, previous, key_data, warm):
            pk = pack_group(group, grads, residuals)
            key = jax.random.wrap_key_data(key_data)
            value, left, server = reduce_bucket(
                plan,
                j,
                pk,
                server,
                axes=axes,
                key=key,
                algorithm=config.algorithm,
                warmup=warm,
                previous=None if first else previous,
            )
            means, kept = unpack_group(plan, group, value, left, config.feedback_dtype)
            return means, kept, server, _done((value, left, server))

        return _identity_hook(reduce_fn)

    def exact_reduce(grads, residuals, server, previous, key_data, warm):
        packs, offset = [], 0
        for g in exact_groups:
            n = len(g.leaves)
            packs.append(pack_group(g, grads[offset : offset + n], residuals[offset : offset + n]))
            offset += n
        values, kept = reduce_exact(plan, tuple(packs), axes=axes, previous=previous)
        means, residuals = [], []
        for g, value, left in zip(exact_groups, values, kept, strict=True):
            ms, rs = unpack_group(plan, g, value, left, config.feedback_dtype)
            means += ms
            residuals += rs
        return means, residuals, server, _done((values, kept))

    def wrap(params, extra):
        residuals, servers = extra
        leaves = plan.treedef.flatten_up_to(params)
        token = jnp.zeros((), jnp.float32)
        # The forward pass applies the hooks in the reverse of the order the
        # backward pass runs their rules: the uncompressed groups first.
        if exact_groups:
            ix = [i for g in exact_groups for i in g.leaves]
            hook = _identity_hook(exact_reduce)
            out, token = hook(
                [leaves[i] for i in ix], [residuals[i] for i in ix], None, token, key_data, warm
            )
            for i, x in zip(ix, out, strict=True):
                leaves[i] = x
        for j in reversed(order):
            ix = plan.buckets[j].leaves
            server = None if servers is None else servers[j]
            hook = bucket_hook(j, first=j == order[0])
            out, token = hook(
                [leaves[i] for i in ix], [residuals[i] for i in ix], server, token, key_data, warm
            )
            for i, x in zip(ix, out, strict=True):
                leaves[i] = x
        return plan.treedef.unflatten(leaves)

    return wrap, (inputs.residuals, inputs.servers)
