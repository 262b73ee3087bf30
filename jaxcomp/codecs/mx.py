"""MX: the OCP Microscaling formats MXFP8, MXFP6 and MXFP4.

Blocks of 32 values share one E8M0 scale (a power of two, one byte); each
value is an FP8 (E4M3, E5M2), FP6 (E3M2, E2M3) or FP4 (E2M1) element,
bit-packed (FP6: 4 values in 3 bytes, FP4: 2 per byte). The scale rule is
the specification's (section 6.3): the shared exponent is
``floor(log2(max|v|)) - emax``, ``emax`` being the exponent of the element
format's largest finite value, and every ``v / 2^shared`` is rounded to the
element format (ties to even, or stochastically), saturating. See
docs/codecs.md for every rule, the special values included.

Reference: Open Compute Project, "OCP Microscaling Formats (MX)
Specification" v1.0 (2023); Rouhani et al., "Microscaling Data Formats for
Deep Learning" (2023). Kernels: ffi/include/jaxcomp/minifloat.h (shared
with FP8), ffi/mx.cc, cuda/mx.cu; twin: jaxcomp/codecs/_minifloat.py.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from jaxcomp.codecs import _minifloat as mf
from jaxcomp.codecs.base import BucketedCodec, Kernels, array, register
from jaxcomp.ops import bucket as bk
from jaxcomp.ops.packing import pack, unpack

BLOCK = 32  # the specification's block size
_ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")


def _pack(codes, bits):
    """Codes of ``bits`` bits, LSB first: FP6 as 4 codes in 3 bytes."""
    if bits != 6:
        return pack(codes, bits)
    g = codes.astype(jnp.uint32).reshape(-1, 4)
    w = g[:, 0] | (g[:, 1] << 6) | (g[:, 2] << 12) | (g[:, 3] << 18)
    return jnp.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=1).astype(jnp.uint8).reshape(-1)


def _unpack(packed, bits):
    if bits != 6:
        return unpack(packed, bits)
    b = packed.astype(jnp.uint32).reshape(-1, 3)
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return jnp.stack([(w >> (6 * j)) & 0x3F for j in range(4)], axis=1).reshape(-1)


@register
@dataclasses.dataclass(frozen=True, kw_only=True)
class MX(BucketedCodec):
    """One E8M0 scale per 32 values and a 4-, 6- or 8-bit float per value.

    Bits per value: 8.25 (MXFP8), 6.25 (MXFP6), 4.25 (MXFP4). A block
    holding a NaN or an infinity gets the NaN scale (0xFF) and decodes to
    NaN; an all-zero block gets the smallest scale, 2^-127.

    Args:
      element: ``"e4m3"`` or ``"e5m2"`` (MXFP8), ``"e3m2"`` or ``"e2m3"``
        (MXFP6), ``"e2m1"`` (MXFP4).
      stochastic: unbiased stochastic rounding of the elements instead of
        round to nearest even (values the scale rule puts above the
        element's largest finite value still saturate).
      bucket_size: the block, 32 (the specification fixes it).

    References:
      OCP Microscaling Formats (MX) Specification v1.0 (2023), sections 5-6.
    """

    element: str = "e4m3"
    stochastic: bool = False  # type: ignore[misc]  # per instance, not per class
    bucket_size: int = BLOCK

    name: ClassVar[str] = "mx"
    codec_id: ClassVar[int] = 11
    seeded: ClassVar[bool] = True  # the kernel takes (and, nearest, ignores) a seed
    # The kernels of ffi/mx.cc and cuda/mx.cu. On GPUs "auto" runs only
    # the CUDA ones in cuda_auto; every other operation runs the twin, which
    # XLA fuses into its neighbours (docs/gpu.md, "Kernel or twin on the GPU").
    kernels: ClassVar[Kernels] = Kernels.of(
        cpu=("encode", "decode", "decode_sum", "encode_feedback"),
        cuda=("encode", "decode", "encode_feedback"),
        cuda_auto=("encode_feedback",),
    )

    def __post_init__(self):
        mf.format_named("MX", "element", self.element, _ELEMENTS)
        mf.check_stochastic(self)
        if self.bucket_size != BLOCK or isinstance(self.bucket_size, bool):
            raise ValueError(
                f"MX: bucket_size is the specification's block of {BLOCK} values, got "
                f"{self.bucket_size!r} (for other blocks use FP8(bucket_size=...))"
            )

    @property
    def format(self) -> mf.Format:
        return mf.FORMATS[self.element]

    @property
    def cuda_auto(self) -> frozenset[str]:  # type: ignore[override]
        """The CUDA kernels "auto" runs (docs/gpu.md): the one-pass
        error-feedback kernel, and the decode of 6-bit elements, whose
        packed fields XLA's fusion of the twin decodes slower."""
        six_bit = self.element in ("e3m2", "e2m3")
        return frozenset({"encode_feedback", "decode"} if six_bit else {"encode_feedback"})

    @classmethod
    def examples(cls, *, coverage=False):
        users = (cls(), cls(element="e2m3"), cls(element="e2m1"))
        more = (
            cls(element="e5m2"),
            cls(element="e3m2", stochastic=True),
            cls(element="e2m1", stochastic=True),
        )
        return users + more if coverage else users

    def arrays(self, n, dtype):
        nb = self.num_buckets(n)
        return {
            "codes": array(nb * BLOCK * self.format.bits // 8, np.uint8),
            "scales": array(nb, np.uint8),
        }

    def kernel_attrs(self, decode):
        attrs = {"format": self.format.wire_id}
        return attrs if decode else {**attrs, "stochastic": int(self.stochastic)}

    def wire_params(self):
        return (self.format.wire_id, int(self.stochastic))

    @classmethod
    def from_wire_params(cls, params):
        if len(params) != 2 or params[0] not in mf.BY_WIRE_ID or params[1] not in (0, 1):
            raise ValueError(f"MX: expected (element 0..4, stochastic 0|1), got {params}")
        return cls(element=mf.BY_WIRE_ID[params[0]].name, stochastic=bool(params[1]))

    def twin_encode(self, x, seed):
        f = self.format
        xb = bk.to_buckets(x, BLOCK)
        scales = mf.scale_code(bk.max_abs(xb), f)
        t = xb * mf.inverse(scales)[:, None]
        u = mf.uniforms(seed, xb.shape) if self.stochastic else None
        return _pack(mf.encode(t, f, u).reshape(-1), f.bits), scales.astype(jnp.uint8)

    def twin_decode(self, codes, scales, *, n, dtype):
        f = self.format
        c = _unpack(codes, f.bits).reshape(-1, BLOCK)
        hi, lo = mf.scale_factors(scales)
        values = (mf.value(c, f) * hi[:, None]) * lo[:, None]
        # The NaN scale: the canonical NaN (mx.cc), not whichever NaN operand.
        values = jnp.where((scales == 0xFF)[:, None], np.float32(np.nan), values)
        return bk.from_buckets(values, n, dtype)
