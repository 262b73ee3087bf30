// Int8 (the 3LC paper's "8-bit int" baseline), shared by ffi/int8.cc and
// cuda/int8.cu: the per-element bodies, the payload sizes and the checks.
// Twin: jaxcomp/codecs/int8.py.
//
// 255 levels in [-127, 127], scale = max|v| per bucket, round to nearest even.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

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
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: one int8 per element of every
// bucket (the last one zero-padded) and one float32 scale per bucket. The
// checks are the pair families' (checks.h) over these sizes.
JC_HD PairSizes int8_sizes(int64_t n, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return PairSizes{nb * bucket, nb};
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/int8.cc and cuda/int8.cu (jaxcomp/registry.h). Their
// handlers take the operands and results, then the attributes, in order:
//   encode: x (flat f32/bf16/f16) -> q, scales (int8_sizes)
inline constexpr Target kInt8Encode{"jaxcomp_int8_encode",
                                    "bucket_size"};  // power of two
//   decode: q, scales -> flat output, the input's dtype
inline constexpr Target kInt8Decode{"jaxcomp_int8_decode", "bucket_size"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kInt8DecodeSum{"jaxcomp_int8_decode_sum", "bucket_size"};
//   encode_feedback (CPU, CUDA): x, residual (f32) -> q, scales, new residual (f32):
//   the payload of acc = f32(x) + residual, and acc - decode(payload)
inline constexpr Target kInt8EncodeFeedback{"jaxcomp_int8_encode_feedback", "bucket_size"};

}  // namespace jaxcomp
