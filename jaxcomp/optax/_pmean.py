"""``uncompressed_mean``: the uncompressed gradient all-reduce as an optax
transformation, the baseline that ``compress_gradients`` is measured
against. It is what a hand-written data-parallel step does with
``lax.pmean(grads, axis)``, with a state that ``jc.optax.init``,
``state_specs`` and ``telemetry`` understand, so that the same loop (and
``jc.data_parallel``) runs both and reports the bytes each one sends."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp.optax._config import axis_sizes_or_none, bound_axis_sizes
from jaxcomp.optax._state import all_reduce_state, check_type
from jaxcomp.optax._telemetry import (
    Telemetry,
    exact_stats,
    first_telemetry,
    static_telemetry,
    zero_telemetry,
)

_WHO = "jc.optax.uncompressed_mean"


@all_reduce_state()
class PmeanState(NamedTuple):
    """State of :func:`uncompressed_mean` (every leaf replicated: nothing is per device).

    Attributes:
      step: int32[]: updates applied so far.
      telemetry: :class:`Telemetry` of the last step: the gradients' own
        bits per element (32 for float32), the bytes a ring all-reduce of
        them sends per device, a compression ratio of 1 for float32
        gradients; ``residual_norm`` and ``skipped_steps`` are 0 (there is
        no residual, and no step is skipped).
    """

    step: jax.Array
    telemetry: Telemetry


def _axis_names(axis_name) -> tuple:
    if isinstance(axis_name, (tuple, list)):
        if len(axis_name) != 2:
            raise ValueError(
                f"{_WHO}: axis_name must be one mesh axis or a (slow, fast) pair, got {axis_name!r}"
            )
        return tuple(axis_name)
    return (axis_name,)


def _is_reduced(g) -> bool:
    """Floating-point and complex gradients are averaged; float0 gradients
    (of integer parameters) carry nothing and pass through."""
    return jnp.issubdtype(g.dtype, jnp.inexact)


def uncompressed_mean(axis_name="data") -> optax.GradientTransformation:
    """The mean of the gradients over ``axis_name``, uncompressed.

    The documented baseline: the first element of an ``optax.chain`` inside
    a ``jax.shard_map``'d (or ``jax.pmap``'d) train step or
    ``jc.data_parallel``, exactly ``lax.pmean(grads, axis_name)`` (one
    all-reduce of every floating-point leaf, summed by the backend: XLA's,
    NCCL's or gloo's). Swap it for ``compress_gradients(codec, axis_name)``
    to compare; ``compress_gradients("identity", axis_name)`` is uncompressed
    too, but goes through jaxcomp's collectives and keeps a residual state.

    Args:
      axis_name: the data-parallel mesh / pmap axis, or the ``(slow, fast)``
        pair of a hierarchical mesh (the mean is then over both).
    Returns:
      An ``optax.GradientTransformation`` whose state is a
      :class:`PmeanState`, replicated; ``jc.optax.telemetry`` reads it.
    """
    axes = _axis_names(axis_name)

    def init_fn(params) -> PmeanState:
        tel = first_telemetry(
            axis_sizes_or_none(axes), lambda s: _telemetry(params, s, zero_telemetry())
        )
        return PmeanState(step=jnp.zeros((), jnp.int32), telemetry=tel)

    def update_fn(grads, state: PmeanState, params=None):
        del params
        check_type(state, PmeanState, _WHO)
        sizes = bound_axis_sizes(axes, _WHO)
        leaves, treedef = jax.tree.flatten(grads)
        reduced = [i for i, g in enumerate(leaves) if _is_reduced(g)]
        means = lax.pmean([leaves[i] for i in reduced], axes if len(axes) > 1 else axes[0])
        for i, m in zip(reduced, means, strict=True):
            leaves[i] = m
        return treedef.unflatten(leaves), PmeanState(
            step=state.step + 1, telemetry=_telemetry(grads, sizes, state.telemetry)
        )

    return optax.GradientTransformation(init_fn, update_fn)


def pmean(axis_name="data") -> optax.GradientTransformation:
    """Deprecated: :func:`uncompressed_mean` (``jc.pmean`` is the collective)."""
    warnings.warn(
        "jc.optax.pmean is deprecated: it is the uncompressed baseline transformation, "
        "jc.optax.uncompressed_mean (jc.pmean is the compressed collective)",
        DeprecationWarning,
        stacklevel=2,
    )
    return uncompressed_mean(axis_name)


def _telemetry(grads, sizes: tuple[int, ...], previous: Telemetry) -> Telemetry:
    """Static accounting of one step: every element at its own width."""
    leaves = jax.tree.leaves(grads)
    elements = sum(int(np.prod(g.shape, dtype=np.int64)) for g in leaves)
    payload = sum(g.size * g.dtype.itemsize for g in leaves if _is_reduced(g))
    bits, wire, ratio = exact_stats(payload, elements, int(np.prod(sizes)))
    return static_telemetry(bits, wire, ratio, previous)
