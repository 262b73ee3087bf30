// 1-bit SGD (Seide et al. 2014; the study, section 2.2, "reshaped" into
// buckets), shared by ffi/onebit.cc and cuda/onebit.cu: the bodies, the
// payload sizes and the checks. Twin: jaxcomp/codecs/onebit.py.
//
// Bit 1 for v >= 0, decoded to avg+ (the mean of the bucket's non-negative
// values), bit 0 to avg-; both means are halving-tree sums (common.h) divided
// by the counts.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

JC_HD float onebit_mean(float sum, uint32_t count) {
  return count > 0 ? sum / static_cast<float>(count) : 0.0f;
}

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: one bit per element of every
// bucket, packed (uint8), and (avg+, avg-) per bucket (float32). The checks
// are the pair families' (checks.h) over these sizes, kBadMeans the decoder's
// error for means of the wrong size.
JC_HD PairSizes onebit_sizes(int64_t n, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return PairSizes{nb * bucket / 8, 2 * nb};
}

inline constexpr char kBadMeans[] = "means buffer has the wrong size";

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/onebit.cc and cuda/onebit.cu (jaxcomp/registry.h).
// Their handlers take the operands and results, then the attributes, in
// order:
//   encode: x (flat f32/bf16/f16) -> bits, means ((avg+, avg-) per bucket)
inline constexpr Target kOnebitEncode{"jaxcomp_onebit_encode",
                                      "bucket_size"};  // power of two
//   decode: bits, means -> flat output, the input's dtype
inline constexpr Target kOnebitDecode{"jaxcomp_onebit_decode", "bucket_size"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kOnebitDecodeSum{"jaxcomp_onebit_decode_sum", "bucket_size"};
//   encode_feedback (CPU, CUDA): x, residual (f32) -> bits, means, new residual
//   (f32): the payload of acc = f32(x) + residual, and acc - decode(payload)
inline constexpr Target kOnebitEncodeFeedback{"jaxcomp_onebit_encode_feedback", "bucket_size"};

}  // namespace jaxcomp
