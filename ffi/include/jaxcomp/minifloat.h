// Floating-point formats of 4 to 8 bits (FP8 E4M3 and E5M2, FP6 E3M2 and
// E2M3, FP4 E2M1, as the OCP 8-bit floating point and Microscaling v1.0
// specifications define them) and the E8M0 block scale of the MX formats:
// rounding a float32 to a code (to nearest even, or stochastically),
// saturating at the largest finite value, and the code's value. Shared by the
// FP8 and MX families (ffi/fp8.cc, ffi/mx.cc, cuda/fp8.cu, cuda/mx.cu).
// Twin: jaxcomp/codecs/_minifloat.py.
//
// Rounding works on the float32's own bits and products by powers of two,
// so it is exact and the same on every backend: the quantum of |t| is
// 2^(max(e, emin) - mbits), e being t's binary exponent (floor(log2|t|)) and
// emin the format's smallest normal exponent; |t| / quantum is rounded to an
// integer m (RNE, or floor(|t| / quantum + u) with u uniform in [0, 1)), and
// the code of the magnitude is ((max(e, emin) + bias - 1) << mbits) + m,
// which is the subnormal code m for e < emin, and carries into the exponent
// field when m reaches 2^(mbits+1). Codes of non-negative values grow with
// the value, so saturation is min(code, the largest finite code).
#pragma once

#include "jaxcomp/common.h"

namespace jaxcomp {

// The element formats, by their wire id (jaxcomp/codecs/_minifloat.py: FORMATS).
enum MiniFormatId : int { kE4M3 = 0, kE5M2 = 1, kE3M2 = 2, kE2M3 = 3, kE2M1 = 4, kNumMiniFormats = 5 };

struct MiniFormat {
  int ebits;         // exponent bits
  int mbits;         // mantissa bits
  int bias;          // exponent bias
  int emax;          // exponent of the largest finite value
  uint32_t max_code; // code of the largest finite value (sign bit clear)
  float max_value;   // the largest finite value
};

JC_HD constexpr MiniFormat mini_format(int id) {
  switch (id) {
    case kE5M2: return MiniFormat{5, 2, 15, 15, 0x7bu, 57344.0f};  // 0x7c: inf, above: NaN
    case kE3M2: return MiniFormat{3, 2, 3, 4, 0x1fu, 28.0f};        // no inf, no NaN
    case kE2M3: return MiniFormat{2, 3, 1, 2, 0x1fu, 7.5f};
    case kE2M1: return MiniFormat{2, 1, 1, 2, 0x7u, 6.0f};
    default: return MiniFormat{4, 3, 7, 8, 0x7eu, 448.0f};          // E4M3: 0x7f is NaN, no inf
  }
}

JC_HD constexpr int mini_bits(const MiniFormat& f) { return 1 + f.ebits + f.mbits; }

// 2^k as a float32, for k in [-126, 127].
JC_HD float pow2f(int k) { return bits_f32(static_cast<uint32_t>(k + 127) << 23); }

// The code of t: |t| above the largest finite value saturates to it; NaN
// gives code 0 (callers give its block a non-finite scale instead). u < 0: round to nearest
// even; else u in [0, 1) rounds stochastically (unbiased below the largest
// finite value).
JC_HD uint32_t mini_encode(float t, const MiniFormat& f, float u) {
  const uint32_t bits = f32_bits(t);
  const uint32_t sign = (bits >> 31) << (f.ebits + f.mbits);
  const uint32_t a = bits & 0x7fffffffu;
  const int emin = 1 - f.bias;
  int e = static_cast<int>(a >> 23) - 127;  // float32 subnormals and 0: -127, below emin
  e = e < emin ? emin : e;
  float scaled = bits_f32(a) * pow2f(f.mbits - e);  // in [0, 2^(mbits+1)): exact
  // Beyond every format's range (and inf, NaN): 64, which saturates; keeps
  // the conversion to int defined.
  scaled = scaled < 64.0f ? scaled : 64.0f;
  float r;
  if (u < 0.0f) {
    r = (scaled + 12582912.0f) - 12582912.0f;  // RNE: exact for |scaled| < 2^22
  } else {
    r = scaled + u;
  }
  const uint32_t m = static_cast<uint32_t>(static_cast<int32_t>(r));  // floor (r >= 0)
  uint32_t code = (static_cast<uint32_t>(e + f.bias - 1) << f.mbits) + m;
  code = code < f.max_code ? code : f.max_code;
  return a > 0x7f800000u ? 0u : (sign | code);  // NaN: +0, whatever its sign bit
}

// mini_encode(t, f, -1.0f): the code of t rounded to nearest even. On CUDA
// devices of sm_89 and later, the FP8 formats take the conversion instruction
// cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 for finite t: it rounds to nearest
// even, subnormals of the format included, keeps the sign of a zero, and
// saturates a finite value beyond the largest finite one to it, as
// mini_encode does. CUDA 13.0's cuda_fp8.hpp emulates the instruction in
// software for older devices (__nv_cvt_float_to_fp8 with __NV_SATFINITE);
// that emulation and mini_encode give the same code for all 2^32 - 2^24
// finite float32 inputs, in both formats (checked exhaustively on the host).
// A NaN (converted to a NaN code, where mini_encode gives 0) and an infinity
// (the largest finite value in both, but not a case worth relying on) stay on
// the software path. The instruction itself has not run where this was
// written (no GPU): the kernel == twin tests of tests/test_gpu.py check it.
JC_HD uint32_t mini_encode_rn(float t, const MiniFormat& f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (f.ebits + f.mbits == 7 && (f32_bits(t) & 0x7fffffffu) < 0x7f800000u) {
    unsigned short r;  // the first source operand goes to the high byte (here 0), the second to the low
    if (f.ebits == 4) {
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(t));
    } else {
      asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(t));
    }
    return r & 0xffu;
  }
