"""A data-parallel train step for plain ``jax.jit`` on a mesh.

``jc.data_parallel(loss_fn, tx, mesh)`` is the layer between a user's loss
and an optax chain that holds a compressed all-reduce
(``jc.optax.compress_gradients``, ``onebit_adam``, ``powersgd``): it
returns a step that takes and returns global arrays (the batch sharded over
the data axis, the parameters replicated, the optimizer state with its
per-device parts sharded, as ``jc.optax.init`` lays them out) and runs the
per-device forward and backward pass and the optimizer update inside
``jax.shard_map`` itself. It is what ``hvd.DistributedOptimizer`` is to a
Horovod loop: the user keeps the loss, the model, the optimizer and the
loop; the step only moves the gradient average into the chain.

Flax NNX models are taken as they are: ``init(model)`` splits the module
into its parameters (trained, a plain dict) and the rest, and the loss
receives the module rebuilt from both; what the loss sets of the rest
(BatchNorm's running statistics) is averaged over the data axis and kept
for the next step. See docs/training-loop.md.

With ``jc.optax.diloco`` the replicas train copies of their own between
synchronizations, so the step lays the parameters out per replica (one
copy per device, sharded over the data axis) and returns each device's
loss; see docs/diloco.md.

Guards: the step refuses parameters laid out sharded over the devices
(it trains replicated ones, and would gather them onto every device
without a word; sharded training is ``shard_params=``, jaxcomp/fsdp.py), refuses an
optimizer whose update does not all-reduce
the gradients (every device would silently train its own copy of
parameters typed as replicated), and on XLA:CPU it keeps at most one step
in flight (``max_in_flight``), because many steps dispatched ahead can
abort the process in XLA's collective rendezvous on a busy machine.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import Literal
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._axes import names_of
from jaxcomp.collectives import all_finite
from jaxcomp.optax import CompressState, DiLoCoState, all_reduce_states, state_specs
from jaxcomp.optax import init as init_state

__all__ = ["DataParallel", "data_parallel"]


def _nnx():
    """flax.nnx if Flax is installed (it is optional), else None."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is in the examples extra
        return None
    return nnx


def _is_nnx_module(x) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Module)


