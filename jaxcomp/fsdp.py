"""Sharded training: parameters, gradients, optimizer state and residuals
sharded over the devices (ZeRO-3 / FSDP), or sharded within a fast group and
replicated over a slow axis (HSDP), with the parameter all-gather and the
gradient reduce-scatter compressed.

``jc.data_parallel(loss_fn, tx, mesh, shard_params=jc.fsdp.ShardParams(...))``
builds the step (:class:`ShardedDataParallel`). Each device holds a shard of
every parameter (a slice of one dimension), its optimizer state and its
residual. Where the loss uses a parameter, :func:`gather` all-gathers it
(``jc.all_gather``, optionally block-quantized); its gradient is
reduce-scattered in the backward pass of that gather (``jc.psum_scatter``:
encode, all-to-all, float32 decode-and-sum: each element quantized once on
the wire), so only the owned shard of the mean gradient reaches the
optimizer, which updates the owned shard.

What error feedback keeps, and why nothing is lost: a device's compression
error on the rows it sends to owner ``j`` is its own (no other device knows
it, and the owner sees only the decoded sum), so it stays with the sender
and re-enters the same rows next step. The conservation invariant of
docs/architecture.md holds for the sharded mean: over the steps, the owners'
applied mean gradients times P plus every device's residual equal the sum of
the gradients. That residual has the size of what a device compresses: the
whole (gathered) parameter on one axis, ``1/F`` of it on a ``(slow, fast)``
mesh whose fast hop is exact, a shard with HSDP (docs/fsdp.md weighs it).

Per-layer state through ``jax.grad``: :func:`gather` is a ``custom_vjp``
whose backward pass returns the new residual as the "gradient" of the
residual it was given (Flax's "overwrite with gradient" idea), so a stacked
model gathers one layer at a time inside its ``lax.scan`` and each layer's
residual comes back stacked like the layer's parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import collectives
from jaxcomp._axes import names_of
from jaxcomp.codecs.base import Codec, as_codec
from jaxcomp.optax._step import all_finite

__all__ = [
    "Shard",
    "ShardParams",
    "ShardedDataParallel",
    "ShardedState",
    "gather",
]


@dataclasses.dataclass(frozen=True)
class ShardParams:
    """How ``jc.data_parallel`` shards the parameters (``shard_params=``).

    Attributes:
      axis: the mesh axis the parameters are sharded over, or a ``(slow,
        fast)`` pair of axes (sharded over both; the reduce-scatter is exact
        over ``fast`` and compressed over ``slow``, the all-gather
        compressed over ``slow`` only).
      gradients: the codec of the gradient reduce-scatter (a codec or its
        spec string); None: float32, ``lax.psum_scatter``.
      parameters: the codec of the parameter all-gather (Int8, FP8, MX:
        block-quantized weights in the forward and backward passes; the
        master shard stays exact with its owner, so the quantization is a
        perturbation of each step's forward pass, never accumulated, and
        nothing corrects it); None: exact, ``lax.all_gather``.
      error_feedback: keep what the gradient codec drops in a residual and
        add it back next step (the module docstring says where it lives).
      replicate_over: HSDP: a slow mesh axis the shards are replicated over
        (``axis`` is then the fast one, whose collectives are exact); the
        gradient's shard is all-reduced over it with ``gradients``
        (``jc.psum``), with a shard-sized residual.
      layers: ``layers(path, leaf) -> bool``: the stacked leaves the loss
        gathers itself, one layer at a time (``jc.fsdp.gather`` inside the
        scan over layers): they reach the loss as :class:`Shard` handles,
        sharded along their dimension 1. None: every leaf is gathered before
        the loss is called.
      seed: the seed of the stochastic codecs' keys (folded with the step,
        the leaf, the layer and the device).
      shard_dim: ``shard_dim(path, leaf) -> int | None``: the dimension
        to shard a leaf along (None: replicated, its gradient averaged
        exactly), for a leaf whose dimension 0 does not divide over the
        devices (the per-head parameters of an attention layer). None: 0,
        and 1 for ``layers`` leaves (whose dimension 0 is the layer's).
      min_compress_size: leaves of fewer values (per layer, for ``layers``
        leaves) take exact collectives whatever the codecs: a codec pads
        each device's row to a whole bucket, so a LayerNorm scale or a bias
        of a few dozen values per device costs more compressed than in
        float32 (docs/fsdp.md measures it). 0: every sharded leaf through
        the codecs.
    """

    axis: Hashable | tuple = "fsdp"
    gradients: Codec | str | None = None
    parameters: Codec | str | None = None
    error_feedback: bool = True
    replicate_over: Hashable | None = None
    layers: Callable[[tuple, Any], bool] | None = None
    seed: int = 0
    shard_dim: Callable[[tuple, Any], int | None] | None = None
    min_compress_size: int = 0

    def __post_init__(self):
        for field in ("gradients", "parameters"):
            c = getattr(self, field)
            if c is not None:
                object.__setattr__(self, field, as_codec(c, f"jc.fsdp.ShardParams({field}=)"))


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What one gather needs, static: the sharded dimension counted from the
    end (so that it holds for the per-layer slices of a stacked leaf), the
    axes and the codecs."""

    dim: int
    shard_axes: tuple  # the axes the leaf is sharded over: (axis,) or (slow, fast)
    replicate: Hashable | None
    gradients: Codec | None
    parameters: Codec | None
    feedback: bool
    devices: int  # every device the mean is over

    @property
    def axis(self):
        return self.shard_axes[0] if len(self.shard_axes) == 1 else self.shard_axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Shard:
    """A parameter's shard as the loss receives it for a leaf it gathers
    itself (``ShardParams.layers``): slicing it (``lax.scan`` over a stacked
    leaf) slices the shard, its residual and its keys alike;
    :func:`gather` makes the whole parameter of one layer.

    Attributes:
      shard: this device's shard.
      residual: its error-feedback residual (float32), or None.
      key: the PRNG key of its collectives.
      probe: float32 zeros (one per layer) whose "gradient" is 1 where the
        backward pass of the gather ran: a residual whose gather did not
        run (a parameter the loss left unused) is kept as it was.
    """

    shard: jax.Array
    residual: jax.Array | None
    key: jax.Array
    probe: jax.Array | None
    spec: _Spec = dataclasses.field(metadata=dict(static=True))


def gather(x):
    """The whole parameter of a :class:`Shard` (one layer's, inside a scan
    over a stacked leaf): all-gathered, and in the backward pass its
    gradient reduce-scattered with error feedback. Anything else is
    returned as it is, so a loss works with gathered and sharded leaves
    alike. Each handle is to be gathered once per step (its residual comes
    back as its "gradient"); wrap the layer in ``jax.checkpoint`` so that
    the backward pass gathers again instead of keeping every layer's
    parameters (ZeRO-3's backward all-gather)."""
    if not isinstance(x, Shard):
        return x
    return _gather(x.spec, x.shard, x.residual, x.key, x.probe)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather(spec: _Spec, shard, residual, key, probe):
    return _all_gather(spec, shard, key)


def _gather_fwd(spec, shard, residual, key, probe):
    return _all_gather(spec, shard, key), (residual, key, probe)


def _gather_bwd(spec, saved, ct):
    residual, key, probe = saved
    grad, residual = _reduce_scatter(spec, ct, residual, key)
    return grad, residual, None, None if probe is None else jnp.ones_like(probe)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _all_gather(spec: _Spec, shard, key):
    x = jnp.moveaxis(shard, spec.dim, 0)
    if spec.parameters is None:
        full = lax.all_gather(x, spec.axis, tiled=True)
    else:
        full = collectives.all_gather(
            x, spec.axis, spec.parameters, key=jax.random.fold_in(key, 0), tiled=True
        )
    return jnp.moveaxis(full, 0, spec.dim)


def _reduce_scatter(spec: _Spec, ct, residual, key):
    """``(mean gradient of the owned shard, new residual)`` from this
    device's gradient of the whole parameter."""
    g = jnp.moveaxis(ct, spec.dim, 0).astype(jnp.float32)
    key = jax.random.fold_in(key, 1)
    codec, new = spec.gradients, residual
    if spec.replicate is None:
        if codec is None:
            total = lax.psum_scatter(g, spec.axis, tiled=True)
        elif spec.feedback:
            flat = jnp.moveaxis(residual, spec.dim, 0).reshape(-1)
            total, kept = collectives.psum_scatter_feedback(
                g, flat, spec.axis, codec, key=key, tiled=True
            )
            new = _like(kept, residual, spec.dim)
        else:
            total = collectives.psum_scatter(g, spec.axis, codec, key=key, tiled=True).value
    else:
        # HSDP: exact over the fast axis, then the shard all-reduced over the slow one.
        part = lax.psum_scatter(g, spec.axis, tiled=True)
        if codec is None:
            total = lax.psum(part, spec.replicate)
        else:
            acc = part + jnp.moveaxis(residual, spec.dim, 0) if spec.feedback else part
            r = collectives.psum(acc, spec.replicate, codec, key=key)
            total = r.value.astype(jnp.float32)
            if spec.feedback:
                new = jnp.moveaxis(acc - r.sent, 0, spec.dim)
    grad = (total / spec.devices).astype(ct.dtype)
    return jnp.moveaxis(grad, 0, spec.dim), new


def _like(flat, residual, dim):
    """``flat`` in ``residual``'s layout (its sharded dimension first while flat)."""
    moved = jnp.moveaxis(residual, dim, 0)
    return jnp.moveaxis(flat.reshape(moved.shape), 0, dim)


class ShardedState(NamedTuple):
    """The state of a sharded step, beside the parameters.

    Attributes:
      opt_state: ``tx``'s state of this device's shards, every leaf with a
        leading axis of one entry per device (sharded over the mesh).
      residuals: a tuple, one float32 array per sharded parameter in the
        order of the parameters' leaves, with a leading axis of one entry per
        device (sharded), each entry shaped like what that device compresses
        (:class:`ShardParams`); empty without error feedback.
      step: the number of steps taken (int32, replicated): the keys'
        counter.
    """

    opt_state: Any
    residuals: Any
    step: jax.Array


class ShardedDataParallel:
    """The sharded train step: ``jc.data_parallel(loss_fn, tx, mesh,
    shard_params=...)``.

    ``params, state = step.init(params)`` lays the parameters out sharded
    (``NamedSharding``: each leaf's dimension 0, or 1 for ``layers``
    leaves, split over the sharding axes; scalars replicated) and creates
    the optimizer state and residuals of every device's shards;
    ``params, state, loss = step(params, state, batch)`` runs one step.
    ``tx`` is a plain optax optimizer (``optax.adamw(...)``): the step's own
    collectives average the gradients, and ``tx`` updates each device's
    shards. A step whose mean gradient (or a new residual) is not finite
    on some device changes no parameter and no state on any device (its
    loss shows it), as ``compress_gradients`` keeps its residuals.

    Args:
      loss_fn: ``loss_fn(params, batch)`` (``loss_fn(params, batch, key)``
        when the step is given a key), the scalar loss of this device's
        batch. ``params`` holds the gathered parameters, and
        :class:`Shard` handles for ``layers`` leaves.
      tx: the optimizer.
      mesh: the mesh; the batch is split over every axis the parameters
        are sharded or replicated over, and others must have size 1.
      shard_params: a :class:`ShardParams`, or an axis name (exact
        collectives over it).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux is averaged.
      donate: donate the parameters and the state to the step.
    """

    def __init__(
        self,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        shard_params: ShardParams | Hashable,
        *,
        has_aux: bool = False,
        donate: bool = True,
    ):
        if not isinstance(shard_params, ShardParams):
            shard_params = ShardParams(axis=shard_params)
        self.loss_fn = loss_fn
        self.tx = tx
        self.mesh = mesh
        self.config = shard_params
        self.has_aux = has_aux
        self.donate = donate
        self._shard_axes = names_of(shard_params.axis)
        rep = shard_params.replicate_over
        self._axes = ((rep,) if rep is not None else ()) + self._shard_axes
        _check_mesh(mesh, self._axes, shard_params)
        self.num_devices = int(np.prod([mesh.shape[a] for a in self._axes]))
        self._shard_size = int(np.prod([mesh.shape[a] for a in self._shard_axes]))
        if len(self._shard_axes) == 2 and rep is not None:
            raise ValueError(
                "jc.fsdp.ShardParams: replicate_over (HSDP) takes one sharding axis, got "
                f"axis={shard_params.axis!r}"
            )
        self._all = self._axes if len(self._axes) > 1 else self._axes[0]
        self._shard_spec = self._shard_axes if len(self._shard_axes) > 1 else self._shard_axes[0]
        self.batch_sharding = NamedSharding(mesh, P(self._all))
        self._dims = None  # per leaf: the sharded dimension, None for replicated leaves
        self._step = None

    # -- layout --------------------------------------------------------------

    def _plan(self, params) -> tuple[list, list]:
        """Per leaf, its sharded dimension (None: replicated), checked, and
        whether it is a ``layers`` leaf."""
        cfg, k = self.config, self._shard_size
        dims, layers = [], []
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            layer = bool(cfg.layers is not None and cfg.layers(path, x))
            layers.append(layer)
            dim = 1 if layer else 0
            if cfg.shard_dim is not None:
                dim = cfg.shard_dim(path, x)
            name = jax.tree_util.keystr(path)
            if layer and (dim is None or dim < 1 or dim >= np.ndim(x)):
                raise ValueError(
                    f"jc.data_parallel: {name} is a layers leaf of shape {np.shape(x)}; a "
                    "stacked leaf has a layer axis and at least one more, and is sharded "
                    f"along one of the others (shard_dim gave {dim!r})"
                )
            if dim is not None and not 0 <= dim < max(np.ndim(x), 1):
                raise ValueError(
                    f"jc.data_parallel: shard_dim gave {dim!r} for {name} of shape "
                    f"{np.shape(x)}: a dimension of the leaf, or None to replicate it"
                )
            if dim is None or np.ndim(x) == 0:
                dims.append(None)  # replicated, its gradient averaged exactly
                continue
            if x.shape[dim] % k:
                raise ValueError(
                    f"jc.data_parallel: parameter {name} of shape {tuple(x.shape)} cannot be "
                    f"sharded: its dimension {dim} ({x.shape[dim]}) is not a multiple of the "
                    f"{k} devices of {self.config.axis!r}. Pad that dimension to a multiple "
                    f"of {k} (a vocabulary, say), shard it along another dimension "
                    "(ShardParams.shard_dim), or use a mesh whose sharding axes divide it"
                )
            dims.append(dim)
        return dims, layers

    def _param_spec(self, x, dim):
        if dim is None:
            return P()
        return P(*([None] * dim), self._shard_spec)

    def _compressed(self, i: int) -> bool:
        """Whether sharded leaf ``i`` goes through the codecs: values per
        gather (per layer for a ``layers`` leaf) at least
        ``min_compress_size``."""
        shape = self._shapes[i]
        n = int(np.prod(shape))
        return (n // shape[0] if self._layers[i] else n) >= self.config.min_compress_size

    def _residual_shape(self, i: int) -> tuple | None:
        """What one device compresses of leaf ``i`` (its residual's shape)."""
        cfg, dim = self.config, self._dims[i]
        if dim is None or cfg.gradients is None or not cfg.error_feedback:
            return None
        if not self._compressed(i):
            return None
        shape = list(self._shapes[i])
        if cfg.replicate_over is not None:
            shape[dim] //= self._shard_size  # the shard
        elif len(self._shard_axes) == 2:
            shape[dim] //= self.mesh.shape[self._shard_axes[1]]  # the slow hop's input
        return tuple(shape)

    def init(self, params) -> tuple[Any, ShardedState]:
        """Lays ``params`` (a pytree of arrays) out sharded and creates the
        state.

        Returns:
          ``(params, state)``: the parameters, each leaf sharded along its
          dimension 0 (1 for ``layers`` leaves) over the sharding axes, and
          the :class:`ShardedState` of every device's shards.
        """
        if _is_module(params):
            raise TypeError(
                "jc.data_parallel(shard_params=...) takes a pytree of parameters; for a Flax "
                "NNX model pass nnx.state(model, nnx.Param) and rebuild it in the loss"
            )
        leaves, treedef = jax.tree.flatten(params)
        self._dims, self._layers = self._plan(params)
        self._shapes = [tuple(x.shape) for x in leaves]
        specs = [self._param_spec(x, d) for x, d in zip(leaves, self._dims, strict=True)]
        self._treedef = treedef
        self._param_specs = treedef.unflatten(specs)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._param_specs)
        params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)
        shapes = [self._residual_shape(i) for i in range(len(leaves))]
        self._residual_shapes = shapes
        per_device = P(self._all)

        def local_init(p):
            res = tuple(jnp.zeros((1, *s), jnp.float32) for s in shapes if s is not None)
            return _stack(self.tx.init(p)), res

        opt, res = jax.jit(
            jax.shard_map(
                local_init,
                mesh=self.mesh,
                in_specs=(self._param_specs,),
                out_specs=per_device,
                check_vma=False,
            )
        )(params)
        count = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(self.mesh, P()))
        return params, ShardedState(opt, res, count)

    def shard_batch(self, local_batch):
        """A global batch from this process's part of it (as
        ``jc.data_parallel``'s)."""
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            local_batch,
        )

    # -- the step --------------------------------------------------------------

    def lower(self, params, state: ShardedState, batch, key: jax.Array | None = None):
        """The step lowered for these arguments (``jax.stages.Lowered``):
        ``.compile()`` gives the executable whose ``memory_analysis()`` and
        ``as_text()`` (the collectives and their bytes) the step runs, from
        the same cache as the calls."""
        if self._dims is None:
            raise ValueError("jc.data_parallel: call init(params) before the step")
        if self._step is None:
            self._step = self._build()
        keys = () if key is None else (key,)
        return self._step.lower(params, state, batch, *keys)

    def __call__(self, params, state: ShardedState, batch, key: jax.Array | None = None):
        """One step: ``(params, state, loss)`` (``(loss, aux)`` with
        ``has_aux``), the loss averaged over the devices."""
        if self._dims is None:
            raise ValueError("jc.data_parallel: call init(params) before the step")
        if self._step is None:
            self._step = self._build()
        keys = () if key is None else (key,)
        return self._step(params, state, batch, *keys)

    def _lay_out(self, x):
        """``x`` sharded as ``batch_sharding``, inside the jitted step."""
        types = dict(zip(self.mesh.axis_names, self.mesh.axis_types, strict=True))
        if all(types[a] == jax.sharding.AxisType.Explicit for a in self._axes):
            return jax.sharding.reshard(x, self.batch_sharding)
        return lax.with_sharding_constraint(x, self.batch_sharding)

    def _spec_of(self, i: int) -> _Spec:
        """The static spec of sharded leaf ``i``'s gathers."""
        cfg, dim = self.config, self._dims[i]
        on = self._compressed(i)
        return _Spec(
            dim=dim - len(self._shapes[i]),
            shard_axes=self._shard_axes,
            replicate=cfg.replicate_over,
            gradients=cfg.gradients if on else None,
            parameters=cfg.parameters if on else None,
            feedback=on and cfg.error_feedback and cfg.gradients is not None,
            devices=self.num_devices,
        )

    def _build(self):
        cfg, dims, treedef = self.config, self._dims, self._treedef
        axes = self._all
        per_device = P(axes)
        # Leaf i's residual is state.residuals[slot[i]] (None: it has none);
        # leaf_ndim[j]: the dimensions of one gather's residual in slot j
        # (a layers leaf's residual has a leading layer axis besides).
        slot, n, leaf_ndim = [], 0, []
        for s, layer in zip(self._residual_shapes, self._layers, strict=True):
            slot.append(None if s is None else n)
            if s is not None:
                n += 1
                leaf_ndim.append(len(s) - layer)

        def local(params, state, batch, *key):
            opt = jax.tree.map(lambda a: a[0], state.opt_state)
            residuals = tuple(r[0] for r in state.residuals)
            base = jax.random.fold_in(jax.random.key(cfg.seed), state.step)
            args = ()
            if key:
                args = (jax.random.fold_in(key[0], lax.axis_index(axes)),)

            def loss_of(shards, residuals, probes):
                leaves = treedef.flatten_up_to(shards)
                built = []
                for i, (x, dim) in enumerate(zip(leaves, dims, strict=True)):
                    r, probe = (
                        (None, None) if slot[i] is None else (residuals[slot[i]], probes[slot[i]])
                    )
                    if dim is None:
                        built.append(x)
                        continue
                    spec = self._spec_of(i)
                    k = jax.random.fold_in(base, i)
                    if self._layers[i]:  # one key per layer, gathered by the loss
                        ks = jax.vmap(lambda j, k=k: jax.random.fold_in(k, j))(
                            jnp.arange(x.shape[0])
                        )
                        built.append(Shard(x, r, ks, probe, spec))
                    else:
                        built.append(_gather(spec, x, r, k, probe))
                return self.loss_fn(treedef.unflatten(built), batch, *args)

            # A residual comes back as its "gradient" where its gather's
            # backward pass ran (the probe's gradient is 1 there), else as it
            # was: a parameter the loss did not use keeps what it owes.
            probes = tuple(
                jnp.zeros(r.shape[: r.ndim - leaf_ndim[j]]) for j, r in enumerate(residuals)
            )
            grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1, 2), has_aux=self.has_aux)
            out, (grads, new_res, ran) = grad_fn(params, residuals, probes)
            new_res = tuple(
                jnp.where(g.reshape(g.shape + (1,) * (r.ndim - g.ndim)) > 0, n, r)
                for g, n, r in zip(ran, new_res, residuals, strict=True)
            )
            # Replicated leaves (scalars): their gradients averaged exactly.
            g = treedef.flatten_up_to(grads)
            g = [lax.pmean(x, axes) if d is None else x for x, d in zip(g, dims, strict=True)]
            grads = treedef.unflatten(g)
            # A step whose mean gradient is not finite changes nothing: the
            # parameters, the optimizer state and the residuals stay as they
            # were (every device agrees: the flag is reduced over the mesh).
            ok = lax.pmin(all_finite(jax.tree.leaves((grads, new_res))).astype(jnp.int32), axes)
            ok = ok.astype(bool)
            updates, new_opt = self.tx.update(grads, opt, params)
            new_params = optax.apply_updates(params, updates)
            params, opt, new_res = jax.tree.map(
                lambda new, old: jnp.where(ok, new, old),
                (new_params, new_opt, new_res),
                (params, opt, residuals),
            )
            loss, aux = out if self.has_aux else (out, None)
            loss = lax.pmean(loss, axes)
            if self.has_aux:
                aux = jax.tree.map(lambda a: lax.pmean(a, axes), aux)
            out = (loss, aux) if self.has_aux else loss
            new_state = ShardedState(_stack(opt), _stack(new_res), state.step + 1)
            return params, new_state, out

        def step(params, state, batch, *key):
            batch = jax.tree.map(self._lay_out, batch)
            state_spec = ShardedState(
                jax.tree.map(lambda _: per_device, state.opt_state),
                jax.tree.map(lambda _: per_device, state.residuals),
                P(),
            )
            f = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(
                    self._param_specs,
                    state_spec,
                    jax.tree.map(lambda _: per_device, batch),
                    *((P(),) * len(key)),
                ),
                out_specs=(self._param_specs, state_spec, P()),
                check_vma=False,
            )
            return f(params, state, batch, *key)

        return jax.jit(step, donate_argnums=(0, 1) if self.donate else ())


def _stack(tree):
    """Every leaf with a leading axis of one entry (this device's)."""
    return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)


def _is_module(x) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional
        return False
    return isinstance(x, nnx.Module)


def _check_mesh(mesh: Mesh, axes: tuple, cfg: ShardParams) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"jc.data_parallel: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}"
        )
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(
            f"jc.data_parallel: shard_params names the axes {list(axes)}, but {unknown} "
            f"{'is' if len(unknown) == 1 else 'are'} not an axis of the mesh, whose axes are "
            f"{mesh.axis_names}: jax.make_mesh((8,), ('fsdp',)) for FSDP, "
            "jax.make_mesh((2, 4), ('slow', 'fast')) with axis='fast', replicate_over='slow' "
            "for HSDP"
        )
    if len(set(axes)) != len(axes):
        raise ValueError(f"jc.data_parallel: shard_params names an axis twice: {list(axes)}")
    others = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
    if others:
        raise ValueError(
            f"jc.data_parallel: the mesh has axes {others} besides the sharding axes "
            f"{list(axes)}; the sharded step shards the parameters over "
            f"{cfg.axis!r} (and replicates them over replicate_over, if set) and splits the "
            "batch over all of them: pass a mesh of those axes only"
        )
