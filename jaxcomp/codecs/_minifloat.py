"""Floating-point element formats of 4 to 8 bits and the E8M0 block scale,
shared by the FP8 and MX codecs: the pure-JAX twins of
ffi/include/jaxcomp/minifloat.h (the same operations on the same float32
bits, so the same codes), and the format table.

The formats are those of the OCP 8-bit Floating Point Specification (OFP8,
E4M3 and E5M2) and of the OCP Microscaling Formats (MX) Specification v1.0
(FP6 E3M2 and E2M3, FP4 E2M1, the E8M0 scale). docs/codecs.md states the
rules.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops.rng import rng_uniform


@dataclasses.dataclass(frozen=True)
class Format:
    """One element format (minifloat.h: MiniFormat)."""

    name: str
    wire_id: int
    ebits: int
    mbits: int
    bias: int
    emax: int  # exponent of the largest finite value
    max_code: int  # its code
    max_value: float  # the largest finite value

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits


FORMATS = {
    f.name: f
    for f in (
        Format("e4m3", 0, 4, 3, 7, 8, 0x7E, 448.0),
        Format("e5m2", 1, 5, 2, 15, 15, 0x7B, 57344.0),
        Format("e3m2", 2, 3, 2, 3, 4, 0x1F, 28.0),
        Format("e2m3", 3, 2, 3, 1, 2, 0x1F, 7.5),
        Format("e2m1", 4, 2, 1, 1, 2, 0x7, 6.0),
    )
}
BY_WIRE_ID = {f.wire_id: f for f in FORMATS.values()}

_U = np.uint32


def format_named(codec: str, param: str, name, allowed) -> Format:
    """The format called ``name`` among ``allowed`` (the codec's parameter
    ``param``), or a ValueError."""
    if not isinstance(name, str) or name not in allowed:
        raise ValueError(f"{codec}: {param} must be one of {tuple(allowed)}, got {name!r}")
    return FORMATS[name]


def check_stochastic(codec) -> None:
    """Checks the codec's ``stochastic`` field is a bool, and stores it as one."""
    if not isinstance(codec.stochastic, (bool, np.bool_)):
        raise ValueError(
            f"{type(codec).__name__}: stochastic must be True or False, got {codec.stochastic!r}"
        )
    object.__setattr__(codec, "stochastic", bool(codec.stochastic))


def _pow2(k: jax.Array) -> jax.Array:
    """2^k as float32 from its exponent bits (k in [-126, 127]; -127 gives 0,
    as minifloat.h's pow2f)."""
    return lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23, jnp.float32)


def encode(t: jax.Array, f: Format, u: jax.Array | None) -> jax.Array:
    """minifloat.h: mini_encode, element-wise: float32 -> uint32 codes.

    Args:
      t: float32 values (any shape).
      f: the element format.
      u: None (round to nearest even) or uniforms in [0, 1), shaped like t.
    """
    bits = lax.bitcast_convert_type(t, jnp.uint32)
    sign = (bits >> 31) << (f.ebits + f.mbits)
    a = bits & _U(0x7FFFFFFF)
    emin = 1 - f.bias
    e = jnp.maximum((a >> 23).astype(jnp.int32) - 127, emin)
    scaled = lax.bitcast_convert_type(a, jnp.float32) * _pow2(f.mbits - e)
    scaled = jnp.where(scaled < np.float32(64), scaled, np.float32(64))
    if u is None:
        # Ties to even, as minifloat.h's (scaled + 1.5 * 2^23) - 1.5 * 2^23
        # (which an XLA with fast math would fold to scaled).
        r = jnp.round(scaled)
    else:
        r = scaled + u
    m = r.astype(jnp.int32).astype(jnp.uint32)
    code = ((e + f.bias - 1).astype(jnp.uint32) << f.mbits) + m
    code = jnp.minimum(code, _U(f.max_code))
    return jnp.where(a > _U(0x7F800000), _U(0), sign | code)  # NaN: +0


def value(codes: jax.Array, f: Format) -> jax.Array:
    """minifloat.h: mini_value, element-wise: codes -> float32."""
    c = codes.astype(jnp.uint32)
    mag = c & _U((1 << (f.ebits + f.mbits)) - 1)
    exp = (mag >> f.mbits).astype(jnp.int32)
    mant = mag & _U((1 << f.mbits) - 1)
    sig = jnp.where(exp == 0, mant, mant + _U(1 << f.mbits)).astype(jnp.int32)
    k = jnp.where(exp == 0, 1, exp) - f.bias - f.mbits
    v = sig.astype(jnp.float32) * _pow2(k)
    if f.bits == 8:  # E4M3's 0x7f: NaN; E5M2's 0x7c: inf, above: NaN
        special = np.float32(np.nan)
        if f.ebits == 5:
            special = jnp.where(mag == _U(0x7C), np.float32(np.inf), special)
        v = jnp.where(mag > _U(f.max_code), special, v)
    return jnp.where((c >> (f.ebits + f.mbits)) & _U(1) != 0, -v, v)


def uniforms(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The stochastic rounding's u of every element, by its index in the
    zero-padded buckets (row-major), as the kernels draw it."""
    index = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
    return rng_uniform(seed, index)


# ---------------------------------------------------------------------------
# The E8M0 scale (minifloat.h: mx_scale_code, mx_inverse, mx_scale_hi, mx_scale_lo)
# ---------------------------------------------------------------------------
def scale_code(maxabs: jax.Array, f: Format) -> jax.Array:
    a = lax.bitcast_convert_type(maxabs, jnp.uint32)
    e = jnp.clip((a >> 23).astype(jnp.int32) - 127 - f.emax, -127, 127)
    return jnp.where(a >= _U(0x7F800000), _U(0xFF), (e + 127).astype(jnp.uint32))


def inverse(scale: jax.Array) -> jax.Array:
    s = scale.astype(jnp.int32)
    return jnp.where(s == 0xFF, np.float32(0), _pow2(jnp.minimum(127 - s, 127)))


def scale_factors(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(hi, lo), 2^(scale - 127) = hi * lo with both normal (minifloat.h:
    mx_scale_hi, mx_scale_lo); hi is NaN for 0xff."""
    s = scale.astype(jnp.int32)
    hi = jnp.where(s == 0xFF, np.float32(np.nan), _pow2(jnp.where(s == 0, -63, s - 127)))
    lo = jnp.where(s == 0, np.float32(2.0**-64), np.float32(1))
    return hi, lo
