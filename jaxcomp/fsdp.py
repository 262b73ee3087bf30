"""Sharded training: parameters, gradients, optimizer state and residuals
sharded over the devices (ZeRO-3 / FSDP), or sharded within a fast group and
replicated over a slow axis (HSDP), with the parameter all-gather and the
gradient reduce-scatter compressed.

``jc.data_parallel(loss_fn, tx, mesh, shard_params=jc.fsdp.ShardParams(...))``
builds the step (:class:`jaxcomp.DataParallel`, on this module's
:class:`Layout`). It has two parts:

- per device, inside ``jax.shard_map`` (manual over the data axes only, so
  that a model axis of the mesh stays XLA's): where the loss uses a
  parameter, :func:`gather` all-gathers it (``jc.all_gather``, optionally
  block-quantized), and in the backward pass of that gather its gradient is
  reduce-scattered (``jc.psum_scatter``: each element quantized once on the
  wire) with error feedback;
- on global arrays, outside ``shard_map``: ``tx.update`` on the mean
  gradients, laid out as the parameters, which XLA partitions. Every optax
  transform then computes what it computes on one device: a global norm is
  a norm over the whole model, a factored moment one over whole rows.

What error feedback keeps, and why nothing is lost: a device's compression
error on the rows it sends to owner ``j`` is its own (no other device knows
it, and the owner sees only the decoded sum), so it stays with the sender
and re-enters the same rows next step. Over the steps, the applied mean
gradients times P plus every device's residual equal the sum of the
gradients (docs/architecture.md's invariant for the sharded mean).

Per-layer state through ``jax.grad``: :func:`gather` is a ``custom_vjp``
whose backward pass returns the new residual as the "gradient" of the
residual it was given, so a stacked model gathers one layer at a time
inside its ``lax.scan`` and each layer's residual comes back stacked like
the layer's parameters.
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
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import collectives
from jaxcomp._axes import names_of
from jaxcomp.codecs.base import Codec, as_codec
from jaxcomp.optax import LayerStack, OneBitAdamState, all_reduce_states

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
        fast)`` pair (sharded over both; the reduce-scatter exact over
        ``fast`` and compressed over ``slow``).
      gradients: the codec of the gradient reduce-scatter (a codec or its
        spec string); None: float32, ``lax.psum_scatter``.
      parameters: the codec of the parameter all-gather (Int8, FP8, MX);
        None: exact, ``lax.all_gather``.
      error_feedback: keep what the gradient codec drops in a residual and
        add it back next step.
      replicate_over: HSDP: a slow mesh axis the shards are replicated over
        (``axis`` is then the fast one, whose collectives are exact); the
        gradient's shard is all-reduced over it with ``gradients``.
      layers: ``layers(path, leaf) -> bool``: the stacked leaves the loss
        gathers itself, one layer at a time (``jc.fsdp.gather`` inside the
        scan over layers); they reach the loss as :class:`Shard` handles.
      seed: the seed of the stochastic codecs' keys.
      shard_dim: ``shard_dim(path, leaf) -> int | None``: the dimension to
        shard a leaf along (None: replicated over the data axes, its
        gradient averaged exactly). Default: 0, and 1 for ``layers`` leaves.
      min_compress_size: leaves of fewer values (per layer for ``layers``
        leaves) take exact collectives whatever the codecs (a codec pads
        each device's row to a whole bucket).
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

    @property
    def data_axes(self) -> tuple:
        """Every mesh axis the batch is split over: ``replicate_over`` (if
        set), then the sharding axes."""
        rep = (self.replicate_over,) if self.replicate_over is not None else ()
        return rep + names_of(self.axis)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What one gather needs, static (the ``custom_vjp``'s argument)."""

    dim: int  # the sharded dimension, counted from the end (it holds for one layer's slice)
    shard_axes: tuple  # the axes the leaf is sharded over: (axis,) or (slow, fast)
    replicate: Hashable | None
    gradients: Codec | None
    parameters: Codec | None
    feedback: bool
    devices: int  # every device the mean is over
    # One gather's parameter laid out over the mesh's other (model) axes:
    # a PartitionSpec's entries, one per dimension (all None without them).
    model: tuple = ()
    path: str = ""

    @property
    def axis(self):
        return self.shard_axes[0] if len(self.shard_axes) == 1 else self.shard_axes

    @property
    def model_axes(self) -> tuple:
        return tuple(a for e in self.model if e is not None for a in names_of(e))


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
      key: the PRNG key of its collectives (one per layer before the scan).
      probe: float32 zeros (one per layer) whose "gradient" is 1 where the
        backward pass of the gather ran, so that a parameter the loss left
        unused keeps its residual.
    """

    shard: jax.Array
    residual: jax.Array | None
    key: jax.Array
    probe: jax.Array | None
    spec: _Spec = dataclasses.field(metadata=dict(static=True))

    def __jax_array__(self):
        raise ValueError(
            f"jc.fsdp: {self.spec.path} is a ShardParams(layers=...) leaf, which reaches the "
            "loss as a jc.fsdp.Shard handle: make one layer of it whole with "
            "jc.fsdp.gather(...) inside the scan over its layers, or leave it out of layers="
        )


def gather(x):
    """The whole parameter of a :class:`Shard` (one layer's, inside a scan
    over a stacked leaf): all-gathered, and in the backward pass its
    gradient reduce-scattered with error feedback. One layer's slice of a
    :class:`jaxcomp.optax.LayerStack` (the replicated step's stacked
    leaves, ``compress_gradients(layers=)``) is that layer's parameter,
    its gradient averaged in the backward pass. ``x`` may be a pytree of
    them (a layer's parameters: their gradients then go one after the
    other). Anything else is returned as it is, so a loss works with
    gathered and sharded leaves alike. Gather each handle once per step,
    and wrap the layer in ``jax.checkpoint`` so that the backward pass
    gathers again instead of keeping every layer's parameters."""
    leaves, treedef = jax.tree.flatten(x, is_leaf=_is_handle)
    if not any(_is_handle(v) for v in leaves):
        return x
    out = [_gather_one(v) if isinstance(v, Shard) else v for v in leaves]
    at = [i for i, v in enumerate(leaves) if isinstance(v, LayerStack)]
    for i, v in zip(at, LayerStack.gather([leaves[i] for i in at]) if at else (), strict=True):
        out[i] = v
    return jax.tree.unflatten(treedef, out)


