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

A model scanned over its layers gets its gradients out of the reverse scan
stacked, all at once, so a hook on the stacked parameter could send nothing
before the scan ends. The leaves ``compress_gradients(layers=)`` names (one
stacked bucket each) reach the loss as :class:`LayerStack` handles instead:
the scan slices them, and ``jc.fsdp.gather`` in the layer is the hook,
whose backward rule reduces that layer's slice inside the scan's body, as
``reduce_bucket`` reduces it layer by layer after the backward pass. On
XLA:CPU the collectives of the other buckets wait for the scan: a hook on
the stacks, first in the order, passes the token on once the scan is done.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp

from jaxcomp.collectives import after
from jaxcomp.optax._plan import Plan
from jaxcomp.optax._step import (
    layer_key,
    pack_group,
    reduce_bucket,
    reduce_exact,
    reduce_layer,
    unpack_group,
)


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


@dataclasses.dataclass(frozen=True)
class _LayerSpec:
    """What one stacked bucket's hook needs, static."""

    plan: Plan
    bucket: int
    axes: Hashable | tuple
    algorithm: str

    @property
    def path(self) -> str:
        return self.plan.paths[self.plan.buckets[self.bucket].leaves[0]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerStack:
    """A stacked leaf (``compress_gradients(layers=)``) as the loss of
    ``jc.data_parallel``'s overlapped step receives it. A scan over its
    leading axis slices every field; ``jc.fsdp.gather`` of one layer's
    slice is that layer's parameter, whose gradient is then averaged over
    the devices inside the backward scan.

    Attributes:
      value: the parameter (its layers).
      residual: this device's error-feedback residual, or None.
      server: the layers' server residuals (a row per layer), or None.
      key: the layers' PRNG key data.
      warm: per layer, whether the step is a warm-up step (exact), or None.
      probe: float32 zeros whose "gradient" is 1 where a layer's hook ran,
        so that a layer the loss left ungathered keeps what it owes.
    """

    value: jax.Array
    residual: jax.Array | None
    server: jax.Array | None
    key: jax.Array
    warm: jax.Array | None
    probe: jax.Array
    spec: _LayerSpec = dataclasses.field(metadata=dict(static=True))

    def __jax_array__(self):
        raise ValueError(
            f"jc.data_parallel: {self.spec.path} is a compress_gradients(layers=...) leaf, "
            "which reaches the loss as a jc.optax.LayerStack: make one layer of it an array "
            "with jc.fsdp.gather(...) inside the scan over its layers, or leave it out of layers="
        )

    @staticmethod
    def gather(stacks: list) -> list:
        """One layer's parameters from their slices (inside the scan over
        layers), their gradients averaged in the backward pass, one bucket
        after the other (``jc.fsdp.gather`` calls it)."""
        for x in stacks:
            if jnp.ndim(x.key) != 1:
                raise ValueError(
                    f"jc.fsdp.gather: {x.spec.path} is a compress_gradients(layers=...) leaf, "
                    f"gathered here whole (its keys have shape {jnp.shape(x.key)}, one per "
                    "layer): gather one layer at a time inside the scan over its leading "
                    "(layer) axis (lax.scan, nnx.scan), or leave the leaf out of layers= if it "
                    "is not a stack"
                )
        fields = [(x.value, x.residual, x.server, x.key, x.warm, x.probe) for x in stacks]
        return _layer_hook(tuple(x.spec for x in stacks), *map(list, zip(*fields, strict=True)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer_hook(specs, values, residuals, servers, keys, warms, probes):
    return values


def _layer_hook_fwd(specs, values, residuals, servers, keys, warms, probes):
    return values, (residuals, servers, keys, warms, probes)


def _layer_hook_bwd(specs, saved, cts):
    residuals, servers, keys, warms, probes = saved
    means, kept, new_servers, previous = [], [], [], None
    for spec, ct, r, s, k, w in zip(specs, cts, residuals, servers, keys, warms, strict=True):
        plan, j = spec.plan, spec.bucket
        pk = after(pack_group(plan.buckets[j], [ct], [r]), previous)
        key = jax.random.wrap_key_data(k)
        value, left, s = reduce_layer(plan, j, pk, s, key, spec.axes, spec.algorithm, w)
        mean = value.reshape(ct.shape).astype(ct.dtype)
        left = None if r is None else left.reshape(r.shape).astype(r.dtype)
        means.append(mean)
        kept.append(left)
        new_servers.append(s)
        previous = (value, left, s)
    ran = [jnp.ones_like(p) for p in probes]
    none = [None] * len(specs)
    return means, kept, new_servers, none, none, ran


_layer_hook.defvjp(_layer_hook_fwd, _layer_hook_bwd)


@jax.custom_vjp
def _stacks_done(stacks, token):
    """Identity on the stacks' fields (``(value, residual, server, probe)``
    each) and the token; backward: the new residuals where the layer's hook
    ran, else the old ones, and the token once the scan is done."""
    return stacks, token


def _stacks_done_fwd(stacks, token):
    return (stacks, token), stacks


def _stacks_done_bwd(saved, cotangents):
    cts, _ = cotangents
    out = []
    for (_, residual, server, _), (g, r, s, ran) in zip(saved, cts, strict=True):
        out.append(
            (g, _where_ran(ran, r, residual), _where_ran(ran, s, server), jnp.zeros_like(ran))
        )
    return out, _done(out)


def _where_ran(ran, new, old):
    """``new`` for the layers whose hook ran, ``old`` for the others."""
    if old is None:
        return None
    layers = (ran.shape[0], old.size // ran.shape[0])
    picked = jnp.where((ran > 0)[:, None], new.reshape(layers), old.reshape(layers))
    return picked.reshape(old.shape)


_stacks_done.defvjp(_stacks_done_fwd, _stacks_done_bwd)


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
    order = [j for j in issue_order(plan, first_use) if not plan.buckets[j].layers]
    stacked = [j for j in range(nb) if plan.buckets[j].layers]
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

    def stack(j: int, value, residual, server, probe) -> LayerStack:
        n = plan.buckets[j].layers
        keys = jax.vmap(lambda layer: jax.random.key_data(layer_key(inputs.step_key, layer)))(
            jnp.arange(n)
        )
        return LayerStack(
            value,
            residual,
            None if server is None else server.reshape(n, server.size // n),
            keys,
            None if warm is None else jnp.broadcast_to(warm, (n,)),
            probe,
            _LayerSpec(plan, j, axes, config.algorithm),
        )

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
            hook = bucket_hook(j, first=j == order[0] and not stacked)
            out, token = hook(
                [leaves[i] for i in ix], [residuals[i] for i in ix], server, token, key_data, warm
            )
            for i, x in zip(ix, out, strict=True):
                leaves[i] = x
        if stacked:  # first in the order: the other buckets' collectives wait for the scans
            fields = []
            for j in stacked:
                (i,), n = plan.buckets[j].leaves, plan.buckets[j].layers
                server = None if servers is None else servers[j]
                fields.append((leaves[i], residuals[i], server, jnp.zeros((n,), jnp.float32)))
            fields, token = _stacks_done(fields, token)
            for j, f in zip(stacked, fields, strict=True):
                leaves[plan.buckets[j].leaves[0]] = stack(j, *f)
        return plan.treedef.unflatten(leaves)

    return wrap, (inputs.residuals, inputs.servers)