class DataParallel:
    """A jitted data-parallel train step over ``mesh``: ``jc.data_parallel``.

    ``step = jc.data_parallel(loss_fn, tx, mesh)``, then ``params, state =
    step.init(params)`` and ``params, state, loss = step(params, state,
    batch)``, on global arrays; each device computes ``loss_fn`` and its
    gradient on its shard of the batch. Replicated (the default), ``tx``
    starts with the gradients' all-reduce (``jc.optax.compress_gradients``
    and the like) and runs on every device; sharded (``shard_params=``,
    docs/fsdp.md), ``tx`` is any optax optimizer. docs/training-loop.md.

    Args:
      loss_fn: ``loss_fn(params, batch)`` (``loss_fn(params, batch, key)``
        when the step is given a key): the scalar loss of this device's
        batch, or ``(loss, aux)`` with ``has_aux``; with Flax NNX, ``params`` is the module.
      tx: the optimizer (above).
      mesh: the device mesh; axes besides the data axes are model axes.
      axis_name: the data axis, or a ``(slow, fast)`` pair (replicated).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      accumulate_steps: microbatches per device per step (replicated).
      donate: donate the parameters and the state to the step.
      max_in_flight: the most steps dispatched and not yet finished;
        ``"auto"``: 1 on a CPU mesh of several devices, no bound elsewhere.
      shard_params: a :class:`jaxcomp.fsdp.ShardParams` (or a mesh axis):
        sharded training over its axes.
      require_all_reduce: refuse an update that does not all-reduce the
        gradients (replicated; False for what means it).
      overlap: send each bucket from inside the backward pass (replicated,
        ``tx`` starting with ``compress_gradients``); "auto": but on the CPU.
    """

    def __init__(
        self,
        loss_fn: Callable,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        axis_name="data",
        *,
        has_aux: bool = False,
        accumulate_steps: int = 1,
        donate: bool = True,
        max_in_flight: int | str | None = "auto",
        require_all_reduce: bool = True,
        shard_params=None,
        overlap: bool | str = "auto",
    ):
        if shard_params is None:
            axes = _check_arguments(loss_fn, tx, mesh, axis_name, accumulate_steps)
        else:
            from jaxcomp import fsdp

            if not isinstance(shard_params, fsdp.ShardParams):
                shard_params = fsdp.ShardParams(axis=shard_params)
            if axis_name != "data":
                raise ValueError(
                    "jc.data_parallel: with shard_params the axes are shard_params' "
                    f"(jc.fsdp.ShardParams(axis=...)); leave axis_name out, got {axis_name!r}"
                )
            if accumulate_steps != 1:
                raise ValueError(
                    "jc.data_parallel: with shard_params the step takes no accumulate_steps"
                )
            axes = shard_params.data_axes
            fsdp.check_mesh(mesh, axes, shard_params)
            axis_name = axes if len(axes) > 1 else axes[0]
        self.loss_fn = loss_fn
        self.tx = tx
        self.mesh = mesh
        self.axis_name = axis_name
        self.shard_params = shard_params
        self.has_aux = has_aux
        self.accumulate_steps = int(accumulate_steps)
        self.donate = donate
        self.require_all_reduce = bool(require_all_reduce)
        self.overlap = _overlap(overlap, mesh)
        self._overlap_asked = overlap is True  # then a step that cannot overlap raises
        self._axes = axes
        self._data_spec = P(axes if len(axes) > 1 else axes[0])
        self.batch_sharding = NamedSharding(mesh, self._data_spec)
        self.replicated = NamedSharding(mesh, P())
        self.per_replica = NamedSharding(mesh, P(axes[0]))
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self.max_in_flight = _in_flight_bound(max_in_flight, mesh, self.num_devices)
        self._explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
        self._in_flight: collections.deque = collections.deque()  # the unfinished steps' losses
        self._module = None  # (graphdef, parameter template, rest) for an NNX model
        self._step = None  # the jitted step, built on the first call
        self._per_replica = False  # parameters laid out per replica (diloco)
        self._param_shardings = None  # the parameters' layout, from init() or the first step
        self._layout = None  # sharded: the parameters' fsdp.Layout, from init()

    # -- state -------------------------------------------------------------

    def init(self, params) -> tuple[Any, Any]:
        """Places the parameters and creates the state on the mesh.

        Args:
          params: a pytree of arrays (host arrays, or arrays on the mesh:
            replicated over the data axes, or laid out over a model axis,
            a layout the step keeps), or a Flax NNX module (its
            ``nnx.Param`` variables are trained, as a pure dict).
        Returns:
          ``(params, state)``. Replicated: the parameters replicated over
          the data axes and ``jc.optax.init``'s optimizer state. Sharded:
          the parameters sharded over the sharding axes and a
          :class:`jaxcomp.fsdp.ShardedState`.
        """
        params = self._take_module(params)
        if self.shard_params is not None:
            return self._init_sharded(params)
        _check_replicated(params, "init", self._axes)
        self._param_shardings = self._layout_of(params)
        self._param_shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        params = self._copy(params, self._param_shardings)
        opt_state = init_state(self.tx, params, self.mesh, self.axis_name)
        self._per_replica = self._per_replica_of(opt_state)
        if self._per_replica:
            n, sharding = self.num_devices, self.per_replica
            params = jax.jit(
                lambda p: jax.tree.map(lambda a: jnp.stack([a] * n), p), out_shardings=sharding
            )(params)
        return params, opt_state

    def _init_sharded(self, params):
        from jaxcomp import fsdp

        layout = fsdp.Layout(self.shard_params, self.mesh, params, self._model_entries)
        self._check_model_axes(layout.model)
        self._layout = layout
        self._param_shardings = layout.param_shardings
        params = self._copy(params, layout.param_shardings)
        self._opt_shardings = layout.state_shardings(self.tx, params)
        opt_state = jax.jit(self.tx.init, out_shardings=self._opt_shardings)(params)
        count = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
        return params, fsdp.ShardedState(opt_state, layout.zero_residuals(), count)

    @staticmethod
    def _copy(params, shardings):
        """``params`` laid out as ``shardings``, a copy: the step donates its
        parameters, and must not delete the caller's (device_put may reuse
        the caller's buffer)."""
        params = jax.device_put(params, shardings)
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)

    def relayout(self, state, *, from_axis_sizes=None, from_shard_params=None):
        """A state saved on another mesh (another number of devices, or a
        two-level mesh), laid out for this step (after :meth:`init`), with
        what the error-feedback residuals owe the mean kept.

        Replicated: ``jc.optax.relayout`` of the optimizer state. Sharded:
        ``tx``'s state is global and moves as it is; each residual's sum
        over the devices at every parameter element, over their number, is
        kept exactly (up to one float32 rounding), spread evenly over the
        new devices that hold the element.

        Args:
          state: the saved state (host arrays, or arrays in any layout, as
            orbax restores them).
          from_axis_sizes: the saved mesh's data-axis sizes (one int for one
            axis; needed for a two-level mesh).
          from_shard_params: sharded: the saved step's ``ShardParams``, if
            not this step's.
        """
        if self._param_shardings is None:
            raise ValueError("jc.data_parallel: call init(params) before relayout(state)")
        if self.shard_params is None:
            from jaxcomp.optax import relayout

            return relayout(
                state,
                self.tx,
                self._param_shapes,
                self.mesh,
                self.axis_name,
                from_axis_sizes=from_axis_sizes,
            )
        from jaxcomp import fsdp

        residuals = self._layout.relayout_residuals(
            state.residuals, from_shard_params, from_axis_sizes
        )
        if jax.tree.structure(state.opt_state) != jax.tree.structure(self._opt_shardings):
            raise ValueError(
                "jc.data_parallel: relayout: the saved opt_state does not have the structure "
                "of tx.init(params) (is it from another optimizer?)"
            )
        opt_state = jax.device_put(state.opt_state, self._opt_shardings)
        return fsdp.ShardedState(opt_state, residuals, jax.device_put(state.step, self.replicated))

    def _layout_of(self, params):
        """The parameters' shardings: replicated over the data axes, laid
        out over a model axis as given."""
        self._check_model_axes([self._model_entries(x) for x in jax.tree.leaves(params)])
        return jax.tree.map(
            lambda x: NamedSharding(self.mesh, _spec(self._model_entries(x))), params
        )

    def _per_replica_of(self, opt_state) -> bool:
        """Whether ``opt_state`` is that of an optimizer whose replicas keep
        parameters of their own (``jc.optax.diloco``), checked against what
        this step supports."""
        if not any(isinstance(s, DiLoCoState) for s in all_reduce_states(opt_state)):
            return False
        others = [a for a in self.mesh.axis_names if a not in self._axes and self.mesh.shape[a] > 1]
        if others:
            raise ValueError(
                f"jc.data_parallel: jc.optax.diloco keeps one copy of the parameters per replica "
                f"and runs on a mesh of the data axes only, not one with {others} besides them"
            )
        if len(self._axes) > 1:
            raise ValueError(
                "jc.data_parallel: jc.optax.diloco runs over one data axis here, not the "
                f"pair {self.axis_name!r}; for a slow axis synchronized by diloco and a fast one "
                "averaged at every step, write the shard_map step of docs/diloco.md "
                "('Two levels')"
            )
        return True

    def _model_entries(self, x) -> tuple:
        """``x``'s layout over the mesh's axes other than the data axes (a
        model axis), as the caller gave it: one PartitionSpec entry per
        dimension (all None on a mesh of the data axes only)."""
        sharding = getattr(x, "sharding", None)
        spec = getattr(sharding, "spec", None)
        mesh = getattr(sharding, "mesh", None)
        ndim = np.ndim(x)
        if spec is None or mesh is None or tuple(mesh.axis_names) != tuple(self.mesh.axis_names):
            return (None,) * ndim
        entries = []
        for e in tuple(spec) + (None,) * (ndim - len(spec)):
            kept = tuple(a for a in names_of(e) if a is not None and a not in self._axes)
            entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
        return tuple(entries)

    def _check_model_axes(self, entries: list) -> None:
        """Refuses a mesh axis beyond the data axes that no parameter is laid
        out over (``entries``: :meth:`_model_entries` of every leaf): every
        device along it would compute the same step."""
        used = {a for leaf in entries for e in leaf if e is not None for a in names_of(e)}
        idle = [a for a in self.mesh.axis_names if a not in self._axes and a not in used]
        idle = [a for a in idle if self.mesh.shape[a] > 1]
        if idle:
            raise ValueError(
                f"jc.data_parallel: the mesh has axes {idle} besides the data axes "
                f"{list(self._axes)}, and no parameter is laid out over them, so every device "
                "along them would compute the same step. For tensor parallelism lay the "
                "parameters out over the model axis first (jax.device_put(params, "
                "NamedSharding(mesh, P(None, 'model')))); for HSDP pass "
                "shard_params=jc.fsdp.ShardParams(axis=..., replicate_over=...); otherwise "
                "pass a mesh of the data axes only"
            )

    # -- Flax NNX ------------------------------------------------------------

    def _take_module(self, params):
        """``params`` as a pytree of arrays: an NNX module's ``nnx.Param``
        variables as a pure dict, the module's structure and its other
        variables kept for the loss (:meth:`_loss`)."""
        if not _is_nnx_module(params):
            return params
        nnx = _nnx()
        graphdef, state, rest = nnx.split(params, nnx.Param, ...)
        _check_replicated(rest, "init", self._axes)
        template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        self._module = (graphdef, template, jax.device_put(rest, self.replicated))
        return _to_pure_dict(nnx, state)

    def module(self, params):
        """The NNX module rebuilt from trained ``params`` and the other
        variables as the last step left them (BatchNorm's running
        statistics averaged over the devices), for evaluation or to write
        back: ``nnx.update(model, nnx.state(step.module(params)))``."""
        if self._module is None:
            raise ValueError(
                "jc.data_parallel: module() rebuilds a Flax NNX model; init() was given a "
                "pytree of parameters, not an nnx.Module"
            )
        if self._per_replica:  # one copy per replica: the first
            params = jax.tree.map(lambda a: a[0], params)
        return self._merge(params, self._module[2])

    def _merge(self, params, rest):
        """The NNX module of ``params`` (a pure dict) and the other variables."""
        nnx = _nnx()
        graphdef, template, _ = self._module
        state = jax.tree.map(lambda a: a, template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state, rest)

    def _rest(self):
        """The NNX model's other variables for the next step (``()`` for a
        pytree of parameters)."""
        return () if self._module is None else self._module[2]

    def _keep_rest(self, changed) -> None:
        """Keeps the NNX variables a step set (``changed``: one entry per
        leaf of the rest, None where the loss left it alone)."""
        if any(c is not None for c in changed):
            leaves, treedef = jax.tree.flatten(self._module[2])
            new = [o if c is None else c for o, c in zip(leaves, changed, strict=True)]
            self._module = (*self._module[:2], treedef.unflatten(new))

    def _loss(self, params, rest, *args, mutated: list):
        """``(loss, (aux, rest))``: the user's loss and aux (None without
        ``has_aux``) and, for an NNX model, its non-parameter variables after
        the loss ran; ``mutated`` gets, at trace time, whether the loss set
        each of them (BatchNorm's statistics) or left it as it was."""
        if self._module is None:
            out, new_rest = self.loss_fn(params, *args), rest
        else:
            # Variables made in this trace: the loss may set them (Flax refuses
            # to set a Variable made in the trace outside value_and_grad's).
            model = self._merge(params, jax.tree.map(lambda a: a, rest))
            out = self.loss_fn(model, *args)
            new_rest = _nnx().split(model, _nnx().Param, ...)[2]
            if jax.tree.structure(new_rest) != jax.tree.structure(rest):
                raise ValueError(
                    "jc.data_parallel: the loss added or removed variables of the NNX module "
                    "(nnx.sow, a lazily created variable); the step carries only the "
                    "variables that init() saw. Return intermediates as aux (has_aux=True) "
                    "and create other variables in the module's __init__."
                )
            old = jax.tree.leaves(rest)
            mutated[:] = [n is not o for n, o in zip(jax.tree.leaves(new_rest), old, strict=True)]
        loss, aux = out if self.has_aux else (out, None)
        return loss, (aux, new_rest)

    # -- the batch -----------------------------------------------------------

    def shard_batch(self, local_batch):
        """A global batch from this process's part of it.

        Args:
          local_batch: a pytree of host arrays, the leading axis this
            process's examples (all of the batch in a one-process job).
        Returns:
          Global arrays sharded over the data axes
          (``jax.make_array_from_process_local_data``).
        """
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x)),
            local_batch,
        )

    def _check_batch(self, batch) -> None:
        leaves = jax.tree.leaves(batch)
        if not leaves:
            raise ValueError("jc.data_parallel: the batch has no arrays")
        per = self.num_devices * self.accumulate_steps
        for x in leaves:
            if not np.ndim(x) or np.shape(x)[0] % per:
                raise ValueError(
                    f"jc.data_parallel: every batch array needs a leading (batch) axis that is "
                    f"a multiple of {per} ({self.num_devices} data devices x accumulate_steps="
                    f"{self.accumulate_steps}); got shape {np.shape(x)}"
                )

    def _lay_out(self, x, sharding):
        """``x`` laid out as ``sharding`` inside the jitted step (a batch
        laid out otherwise, a host array say, is resharded: shard_map takes
        it as it is on Auto axes, but refuses a mismatch on Explicit ones)."""
        if self._explicit:
            return jax.sharding.reshard(x, sharding)
        return lax.with_sharding_constraint(x, sharding)

    # -- the step ----------------------------------------------------------

    def __call__(self, params, state, batch, key: jax.Array | None = None):
        """One training step.

        Args:
          params: the parameters, as :meth:`init` returned them (or the
            previous step).
          state: the optimizer state (sharded: the ``ShardedState``), likewise.
          batch: a pytree of global arrays whose leading axis is the global
            batch, a multiple of the number of data devices (times
            ``accumulate_steps``); best sharded as ``batch_sharding``
            (:meth:`shard_batch`), else it is resharded.
          key: an optional PRNG key (dropout, augmentation): the loss gets
            ``fold_in(key, device index)`` (and the microbatch index when
            accumulating), a different key on every device.
        Returns:
          ``(params, state, loss)``, or ``(params, state, (loss, aux))`` with
          ``has_aux``: the loss averaged over the devices (and
          microbatches); aux's floating-point leaves averaged likewise, its
          integer leaves summed. Under ``jc.optax.diloco``, each device's own
          instead (a leading axis of one entry per device).
        """
        self._check_batch(batch)
        step = self._built(params, state)
        if self.shard_params is None:
            if self._per_replica:
                self._check_per_replica(params)
            else:
                _check_replicated(params, "the step", self._axes)
        keys = () if key is None else (key,)  # jit traces each arity once
        self._wait_for_room()
        params, state, out, changed = step(params, state, batch, self._rest(), *keys)
        if self.max_in_flight is not None:
            self._in_flight.append(out)  # ready when the step has finished
        self._keep_rest(changed)
        return params, state, out

    def lower(self, params, state, batch, key: jax.Array | None = None):
        """The step lowered for these arguments (``jax.stages.Lowered``):
        ``.compile()`` gives the executable the calls run, whose
        ``as_text()`` holds its collectives and ``memory_analysis()`` its
        buffers."""
        keys = () if key is None else (key,)
        return self._built(params, state).lower(params, state, batch, self._rest(), *keys)

    def _built(self, params, state):
        """The jitted step, built on the first call."""
        if self._step is not None:
            return self._step
        if self.shard_params is not None:
            if self._layout is None:
                raise ValueError("jc.data_parallel: call init(params) before the step")
            self._step = self._build_sharded()
            return self._step
        state_specs(state, self.axis_name, strict=False)  # raises for one made off the mesh
        self._per_replica = self._per_replica_of(state)
        if self._param_shardings is None:  # a state made without init()
            self._param_shardings = self._layout_of(params)
        self._step = self._build()
        return self._step

    def _wait_for_room(self) -> None:
        """Blocks until fewer than ``max_in_flight`` steps are unfinished.

        A step's outputs are ready once its program has finished on every
        device (its loss is an output of that program), so waiting on the
        oldest pending loss frees its slot without touching the parameters
        that the next step donates.
        """
        while self.max_in_flight is not None and len(self._in_flight) >= self.max_in_flight:
            jax.block_until_ready(self._in_flight.popleft())

    def _check_per_replica(self, params) -> None:
        for x in jax.tree.leaves(params):
            spec = getattr(getattr(x, "sharding", None), "spec", ())
            if (
                not np.ndim(x)
                or np.shape(x)[0] != self.num_devices
                or tuple(spec)[:1] != (self._axes[0],)
            ):
                raise ValueError(
                    "jc.data_parallel: under jc.optax.diloco the parameters are one copy per "
                    f"replica, a leading axis of {self.num_devices} sharded over "
                    f"{self._axes[0]!r}, as init() returns them; got shape {np.shape(x)}"
                )

    def _device_grads(self, loss_of, params, rest, batch, key, extra=()):
        """What every device computes first, in both modes: the loss and
        the gradients of ``loss_of(params, *extra, rest, batch, *key)`` with
        respect to ``params`` and ``extra``, its key folded with the
        device's index, the NNX streams a stream per device. Returns
        ``((loss, aux), grads, rest, mutated)``."""
        axes = self._axes if len(self._axes) > 1 else self._axes[0]
        if key is not None:
            key = jax.random.fold_in(key, lax.axis_index(axes))
        rest = _per_device_streams(rest, axes)
        mutated: list = []
        loss = functools.partial(loss_of, mutated=mutated)
        if self.accumulate_steps > 1:
            grad_fn = jax.value_and_grad(loss, has_aux=True)
            out, grads, rest = self._accumulate(grad_fn, params, rest, batch, key)
            return out, grads, rest, mutated
        argnums = tuple(range(1 + len(extra)))
        grad_fn = jax.value_and_grad(loss, argnums=argnums, has_aux=True)
        args = () if key is None else (key,)
        (loss, (aux, rest)), grads = grad_fn(params, *extra, rest, batch, *args)
        return (loss, aux), grads if extra else grads[0], rest, mutated

    def _build(self):
        """The replicated step: ``tx`` (with its all-reduce) on every device."""
        axes = self._axes if len(self._axes) > 1 else self._axes[0]
        per_replica = self._per_replica

        def local(params, opt_state, batch, rest, key=None):
            if per_replica:  # this replica's copy
                params = jax.tree.map(lambda a: a[0], params)
            overlapped = self._overlapped(params, opt_state)
            if overlapped is None:
                (loss, aux), grads, rest, mutated = self._device_grads(
                    self._loss, params, rest, batch, key
                )
                if self.require_all_reduce and not per_replica:
                    check_all_reduce(self.tx, grads, opt_state, params, self.axis_name)
            else:  # the chain's first transformation reduces in the backward pass
                at, reducer = overlapped
                state = _at(opt_state, at)
                wrap, extra = reducer.hooks(
                    params, state, self._first_use(params, rest, batch, key)
                )

                def loss_of(params, extra, rest, batch, *key, mutated):
                    return self._loss(wrap(params, extra), rest, batch, *key, mutated=mutated)

                (loss, aux), (grads, new_extra), rest, mutated = self._device_grads(
                    loss_of, params, rest, batch, key, extra=(extra,)
                )
                opt_state = _replace_at(opt_state, at, reducer.reduced(state, new_extra))
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            out = (loss, aux) if self.has_aux else loss
            if not per_replica:
                return (
                    params,
                    opt_state,
                    _reduce_metrics(out, axes),
                    _average_mutated(rest, mutated, axes),
                )
            if any(mutated):
                raise ValueError(
                    "jc.data_parallel: under jc.optax.diloco the loss may not set NNX variables "
                    "(BatchNorm's statistics): averaging them would be a collective at every "
                    "step, and the steps within a round run none"
                )
            expand = functools.partial(jax.tree.map, lambda a: jnp.asarray(a)[None])
            return expand(params), opt_state, expand(out), [None] * len(mutated)

        def step(params, opt_state, batch, rest, *key):
            specs = state_specs(opt_state, self.axis_name, strict=False)
            own = self._data_spec if per_replica else P()  # parameters, metrics
            batch = jax.tree.map(lambda x: self._lay_out(x, self.batch_sharding), batch)
            f = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(
                    own,
                    specs,
                    jax.tree.map(lambda _: self._data_spec, batch),
                    P(),
                    *((P(),) * len(key)),
                ),
                out_specs=(own, specs, own, P()),
                # Manual over the data axes only: a model axis stays XLA's.
                axis_names=frozenset(self._axes),
                # jc.pmean's value is identical on every device but comes out of
                # all_gathers that JAX types as per-device (docs/collectives.md).
                check_vma=False,
            )
            params, opt_state, out, changed = f(params, opt_state, batch, rest, *key)
            if not per_replica:  # the parameters' layout over a model axis, as given
                params = self._keep_layout(params)
            return params, opt_state, out, changed

        return jax.jit(step, donate_argnums=(0, 1) if self.donate else ())

    def _build_sharded(self):
        """The sharded step: gathers and reduce-scatters in the backward
        pass, inside ``shard_map``; ``tx`` on the global mean gradients."""
        from jaxcomp import fsdp

        layout, cfg = self._layout, self.shard_params
        axes = layout.axes

        def local(params, residuals, batch, rest, count, *key):
            residuals = tuple(r[0] for r in residuals)
            probes = layout.probes(residuals)
            base = jax.random.fold_in(jax.random.key(cfg.seed), count)

            def loss_of(shards, residuals, probes, rest, batch, *key, mutated):
                params = layout.gathered(shards, (residuals, probes), base)
                return self._loss(params, rest, batch, *key, mutated=mutated)

            (loss, aux), (grads, new_res, ran), rest, mutated = self._device_grads(
                loss_of, params, rest, batch, key[0] if key else None, extra=(residuals, probes)
            )
            # A residual comes back as its "gradient" where its gather's
            # backward pass ran (the probe's gradient is 1 there), else as it
            # was: a parameter the loss did not use keeps what it owes.
            new_res = tuple(
                jnp.where(g.reshape(g.shape + (1,) * (r.ndim - g.ndim)) > 0, n, r)
                for g, n, r in zip(ran, new_res, residuals, strict=True)
            )
            # Replicated leaves: their gradients averaged exactly.
            g = layout.treedef.flatten_up_to(grads)
            g = [
                lax.pmean(x, axes) if d is None else x for x, d in zip(g, layout.dims, strict=True)
            ]
            # A step whose mean gradient is not finite changes nothing (every
            # device agrees: the flag is reduced over the data axes).
            ok = all_finite(jax.tree.leaves((g, new_res))).astype(jnp.int32)
            ok = lax.pmin(ok, axes).astype(bool)
            out = _reduce_metrics((loss, aux) if self.has_aux else loss, axes)
            return (
                layout.treedef.unflatten(g),
                tuple(r[None] for r in new_res),
                ok,
                out,
                _average_mutated(rest, mutated, axes),
            )

        def step(params, state, batch, rest, *key):
            batch = jax.tree.map(lambda x: self._lay_out(x, self.batch_sharding), batch)
            per_device = tuple(P(axes) for _ in state.residuals)
            f = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(
                    layout.manual_specs,
                    per_device,
                    jax.tree.map(lambda _: P(axes), batch),
                    P(),
                    P(),
                    *((P(),) * len(key)),
                ),
                out_specs=(layout.manual_specs, per_device, P(), P(), P()),
                axis_names=frozenset(self._axes),
                check_vma=False,
            )
            grads, residuals, ok, out, changed = f(
                params, state.residuals, batch, rest, state.step, *key
            )
            # A step that is not finite changes nothing. A branch rather than a
            # select of new against old: the update's buffers can then take the
            # old ones' place, as they would without the rule.
            params, opt_state = lax.cond(
                ok,
                self._update,
                lambda g, o, p: (p, o),
                grads,
                state.opt_state,
                params,
            )
            residuals = jax.tree.map(
                lambda new, old: jnp.where(ok, new, old), residuals, state.residuals
            )
            return params, fsdp.ShardedState(opt_state, residuals, state.step + 1), out, changed

        return jax.jit(step, donate_argnums=(0, 1) if self.donate else ())

    def _overlapped(self, params, opt_state):
        """Where in ``opt_state`` the ``compress_gradients`` state is whose
        reduction the backward pass runs, and ``tx``'s reducer for it (the
        first transformation of the chain), or None (after the backward
        pass)."""
        if not self.overlap:
            return None
        made = jax.eval_shape(self.tx.init, params)
        at = _first_compress(made)
        why = None
        if self._per_replica or self.accumulate_steps > 1:
            why = "jc.optax.diloco and accumulate_steps > 1 reduce once, after the microsteps"
        elif at is None:
            why = "tx does not start with jc.optax.compress_gradients (as optax.chain's first)"
        elif _first_compress(opt_state) != at:
            why = "the state was not made by tx.init"
        if why is None:
            return at, _at(made, at).comm.reducer
        if self._overlap_asked:
            raise ValueError(
                f"jc.data_parallel: overlap=True, but the buckets cannot be sent from inside "
                f"the backward pass: {why}. Leave overlap at its default ('auto') to reduce "
                "after the backward pass where it cannot."
            )
        return None

    def _first_use(self, params, rest, batch, key) -> list:
        """Per parameter leaf, where the loss first uses it (see
        :func:`_first_uses`)."""
        args = () if key is None else (key,)
        closed = jax.make_jaxpr(lambda p: self._loss(p, rest, batch, *args, mutated=[])[0])(params)
        return _first_uses(closed.jaxpr, len(jax.tree.leaves(params)))

    def _update(self, grads, opt_state, params):
        """``tx``'s update on global arrays, partitioned by XLA (sharded)."""
        from jaxcomp import fsdp

        def update(g, o, p):
            updates, o = self.tx.update(g, o, p)
            return optax.apply_updates(p, updates), o

        shardings = (self._param_shardings, self._opt_shardings)
        if self._explicit:  # XLA lays out what the update computes in between
            update = jax.sharding.auto_axes(update, out_sharding=shardings)
        try:
            out = update(grads, opt_state, params)
        except NameError as e:  # a collective over a data axis, which is not bound here
            raise ValueError(
                fsdp.averages_message("jc.data_parallel(shard_params=...)", "tx", e)
            ) from e
        if not self._explicit:
            out = lax.with_sharding_constraint(out, shardings)
        return out

    def _keep_layout(self, params):
        if all(self.mesh.shape[a] == 1 for a in self.mesh.axis_names if a not in self._axes):
            return params  # a mesh of the data axes: replicated, as shard_map returns them
        return self._lay_out(params, self._param_shardings)

    def _accumulate(self, grad_fn, params, rest, batch, key):
        """Gradient accumulation: the local batch in ``accumulate_steps``
        microbatches, their gradients and ``(loss, aux)`` averaged, one
        update; the NNX variables the loss sets go from one microbatch to
        the next, as they would over as many steps."""
        k = self.accumulate_steps
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

        def body(carry, inputs):
            total, rest = carry
            i, mb = inputs
            args = () if key is None else (jax.random.fold_in(key, i),)
            (loss, (aux, rest)), grads = grad_fn(params, rest, mb, *args)
            return (jax.tree.map(jnp.add, total, ((loss, aux), grads)), rest), None

        first = jax.tree.map(lambda x: x[0], micro)
        (loss, (aux, _)), grads = jax.eval_shape(
            lambda: grad_fn(params, rest, first, *(() if key is None else (key,)))
        )
        shapes = ((loss, aux), grads)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _acc_dtype(s.dtype)), shapes)
        (total, rest), _ = lax.scan(body, (zeros, rest), (jnp.arange(k), micro))
        out, grads = total
        grads = jax.tree.map(lambda g, s: (g / k).astype(s.dtype), grads, shapes[1])

        def mean(x, s):
            return (x / k).astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else x

        return jax.tree.map(mean, out, shapes[0]), grads, rest


