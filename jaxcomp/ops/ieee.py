"""Correctly rounded float32 division and square root, and the kernels' rules
for subnormals and NaNs, for the twins.

XLA's GPU code lowers float32 ``/`` to an approximate division and ``sqrt``
to an approximate root, off by an ulp for many operands (how many:
benchmarks/xla_arith.py, docs/gpu.md), while XLA's CPU code, the CPU
kernels and the CUDA kernels (nvcc's -prec-div=true -prec-sqrt=true) round
both correctly. The twins need one division or root per bucket, so
they compute them here from integer operations (restoring division and the
digit-by-digit root, one result bit per step), which every platform
executes exactly: the same bits everywhere, at a cost per bucket, not per
element.

Both follow the kernels' arithmetic (docs/codecs.md, "One answer"): round
to nearest even, subnormal operands read as zero (the sign kept) and
subnormal results flushed to zero, as under the CPU's FTZ/DAZ modes and
nvcc's --ftz=true; NaN results with x86's bits (a NaN operand quieted, the
default NaN 0xffc00000 for an invalid operation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops._dispatch import platform_dependent

_SIGN = np.uint32(0x80000000)
_MANT = np.uint32(0x007FFFFF)
_HIDDEN = np.uint32(0x00800000)
_INF = np.uint32(0x7F800000)
# NaN results as x86's SSE gives them, so that the twins give the CPU kernels'
# bits on every platform: a NaN operand comes out quiet (the first operand's
# where both are NaN), an invalid operation (0/0, inf/inf, sqrt(-1)) gives
# the default NaN 0xffc00000.
_QUIET = np.uint32(0x00400000)
_DEFAULT_NAN = np.uint32(0xFFC00000)


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.uint32)


def _float(u: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(u, jnp.float32)


def _u32(v: int) -> np.uint32:
    return np.uint32(v)


def div_exact(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` in float32, correctly rounded, as the kernels compute it.

    Args:
      a, b: float32 arrays of one shape (or broadcastable scalars).
    Returns:
      The IEEE 754 quotient, rounded to nearest even; a subnormal operand
      reads as a zero of its sign, a subnormal quotient is flushed to zero;
      NaN results with x86's bits (above).
    """
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    ua, ub = _bits(a), _bits(b)
    sign = (ua ^ ub) & _SIGN
    ea = ((ua >> 23) & _u32(0xFF)).astype(jnp.int32)
    eb = ((ub >> 23) & _u32(0xFF)).astype(jnp.int32)
    fa, fb = ua & _MANT, ub & _MANT
    a_zero, b_zero = ea == 0, eb == 0  # zeros and subnormals
    a_inf, b_inf = (ea == 255) & (fa == 0), (eb == 255) & (fb == 0)
    a_nan, b_nan = (ea == 255) & (fa != 0), (eb == 255) & (fb != 0)
    nan = a_nan | b_nan | (a_zero & b_zero) | (a_inf & b_inf)
    nan_bits = jnp.where(a_nan, ua | _QUIET, jnp.where(b_nan, ub | _QUIET, _DEFAULT_NAN))
    inf = (a_inf | b_zero) & ~nan
    zero = (a_zero | b_inf) & ~nan & ~inf

    # Finite, normal operands: ma / mb in (1/2, 2), normalized to [1, 2) by
    # doubling ma; 25 quotient bits (24 and the rounding bit), the rest
    # only as "nonzero remainder".
    ma, mb = fa | _HIDDEN, fb | _HIDDEN
    low = ma < mb
    r = jnp.where(low, ma << 1, ma)
    e = ea - eb + 127 - low.astype(jnp.int32)
    q = jnp.zeros_like(ma)
    for _ in range(25):
        ge = r >= mb
        q = (q << 1) | ge.astype(jnp.uint32)
        r = jnp.where(ge, r - mb, r) << 1
    return _pack(sign, e, q, r != 0, nan, nan_bits, inf, zero)


