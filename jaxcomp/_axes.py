"""The mesh axes a compressed all-reduce runs over, and the axes bound where
a function is traced (for error messages)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
from jax import lax


@dataclasses.dataclass(frozen=True)
class Axes:
    """One mesh axis, or ``(slow, fast)`` axes for the hierarchical
    algorithm (e.g. ``("node", "local")``): what ``jc.psum`` reduces over,
    normalized once from the ``axis_name`` / ``axis_sizes`` the public
    functions take.

    Attributes:
      sizes: the devices on each axis.
      names: the axes' names where they are bound (inside ``jax.shard_map``
        or ``jax.pmap``); None where only the sizes are known (the byte and
        server-state accounting).
    """

    sizes: tuple[int, ...]
    names: tuple[Hashable, ...] | None = None

    @classmethod
    def of_sizes(cls, axis_sizes: Any) -> Axes:
        """``axis_sizes`` as the accounting functions take it: the axis
        size, or the sizes of one axis or ``(slow, fast)`` axes (a tuple or
        a list)."""
        if isinstance(axis_sizes, (tuple, list)):
            if len(axis_sizes) not in (1, 2):
                raise ValueError(
                    "jc.collectives: axis sizes are one axis' size or (slow, fast) sizes, "
                    f"got {axis_sizes!r}"
                )
            return cls(tuple(axis_sizes))
        return cls((axis_sizes,))

    @classmethod
    def bound(cls, axis_name: Any, who: str) -> Axes:
        """The axes ``axis_name`` names (one name, or ``(slow, fast)``
        names), with their sizes where this is traced; a clear error names
        an axis that is not bound here."""
        names = names_of(axis_name)
        return cls(tuple(bound_size(name, lambda a: _unbound(a, who)) for name in names), names)

    @property
    def hierarchical(self) -> bool:
        """Whether these are ``(slow, fast)`` axes."""
        return len(self.sizes) == 2

    @property
    def size(self) -> int:
        """Devices over all the axes."""
        return math.prod(self.sizes)

    @property
    def axis_sizes(self) -> Any:
        """The sizes as the public functions take them (an int for one
        axis), for messages."""
        return self.sizes if self.hierarchical else self.sizes[0]

    @property
    def name(self) -> Any:
        """The axis name to hand to ``lax`` collectives: the one name, or
        the tuple of both (the devices of both axes as one)."""
        assert self.names is not None, "axes without names"
        return self.names if self.hierarchical else self.names[0]

    @property
    def slow(self) -> Axes:
        """The slow axis of ``(slow, fast)`` axes."""
        return self._one(0)

    @property
    def fast(self) -> Axes:
        """The fast axis of ``(slow, fast)`` axes."""
        return self._one(1)

    def _one(self, i: int) -> Axes:
        return Axes(self.sizes[i : i + 1], None if self.names is None else self.names[i : i + 1])

    def index(self) -> jax.Array:
        """This device's index over the axes (slow-major for two)."""
        return lax.axis_index(self.name)


def names_of(axis_name: Any) -> tuple[Hashable, ...]:
    """``axis_name`` as a tuple of mesh axis names: one name, or a
    ``(slow, fast)`` pair (a tuple or a list)."""
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def bound_size(name: Hashable, unbound: Callable[[Hashable], str]) -> int:
    """The size of the mesh axis ``name`` where this is traced, or a
    ValueError of ``unbound(name)`` followed by the axes that are bound."""
    try:
        return int(lax.axis_size(name))
    except NameError as e:
        raise ValueError(unbound(name) + describe_bound_axes()) from e


def _unbound(name: Hashable, who: str) -> str:
    return (
        f"{who}: axis name {name!r} is not bound here; call it inside jax.shard_map "
        "or jax.pmap over a mesh axis of that name."
    )


def bound_axes() -> dict[str, int] | None:
    """``{name: size}`` of the axes bound here (the manual axes of the mesh
    inside ``jax.shard_map`` or ``jax.pmap``), ``{}`` outside them, or None
    where this JAX version does not say (this only feeds error messages)."""
    try:
        mesh = jax.sharding.get_abstract_mesh()
        sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        return {a: sizes[a] for a in mesh.manual_axes}
    except Exception:  # an older JAX without the abstract mesh
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