#endif
  return mini_encode(t, f, -1.0f);
}

// The value of a code (sign included).
JC_HD float mini_value(uint32_t code, const MiniFormat& f) {
  const uint32_t mag = code & ((1u << (f.ebits + f.mbits)) - 1u);
  const int exp = static_cast<int>(mag >> f.mbits);
  const uint32_t mant = mag & ((1u << f.mbits) - 1u);
  // Subnormal: mant * 2^(emin - mbits); normal: (2^mbits + mant) * 2^(exp - bias - mbits).
  const float sig = static_cast<float>(static_cast<int32_t>(exp == 0 ? mant : mant + (1u << f.mbits)));
  const int k = (exp == 0 ? 1 : exp) - f.bias - f.mbits;
  float v = sig * pow2f(k);
  // The codes of FP8's inf and NaN (only E4M3's 0x7f and E5M2's 0x7c..0x7f
  // exist; a decoder sees them only in a payload not made by the encoder).
  if (f.ebits + f.mbits == 7 && mag > f.max_code) v = (f.ebits == 5 && mag == 0x7cu) ? INFINITY : NAN;
  return (code >> (f.ebits + f.mbits)) & 1u ? -v : v;
}

// ---------------------------------------------------------------------------
// The E8M0 scale of an MX block (OCP Microscaling v1.0, section 6.3): the
// shared exponent floor(log2(max|v|)) - emax of the element format, clamped
// to E8M0's [-127, 127] and stored biased by 127; 0xff (NaN) for a block
// holding a NaN or an infinity. A zero block gets the smallest scale, 2^-127.
// ---------------------------------------------------------------------------
JC_HD uint32_t mx_scale_code(float maxabs, const MiniFormat& f) {
  const uint32_t a = f32_bits(maxabs);  // non-negative
  if (a >= 0x7f800000u) return 0xffu;
  int e = static_cast<int>(a >> 23) - 127 - f.emax;  // float32 subnormals: below -127
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return static_cast<uint32_t>(e + 127);
}

// 1 / 2^(scale - 127), the factor elements are multiplied by before rounding
// (the scale of a finite block is at most 2^(127 - emax), so the factor is a
// normal float32); 0 for a NaN scale.
JC_HD float mx_inverse(uint32_t scale) { return scale == 0xffu ? 0.0f : pow2f(127 - static_cast<int>(scale)); }

// 2^(scale - 127) as the product of two factors, each a normal float32 (or
// NaN for 0xff): hi = 2^(scale - 127) and lo = 1, except for scale 0, whose
// 2^-127 is a float32 subnormal: hi = 2^-63, lo = 2^-64. Decoders multiply by
// both, so a block whose value is a normal float32 keeps it where a runtime
// that flushes denormals (XLA's CPU) would zero a subnormal 2^-127.
JC_HD float mx_scale_hi(uint32_t scale) {
  if (scale == 0xffu) return NAN;
  return pow2f(scale == 0 ? -63 : static_cast<int>(scale) - 127);
}
JC_HD float mx_scale_lo(uint32_t scale) { return scale == 0 ? pow2f(-64) : 1.0f; }

}  // namespace jaxcomp
