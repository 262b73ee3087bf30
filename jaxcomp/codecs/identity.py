"""Identity: the uncompressed baseline, through the same interface."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, register


@register
@dataclasses.dataclass(frozen=True)
class Identity(Codec):
    """Sends the tensor as it is. It has no kernel: both backends are the
    same reshape, so they agree trivially."""

    name: ClassVar[str] = "identity"
    codec_id: ClassVar[int] = 0

    def split_granularity(self):
        return 1  # independent values

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        return {"values": jax.ShapeDtypeStruct((n,), jnp.dtype(dtype))}

    def _encode(self, flat, seed, backend):
        return {"values": flat}

    def _decode(self, payload, n, dtype, backend):
        return payload["values"]

    def wire_params(self):
        return ()

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        return cls()
