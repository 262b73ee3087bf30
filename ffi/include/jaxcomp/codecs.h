// Per-element and per-bucket bodies of the fixed-rate codecs, shared by the
// CPU handlers and the CUDA kernels. The twins are in jaxcomp/ops/*.py.
//
// Reductions that depend on order (sums) use the halving tree
//   for (w = B/2; w >= 1; w /= 2) a[i] += a[i + w]   (i < w)
// over a power-of-two bucket B padded with zeros: the CPU loops, the
// classic shared-memory CUDA reduction and the jnp twin all add in this order,
// which is what makes the backends bit-identical.
#pragma once

#include "jaxcomp/common.h"

namespace jaxcomp {

// ---------------------------------------------------------------------------
// QSGD (Alistarh et al. 2017; the multi-GPU low-precision study, section 2.3).
// s = 2^(bits-1) - 1 levels; code = sign << (bits-1) | level.
// ---------------------------------------------------------------------------
JC_HD float qsgd_inv(float scale, int s) { return scale > 0.0f ? static_cast<float>(s) / scale : 0.0f; }
// Steps multiply by a float32 reciprocal rather than divide: XLA rewrites a
// division by a constant into that multiplication, so the twins can only
// match this form.
JC_HD float qsgd_step(float scale, int s) { return scale * (1.0f / static_cast<float>(s)); }

// r = |v| * inv is the position on the level grid; the level is floor(r)
// rounded up with probability frac(r), so E[level] = r (unbiased).
JC_HD uint32_t qsgd_code(float v, float inv, int s, int bits, float u) {
  const float fs = static_cast<float>(s);
  float r = (v < 0.0f ? -v : v) * inv;
  r = r < fs ? r : fs;  // rounding slop above s, and NaN, clamp to s
  // r >= 0, so truncation is floor (and vectorizes without SSE4.1).
  const uint32_t fl = static_cast<uint32_t>(static_cast<int32_t>(r));
  const float frac = r - static_cast<float>(fl);  // exact
  uint32_t level = fl + (u < frac ? 1u : 0u);
  level = level < static_cast<uint32_t>(s) ? level : static_cast<uint32_t>(s);
  const uint32_t sign = v < 0.0f ? 1u : 0u;
  return (sign << (bits - 1)) | level;
}

JC_HD float qsgd_value(uint32_t code, float step, int bits) {
  const uint32_t level = code & ((1u << (bits - 1)) - 1u);
  const float mag = static_cast<float>(level) * step;
  return (code >> (bits - 1)) ? -mag : mag;
}

// v^2 as the sum of three exact products: v = h + l with h = v's top 12
// significant bits, so h*h, h*l and l*l are exact in float32. Any FMA
// contraction of this expression (XLA contracts multiplies that feed adds, on
// CPU and GPU; the kernels never do) gives the same bits, which is what lets
// the twins reproduce the L2 norm exactly. Within 2^-23 of the rounded square.
JC_HD float exact_square(float v) {
  const float h = bits_f32(f32_bits(v) & 0xfffff000u);
  const float l = v - h;
  return (h * h + (h * l) * 2.0f) + l * l;
}

// ---------------------------------------------------------------------------
// Int8: 255 levels in [-127, 127], scale = max|v| per bucket, round to
// nearest even (the 3LC paper's "8-bit int" baseline).
// ---------------------------------------------------------------------------
JC_HD float int8_inv(float maxabs) { return maxabs > 0.0f ? 127.0f / maxabs : 0.0f; }
JC_HD float int8_step(float maxabs) { return maxabs * (1.0f / 127.0f); }

JC_HD int8_t int8_code(float v, float inv) {
  float t = v * inv;
  t = t < -127.0f ? -127.0f : t;
  t = t > 127.0f ? 127.0f : t;
  t = (t == t) ? t : 0.0f;  // NaN (only when the bucket scale is not finite)
  // Round half to even: adding and removing 1.5 * 2^23 is exact for |t| < 2^22.
  t = (t + 12582912.0f) - 12582912.0f;
  return static_cast<int8_t>(static_cast<int32_t>(t));
}

JC_HD float int8_value(int8_t q, float step) { return static_cast<float>(q) * step; }

// ---------------------------------------------------------------------------
// 1-bit SGD (Seide et al. 2014; the study, section 2.2, "reshaped" into
// buckets): bit 1 for v >= 0, decoded to avg+; bit 0 to avg-.
// ---------------------------------------------------------------------------
JC_HD float onebit_mean(float sum, uint32_t count) {
  return count > 0 ? sum / static_cast<float>(count) : 0.0f;
}

}  // namespace jaxcomp

