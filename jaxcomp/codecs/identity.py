"""Identity: the uncompressed baseline, through the same interface."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxcomp.codecs.base import Codec, Rate, array, register


@register
@dataclasses.dataclass(frozen=True)
class Identity(Codec):
    """Sends the tensor as it is. It has no kernel: both backends are the
    same reshape, so they agree trivially. Its payloads are linear (the sum
    of two payloads is the payload of the sum), so the collectives reduce it
    with one plain ``psum``."""

    name: ClassVar[str] = "identity"
    codec_id: ClassVar[int] = 0
    rate: ClassVar[Rate] = Rate.LINEAR

    def split_granularity(self):
        return 1  # independent values

    def arrays(self, n, dtype):
        return {"values": array(n, dtype)}

    def _encode(self, flat, key, backend):
        return (flat,)

    def _decode(self, payload, backend):
        return payload["values"]