def _is_handle(x) -> bool:
    return isinstance(x, (Shard, LayerStack))


def _gather_one(x: Shard):
    if jnp.ndim(x.key) != 0:
        raise ValueError(
            f"jc.fsdp.gather: {x.spec.path} is a ShardParams(layers=...) leaf, gathered here "
            f"whole (its keys have shape {jnp.shape(x.key)}, one per layer): gather one layer at "
            "a time inside the scan over its leading (layer) axis (lax.scan, nnx.scan, "
            "nn.scan), or leave the leaf out of layers= if it is not a stack of layers"
        )
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


def _per_model_block(spec: _Spec, f, arrays: tuple, key, n_out: int):
    """``f(*arrays, key)`` on this device's block of the mesh's model axes.

    Inside the step the data axes are manual and the model axes XLA's. A
    codec's kernel is a custom call, which XLA cannot partition: it would
    gather the model axes first. So each (data, model) device encodes its
    own block, with the model index folded into its key, and the data-axis
    collectives run per model block. ``arrays`` and the ``n_out`` results
    are laid out as one gather's parameter (``spec.model``)."""
    axes = spec.model_axes
    if not axes:
        return f(*arrays, key)

    def block(*args):
        *xs, k = args
        return f(*xs, jax.random.fold_in(k, lax.axis_index(axes)))

    blocks = P(*spec.model)
    return jax.shard_map(
        block,
        in_specs=(*(blocks,) * len(arrays), P()),
        out_specs=blocks if n_out == 1 else (blocks,) * n_out,
        axis_names=frozenset(axes),
        check_vma=False,
    )(*arrays, key)


def _all_gather(spec: _Spec, shard, key):
    return _per_model_block(spec, functools.partial(_gather_block, spec), (shard,), key, 1)


def _gather_block(spec: _Spec, shard, key):
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
    if residual is None:
        f = functools.partial(_scatter_block, spec, residual=None)
        return _per_model_block(spec, lambda c, k: f(c, key=k)[0], (ct,), key, 1), None
    f = functools.partial(_scatter_block, spec)
    return _per_model_block(spec, f, (ct, residual), key, 2)


