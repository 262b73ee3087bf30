"""The codec contract: a frozen, hashable config with pure encode/decode."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp._ffi import resolve_backend
from jaxcomp.ops.rng import seed_words
from jaxcomp.payload import Payload

SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_MAX_ELEMENTS = (1 << 32) - 1

_REGISTRY: dict[str, type[Codec]] = {}
_BY_ID: dict[int, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: makes a codec reachable by name and by wire id."""
    for table, k in ((_REGISTRY, cls.name), (_BY_ID, cls.codec_id)):
        if k in table:
            raise RuntimeError(f"codec {k!r} registered twice")
        table[k] = cls
    return cls


def get(name: str, **params: Any) -> Codec:
    """A codec by its name (``"qsgd"``, ``"onebit"``, ...) and parameters."""
    try:
        cls = _REGISTRY[name.lower()]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {sorted(_REGISTRY)}") from None
    return cls(**params)


def names() -> list[str]:
    """Names of every registered codec."""
    return sorted(_REGISTRY)


def by_id(codec_id: int) -> type[Codec] | None:
    return _BY_ID.get(codec_id)


def check_int(owner: str, name: str, value: Any, allowed: str, ok: bool) -> None:
    """Raises the project's standard ValueError for a bad structural parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not ok:
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")


def check_bucket_size(owner: str, bucket_size: Any) -> None:
    ok = isinstance(bucket_size, (int, np.integer)) and 8 <= bucket_size <= 65536
    ok = ok and (int(bucket_size) & (int(bucket_size) - 1)) == 0
    check_int(owner, "bucket_size", bucket_size, "a power of two in [8, 65536]", ok)


class BucketSizeWire:
    """Wire parameters of a codec configured by ``bucket_size`` alone."""

    bucket_size: int

    def wire_params(self) -> tuple[int, ...]:
        return (self.bucket_size,)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        (bucket_size,) = params
        return cls(bucket_size=bucket_size)


@dataclasses.dataclass(frozen=True)
class Codec:
    """Base class of every codec.

    Subclasses are frozen dataclasses (hashable, usable as static arguments)
    and define ``name``, ``codec_id``, ``stochastic``, ``layout``, ``_encode``,
    ``_decode`` and the wire parameter round trip.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    stochastic: ClassVar[bool] = False

    # -- to be provided by each codec ------------------------------------
    def layout(self, shape: tuple[int, ...], dtype: Any) -> dict[str, jax.ShapeDtypeStruct]:
        """Names, shapes and dtypes of the payload arrays for an input."""
        raise NotImplementedError

    def _encode(
        self, flat: jax.Array, seed: jax.Array | None, backend: str
    ) -> dict[str, jax.Array]:
        raise NotImplementedError

    def _decode(self, payload: Payload, n: int, dtype: np.dtype, backend: str) -> jax.Array:
        raise NotImplementedError

    def wire_params(self) -> tuple[int, ...]:
        """The configuration as integers, for the wire header."""
        raise NotImplementedError

    def split_granularity(self) -> int | None:
        """``g`` such that the payload of ``k * g`` values is, array by array,
        the concatenation of the payloads of its ``k`` consecutive chunks of
        ``g`` values (so a payload can be cut into per-chunk payloads by
        reshaping, and stacked payloads decoded as one). None where no such
        ``g`` exists (a whole-tensor packing or scale)."""
        return None

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Codec:
        raise NotImplementedError

    def bits_per_element(
        self, shape: tuple[int, ...] = (1 << 20,), dtype: Any = jnp.float32
    ) -> float:
        """Wire bits per input element for an input of this shape (default 2^20)."""
        n = int(np.prod(shape, dtype=np.int64))
        return 8.0 * self.wire_nbytes(shape, dtype) / max(n, 1)

    # -- shared machinery --------------------------------------------------
    def wire_nbytes(self, shape: tuple[int, ...], dtype: Any = jnp.float32) -> int:
        """Bytes on the wire for an input of this shape and dtype (static)."""
        return sum(
            int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
            for s in self.layout(tuple(shape), dtype).values()
        )

    def used_nbytes(self, payload: Payload) -> jax.Array:
        return jnp.asarray(payload.nbytes, jnp.int32)

    def check_input(self, x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if np.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{type(self).__name__}.encode: unsupported dtype {np.dtype(x.dtype).name}; "
                "expected float32, bfloat16 or float16"
            )
        if x.size > _MAX_ELEMENTS:
            raise ValueError(
                f"{type(self).__name__}.encode: inputs are limited to 2^32 - 1 elements"
            )
        return x

    def encode(self, x: Any, key: jax.Array | None = None, *, backend: str = "auto") -> Payload:
        """Encodes ``x`` (float32/bfloat16/float16, any shape) into a payload.

        Args:
          x: the tensor.
          key: a JAX PRNG key; required by stochastic codecs, ignored otherwise.
          backend: "auto" (kernel where built, else the twin), "ffi" or "xla".
        Returns:
          A :class:`~jaxcomp.Payload` with static shapes.
        """
        x = self.check_input(x)
        backend = resolve_backend(backend)
        seed = None
        if self.stochastic:
            if key is None:
                raise ValueError(f"{type(self).__name__} is stochastic: encode needs a PRNG key")
            seed = seed_words(key)
        arrays = self._encode(x.reshape(-1), seed, backend)
        return Payload(self, x.shape, x.dtype, arrays)

    def decode(self, payload: Payload, *, backend: str = "auto") -> jax.Array:
        """Decodes a payload of this codec to the original shape and dtype."""
        if not isinstance(payload, Payload):
            raise TypeError(
                f"{type(self).__name__}.decode expects a Payload, got {type(payload).__name__}"
            )
        if payload.codec != self:
            raise ValueError(f"{self!r}.decode got a payload of {payload.codec!r}")
        expected = self.layout(payload.shape, payload.dtype)
        for k, spec in expected.items():
            a = payload[k]
            if tuple(a.shape) != tuple(spec.shape) or np.dtype(a.dtype) != np.dtype(spec.dtype):
                raise ValueError(
                    f"{type(self).__name__}.decode: payload array {k!r} is "
                    f"{np.dtype(a.dtype).name}{list(a.shape)}, expected "
                    f"{np.dtype(spec.dtype).name}{list(spec.shape)} (batched payloads: use jax.vmap)"
                )
        backend = resolve_backend(backend)
        out = self._decode(payload, payload.size, payload.dtype, backend)
        return out.reshape(payload.shape)
