// QSGD (Alistarh et al. 2017; the multi-GPU low-precision study, section
// 2.3), shared by ffi/qsgd.cc and cuda/qsgd.cu: the per-element bodies, the
// payload sizes and the checks. Twin: jaxcomp/codecs/qsgd.py.
//
// s = 2^(bits-1) - 1 levels per bucket; code = sign << (bits-1) | level,
// packed 8 codes to `bits` bytes (common.h: pack8); one float32 scale per
// bucket, max|v| or the L2 norm.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

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
// contraction of this expression (XLA's CPU code contracts multiplies that
// feed adds; the kernels never do) gives the same bits, which is what lets
// the twins reproduce the L2 norm exactly. Within 2^-23 of the rounded square.
JC_HD float exact_square(float v) {
  const float h = bits_f32(f32_bits(v) & 0xfffff000u);
  const float l = v - h;
  return (h * h + (h * l) * 2.0f) + l * l;
}

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: packed codes (uint8) and one
// scale per bucket (float32).
struct QsgdSizes {
  int64_t packed;
  int64_t scales;
};

JC_HD QsgdSizes qsgd_sizes(int64_t n, int64_t bits, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return QsgdSizes{nb * bucket / 8 * bits, nb};
}

inline const char* qsgd_check_bits(int64_t bits) {
  return bits != 2 && bits != 3 && bits != 4 && bits != 8 ? "bits must be 2, 3, 4 or 8" : nullptr;
}

// x of n elements and its seed words -> packed codes and scales. Any l2 is
// valid (nonzero: the L2 norm).
inline const char* qsgd_check_encode(DType x, int64_t n, int64_t seed, int64_t packed, int64_t scales, int64_t bits,
                                     int64_t bucket, int64_t /*l2*/) {
  if (const char* e = qsgd_check_bits(bits)) return e;
  if (const char* e = check_seed(seed)) return e;
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const QsgdSizes want = qsgd_sizes(n, bits, bucket);
  return check_payload(packed, want.packed, scales, want.scales);
}

// Packed codes and scales -> out of n elements.
inline const char* qsgd_check_decode(DType out, int64_t n, int64_t packed, int64_t scales, int64_t bits,
                                     int64_t bucket) {
  if (const char* e = qsgd_check_bits(bits)) return e;
  if (const char* e = check_bucketed_output(out, bucket)) return e;
  const QsgdSizes want = qsgd_sizes(n, bits, bucket);
  return check_payload(packed, want.packed, scales, want.scales);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/qsgd.cc and cuda/qsgd.cu (jaxcomp/registry.h). Their
// handlers take the operands and results, then the attributes, in order:
//   encode: x (flat f32/bf16/f16), seed (2 uint32 words)
//           -> packed codes, scales (one per bucket)
inline constexpr Target kQsgdEncode{"jaxcomp_qsgd_encode",
                                    "bits",         // 2, 3, 4 or 8
                                    "bucket_size",  // power of two
                                    "l2"};          // 1: L2 norm, 0: max norm
//   decode: packed codes, scales -> flat output, the input's dtype
inline constexpr Target kQsgdDecode{"jaxcomp_qsgd_decode", "bits", "bucket_size"};
//   encode_feedback (CPU, CUDA): x, residual (f32), seed -> packed codes, scales,
//           new residual (f32): the payload of acc = f32(x) + residual, and
//           acc - decode(payload); the encoder's attributes
inline constexpr Target kQsgdEncodeFeedback{"jaxcomp_qsgd_encode_feedback", "bits", "bucket_size", "l2"};
//   decode_sum: packed codes [rows, bytes], scales [rows, buckets]
//               -> the rows' sum, flat float32
inline constexpr Target kQsgdDecodeSum{"jaxcomp_qsgd_decode_sum", "bits", "bucket_size"};

}  // namespace jaxcomp