def _scatter_block(spec: _Spec, ct, residual, key):
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
        elif spec.feedback:
            flat = jnp.moveaxis(residual, spec.dim, 0).reshape(-1)
            total, left, _ = collectives.pmean_feedback(
                part.reshape(-1), flat, spec.replicate, codec, key=key, mean=False
            )
            total = total.reshape(part.shape)
            new = _like(left, residual, spec.dim)
        else:
            total = collectives.psum(part, spec.replicate, codec, key=key).value
    grad = (total / spec.devices).astype(ct.dtype)
    return jnp.moveaxis(grad, 0, spec.dim), new


def _like(flat, residual, dim):
    """``flat`` in ``residual``'s layout (its sharded dimension first while flat)."""
    moved = jnp.moveaxis(residual, dim, 0)
    return jnp.moveaxis(flat.reshape(moved.shape), 0, dim)


class ShardedState(NamedTuple):
    """The state of a sharded step, beside the parameters.

    Attributes:
      opt_state: ``tx.init(params)``, global arrays laid out as the
        parameters (a leaf shaped like its parameter is sharded like it;
        others as ``tx.init`` makes them: scalars and factored moments
        replicated or sharded where they follow a sharded dimension).
      residuals: a tuple, one float32 array per parameter with error
        feedback, in the order of the parameters' leaves, with a leading
        axis of one entry per data device (sharded over the data axes),
        each entry shaped like what that device compresses; empty without
        error feedback.
      step: the number of steps taken (int32, replicated): the keys' counter.
    """

    opt_state: Any
    residuals: Any
    step: jax.Array


# The transforms that average the gradients over the data axes themselves:
# in a sharded step they would average different devices' slices.
_AVERAGING = {
    OneBitAdamState: "jc.optax.onebit_adam",
    "CompressState": "jc.optax.compress_gradients",
    "PmeanState": "jc.optax.uncompressed_mean",
    "PowerSGDState": "jc.optax.powersgd",
    "DiLoCoState": "jc.optax.diloco",
}


def _averaging_transform(opt_state) -> str | None:
    """The name of a jaxcomp transform in ``opt_state`` that all-reduces the
    gradients itself, or None."""
    for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, OneBitAdamState)):
        if isinstance(x, OneBitAdamState):
            return _AVERAGING[OneBitAdamState]
    for s in all_reduce_states(opt_state):
        return _AVERAGING.get(type(s).__name__, type(s).__name__)
    return None


