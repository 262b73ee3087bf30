// Int8 on the CPU: the handlers of kInt8Encode, kInt8Decode and
// kInt8EncodeFeedback. The targets, bodies, sizes and checks in
// include/jaxcomp/int8.h; twin in jaxcomp/codecs/int8.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/int8.h"

namespace jaxcomp {
namespace {

using Handlers = CpuPairHandlers<ffi::S8, ffi::F32>;

// ---------------------------------------------------------------------------
// Kernels: the buckets [b0, b1) of one tensor
// ---------------------------------------------------------------------------
JC_CPU_LOOP void encode_range(const Handlers::EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, B, buf.data());
    const float m = cpu::max_abs(buf.data(), B);
    a.side[b] = m;
    const float inv = int8_inv(m);
    int8_t* qb = a.codes + start;
    for (int i = 0; i < B; ++i) qb[i] = int8_code(buf[i], inv);
  }
}

// Error feedback in one pass: each bucket's acc, codes and new residual in
// cache (the decode's values, int8_value, as decode_range computes them).
JC_CPU_LOOP void feedback_range(const Handlers::FeedbackArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> acc(B), hat(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_sum(a.dtype, a.x, a.residual, start, valid, B, acc.data());
    const float m = cpu::max_abs(acc.data(), B);
    a.side[b] = m;
    const float inv = int8_inv(m);
    const float step = int8_step(m);
    int8_t* qb = a.codes + start;
    for (int i = 0; i < B; ++i) {
      qb[i] = int8_code(acc[i], inv);
      hat[i] = int8_value(qb[i], step);
    }
    cpu::store_residual(acc.data(), hat.data(), start, valid, a.out);
  }
}

JC_CPU_LOOP void decode_range(const Handlers::DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const float step = int8_step(a.side[b]);
    const int8_t* qb = a.codes + start;
    for (int i = 0; i < B; ++i) buf[i] = int8_value(qb[i], step);
    cpu::store_any(a.dtype, buf.data(), start, valid, a.out);
  }
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), q being the codes and the
// scales the side data
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kInt8Encode, Handlers::encode<check_pair_encode<int8_sizes>, Handlers::encode_buckets<encode_range>>);
JAXCOMP_REGISTER(kInt8Decode, Handlers::decode<check_pair_decode<int8_sizes>, Handlers::decode_buckets<decode_range>>);
JAXCOMP_REGISTER(kInt8DecodeSum, Handlers::decode_sum<check_pair_decode<int8_sizes>, Handlers::decode_buckets<decode_range>,
                                                      bucket_unit<int8_sizes>>);
JAXCOMP_REGISTER(kInt8EncodeFeedback,
                 Handlers::feedback<check_pair_encode<int8_sizes>, Handlers::feedback_buckets<feedback_range>>);

}  // namespace
}  // namespace jaxcomp