namespace jaxcomp {

// ---------------------------------------------------------------------------
// TernGrad (Wen et al. 2017): per bucket s = max|v|; each value becomes
// sign(v) * s with probability |v| / s, else 0 (unbiased). Trit digits
// (t + 1 in {0, 1, 2}) are base-3^5 packed over the whole stream (ternary.h).
// ---------------------------------------------------------------------------
// 1 / s, or 0 for s = 0 (and for a NaN s, whose compare fails): one level of
// qsgd_inv.
JC_HD float terngrad_inv(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Digit t + 1 for value v: 2 (+1), 0 (-1) or 1 (zero), given inv = 1/s and
// the element's uniform u. A NaN or infinite r never rounds up.
JC_HD uint32_t terngrad_digit(float v, float inv, float u) {
  const float r = (v < 0.0f ? -v : v) * inv;
  const uint32_t up = u < r ? 1u : 0u;
  const uint32_t neg = v < 0.0f ? 1u : 0u;
  return 1u + up - 2u * (up & neg);
}

JC_HD float terngrad_value(uint32_t digit, float scale) {
  return static_cast<float>(static_cast<int32_t>(digit) - 1) * scale;
}

// ---------------------------------------------------------------------------
// Natural compression (Horvath et al., the IntML paper): every value becomes
// a signed power of two. One byte per value:
//   bit 7 sign, bit 6 zero/special flag, bits 0..5 d.
//   flag 0: +-2^(top - d - 127), i.e. the float32 with biased exponent top - d,
//           where top = (max biased exponent of the bucket's finite values) + 1;
//   flag 1: d = 63 NaN, d = 62 +-inf, otherwise zero (the encoder writes 0x40).
// Stochastic: |v| in [2^a, 2^(a+1)) goes to 2^(a+1) with probability
// mantissa / 2^23 (exactly: (bits >> 9) < mantissa), else 2^a; unbiased.
// Deterministic: to the nearer power, the midpoint 1.5 * 2^a rounds up.
// Values more than 63 binades below top (biased exponent e < top - 63 =: emin)
// go to 0 or 2^(emin-127): stochastically with probability |v| / 2^(emin-127)
// (exact to 2^-32), deterministically to the nearer one (ties up).
// Rounding up never passes the exponent cap (254 for float32/bfloat16, 142 =
// 2^15 for float16): values at or above the largest power of the dtype round
// down to it, so finite inputs stay finite.
// ---------------------------------------------------------------------------
constexpr uint32_t kNaturalZero = 0x40u;
constexpr uint32_t kNaturalInf = 0x7eu;  // | sign << 7
constexpr uint32_t kNaturalNaN = 0x7fu;

// |v|'s bits when v is finite, else 0: the bucket's top is the max of these
// (an integer max, order-independent) shifted right by 23, plus one.
// Every select below goes through masks (select_bits): GCC turns ternaries on
// these integers into branches, and the loops would not vectorize.
JC_HD uint32_t natural_finite_abs(float v) {
  const uint32_t a = abs_bits(v);
  return a & mask_if(a < 0x7f800000u);
}

JC_HD uint32_t natural_code(float v, uint32_t top, uint32_t cap, bool stochastic, uint32_t rbits) {
  const uint32_t u = f32_bits(v);
  const uint32_t sign = u >> 31;
  const uint32_t e = (u >> 23) & 0xffu;
  const uint32_t man = u & 0x7fffffu;
  // Normal path: round the exponent up with probability man / 2^23 (or when
  // man >= 2^22, the midpoint included), never past the cap.
  const uint32_t up = static_cast<uint32_t>(stochastic ? (rbits >> 9) < man : man >= 0x400000u);
  const uint32_t er0 = e + up;
  const uint32_t er = select_bits(er0 < cap, er0, cap);
  // Underflow path: k = emin - e >= 1 binades below the smallest power 2^emin,
  // emin = top - 63. P(2^emin) = |v| / 2^emin = (2^23 + man) / 2^(23 + k),
  // compared on 32 bits: threshold (2^31 + man * 2^8) >> (k - 1), 0 for k > 32.
  const int32_t k = static_cast<int32_t>(top) - 63 - static_cast<int32_t>(e);
  const bool under = k >= 1;
  const int32_t km1 = k - 1;
  const uint32_t sh = static_cast<uint32_t>(km1) & mask_if(km1 > 0);  // max(k - 1, 0)
  const uint32_t t32 = ((0x80000000u | (man << 8)) >> (sh & 31u)) & mask_if(sh < 32u);
  const bool up2 = stochastic ? rbits < t32 : k == 1;
  const uint32_t d = select_bits(under, 63u, top - er);
  const bool zero = (e == 0u) | (under & !up2);
  uint32_t code = (sign << 7) | (d & 63u);
  code = select_bits(zero, kNaturalZero, code);
  const uint32_t special = select_bits(man != 0u, kNaturalNaN, kNaturalInf | (sign << 7));
  return select_bits(e == 0xffu, special, code);
}

// natural_code for a bucket where no value is more than 63 binades below top
// (the common case; the CPU loops check it per bucket): the same bytes
// without the underflow path.
JC_HD uint32_t natural_code_fast(float v, uint32_t top, uint32_t cap, bool stochastic, uint32_t rbits) {
  const uint32_t a = abs_bits(v);
  // Rounding up is a carry from the mantissa into the exponent: adding
  // 2^23 - 1 - (rbits >> 9) carries exactly when (rbits >> 9) < mantissa, and
  // adding 2^22 exactly when mantissa >= 2^22 (the midpoint rounds up).
  const uint32_t bump = stochastic ? 0x7fffffu - (rbits >> 9) : 0x400000u;
  uint32_t er = (a + bump) >> 23;  // up to 256 for inf/NaN, replaced below
  er = select_bits(er < cap, er, cap);
  uint32_t code = ((f32_bits(v) >> 24) & 0x80u) | ((top - er) & 63u);
  code = select_bits(a < 0x00800000u, kNaturalZero, code);
  const uint32_t special = select_bits(a > 0x7f800000u, kNaturalNaN, kNaturalInf | ((f32_bits(v) >> 24) & 0x80u));
  return select_bits(a >= 0x7f800000u, special, code);
}

// The smallest biased exponent among the nonzero finite values goes through
// an integer min over these (0xffffffff for zeros, subnormals, inf and NaN).
JC_HD uint32_t natural_min_key(float v) {
  const uint32_t a = abs_bits(v);
  return a | mask_if((a < 0x00800000u) | (a >= 0x7f800000u));
}

JC_HD float natural_value(uint32_t code, uint32_t top) {
  const uint32_t sign = (code & 0x80u) << 24;
  const uint32_t d = code & 63u;
  const int32_t ex = static_cast<int32_t>(top) - static_cast<int32_t>(d);
  const uint32_t normal = sign | ((static_cast<uint32_t>(ex) & mask_if(ex > 0)) << 23);
  const uint32_t inf_or_zero = sign | (0x7f800000u & mask_if(d == 62u));
  const uint32_t special = select_bits(d == 63u, 0x7fc00000u, inf_or_zero);
  return bits_f32(select_bits((code & 0x40u) != 0u, special, normal));
}

}  // namespace jaxcomp
