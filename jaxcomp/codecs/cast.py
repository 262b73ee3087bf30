"""Cast: send values as 16-bit floats (round to nearest even)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, register
from jaxcomp.ops import cast as ops

_TARGETS = ("bfloat16", "float16")


@register
@dataclasses.dataclass(frozen=True)
class Cast(Codec):
    """Converts to ``dtype`` ("bfloat16" or "float16") for the wire and back.

    float16 overflows to +-inf above 65504; bfloat16 keeps float32's range
    with 8 significant bits.
    """

    dtype: str = "bfloat16"

    name: ClassVar[str] = "cast"
    codec_id: ClassVar[int] = 4

    def __post_init__(self):
        if isinstance(self.dtype, str):
            value = self.dtype
        else:
            try:
                value = np.dtype(self.dtype).name
            except TypeError:
                value = repr(self.dtype)
        if value not in _TARGETS:
            raise ValueError(f"Cast: dtype must be one of {_TARGETS}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", value)

    def split_granularity(self):
        return 1  # independent values

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        return {"values": jax.ShapeDtypeStruct((n,), jnp.dtype(self.dtype))}

    def _encode(self, flat, seed, backend):
        return {"values": ops.cast(flat, self.dtype, backend=backend)}

    def _decode(self, payload, n, dtype, backend):
        return ops.cast(payload["values"], dtype, backend=backend)

    def wire_params(self):
        return (_TARGETS.index(self.dtype),)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        (target,) = params
        if not 0 <= target < len(_TARGETS):
            raise ValueError(f"Cast: dtype code must be 0 (bfloat16) or 1 (float16), got {target}")
        return cls(_TARGETS[target])
