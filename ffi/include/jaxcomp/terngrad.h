// TernGrad (Wen et al. 2017), shared by ffi/terngrad.cc and cuda/terngrad.cu:
// the per-element bodies, the payload sizes and the checks. Twin:
// jaxcomp/codecs/terngrad.py.
//
// Per bucket s = max|v|; each value becomes sign(v) * s with probability
// |v| / s, else 0 (unbiased). Trit digits (t + 1 in {0, 1, 2}) are base-3^5
// packed over the whole stream (ternary.h).
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"
#include "jaxcomp/ternary.h"

namespace jaxcomp {

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
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: the base-3^5 bytes of n trits
// and one float32 scale per bucket. The decoder's checks are the pair
// families' (checks.h) over these sizes.
JC_HD PairSizes terngrad_sizes(int64_t n, int64_t bucket) { return PairSizes{base3_bytes(n), num_buckets(n, bucket)}; }

inline const char* terngrad_check_encode(DType x, int64_t n, int64_t seed, int64_t trits, int64_t scales,
                                         int64_t bucket) {
  if (const char* e = check_seed(seed)) return e;
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const PairSizes want = terngrad_sizes(n, bucket);
  return check_payload(trits, want.codes, scales, want.side);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/terngrad.cc and cuda/terngrad.cu (jaxcomp/registry.h).
// Their handlers take the operands and results, then the attributes, in
// order:
//   encode: x (flat f32/bf16/f16), seed (2 uint32 words)
//           -> trits (base-3^5 bytes, ceil(n/5)), scales (max|x| per bucket)
inline constexpr Target kTerngradEncode{"jaxcomp_terngrad_encode",
                                        "bucket_size"};  // power of two
//   decode: trits, scales -> flat output, the input's dtype
inline constexpr Target kTerngradDecode{"jaxcomp_terngrad_decode", "bucket_size"};
//   decode_sum (CPU): trits [rows, bytes], scales [rows, buckets] -> the
//               rows' sum, flat float32; the decoder's attribute
inline constexpr Target kTerngradDecodeSum{"jaxcomp_terngrad_decode_sum", "bucket_size"};
//   encode_feedback (CPU): x, residual (f32, x's length), seed -> trits, scales
//           of acc = float32(x) + residual, and acc - decode (f32)
inline constexpr Target kTerngradEncodeFeedback{"jaxcomp_terngrad_encode_feedback", "bucket_size"};

}  // namespace jaxcomp
