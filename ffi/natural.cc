// Natural compression on the CPU: the handlers of kNaturalEncode,
// kNaturalDecode and kNaturalEncodeFeedback. The targets, bodies, sizes and checks in
// include/jaxcomp/natural.h; twin in jaxcomp/codecs/natural.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/natural.h"

namespace jaxcomp {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
struct EncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int bucket;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  uint8_t* tops;
};

using Handlers = CpuPairHandlers<ffi::U8, ffi::U8>;  // side: the tops
using DecodeArgs = Handlers::DecodeArgs;

template <typename T, bool STOCHASTIC>
void encode_t(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const T* x = static_cast<const T*>(a.x);
  const uint32_t cap = natural_cap<T>();
  const int B = a.bucket;
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  // Codes in 32-bit lanes first, then narrowed in a loop of their own: mixing
  // the widths in one loop spills registers (docs/benchmarks.md).
  std::vector<uint32_t> wide(B);
  uint32_t* w = wide.data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const T* src = x + start;
    uint32_t m = 0, lo = 0xffffffffu;
    for (int64_t i = 0; i < valid; ++i) {
      const float v = to_f32(src[i]);
      m = std::max(m, natural_finite_abs(v));
      lo = std::min(lo, natural_min_key(v));
    }
    const uint32_t top = (m >> 23) + 1u;
    a.tops[b] = static_cast<uint8_t>(top);
    const uint32_t base = static_cast<uint32_t>(start);
    // Without values more than 63 binades below the top (lo's exponent is 255
    // when the bucket has no normal value), the underflow path is dead code.
    // 32-bit counters: the element index is a 32-bit lane.
    const uint32_t count = static_cast<uint32_t>(valid);
    if (static_cast<int32_t>(lo >> 23) >= static_cast<int32_t>(top) - 63) {
      for (uint32_t i = 0; i < count; ++i)
        w[i] = natural_code_fast(to_f32(src[i]), top, cap, STOCHASTIC,
                                 STOCHASTIC ? cpu::rng_bits_k(key, base + i) : 0u);
    } else {
      for (uint32_t i = 0; i < count; ++i)
        w[i] = natural_code(to_f32(src[i]), top, cap, STOCHASTIC, STOCHASTIC ? cpu::rng_bits_k(key, base + i) : 0u);
    }
    uint8_t* out = a.codes + start;
    for (int64_t i = 0; i < valid; ++i) out[i] = static_cast<uint8_t>(w[i]);
  }
}

// Buckets [b0, b1).
JC_CPU_LOOP void encode_range(const EncodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) {
    if (a.stochastic)
      encode_t<decltype(tag), true>(a, b0, b1);
    else
      encode_t<decltype(tag), false>(a, b0, b1);
  });
}

JC_CPU_LOOP void decode_range(const DecodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(a.out);
    const int B = a.bucket;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * B;
      const int64_t valid = std::min<int64_t>(B, a.n - start);
      const uint32_t top = a.side[b];
      const uint8_t* in = a.codes + start;
      T* dst = out + start;
      for (int64_t i = 0; i < valid; ++i) dst[i] = decoded<T>(natural_value(in[i], top));
    }
  });
}

// One tensor, for the pair families' handlers.
void encode(Runner& runner, DType dt, const void* x, int64_t n, const uint32_t* key, uint8_t* codes, uint8_t* tops,
            int64_t bucket, int64_t stochastic) {
  for_buckets(runner, EncodeArgs{dt, x, n, static_cast<int>(bucket), stochastic != 0, key[0], key[1], codes, tops},
              encode_range);
}

// Error feedback in one pass: each bucket's acc = float32(x) + residual,
// coded as encode_t codes a float32 bucket, and acc minus its decoded values
// (decode_range's natural_value), in cache.
struct FeedbackArgs {
  DType dtype;
  const void* x;
  const float* residual;
  int64_t n;
  int bucket;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  uint8_t* tops;
  float* out;
};

template <bool STOCHASTIC>
void feedback_t(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  const uint32_t cap = natural_cap<float>();
  const int B = a.bucket;
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  std::vector<float> acc(B), hat(B);
  std::vector<uint32_t> wide(B);
  uint32_t* w = wide.data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_sum(a.dtype, a.x, a.residual, start, valid, B, acc.data());
    uint32_t m = 0, lo = 0xffffffffu;
    for (int64_t i = 0; i < valid; ++i) {
      m = std::max(m, natural_finite_abs(acc[i]));
      lo = std::min(lo, natural_min_key(acc[i]));
    }
    const uint32_t top = (m >> 23) + 1u;
    a.tops[b] = static_cast<uint8_t>(top);
    const uint32_t base = static_cast<uint32_t>(start);
    const uint32_t count = static_cast<uint32_t>(valid);
    if (static_cast<int32_t>(lo >> 23) >= static_cast<int32_t>(top) - 63) {
      for (uint32_t i = 0; i < count; ++i)
        w[i] = natural_code_fast(acc[i], top, cap, STOCHASTIC, STOCHASTIC ? cpu::rng_bits_k(key, base + i) : 0u);
    } else {
      for (uint32_t i = 0; i < count; ++i)
        w[i] = natural_code(acc[i], top, cap, STOCHASTIC, STOCHASTIC ? cpu::rng_bits_k(key, base + i) : 0u);
    }
    uint8_t* out = a.codes + start;
    for (int64_t i = 0; i < valid; ++i) {
      out[i] = static_cast<uint8_t>(w[i]);
      hat[i] = natural_value(out[i], static_cast<uint8_t>(top));
    }
    cpu::store_residual(acc.data(), hat.data(), start, valid, a.out);
  }
}

JC_CPU_LOOP void feedback_range(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  if (a.stochastic)
    feedback_t<true>(a, b0, b1);
  else
    feedback_t<false>(a, b0, b1);
}

void encode_feedback(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, const uint32_t* key,
                     uint8_t* codes, uint8_t* tops, float* out, int64_t bucket, int64_t stochastic) {
  const FeedbackArgs a{dt,     x,      residual, n,    static_cast<int>(bucket), stochastic != 0,
                       key[0], key[1], codes,    tops, out};
  for_buckets(runner, a, feedback_range);
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h)
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kNaturalEncode, Handlers::encode<natural_check_encode, encode>);
JAXCOMP_REGISTER(kNaturalDecode,
                 Handlers::decode<check_pair_decode<natural_sizes, kBadTops>, Handlers::decode_buckets<decode_range>>);
JAXCOMP_REGISTER(kNaturalDecodeSum,
                 Handlers::decode_sum<check_pair_decode<natural_sizes, kBadTops>, Handlers::decode_buckets<decode_range>,
                                      bucket_unit<natural_sizes>>);
JAXCOMP_REGISTER(kNaturalEncodeFeedback, Handlers::feedback<natural_check_encode, encode_feedback>);

}  // namespace
}  // namespace jaxcomp
