"""The mesh / pmap axes bound where a function is traced, for error messages."""

from __future__ import annotations


def bound_axes() -> dict[str, int] | None:
    """``{name: size}`` of the axes bound here (inside ``jax.shard_map`` or
    ``jax.pmap``), ``{}`` outside them, or None where this JAX version does
    not say (the axis environment is not public API: this only feeds error
    messages)."""
    try:
        from jax._src import core

        return dict(core.get_axis_env().axis_sizes)
    except Exception:  # any change of the private API
        return None


def describe_bound_axes() -> str:
    """A sentence naming the bound axes, or '' where unknown."""
    axes = bound_axes()
    if axes is None:
        return ""
    if not axes:
        return " No axis is bound here (outside jax.shard_map and jax.pmap)."
    names = ", ".join(f"{k!r} (size {v})" for k, v in axes.items())
    return f" The axes bound here are {names}."