def sqrt_exact(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` in float32, correctly rounded, as the kernels compute it.

    Args:
      x: a float32 array.
    Returns:
      The IEEE 754 root, rounded to nearest even; ``sqrt(-0) = -0``, a
      subnormal reads as a zero of its sign, ``sqrt(inf) = inf``; a NaN
      operand comes out quiet, a negative one gives the default NaN.
    """
    x = jnp.asarray(x, jnp.float32)
    u = _bits(x)
    sign = u & _SIGN
    e = ((u >> 23) & _u32(0xFF)).astype(jnp.int32)
    f = u & _MANT
    zero = e == 0
    x_nan = (e == 255) & (f != 0)
    nan = x_nan | ((sign != 0) & ~zero)
    nan_bits = jnp.where(x_nan, u | _QUIET, _DEFAULT_NAN)
    inf = (e == 255) & (f == 0) & ~nan

    # x = m * 2^p, m in [2^23, 2^24), p = e - 150. With k in {25, 26} such
    # that p - k is even, R = m * 2^k is in [2^48, 2^50) and sqrt(x) =
    # sqrt(R) * 2^((p - k) / 2), sqrt(R) in [2^24, 2^25): the digit-by-digit
    # root of R, two radicand bits a step, gives those 25 bits. R's top 26
    # bits are m * 2^(k - 24) and its low 24 bits are zeros.
    m = f | _HIDDEN
    k = 25 + ((e - 150 - 25) & 1)
    top = m << (k - 24).astype(jnp.uint32)
    rem = jnp.zeros_like(m)
    root = jnp.zeros_like(m)
    for j in range(25):
        pair = (top >> _u32(24 - 2 * j)) & _u32(3) if j <= 12 else _u32(0)
        rem = (rem << 2) | pair
        trial = (root << 2) | _u32(1)
        ge = rem >= trial
        rem = jnp.where(ge, rem - trial, rem)
        root = (root << 1) | ge.astype(jnp.uint32)
    er = 151 + (e - 150 - k) // 2
    out = _pack(_u32(0), er, root, rem != 0, nan, nan_bits, inf, zero)
    return jnp.where(zero & ~nan, _float(sign), out)


def div(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a / b`` in float32 as the kernels compute it (:func:`div_exact`):
    XLA's own division on the CPU, which rounds so already (and is cheaper
    to compile), the integer construction elsewhere."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    return platform_dependent(a, b, cpu=lambda a, b: a / b, default=div_exact)


def sqrt(x: jax.Array) -> jax.Array:
    """``sqrt(x)`` in float32 as the kernels compute it (:func:`sqrt_exact`):
    XLA's own on the CPU, the integer construction elsewhere."""
    x = jnp.asarray(x, jnp.float32)
    return platform_dependent(x, cpu=jnp.sqrt, default=sqrt_exact)


def _pack(sign, e, q, sticky, nan, nan_bits, inf, zero) -> jax.Array:
    """Rounds the 25-bit significand q (its top bit at 2^24, the rounding bit
    last) to 24 bits, to nearest even with the sticky bit, and assembles the
    float32 of exponent e (biased), flushing subnormal results to zero."""
    round_bit = q & _u32(1)
    m = q >> 1
    m = m + (round_bit & (sticky.astype(jnp.uint32) | (m & _u32(1))))
    carry = m >> 24  # rounded up to 2^24
    m = jnp.where(carry == 1, m >> 1, m)
    e = e + carry.astype(jnp.int32)
    overflow = e >= 255
    underflow = e <= 0
    finite = sign | (jnp.clip(e, 1, 254).astype(jnp.uint32) << 23) | (m & _MANT)
    out = jnp.where(overflow, sign | _INF, jnp.where(underflow, sign, finite))
    out = jnp.where(inf, sign | _INF, jnp.where(zero, sign, out))
    return _float(jnp.where(nan, nan_bits, out))


def canonical_nan(x: jax.Array) -> jax.Array:
    """Every NaN of ``x`` as the decoders' NaN (common.h: canonical_nan):
    0x7fc00000 as float32, 0x7fc0 as bfloat16, 0x7e00 as float16, whatever
    NaN the platform's arithmetic made."""
    dt = jnp.dtype(x.dtype)
    if dt == jnp.float32:
        nan = _float(jnp.asarray(np.uint32(0x7FC00000)))
    else:
        bits = {jnp.dtype(jnp.bfloat16): 0x7FC0, jnp.dtype(jnp.float16): 0x7E00}[dt]
        nan = lax.bitcast_convert_type(jnp.asarray(np.uint16(bits)), dt)
    return jnp.where(jnp.isnan(x), nan, x)


def daz(x: jax.Array) -> jax.Array:
    """float32 subnormals as zeros of their sign: what the kernels' float
    arithmetic and comparisons read (the CPU's DAZ mode, nvcc's --ftz=true,
    docs/codecs.md "One answer"). XLA's CPU code reads them so itself; XLA's
    GPU code keeps them, so the twins pass the values they compute with or
    compare through this (never what they only read as bits, such as
    max_abs's input)."""
    tiny = np.float32(np.finfo(np.float32).tiny)
    signed_zero = lax.bitcast_convert_type(
        lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0x80000000), jnp.float32
    )
    return jnp.where(jnp.abs(x) < tiny, signed_zero, x)