class Layout:
    """The sharded step's static layout of a parameter pytree, checked: per
    leaf its sharded dimension (None: replicated over the data axes), whether
    it is a ``layers`` leaf and its layout over the mesh's other (model)
    axes; from these the parameters' PartitionSpecs (over the data axes, as
    ``shard_map`` takes them, and over every axis), the residuals' shapes
    and shardings and every gather's static spec.

    Args:
      cfg: the :class:`ShardParams`.
      mesh: the mesh.
      params: the parameters (arrays or shapes).
      model_entries: ``model_entries(leaf) -> tuple``: a leaf's layout over
        the model axes as the caller gave it (one PartitionSpec entry per
        dimension).
    """

    def __init__(self, cfg: ShardParams, mesh: Mesh, params, model_entries: Callable):
        self.config, self.mesh = cfg, mesh
        self.data_axes = cfg.data_axes
        self.axes = self.data_axes if len(self.data_axes) > 1 else self.data_axes[0]
        self.shard_axes = names_of(cfg.axis)
        self.shard_sizes = tuple(mesh.shape[a] for a in self.shard_axes)
        self.num_devices = int(np.prod([mesh.shape[a] for a in self.data_axes]))
        self.dims, self.layers, self.model = _plan(
            cfg, params, int(np.prod(self.shard_sizes)), model_entries
        )
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [jax.tree_util.keystr(k) for k, _ in flat]
        self.shapes = [tuple(np.shape(x)) for _, x in flat]
        n = len(flat)
        self.manual_specs = self.treedef.unflatten([self._spec(i, True) for i in range(n)])
        self.param_shardings = self.treedef.unflatten(
            [NamedSharding(mesh, self._spec(i, False)) for i in range(n)]
        )
        self.residual_shapes = [
            _residual_shape(cfg, d, s, layer, self.shard_sizes)
            for d, s, layer in zip(self.dims, self.shapes, self.layers, strict=True)
        ]
        self.residual_shardings = tuple(
            NamedSharding(mesh, P(self.axes, *self.model[i]))
            for i, s in enumerate(self.residual_shapes)
            if s is not None
        )
        self.gathers = [
            None if d is None else self._gather_spec(i) for i, d in enumerate(self.dims)
        ]

    def _spec(self, i: int, manual: bool) -> P:
        """Leaf ``i``'s PartitionSpec: over the data axes only (``manual``:
        what ``shard_map`` takes), or over every axis."""
        dim = self.dims[i]
        entries = [None] * len(self.shapes[i]) if manual else list(self.model[i])
        if dim is not None:
            entries[dim] = self.shard_axes if len(self.shard_axes) > 1 else self.shard_axes[0]
        while entries and entries[-1] is None:  # P("fsdp"), as one writes it
            entries.pop()
        return P(*entries)

    def _gather_spec(self, i: int) -> _Spec:
        cfg, dim = self.config, self.dims[i]
        on = _compressed(cfg, self.shapes[i], self.layers[i])
        return _Spec(
            dim=dim - len(self.shapes[i]),
            shard_axes=self.shard_axes,
            replicate=cfg.replicate_over,
            gradients=cfg.gradients if on else None,
            parameters=cfg.parameters if on else None,
            feedback=on and cfg.error_feedback and cfg.gradients is not None,
            devices=self.num_devices,
            model=self.model[i][1:] if self.layers[i] else self.model[i],
            path=self.paths[i],
        )

    def zero_residuals(self) -> tuple:
        """The residuals of a new state: zeros, one row per data device."""
        shapes = [(self.num_devices, *s) for s in self.residual_shapes if s is not None]
        return jax.jit(
            lambda: tuple(jnp.zeros(s, jnp.float32) for s in shapes),
            out_shardings=self.residual_shardings,
        )()

    def gathered(self, shards, residuals: tuple, key):
        """The parameters as the loss receives them, inside the step's
        ``shard_map``: each sharded leaf all-gathered (and reduce-scattered
        in the backward pass, its residual coming back as the residual's
        "gradient"), ``layers`` leaves as :class:`Shard` handles.

        Args:
          shards: this device's shards (the parameters' structure).
          residuals: ``(residuals, probes)``: this device's residual of every
            leaf that has one, and a probe of zeros for each (see
            :class:`Shard`).
          key: the step's key of the collectives.
        """
        residuals, probes = residuals
        slot = iter(range(len(residuals)))
        built = []
        for i, x in enumerate(self.treedef.flatten_up_to(shards)):
            if self.dims[i] is None:
                built.append(x)
                continue
            r = p = None
            if self.residual_shapes[i] is not None:
                j = next(slot)
                r, p = residuals[j], probes[j]
            k = jax.random.fold_in(key, i)
            if self.layers[i]:  # one key per layer, gathered by the loss
                ks = jax.vmap(lambda j, k=k: jax.random.fold_in(k, j))(jnp.arange(x.shape[0]))
                built.append(Shard(x, r, ks, p, self.gathers[i]))
            else:
                built.append(_gather(self.gathers[i], x, r, k, p))
        return self.treedef.unflatten(built)

    def probes(self, residuals: tuple) -> tuple:
        """Zeros whose "gradient" says where a gather's backward pass ran:
        one per gather of every residual (a ``layers`` leaf's has one per
        layer)."""
        ndims = [
            len(s) - layer
            for s, layer in zip(self.residual_shapes, self.layers, strict=True)
            if s is not None
        ]
        return tuple(
            jnp.zeros(r.shape[: r.ndim - n]) for r, n in zip(residuals, ndims, strict=True)
        )

    def state_shardings(self, tx: optax.GradientTransformation, params):
        """The layout of ``tx.init(params)``: what JAX's sharding types give
        it when the parameters are typed with their shardings (a moment
        made by ``zeros_like`` is sharded as its parameter; a reduction or a
        new array is replicated), read on an Explicit copy of the mesh,
        whatever the user's axis types. Raises for a ``tx`` that averages
        over the devices itself."""
        who = "jc.data_parallel(shard_params=...)"
        try:
            shapes = jax.eval_shape(tx.init, params)
        except NameError as e:
            raise ValueError(averages_message(who, "tx.init", e)) from e
        name = _averaging_transform(shapes)
        if name is not None:
            raise ValueError(
                f"{who}: tx contains {name}, which averages the gradients over the devices "
                "itself; in the sharded step each device holds other slices of the "
                "parameters, so it would average different parameters. The step's own "
                "collectives average the gradients (ShardParams(gradients=...) compresses "
                "them): pass the optimizer alone, optax.adamw(1e-3) rather than "
                f"optax.chain({name}(...), optax.adamw(1e-3))"
            )
        names = self.mesh.axis_names
        explicit = Mesh(self.mesh.devices, names, axis_types=(AxisType.Explicit,) * len(names))
        typed = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(
                a.shape, a.dtype, sharding=NamedSharding(explicit, s)
            ),
            params,
            jax.tree.map(lambda s: s.spec, self.param_shardings),
        )
        found = []

        def init(p):
            out = tx.init(p)
            found.append(jax.tree.map(lambda x: jax.typeof(x).sharding.spec, out))
            return out

        try:
            with jax.set_mesh(explicit):
                jax.eval_shape(init, typed)
            specs = found[0]
        except Exception:  # an init that sharding types refuse: by shape instead
            specs = _specs_by_shape(shapes, params, self.param_shardings)
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def relayout_residuals(self, saved, from_shard_params, from_axis_sizes) -> tuple:
        """The residuals of a state saved on another mesh (``saved``: one
        array per residual, one row per old device), laid out for this one,
        what they owe the mean kept (``jc.data_parallel``'s ``relayout``)."""
        old_cfg = self.config if from_shard_params is None else from_shard_params
        old_sizes = _saved_sizes(old_cfg, from_axis_sizes, saved)
        old_shapes = [
            _residual_shape(old_cfg, d, s, layer, _shard_part(old_cfg, old_sizes))
            for d, s, layer in zip(self.dims, self.shapes, self.layers, strict=True)
        ]
        saved = list(saved)
        if len(saved) != sum(s is not None for s in old_shapes):
            raise ValueError(
                f"jc.data_parallel: relayout got {len(saved)} residuals, but the saved step "
                f"keeps {sum(s is not None for s in old_shapes)} (one per parameter with error "
                "feedback): pass from_shard_params=, the ShardParams the state was saved with"
            )
        new_sizes = tuple(self.mesh.shape[a] for a in self.data_axes)
        out, it = [], iter(saved)
        for i, (old, new) in enumerate(zip(old_shapes, self.residual_shapes, strict=True)):
            owed = None
            if old is not None:
                r = np.asarray(jax.device_get(next(it)), np.float64)
                if r.shape[1:] != old:
                    raise ValueError(
                        f"jc.data_parallel: relayout: the residual of {self.paths[i]} has shape "
                        f"{r.shape}, not ({int(np.prod(old_sizes))}, *{old}) as the saved step "
                        f"on data axes of sizes {old_sizes} keeps it"
                    )
                owed = _owed(old_cfg, old_sizes, self.dims[i], r, self.shapes[i])
            if new is None:
                if owed is not None and np.any(owed):
                    raise ValueError(
                        f"jc.data_parallel: relayout: {self.paths[i]} has a residual in the "
                        "saved state, but this step keeps none for it (no error feedback, or "
                        "below min_compress_size): what it owes would be lost. Build the step "
                        "with the saved state's error feedback"
                    )
                continue
            if owed is None:
                owed = np.zeros(self.shapes[i])
            out.append(_spread(self.config, new_sizes, self.dims[i], owed).astype(np.float32))
        return tuple(
            jax.device_put(r, s) for r, s in zip(out, self.residual_shardings, strict=True)
        )