# -- does the update all-reduce the gradients? --------------------------------
# The primitives that move data between the devices of a mesh axis. Any of
# them counts as the all-reduce (a ring is ppermutes, two-phase an all_to_all
# then an all_gather): the check looks for a chain with none at all on the way
# from a gradient to a replicated output, not for a proof of invariance.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum_invariant",
        "pmax",
        "pmin",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "ppermute",
        "reduce_scatter",
    }
)
# What each value of the update's jaxpr depends on: (this device's data?,
# the axes of the collectives it passed through).
_CLEAN = (False, frozenset())


def check_all_reduce(tx, grads, opt_state, params, axis_name) -> None:
    """Raises if ``tx.update`` would leave a replicated output (an update,
    or a state leaf laid out as replicated) that depends on this device's
    gradient without passing through a collective over every data axis
    of more than one device (a one-device mesh, a GPU's, has nothing to
    average, and jaxcomp's all-reduce over it moves nothing).

    Called inside the step's ``shard_map``, where the axes are bound: it
    traces ``tx.update`` once more into a jaxpr and follows each value's
    dependencies (:func:`_flow`). ``check_vma`` cannot say it: jaxcomp's
    all-reduce ends in all_gathers that JAX types as per-device.
    """
    axes = {
        a for a in names_of(axis_name) if lax.axis_size(a) > 1
    }  # one device: nothing to average
    if not axes:
        return
    closed, (updates, state) = jax.make_jaxpr(tx.update, return_shape=True)(
        grads, opt_state, params
    )
    per_device = [s != P() for s in _flat_specs(state_specs(opt_state, axis_name, strict=False))]
    sources = [True] * len(jax.tree.leaves(grads)) + per_device
    sources += [False] * len(jax.tree.leaves(params))
    if len(sources) != len(closed.jaxpr.invars):  # an input jax flattened otherwise
        return
    outs = _flow(closed.jaxpr, [(s, frozenset()) for s in sources])
    named = [("updates" + jax.tree_util.keystr(k), P()) for k, _ in _with_path(updates)]
    specs = _flat_specs(state_specs(state, axis_name, strict=False))
    named += [
        ("opt_state" + jax.tree_util.keystr(k), s)
        for (k, _), s in zip(_with_path(state), specs, strict=True)
    ]
    for (name, spec), (local, reduced) in zip(named, outs, strict=True):
        if spec == P() and local and not axes <= reduced:
            raise ValueError(_not_reduced_message(name, axis_name, axes - reduced))


