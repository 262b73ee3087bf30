// Scaled sign (EF-SignSGD, Karimireddy et al. 2019, per bucket), shared by
// ffi/signsgd.cc and cuda/signsgd.cu: the bodies, the payload sizes and the
// checks. Twin: jaxcomp/codecs/signsgd.py.
//
// Bit 1 for v < 0 (LSB first, as 1-bit SGD), decoded to -scale, bit 0 to
// +scale; scale is the bucket's halving-tree sum of |v| (common.h) times the
// reciprocal of its count of valid values.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

// The mean magnitude as sum * (1 / count), each rounded once: the twin's
// count is a constant, and XLA may rewrite a quotient by a constant into a
// product by its rounded reciprocal.
JC_HD float signsgd_scale(float abs_sum, int64_t valid) { return abs_sum * (1.0f / static_cast<float>(valid)); }

// -scale flips the sign bit only (NaN included), as the CPU decoder's XOR does.
JC_HD float signsgd_value(bool negative, float scale) { return negative ? -scale : scale; }

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: one sign bit per element of
// every bucket, packed (uint8), and one scale per bucket (float32). The
// checks are the pair families' (checks.h) over these sizes.
JC_HD PairSizes signsgd_sizes(int64_t n, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return PairSizes{nb * bucket / 8, nb};
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/signsgd.cc and cuda/signsgd.cu (jaxcomp/registry.h).
// Their handlers take the operands and results, then the attributes, in
// order:
//   encode: x (flat f32/bf16/f16) -> signs, scales (signsgd_sizes)
inline constexpr Target kSignsgdEncode{"jaxcomp_signsgd_encode",
                                       "bucket_size"};  // power of two
//   decode: signs, scales -> flat output, the input's dtype
inline constexpr Target kSignsgdDecode{"jaxcomp_signsgd_decode", "bucket_size"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kSignsgdDecodeSum{"jaxcomp_signsgd_decode_sum", "bucket_size"};
//   encode_feedback (CPU): x, residual (f32) -> signs, scales, new residual
//   (f32): the payload of acc = f32(x) + residual, and acc - decode(payload)
inline constexpr Target kSignsgdEncodeFeedback{"jaxcomp_signsgd_encode_feedback", "bucket_size"};

}  // namespace jaxcomp