def ShardedDataParallel(loss_fn, tx, mesh, shard_params, **kwargs):
    """Deprecated: ``jc.data_parallel(loss_fn, tx, mesh, shard_params=...)``."""
    import warnings

    from jaxcomp.train import DataParallel

    warnings.warn(
        "jc.fsdp.ShardedDataParallel is deprecated: use jc.data_parallel(loss_fn, tx, mesh, "
        "shard_params=...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return DataParallel(loss_fn, tx, mesh, shard_params=shard_params, **kwargs)


# -- planning, shared by init and relayout ---------------------------------------


def _plan(cfg: ShardParams, params, k: int, model_entries) -> tuple[list, list, list]:
    """Per leaf of ``params``: the sharded dimension (None: replicated), whether
    it is a ``layers`` leaf, its model-axis entries; checked against ``k``
    sharding devices."""
    dims, layers, model = [], [], []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        layer = bool(cfg.layers is not None and cfg.layers(path, x))
        dim = 1 if layer else 0
        if cfg.shard_dim is not None:
            dim = cfg.shard_dim(path, x)
        name = jax.tree_util.keystr(path)
        shape = tuple(np.shape(x))
        entries = model_entries(x)
        if cfg.shard_dim is None and len(shape) > dim and entries[dim] is not None:
            # The default dimension is laid out over a model axis: the first
            # other one that divides, else replicated over the data axes.
            free = [d for d in range(dim, len(shape)) if entries[d] is None and shape[d] % k == 0]
            dim = free[0] if free else None
        if layer and (dim is None or dim < 1 or dim >= len(shape)):
            raise ValueError(
                f"jc.data_parallel: ShardParams(layers=...) matched {name} of shape {shape}, "
                "which is not a stack of layers as layers= means: a stacked leaf has a leading "
                "layer axis and at least one more, and is sharded along one of the others "
                f"(shard_dim gave {dim!r}). Leave {name} out of layers="
            )
        if layer and entries[0] is not None:
            raise ValueError(
                f"jc.data_parallel: {name} is a layers leaf, and its layer axis is laid out over "
                f"{entries[0]!r}; the scan over layers needs every layer on every device"
            )
        if dim is not None and not 0 <= dim < max(len(shape), 1):
            raise ValueError(
                f"jc.data_parallel: shard_dim gave {dim!r} for {name} of shape "
                f"{shape}: a dimension of the leaf, or None to replicate it"
            )
        layers.append(layer)
        model.append(entries)
        if dim is None or not shape:
            dims.append(None)  # replicated, its gradient averaged exactly
            continue
        if entries[dim] is not None:
            raise ValueError(
                f"jc.data_parallel: {name} of shape {shape} is laid out over {entries[dim]!r} "
                f"along its dimension {dim}, the one the step shards over {cfg.axis!r}: shard "
                "it along another dimension (ShardParams(shard_dim=...)), or lay it out over "
                "the model axis along another"
            )
        if shape[dim] % k:
            stacked = not layer and len(shape) >= 3 and dim == 0 and shape[1] % k == 0
            hint = (
                " If its dimension 0 is a stack of layers (a model scanned over them), name "
                "it in ShardParams(layers=...): it is then sharded along dimension 1 and "
                "gathered one layer at a time."
                if stacked
                else ""
            )
            raise ValueError(
                f"jc.data_parallel: parameter {name} of shape {shape} cannot be "
                f"sharded: its dimension {dim} ({shape[dim]}) is not a multiple of the "
                f"{k} devices of {cfg.axis!r}.{hint} {'Otherwise pad' if hint else 'Pad'} that "
                f"dimension to a multiple of {k} (a vocabulary, say), shard it along another "
                "dimension "
                "(ShardParams.shard_dim), or use a mesh whose sharding axes divide it"
            )
        dims.append(dim)
    return dims, layers, model


def _compressed(cfg: ShardParams, shape: tuple, layer: bool) -> bool:
    """Whether a sharded leaf goes through the codecs: values per gather
    (per layer for a ``layers`` leaf) at least ``min_compress_size``."""
    n = int(np.prod(shape))
    return (n // shape[0] if layer else n) >= cfg.min_compress_size


def _residual_shape(cfg: ShardParams, dim, shape: tuple, layer: bool, shard_sizes: tuple):
    """What one device compresses of a leaf (its residual's shape), or None."""
    if dim is None or cfg.gradients is None or not cfg.error_feedback:
        return None
    if not _compressed(cfg, shape, layer):
        return None
    shape = list(shape)
    if cfg.replicate_over is not None or len(shard_sizes) == 2:
        shape[dim] //= shard_sizes[-1]  # HSDP's shard; (slow, fast): the slow hop's input
    return tuple(shape)


def _saved_sizes(cfg: ShardParams, sizes, residuals) -> tuple:
    """The saved mesh's data-axis sizes (``cfg.data_axes``' order)."""
    n_axes = len(cfg.data_axes)
    if sizes is None:
        if n_axes != 1:
            raise ValueError(
                "jc.data_parallel: relayout of a state saved on a two-level mesh needs "
                f"from_axis_sizes= (the sizes of {list(cfg.data_axes)})"
            )
        rows = {np.shape(r)[0] for r in residuals}
        if len(rows) > 1:
            raise ValueError(f"jc.data_parallel: relayout: residuals of {sorted(rows)} rows")
        return (rows.pop(),) if rows else (1,)
    sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (int(sizes),)
    if len(sizes) != n_axes:
        raise ValueError(
            f"jc.data_parallel: relayout: from_axis_sizes={sizes!r}, but the saved step's data "
            f"axes are {list(cfg.data_axes)}"
        )
    return sizes


def _shard_part(cfg: ShardParams, sizes: tuple) -> tuple:
    """The sharding axes' sizes among the data axes' ``sizes``."""
    return sizes[1:] if cfg.replicate_over is not None else sizes


def _owed(cfg: ShardParams, sizes: tuple, dim: int, r: np.ndarray, shape: tuple) -> np.ndarray:
    """What every device's residual (``r``: one row per device, the data axes
    row-major) owes the mean, per parameter element, float64 in the leaf's
    shape: ``sum over devices of the residual at its position / devices``."""
    devices = int(np.prod(sizes))
    full = np.zeros(np.moveaxis(np.zeros(shape, np.int8), dim, 0).shape)
    moved = np.moveaxis(r, dim + 1, 1)  # [devices, rows, ...]
    if cfg.replicate_over is not None:  # HSDP: device (s, f) owes shard f
        s, f = sizes
        blocks = full.reshape(f, -1, *full.shape[1:])
        blocks += moved.reshape(s, f, *moved.shape[1:]).sum(0)
    elif len(sizes) == 2:  # (slow, fast): row s' of device (s, f) is block s'*F + f
        s, f = sizes
        blocks = full.reshape(s, f, -1, *full.shape[1:])  # [s', f, rows/P, ...]
        parts = moved.reshape(s, f, s, -1, *moved.shape[2:]).sum(0)  # [f, s', rows/P, ...]
        blocks += np.swapaxes(parts, 0, 1)
    else:  # one axis: every device owes the whole parameter
        full += moved.sum(0)
    return np.moveaxis(full / devices, 0, dim)


def _spread(cfg: ShardParams, sizes: tuple, dim: int, owed: np.ndarray) -> np.ndarray:
    """Residuals, one row per device, that owe ``owed`` (:func:`_owed`'s
    inverse, the amount spread evenly over the devices holding each
    element)."""
    devices = int(np.prod(sizes))
    moved = np.moveaxis(owed, dim, 0)
    if cfg.replicate_over is not None:  # (s, f) holds shard f: S devices owe it
        s, f = sizes
        shards = moved.reshape(f, -1, *moved.shape[1:]) * (devices / s)
        rows = np.broadcast_to(shards[None], (s, *shards.shape)).reshape(devices, *shards.shape[1:])
    elif len(sizes) == 2:  # row s' of (s, f) is block s'*F + f: S devices owe it
        s, f = sizes
        blocks = moved.reshape(s, f, -1, *moved.shape[1:]) * (devices / s)  # [s', f, ...]
        per_fast = np.swapaxes(blocks, 0, 1).reshape(f, -1, *moved.shape[1:])  # [f, rows/F, ...]
        rows = np.broadcast_to(per_fast[None], (s, *per_fast.shape))
        rows = rows.reshape(devices, *per_fast.shape[1:])
    else:
        rows = np.broadcast_to(moved[None], (devices, *moved.shape))
    return np.moveaxis(np.ascontiguousarray(rows), 1, dim + 1)


def _specs_by_shape(shapes, params, shardings):
    """A state leaf's layout from the parameters' when sharding types cannot
    say it: a leaf shaped like exactly one layout of the parameters' takes
    it; every other leaf is replicated."""
    by_shape: dict = {}
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
        by_shape.setdefault(tuple(np.shape(x)), set()).add(s.spec)

    def spec(leaf):
        found = by_shape.get(tuple(leaf.shape), set())
        return next(iter(found)) if len(found) == 1 else P()

    return jax.tree.map(spec, shapes)


def averages_message(who: str, what: str, e: Exception) -> str:
    return (
        f"{who}: {what} runs a collective over a mesh axis ({e}); in the sharded step the "
        "optimizer runs on global arrays, outside shard_map, and the step's own collectives "
        "average the gradients. Pass an optimizer without collectives (no lax.pmean, no "
        "jc.optax.compress_gradients or jc.optax.uncompressed_mean in the chain)"
    )


def check_mesh(mesh: Mesh, axes: tuple, cfg: ShardParams) -> None:
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
    if len(names_of(cfg.axis)) == 2 and cfg.replicate_over is not None:
        raise ValueError(
            "jc.fsdp.ShardParams: replicate_over (HSDP) takes one sharding axis, got "
            f"axis={cfg.axis!r}"
        )