def _not_reduced_message(name: str, axis_name, missing) -> str:
    axis = axis_name if isinstance(axis_name, str) else tuple(axis_name)
    missing = ", ".join(repr(a) for a in sorted(missing))
    return (
        f"jc.data_parallel: the optimizer does not average the gradients over the data "
        f"axis {missing}: {name} depends on this device's gradient without passing "
        "through a collective, so every device would update its own copy of parameters "
        "typed as replicated and the copies would silently drift apart. Put the all-reduce "
        f"first in the chain: optax.chain(jc.optax.compress_gradients(codec, {axis!r}), "
        f"optax.adam(1e-3)), or optax.chain(jc.optax.uncompressed_mean({axis!r}), optax.adam(1e-3)) "
        "for the uncompressed baseline (also jc.optax.onebit_adam, jc.optax.powersgd)."
    )


def _flat_specs(specs) -> list:
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def _with_path(tree) -> list:
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def _flow(jaxpr, inputs: list) -> list:
    """What each output of ``jaxpr`` depends on, given its inputs' (see
    ``_CLEAN``): a value depends on whatever its operands depend on, plus
    the axes of the collectives that made it. A call (jit, custom_jvp,
    custom_vjp, remat) is followed inside; a loop or a branch (scan,
    while, cond) is taken whole: its outputs depend on all its inputs and
    on every collective in its body."""
    env = dict(zip(jaxpr.invars, inputs, strict=True))

    def read(v):
        return _CLEAN if isinstance(v, Literal) else env.get(v, _CLEAN)

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = _call_body(eqn)
        if body is not None:
            outs = _flow(body, ins)
        else:
            local = any(t[0] for t in ins) or eqn.primitive.name == "axis_index"
            reduced = frozenset().union(*(t[1] for t in ins), _collective_axes(eqn))
            outs = [(local, reduced)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


# What moves or casts a parameter without using it: the use that matters to
# the backward pass is the first one of what these make of it.
_NOT_A_USE = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
    }
)


