"""3LC: 3-value quantization with sparsity multiplication, base-3^5 encoding
and zero-run encoding.

Lim, Andersen, Kaminsky, "3LC: Lightweight and Effective Traffic Compression
for Distributed Machine Learning" (SysML 2019), sections 3.1-3.3. The paper
pairs it with error accumulation buffers (section 3.1), which
``jaxcomp.optax.compress_gradients`` provides.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs.base import Codec, check_int, register
from jaxcomp.ops import ternary
from jaxcomp.ops import threelc as ops
from jaxcomp.payload import Payload

# Bytes of a payload besides the stream: the float32 scale, the int32 length
# and the uint8 overflow flag.
_FIXED_NBYTES = 4 + 4 + 1


def _check_sparsity(s: Any) -> float:
    ok = isinstance(s, (int, float, np.integer, np.floating)) and not isinstance(s, bool)
    # float32(s) is what the kernels multiply by; it must stay below 2 too.
    ok = ok and 1.0 <= float(s) < 2.0 and float(np.float32(s)) < 2.0
    if not ok:
        raise ValueError(f"ThreeLC: sparsity must be a number in [1.0, 2.0), got {s!r}")
    return float(s)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class ThreeLC(Codec):
    """3LC (Lim et al., SysML 2019, section 3): deterministic, one scale for
    the whole tensor.

    ``m = max|x| * float32(sparsity)`` and each value becomes ``m * q`` with
    ``q = round(x / m)`` in {-1, 0, 1}, rounding half to even (section 3.1):
    ``q = sign(x)`` exactly when ``2|x| > m``. The digits ``q + 1`` are
    base-3^5 packed (section 3.2, 1.6 bits per value) and runs of the byte
    121 (five zeros) are zero-run encoded (section 3.3), so the size follows
    the data: the payload is a fixed-capacity buffer plus the used length
    (``payload.used_nbytes``).

    Payload arrays, in order: ``stream`` uint8[capacity] (the zero-run-encoded
    bytes, then zeros), ``scale`` float32[1] (m), ``length`` int32[1] (bytes
    of the complete stream; more than the capacity when it did not fit) and
    ``overflow`` uint8[1] (1 when ``length > capacity``; the buffer then holds
    the stream's first ``capacity`` bytes and decoding gives NaN everywhere,
    never plausible numbers).

    Args:
      sparsity: the sparsity multiplier ``s``, in [1.0, 2.0); larger values
        give more zeros and a shorter stream.
      capacity: bytes of the stream buffer, an int >= 0, or None (default) for
        ``ceil(n / 5)``, the size without zero-run encoding, which the stream
        never exceeds. A smaller capacity saves wire bytes when the data is
        sparse enough and reports an overflow otherwise.
    """

    sparsity: float = 1.0
    capacity: int | None = None

    name: ClassVar[str] = "threelc"
    codec_id: ClassVar[int] = 7
    stochastic: ClassVar[bool] = False

    def __post_init__(self):
        object.__setattr__(self, "sparsity", _check_sparsity(self.sparsity))
        if self.capacity is not None:
            check_int(
                "ThreeLC",
                "capacity",
                self.capacity,
                "None or an int in [0, 2^31 - 1]",
                isinstance(self.capacity, (int, np.integer)) and 0 <= self.capacity < 2**31,
            )
            object.__setattr__(self, "capacity", int(self.capacity))

    # -- layout and wire -------------------------------------------------
    def stream_capacity(self, n: int) -> int:
        """Bytes of the stream buffer for n elements."""
        return ternary.num_bytes(n) if self.capacity is None else self.capacity

    def layout(self, shape, dtype=jnp.float32):
        n = int(np.prod(shape, dtype=np.int64))
        return {
            "stream": jax.ShapeDtypeStruct((self.stream_capacity(n),), jnp.uint8),
            "scale": jax.ShapeDtypeStruct((1,), jnp.float32),
            "length": jax.ShapeDtypeStruct((1,), jnp.int32),
            "overflow": jax.ShapeDtypeStruct((1,), jnp.uint8),
        }

    def wire_params(self) -> tuple[int, ...]:
        # The multiplier as the bits of its float64 value; capacity -1 for None.
        (bits,) = struct.unpack("<q", struct.pack("<d", self.sparsity))
        return (bits, -1 if self.capacity is None else self.capacity)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> ThreeLC:
        bits, capacity = params
        (s,) = struct.unpack("<d", struct.pack("<q", bits))
        return cls(sparsity=s, capacity=None if capacity == -1 else capacity)

    # -- encode / decode -------------------------------------------------
    def _encode(self, flat, seed, backend):
        cap = self.stream_capacity(flat.size)
        stream, scale, length, overflow = ops.encode(
            flat, s=self.sparsity, capacity=cap, backend=backend
        )
        return {"stream": stream, "scale": scale, "length": length, "overflow": overflow}

    def _decode(self, payload, n, dtype, backend):
        return ops.decode(
            payload["stream"],
            payload["scale"],
            payload["length"],
            payload["overflow"],
            n=n,
            dtype=dtype,
            backend=backend,
        )

    # -- variable rate -----------------------------------------------------
    def used_nbytes(self, payload: Payload) -> jax.Array:
        """Stream bytes in use (at most the capacity), plus the scale, the
        length and the flag: what has to cross the wire."""
        cap = payload["stream"].shape[-1]
        used = jnp.clip(payload["length"][..., 0], 0, cap)
        return (used + _FIXED_NBYTES).astype(jnp.int32)

    @staticmethod
    def overflowed(payload: Payload) -> jax.Array:
        """True where the stream did not fit its buffer (bool; one per tensor)."""
        return payload["overflow"][..., 0] != 0

    @staticmethod
    def stream_length(payload: Payload) -> jax.Array:
        """Bytes of the complete stream (int32): the smallest capacity that
        holds it, which a caller may use to choose a capacity."""
        return payload["length"][..., 0]

    def with_capacity(self, payload: Payload, nbytes: int) -> Payload:
        """The payload with its stream buffer cut or zero-padded to ``nbytes``.

        Returns a payload of ``ThreeLC(sparsity=self.sparsity,
        capacity=nbytes)``. Nothing is lost when ``nbytes`` is at least the
        stream length; otherwise the result is marked overflowed. Works on
        traced arrays (``nbytes`` is static).
        """
        if payload.codec != self:
            raise ValueError(f"{self!r}.with_capacity got a payload of {payload.codec!r}")
        codec = dataclasses.replace(self, capacity=nbytes)
        stream = payload["stream"]
        cap = stream.shape[-1]
        if nbytes <= cap:
            stream = stream[..., :nbytes]
        else:
            pad = [(0, 0)] * (stream.ndim - 1) + [(0, nbytes - cap)]
            stream = jnp.pad(stream, pad)
        length = payload["length"]
        overflow = ((payload["overflow"] != 0) | (length > nbytes)).astype(jnp.uint8)
        arrays = {"stream": stream, "scale": payload["scale"], "length": length}
        arrays["overflow"] = overflow
        return Payload(codec, payload.shape, payload.dtype, arrays)
