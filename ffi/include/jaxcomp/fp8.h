// FP8 (E4M3 or E5M2, a float32 max|v| per block), shared by ffi/fp8.cc and
// cuda/fp8.cu: the scale rule, the payload sizes and the checks. The rounding
// is minifloat.h's. Twin: jaxcomp/codecs/fp8.py.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/minifloat.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

// fmax / max|v| (0 for a zero, NaN or infinite max|v|), as int8_inv.
JC_HD float fp8_inv(float maxabs, const MiniFormat& f) { return maxabs > 0.0f ? f.max_value / maxabs : 0.0f; }
// max|v| * (1 / fmax), the reciprocal rounded once (a constant).
JC_HD float fp8_step(float maxabs, const MiniFormat& f) { return maxabs * (1.0f / f.max_value); }

struct Fp8Sizes {
  int64_t codes;
  int64_t scales;
};

JC_HD Fp8Sizes fp8_sizes(int64_t n, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return Fp8Sizes{nb * bucket, nb};
}

inline const char* fp8_check_format(int64_t format) {
  return (format == kE4M3 || format == kE5M2) ? nullptr : "format must be 0 (e4m3) or 1 (e5m2)";
}

inline const char* fp8_check_encode(DType x, int64_t n, int64_t seed, int64_t codes, int64_t scales, int64_t bucket,
                                    int64_t format, int64_t stochastic) {
  if (const char* e = check_seed(seed)) return e;
  if (const char* e = fp8_check_format(format)) return e;
  if (stochastic != 0 && stochastic != 1) return "stochastic must be 0 or 1";
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const Fp8Sizes want = fp8_sizes(n, bucket);
  return check_payload(codes, want.codes, scales, want.scales);
}

inline const char* fp8_check_decode(DType out, int64_t n, int64_t codes, int64_t scales, int64_t bucket,
                                    int64_t format) {
  if (const char* e = fp8_check_format(format)) return e;
  if (const char* e = check_bucketed_output(out, bucket)) return e;
  const Fp8Sizes want = fp8_sizes(n, bucket);
  return check_payload(codes, want.codes, scales, want.scales);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/fp8.cc and cuda/fp8.cu (jaxcomp/registry.h). Their
// handlers take the operands and results, then the attributes, in order:
//   encode: x (flat f32/bf16/f16), seed (2 uint32 words)
//           -> codes (one per element, whole buckets), scales (max|v| per bucket)
inline constexpr Target kFp8Encode{"jaxcomp_fp8_encode",
                                   "bucket_size",  // power of two
                                   "format",       // 0: e4m3, 1: e5m2
                                   "stochastic"};  // 1: stochastic, 0: nearest even
//   decode: codes, scales -> flat output, the input's dtype
inline constexpr Target kFp8Decode{"jaxcomp_fp8_decode", "bucket_size", "format"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kFp8DecodeSum{"jaxcomp_fp8_decode_sum", "bucket_size", "format"};
//   encode_feedback (CPU): x, residual (f32, x's length), seed -> codes, scales
//           of acc = float32(x) + residual, and acc - decode (f32)
inline constexpr Target kFp8EncodeFeedback{"jaxcomp_fp8_encode_feedback", "bucket_size", "format", "stochastic"};

}  // namespace jaxcomp