def _first_uses(jaxpr, n: int) -> list:
    """Per input ``i < n`` of ``jaxpr``, the position (in program order,
    calls followed inside) of the first equation that uses it or a cast or
    reshape of it; ``inf`` where nothing does. The backward pass has the
    complete gradient of a parameter once it has passed its first use."""
    first: dict[int, int] = {}
    position = iter(range(1 << 62))

    def walk(jaxpr, env):
        for eqn in jaxpr.eqns:
            t = next(position)
            ins = [
                frozenset() if isinstance(v, Literal) else env.get(v, frozenset())
                for v in eqn.invars
            ]
            tracked = frozenset().union(*ins)
            if not tracked:
                continue
            body = _call_body(eqn)
            if body is not None:  # what the call returns of a parameter, cast, is it
                inner = walk(body, {v: ix for v, ix in zip(body.invars, ins, strict=True) if ix})
                outs = [None if isinstance(v, Literal) else inner.get(v) for v in body.outvars]
                env.update((o, ix) for o, ix in zip(eqn.outvars, outs, strict=True) if ix)
            elif eqn.primitive.name in _NOT_A_USE:
                env.update((v, tracked) for v in eqn.outvars)
            else:
                for i in tracked:
                    first.setdefault(i, t)
        return env

    walk(jaxpr, {v: frozenset((i,)) for i, v in enumerate(jaxpr.invars[:n])})
    return [first.get(i, float("inf")) for i in range(n)]


