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
into its parameters (trained, a plain dict) and the rest (kept as it was),
and the loss receives the module rebuilt from both. See
docs/training-loop.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

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
    """A compiled data-parallel train step over a mesh (see :func:`data_parallel`).

    Attributes:
      mesh: the device mesh.
      axis_name: the data-parallel axis (or the ``(slow, fast)`` pair).
      batch_sharding: the ``NamedSharding`` of a global batch (leading axis
        split over the data axes).
      replicated: the ``NamedSharding`` of the parameters.
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
    ):
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
        axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown or not axes:
            raise ValueError(
                f"jc.data_parallel: axis_name {axis_name!r} is not an axis of the mesh, whose "
                f"axes are {mesh.axis_names}"
            )
        others = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
        if others:
            raise ValueError(
                f"jc.data_parallel: the mesh has axes {others} besides the data axes {axes}. "
                "The step replicates the parameters over the whole mesh (pure data "
                "parallelism); for model parallelism write the shard_map step by hand "
                "(docs/training-loop.md), or pass a mesh of the data axes only."
            )
        if not isinstance(accumulate_steps, (int, np.integer)) or accumulate_steps < 1:
            raise ValueError(
                f"jc.data_parallel: accumulate_steps must be an int >= 1, got {accumulate_steps!r}"
            )
        self.loss_fn = loss_fn
        self.tx = tx
        self.mesh = mesh
        self.axis_name = axis_name
        self.has_aux = has_aux
        self.accumulate_steps = int(accumulate_steps)
        self.donate = donate
        self._axes = axes
        self._data_spec = P(axes if len(axes) > 1 else axes[0])
        self.batch_sharding = NamedSharding(mesh, self._data_spec)
        self.replicated = NamedSharding(mesh, P())
        self.num_devices = int(np.prod([mesh.shape[a] for a in axes]))
        self._module = None  # (graphdef, parameter template, rest) for an NNX model
        self._step = None  # the jitted step, built on the first call

    # -- state -------------------------------------------------------------

    def init(self, params) -> tuple[Any, Any]:
        """Places the parameters and creates the optimizer state on the mesh.

        Args:
          params: a pytree of arrays, or a Flax NNX module (its ``nnx.Param``
            variables are trained, as a plain dict; the other variables are
            kept as they are and given to the loss with them).
        Returns:
          ``(params, opt_state)``: the parameters replicated over the mesh and
          the state of ``jc.optax.init`` (per-device residuals sharded over
          the data axis).
        """
        from jaxcomp.optax import init as init_state

        if _is_nnx_module(params):
            nnx = _nnx()
            graphdef, state, rest = nnx.split(params, nnx.Param, ...)
            template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
            self._module = (graphdef, template, jax.device_put(rest, self.replicated))
            params = _to_pure_dict(nnx, state)
        # A copy: the step donates its parameters, and must not delete the caller's.
        # (device_put may reuse the caller's buffer on one device).
        params = jax.device_put(params, self.replicated)
        params = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.replicated)(params)
        return params, init_state(self.tx, params, self.mesh, self.axis_name)

    def module(self, params):
        """The NNX module rebuilt from trained ``params`` (for evaluation or
        to write back: ``nnx.update(model, nnx.state(step.module(params)))``)."""
        if self._module is None:
            raise ValueError(
                "jc.data_parallel: module() rebuilds a Flax NNX model; init() was given a "
                "pytree of parameters, not an nnx.Module"
            )
        return self._merge(params, self._module[2])

    def _merge(self, params, rest):
        """The NNX module of ``params`` (a pure dict) and the other variables."""
        nnx = _nnx()
        graphdef, template, _ = self._module
        state = jax.tree.map(lambda a: a, template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state, rest)

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

    # -- the step ----------------------------------------------------------

    def __call__(self, params, opt_state, batch, key: jax.Array | None = None):
        """One training step.

        Args:
          params: the parameters, as :meth:`init` returned them (or the
            previous step).
          opt_state: the optimizer state, likewise.
          batch: a pytree of global arrays whose leading axis is the global
            batch, a multiple of the number of data devices (times
            ``accumulate_steps``); best sharded as ``batch_sharding``
            (:meth:`shard_batch`), else it is resharded.
          key: an optional PRNG key (dropout, augmentation): the loss gets
            ``fold_in(key, device index)`` (and the microbatch index when
            accumulating), a different key on every device.
        Returns:
          ``(params, opt_state, loss)``, or ``(params, opt_state, (loss,
          aux))`` with ``has_aux``: the loss averaged over the devices (and
          microbatches); aux's floating-point leaves averaged likewise, its
          integer leaves summed.
        """
        self._check_batch(batch)
        _check_laid_out(opt_state)
        if self._step is None:
            self._step = self._build()
        rest = () if self._module is None else self._module[2]
        keys = () if key is None else (key,)  # jit traces each arity once
        return self._step(params, opt_state, batch, rest, *keys)

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

    def _loss(self, params, rest, *args):
        if self._module is None:
            return self.loss_fn(params, *args)
        return self.loss_fn(self._merge(params, rest), *args)

    def _build(self):
        from jaxcomp.optax._state import _specs

        axes = self._axes if len(self._axes) > 1 else self._axes[0]
        k = self.accumulate_steps
        grad_fn = jax.value_and_grad(self._loss, has_aux=self.has_aux)

        def local(params, opt_state, batch, rest, key=None):
            if key is not None:
                key = jax.random.fold_in(key, lax.axis_index(axes))
            if k == 1:
                out, grads = grad_fn(params, rest, batch, *(() if key is None else (key,)))
            else:
                out, grads = self._accumulate(grad_fn, params, rest, batch, key)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, _reduce_metrics(out, axes)

        def step(params, opt_state, batch, rest, *key):
            state_specs = _specs(opt_state, self.axis_name)
            f = jax.shard_map(
                local,
                mesh=self.mesh,
                in_specs=(
                    P(),
                    state_specs,
                    jax.tree.map(lambda _: self._data_spec, batch),
                    P(),
                    *((P(),) * len(key)),
                ),
                out_specs=(P(), state_specs, P()),
                # jc.pmean's value is identical on every device but comes out of
                # all_gathers that JAX types as per-device (docs/collectives.md).
                check_vma=False,
            )
            return f(params, opt_state, batch, rest, *key)

        return jax.jit(step, donate_argnums=(0, 1) if self.donate else ())

    def _accumulate(self, grad_fn, params, rest, batch, key):
        """Gradient accumulation: the local batch in ``accumulate_steps``
        microbatches, their gradients and outputs averaged, one update."""
        k = self.accumulate_steps
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

        def body(carry, inputs):
            i, mb = inputs
            args = () if key is None else (jax.random.fold_in(key, i),)
            out, grads = grad_fn(params, rest, mb, *args)
            return jax.tree.map(jnp.add, carry, (out, grads)), None

        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(
            lambda: grad_fn(params, rest, first, *(() if key is None else (key,)))
        )
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, _acc_dtype(s.dtype)), shapes)
        total, _ = lax.scan(body, zeros, (jnp.arange(k), micro))
        out, grads = total
        grads = jax.tree.map(lambda g, s: (g / k).astype(s.dtype), grads, shapes[1])

        def mean(x, s):
            return (x / k).astype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else x

        return jax.tree.map(mean, out, shapes[0]), grads


def _check_laid_out(opt_state) -> None:
    from jaxcomp.optax._state import _check_laid_out as check
    from jaxcomp.optax._state import _find

    if _find(opt_state):
        check(opt_state)


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


def data_parallel(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    has_aux: bool = False,
    accumulate_steps: int = 1,
    donate: bool = True,
) -> DataParallel:
    """A jitted data-parallel train step over ``mesh``.

    ``step = jc.data_parallel(loss_fn, tx, mesh)``, then
    ``params, opt_state = step.init(params)`` and
    ``params, opt_state, loss = step(params, opt_state, batch)`` under plain
    ``jax.jit`` semantics: every argument and result is a global array.
    Inside, each device computes ``loss_fn`` and its gradient on its shard of
    the batch, and ``tx`` (whose first element all-reduces the gradients:
    ``jc.optax.compress_gradients``, ``onebit_adam`` or ``powersgd``, or a
    plain ``lax.pmean``) updates the parameters, inside ``jax.shard_map``.

    Args:
      loss_fn: ``loss_fn(params, batch)`` or, when the step is given a key,
        ``loss_fn(params, batch, key)``, returning the scalar loss of this
        device's batch (a mean over its examples), or ``(loss, aux)`` with
        ``has_aux``. With an NNX model, ``params`` is the module.
      tx: the optax chain; its all-reduce runs over ``axis_name``.
      mesh: the device mesh; all its axes of size > 1 are data axes.
      axis_name: the data axis, or the ``(slow, fast)`` pair of a
        hierarchical mesh (the batch is split over both).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      accumulate_steps: split each device's batch into this many
        microbatches and average their gradients before one update (one
        all-reduce per step, whatever the number).
      donate: donate the parameters and the optimizer state to the step
        (their buffers are reused; do not use the arrays passed in after
        the call).
    Returns:
      A :class:`DataParallel`: ``init``, the step itself, ``shard_batch``
      and, for NNX, ``module``.
    """
    return DataParallel(
        loss_fn,
        tx,
        mesh,
        axis_name,
        has_aux=has_aux,
        accumulate_steps=accumulate_steps,
        donate=donate,
    )
