// Scaled sign on the CPU: the handlers of kSignsgdEncode, kSignsgdDecode and
// kSignsgdEncodeFeedback. The targets, bodies, sizes and checks in
// include/jaxcomp/signsgd.h; twin in jaxcomp/codecs/signsgd.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/signsgd.h"

namespace jaxcomp {
namespace {

using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;

// ---------------------------------------------------------------------------
// Kernels: the buckets [b0, b1) of one tensor
// ---------------------------------------------------------------------------
// Encode of bucket b from its float32 values buf[0..B) (valid of them, zeros
// after); mag is B-sized scratch.
inline void encode_bucket(const Handlers::EncodeArgs& a, int64_t b, int64_t valid, const float* buf, float* mag,
                          uint8_t* signs) {
  const int B = a.bucket;
  for (int i = 0; i < B; ++i) {
    signs[i] = buf[i] < 0.0f ? 1 : 0;
    mag[i] = std::fabs(buf[i]);
  }
  a.side[b] = signsgd_scale(cpu::tree_sum(mag, B), valid);
  cpu::pack_bucket<1>(signs, B, a.codes + b * (B / 8));
}

// The B values of one bucket, decoded into out. -scale is scale with its
// sign bit flipped, so a value is the scale's bits XOR (bit << 31): no
// select, and the loop over a byte's eight bits vectorizes. A NaN scale
// makes the whole bucket the decoders' NaN (common.h), of either sign bit;
// decided once per bucket, so the loop stays a plain XOR.
inline void decode_bucket(const uint8_t* signs, float side, int B, float* out) {
  if (side != side) {
    std::fill(out, out + B, canonical_nan(side));
    return;
  }
  const uint32_t scale = f32_bits(side);
  for (int g = 0; g < B / 8; ++g) {
    const uint32_t byte = signs[g];
    for (int j = 0; j < 8; ++j) out[8 * g + j] = bits_f32(scale ^ (((byte >> j) & 1u) << 31));
  }
}

JC_CPU_LOOP void encode_range(const Handlers::EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B), mag(B);
  std::vector<uint8_t> signs(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, B, buf.data());
    encode_bucket(a, b, valid, buf.data(), mag.data(), signs.data());
  }
}

JC_CPU_LOOP void decode_range(const Handlers::DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const bool direct = a.dtype == DType::kF32 && valid == B;
    float* out = direct ? static_cast<float*>(a.out) + start : buf.data();
    decode_bucket(a.codes + b * (B / 8), a.side[b], B, out);
    if (!direct) cpu::store_any(a.dtype, buf.data(), start, valid, a.out);
  }
}

// Error feedback in one pass: each bucket's acc = f32(x) + residual, encoded
// and decoded as above, and acc - decoded written out.
JC_CPU_LOOP void feedback_range(const Handlers::FeedbackArgs& f, int64_t b0, int64_t b1) {
  const int B = f.bucket;
  const Handlers::EncodeArgs a{DType::kF32, nullptr, f.n, B, f.codes, f.side};
  std::vector<float> acc(B), mag(B), hat(B);
  std::vector<uint8_t> signs(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, f.n - start);
    cpu::load_sum(f.dtype, f.x, f.residual, start, valid, B, acc.data());
    encode_bucket(a, b, valid, acc.data(), mag.data(), signs.data());
    decode_bucket(f.codes + b * (B / 8), f.side[b], B, hat.data());
    cpu::store_residual(acc.data(), hat.data(), start, valid, f.out);
  }
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), the signs being the codes and
// the scales the side data
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kSignsgdEncode,
                 Handlers::encode<check_pair_encode<signsgd_sizes>, Handlers::encode_buckets<encode_range>>);
JAXCOMP_REGISTER(kSignsgdDecode,
                 Handlers::decode<check_pair_decode<signsgd_sizes>, Handlers::decode_buckets<decode_range>>);
JAXCOMP_REGISTER(kSignsgdDecodeSum,
                 Handlers::decode_sum<check_pair_decode<signsgd_sizes>, Handlers::decode_buckets<decode_range>,
                                      bucket_unit<signsgd_sizes>>);
JAXCOMP_REGISTER(kSignsgdEncodeFeedback,
                 Handlers::feedback<check_pair_encode<signsgd_sizes>, Handlers::feedback_buckets<feedback_range>>);

}  // namespace
}  // namespace jaxcomp