def _first_compress(state, at: tuple = ()):
    """The path of the first transformation's state, following the first
    element of chains, if it is a :class:`~jaxcomp.optax.CompressState`."""
    if isinstance(state, CompressState):
        return at
    if type(state) is tuple and state:
        return _first_compress(state[0], (*at, 0))
    return None


def _at(state, at: tuple):
    for i in at:
        state = state[i]
    return state


def _replace_at(state, at: tuple, value):
    if not at:
        return value
    i = at[0]
    return (*state[:i], _replace_at(state[i], at[1:], value), *state[i + 1 :])


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for j in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(j, "eqns"):
                yield j
            elif hasattr(getattr(j, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                yield j.jaxpr


def _call_body(eqn):
    """The jaxpr of a call whose inputs and outputs are the equation's, else None."""
    if eqn.primitive.name in ("scan", "while"):
        return None
    bodies = list(_subjaxprs(eqn))
    if len(bodies) == 1 and (len(bodies[0].invars), len(bodies[0].outvars)) == (
        len(eqn.invars),
        len(eqn.outvars),
    ):
        return bodies[0]
    return None


def _collective_axes(eqn) -> frozenset:
    """The mesh axes of the collectives of ``eqn`` and of its sub-jaxprs."""
    axes = set()
    if eqn.primitive.name in _COLLECTIVES:
        names = eqn.params.get("axes", eqn.params.get("axis_name", ()))
        axes.update(names if isinstance(names, (tuple, list)) else (names,))
    for body in _subjaxprs(eqn):
        for inner in body.eqns:
            axes |= _collective_axes(inner)
    return frozenset(axes)


def _check_arguments(loss_fn, tx, mesh, axis_name, accumulate_steps) -> tuple:
    """The data axes, after checking :func:`data_parallel`'s arguments."""
    if not callable(loss_fn):
        raise TypeError(f"jc.data_parallel: loss_fn must be callable, got {loss_fn!r}")
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(
            "jc.data_parallel: tx must be an optax.GradientTransformation (for example "
            "optax.chain(jc.optax.compress_gradients(codec, 'data'), optax.sgd(0.1))), got "
            f"{type(tx).__name__}"
        )
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"jc.data_parallel: mesh must be a jax.sharding.Mesh (jax.make_mesh((8,), "
            f"('data',))), got {type(mesh).__name__}"
        )
    axes = names_of(axis_name)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown or not axes:
        raise ValueError(
            f"jc.data_parallel: axis_name {axis_name!r} is not an axis of the mesh, whose "
            f"axes are {mesh.axis_names}"
        )
    if not isinstance(accumulate_steps, (int, np.integer)) or accumulate_steps < 1:
        raise ValueError(
            f"jc.data_parallel: accumulate_steps must be an int >= 1, got {accumulate_steps!r}"
        )
    return axes


def _check_replicated(params, where: str, axes: tuple) -> None:
    """Raises for a parameter laid out sharded over the data ``axes`` (a
    layout over the mesh's other axes, a model axis, is kept): the step
    replicates the parameters over the data axes, and would otherwise
    gather it onto every device without a word."""

    def sharded(x) -> bool:
        sharding = getattr(x, "sharding", None)
        if sharding is None or sharding.is_fully_replicated:
            return False
        spec = getattr(sharding, "spec", None)
        if spec is None:
            return True
        return any(a in axes for e in spec if e is not None for a in names_of(e))

    if not any(sharded(x) for x in jax.tree.leaves(params)):
        return  # every step: no paths computed unless one is sharded
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not sharded(x):
            continue
        spec = getattr(x.sharding, "spec", x.sharding)
        raise ValueError(
            f"jc.data_parallel: {where} got parameter {jax.tree_util.keystr(path)} sharded "
            f"over the devices ({spec}), but the step trains replicated parameters (pure "
            "data parallelism: every device holds the whole model) and would silently "
            "gather it onto every device. For sharded (FSDP) training pass "
            "shard_params= (jc.fsdp.ShardParams; docs/fsdp.md). If the model fits on one "
            "device, replicate it yourself first: "
            "jax.device_put(params, NamedSharding(mesh, P()))."
        )


def _spec(entries) -> P:
    """The PartitionSpec of ``entries`` without trailing Nones (``P()``, as one writes it)."""
    entries = list(entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _to_pure_dict(nnx, state) -> dict:
    # nnx.to_pure_dict since flax 0.11; State.to_pure_dict before
    to_pure = getattr(nnx, "to_pure_dict", None)
    return to_pure(state) if to_pure is not None else state.to_pure_dict()


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.inexact) else dtype


def _reduce_metrics(out, axes):
    def reduce(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return lax.pmean(x, axes)
        return lax.psum(x, axes)

    return jax.tree.map(reduce, out)


def _per_device_streams(rest, axes):
    """The NNX variables with the device's index along the data axes folded
    into every PRNG key among them (the ``nnx.Rngs`` a module holds, such as
    ``nnx.Dropout``'s), so that each device draws a stream of its own:
    data parallelism with the same dropout mask on every device is another,
    weaker regularizer. The step keeps the keys as they were (the loss only
    advances the streams' counters), so every step folds the same keys."""

    def fold(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            return jax.random.fold_in(x, lax.axis_index(axes))
        return x

    return jax.tree.map(fold, rest)


def _average_mutated(rest, mutated: list, axes) -> list:
    """The NNX variables the loss set, one entry per leaf of ``rest`` (None
    where the loss left it alone, so the step does not copy it): floating
    ones averaged over the data axes, as data-parallel BatchNorm averages
    its running statistics; others (an RNG counter, which every device
    advances alike) as they are."""

    def average(x):
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return lax.pmean(x, axes)
        return x

    leaves = jax.tree.leaves(rest)
    mutated = mutated or [False] * len(leaves)  # a pytree of parameters: no such variables
    return [average(x) if m else None for x, m in zip(leaves, mutated, strict=True)]


def _overlap(overlap, mesh: Mesh) -> bool:
    """``overlap`` checked, with "auto" resolved per platform: on GPUs and
    TPUs, whose collectives run asynchronously beside the backward pass;
    not on the CPU, whose executor runs the backward pass's matrix products
    beside a collective for little of a step, so that the ordering of the
    buckets costs more than it hides (docs/benchmarks.md, "Communication in
    the backward pass")."""
    if isinstance(overlap, str) and overlap == "auto":
        return mesh.devices.flat[0].platform != "cpu"
    if not isinstance(overlap, bool):
        raise ValueError(
            f'jc.data_parallel: overlap must be True, False or "auto", got {overlap!r}'
        )
    return overlap


def _in_flight_bound(max_in_flight, mesh: Mesh, num_devices: int) -> int | None:
    """``max_in_flight`` checked, with "auto" resolved per platform.

    XLA:CPU aborts a process whose collective rendezvous waits longer than
    40 s. Its devices' programs share a pool of max(cores, devices) threads,
    and a participant holds one until all have arrived: with many steps
    dispatched ahead on a busy machine, the threads can fill with one
    step's participants waiting for devices still in an earlier step
    (docs/training-loop.md, "Steps in flight"). With one step in flight,
    every waiting participant waits for its own step's. GPUs (and one
    device, which has no collective) keep JAX's asynchronous dispatch.
    """
    if isinstance(max_in_flight, str) and max_in_flight == "auto":
        cpu = mesh.devices.flat[0].platform == "cpu"
        return 1 if cpu and num_devices > 1 else None
    if max_in_flight is None:
        return None
    if (
        isinstance(max_in_flight, bool)
        or not isinstance(max_in_flight, (int, np.integer))
        or max_in_flight < 1
    ):
        raise ValueError(
            'jc.data_parallel: max_in_flight must be "auto", an int >= 1 or None (no bound), '
            f"got {max_in_flight!r}"
        )
    return int(max_in_flight)


# The function-style name that the docs use: the class is the step.
data_parallel = DataParallel
