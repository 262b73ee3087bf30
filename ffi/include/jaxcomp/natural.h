// Natural compression (Horvath et al., the IntML paper), shared by
// ffi/natural.cc and cuda/natural.cu: the per-element bodies, the payload
// sizes and the checks. All integer arithmetic on the float32 bits; twin:
// jaxcomp/codecs/natural.py.
//
// Every value becomes a signed power of two. One byte per value:
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
#pragma once

#include <type_traits>

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

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

// The exponent cap of a storage type T (see above).
template <typename T>
JC_HD uint32_t natural_cap() {
  return std::is_same<T, f16_t>::value ? 142u : 254u;
}

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: one code byte per element (no
// padding) and one top exponent (uint8) per bucket. The decoder's checks are
// the pair families' (checks.h) over these sizes, kBadTops its error for tops
// of the wrong size.
JC_HD PairSizes natural_sizes(int64_t n, int64_t bucket) { return PairSizes{n, num_buckets(n, bucket)}; }

inline constexpr char kBadTops[] = "tops buffer has the wrong size";

inline const char* natural_check_encode(DType x, int64_t n, int64_t seed, int64_t codes, int64_t tops,
                                        int64_t bucket, int64_t stochastic) {
  if (const char* e = check_seed(seed)) return e;
  if (stochastic != 0 && stochastic != 1) return "stochastic must be 0 or 1";
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const PairSizes want = natural_sizes(n, bucket);
  return check_payload(codes, want.codes, tops, want.side);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/natural.cc and cuda/natural.cu (jaxcomp/registry.h).
// Their handlers take the operands and results, then the attributes, in
// order:
//   encode: x (flat f32/bf16/f16), seed (2 uint32 words)
//           -> codes (one per element), tops (the top exponent of each bucket)
inline constexpr Target kNaturalEncode{"jaxcomp_natural_encode",
                                       "bucket_size",  // power of two
                                       "stochastic"};  // 1: unbiased, 0: nearest
//   decode: codes, tops -> flat output, the input's dtype
inline constexpr Target kNaturalDecode{"jaxcomp_natural_decode", "bucket_size"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kNaturalDecodeSum{"jaxcomp_natural_decode_sum", "bucket_size"};
//   encode_feedback (CPU): x, residual (f32, x's length), seed -> codes, tops
//           of acc = float32(x) + residual, and acc - decode (f32)
inline constexpr Target kNaturalEncodeFeedback{"jaxcomp_natural_encode_feedback", "bucket_size", "stochastic"};

}  // namespace jaxcomp
