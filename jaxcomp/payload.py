"""The payload: what a codec puts on the wire, as a pytree of fixed-shape arrays."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from jaxcomp.codecs.base import Codec


@jax.tree_util.register_pytree_node_class
class Payload:
    """Encoded tensor: communicated arrays plus static metadata.

    The arrays (``payload.arrays``, also ``payload["name"]``) are the pytree
    leaves and are what crosses the wire; ``codec``, ``shape`` and ``dtype``
    (of the original tensor) are static and stay local. Collectives may add
    leading axes to the arrays (e.g. ``all_gather``); the metadata describes
    one tensor.
    """

    __slots__ = ("_arrays", "codec", "dtype", "shape")

    def __init__(
        self, codec: Codec, shape: tuple[int, ...], dtype: Any, arrays: Mapping[str, jax.Array]
    ):
        self.codec = codec
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self._arrays = dict(arrays)

    @property
    def arrays(self) -> dict[str, jax.Array]:
        """The payload arrays by name, in the codec's layout order (a copy)."""
        return dict(self._arrays)

    def __getitem__(self, name: str) -> jax.Array:
        return self._arrays[name]

    @property
    def size(self) -> int:
        """Number of elements of the original tensor."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Bytes the payload occupies on the wire (static)."""
        return sum(
            int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in self._arrays.values()
        )

    def map(self, fn) -> Payload:
        """The payload with a function applied to every array.

        Args:
          fn: array -> array (e.g. a collective that adds a leading axis).
        Returns:
          A payload of the same codec, shape and dtype.
        """
        return Payload(
            self.codec, self.shape, self.dtype, {k: fn(a) for k, a in self._arrays.items()}
        )

    @property
    def used_nbytes(self) -> jax.Array:
        """Bytes actually used, as a traced int32 scalar.

        Equal to :attr:`nbytes` for fixed-rate codecs; smaller for
        variable-rate codecs whose arrays are fixed-capacity buffers.
        """
        return self.codec.used_nbytes(self)

    def tree_flatten(self):
        """Pytree protocol: the arrays are the leaves; the rest is static."""
        names = tuple(self._arrays)
        return tuple(self._arrays[k] for k in names), (self.codec, self.shape, self.dtype, names)

    @classmethod
    def tree_unflatten(cls, aux, children):
        """Pytree protocol: the inverse of :meth:`tree_flatten`."""
        codec, shape, dtype, names = aux
        return cls(codec, shape, dtype, dict(zip(names, children, strict=True)))

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{k}={jnp.dtype(v.dtype).name}{list(v.shape)}" for k, v in self._arrays.items()
        )
        return f"Payload({self.codec!r}, shape={self.shape}, dtype={self.dtype.name}, {fields})"
