"""Cast: send values as 16-bit floats (round to nearest even).

Kernels: ffi/include/jaxcomp/cast.h (bodies), ffi/cast.cc, cuda/cast.cu; the
twin is XLA's own conversion. Error feedback's compression has a one-pass
CPU kernel (``encode_feedback``: ffi/cast.cc).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.codecs.base import Codec, Kernels, array, register

_TARGETS = ("bfloat16", "float16")


@register
@dataclasses.dataclass(frozen=True)
class Cast(Codec):
    """Converts to ``dtype`` ("bfloat16" or "float16") for the wire and back.

    float16 overflows to +-inf above 65504; bfloat16 keeps float32's range
    with 8 significant bits.

    Args:
      dtype: "bfloat16" (default) or "float16".
    """

    dtype: str = "bfloat16"

    name: ClassVar[str] = "cast"
    codec_id: ClassVar[int] = 4
    # jaxcomp_cast converts either way; the CPU module has the one-pass and
    # decode-and-accumulate targets too.
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback")
    )

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

    @classmethod
    def examples(cls, *, coverage=False):
        return (cls("bfloat16"), cls("float16"))

    @property
    def cuda_auto(self) -> frozenset[str]:  # type: ignore[override]
        """The CUDA kernels "auto" runs (docs/gpu.md): the bfloat16 encode,
        faster than the twin in the train step; float16's twin encodes
        faster, and both decode faster as the twin."""
        return frozenset({"encode"}) if self.dtype == "bfloat16" else frozenset()

    def split_granularity(self):
        return 1  # independent values

    def arrays(self, n, dtype):
        return {"values": array(n, self.dtype)}

    def _encode(self, flat, key, backend):
        backend, cuda = self.route("encode", backend)
        return (cast(flat, self.dtype, backend=backend, cuda=cuda),)

    def _decode(self, payload, backend):
        backend, cuda = self.route("decode", backend)
        return cast(payload["values"], payload.dtype, backend=backend, cuda=cuda)

    # The twins of encode_feedback's kernel (jaxcomp_cast_encode_feedback):
    # the conversion each way.
    def twin_encode(self, flat):
        return (_astype(flat, jnp.dtype(self.dtype)),)

    def twin_decode(self, values, *, n, dtype):
        return _astype(values, jnp.dtype(dtype))

    def wire_params(self):
        return (_TARGETS.index(self.dtype),)

    @classmethod
    def from_wire_params(cls, params: tuple[int, ...]) -> Any:
        (target,) = params
        if not 0 <= target < len(_TARGETS):
            raise ValueError(f"Cast: dtype code must be 0 (bfloat16) or 1 (float16), got {target}")
        return cls(_TARGETS[target])


def cast(x: jax.Array, dtype, *, backend: str = "auto", cuda: bool | None = None) -> jax.Array:
    """``x`` converted to ``dtype`` (float32, bfloat16 or float16), same shape,
    rounding to nearest even: the FFI target ``jaxcomp_cast``, whose twin is
    ``astype``; ``cuda`` as :meth:`Codec.kernel` takes it (the codec's rule)."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    flat = x.reshape(-1)
    out = Codec.kernel(
        backend,
        "jaxcomp_cast",
        lambda f: (_astype(f, dtype),),
        (flat,),
        (jax.ShapeDtypeStruct(flat.shape, dtype),),
        cuda=cuda,
    )[0]
    return out.reshape(x.shape)


def _astype(x: jax.Array, dtype) -> jax.Array:
    """``x.astype(dtype)`` with the NaNs of the kernels' conversions
    (common.h: to_f32, f32_to_bf16_bits, f32_to_f16_bits, which follow
    XLA's CPU code): a bfloat16 NaN widens bit for bit, a float16 NaN
    quiet with its payload; to bfloat16 a NaN becomes 0x7fc0 with its sign,
    to float16 a quiet NaN with its sign and the payload's top 10 bits. XLA's GPU code
    writes other NaNs (0x7fff, 0x7fffffff); the values are the same."""
    # The NaN's float32 bits (common.h: to_f32), then its bits in dtype.
    if x.dtype == jnp.float32:
        bits = lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype == jnp.bfloat16:
        bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    else:
        h = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        bits = ((h & 0x8000) << 16) | np.uint32(0x7FC00000) | ((h & 0x3FF) << 13)
    if dtype == jnp.float32:
        nan = lax.bitcast_convert_type(bits, jnp.float32)
    else:
        sign = (bits >> 16) & np.uint32(0x8000)
        if dtype == jnp.bfloat16:
            half = sign | np.uint32(0x7FC0)
        else:
            half = sign | np.uint32(0x7E00) | ((bits >> 13) & np.uint32(0x3FF))
        nan = lax.bitcast_convert_type(half.astype(jnp.uint16), dtype)
    return jnp.where(jnp.isnan(x), nan, x.astype(dtype))
