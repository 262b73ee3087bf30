// FP8 on the CPU: the handlers of kFp8Encode, kFp8Decode and
// kFp8EncodeFeedback. Rounding in
// include/jaxcomp/minifloat.h, the targets, sizes and checks in
// include/jaxcomp/fp8.h; twin in jaxcomp/codecs/fp8.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/fp8.h"

namespace jaxcomp {
namespace {

struct EncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int bucket;
  int format;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  float* scales;
};

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  int format;
  const uint8_t* codes;
  const float* scales;
};

// The codes of one bucket of B float32 values (the zero padding included).
template <int FMT, bool STOCHASTIC>
inline void encode_bucket(const float* buf, int B, float inv, cpu::RngKey key, uint32_t base, uint8_t* out) {
  const MiniFormat f = mini_format(FMT);
  for (int i = 0; i < B; ++i) {
    const float u = STOCHASTIC ? cpu::rng_uniform_k(key, base + static_cast<uint32_t>(i)) : -1.0f;
    out[i] = static_cast<uint8_t>(mini_encode(buf[i] * inv, f, u));
  }
}

// The format a compile-time constant: the rounding's shifts and limits fold.
template <int FMT, bool STOCHASTIC>
void encode_t(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  const MiniFormat f = mini_format(FMT);
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, B, buf.data());
    const float m = cpu::max_abs(buf.data(), B);
    a.scales[b] = m;
    encode_bucket<FMT, STOCHASTIC>(buf.data(), B, fp8_inv(m, f), key, static_cast<uint32_t>(start), a.codes + start);
  }
}

JC_CPU_LOOP void encode_range(const EncodeArgs& a, int64_t b0, int64_t b1) {
  if (a.format == kE5M2) {
    if (a.stochastic) return encode_t<kE5M2, true>(a, b0, b1);
    return encode_t<kE5M2, false>(a, b0, b1);
  }
  if (a.stochastic) return encode_t<kE4M3, true>(a, b0, b1);
  encode_t<kE4M3, false>(a, b0, b1);
}

// One tensor, for the handlers.
void encode(Runner& runner, DType dt, const void* x, int64_t n, const uint32_t* key, uint8_t* codes, float* scales,
            int64_t bucket, int64_t format, int64_t stochastic) {
  const EncodeArgs a{dt,     x,      n,     static_cast<int>(bucket), static_cast<int>(format), stochastic != 0,
                     key[0], key[1], codes, scales};
  for_buckets(runner, a, encode_range);
}

template <int FMT, typename T>
void decode_t(const DecodeArgs& a, int64_t b0, int64_t b1) {
  const MiniFormat f = mini_format(FMT);
  const int B = a.bucket;
  T* out = static_cast<T*>(a.out);
  // The value of every code, once per call (a gather vectorizes where the
  // format's arithmetic with its special cases does not).
  float table[256];
  for (uint32_t c = 0; c < 256; ++c) table[c] = mini_value(c, f);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const float step = fp8_step(a.scales[b], f);
    const uint8_t* in = a.codes + start;
    T* dst = out + start;
    if (step != step) {  // a NaN scale: the canonical NaN (see mx.cc)
      for (int64_t i = 0; i < valid; ++i) dst[i] = decoded<T>(NAN);
      continue;
    }
    for (int64_t i = 0; i < valid; ++i) dst[i] = decoded<T>(table[in[i]] * step);
  }
}

JC_CPU_LOOP void decode_range(const DecodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.format == kE5M2) return decode_t<kE5M2, T>(a, b0, b1);
    decode_t<kE4M3, T>(a, b0, b1);
  });
}

void decode(Runner& runner, DType dt, const uint8_t* codes, const float* scales, int64_t n, void* out, int64_t bucket,
            int64_t format) {
  for_buckets(runner, DecodeArgs{dt, out, n, static_cast<int>(bucket), static_cast<int>(format), codes, scales},
              decode_range);
}

// Error feedback in one pass: each bucket's acc = float32(x) + residual,
// encoded as encode_t encodes a float32 bucket, and acc minus its decoded
// values (decode_t's table value times the step), in cache.
struct FeedbackArgs {
  DType dtype;
  const void* x;
  const float* residual;
  int64_t n;
  int bucket;
  int format;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  float* scales;
  float* out;
};

template <int FMT, bool STOCHASTIC>
void feedback_t(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  const MiniFormat f = mini_format(FMT);
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  float table[256];
  for (uint32_t c = 0; c < 256; ++c) table[c] = mini_value(c, f);
  std::vector<float> acc(B), hat(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_sum(a.dtype, a.x, a.residual, start, valid, B, acc.data());
    const float m = cpu::max_abs(acc.data(), B);
    a.scales[b] = m;
    const float step = fp8_step(m, f);
    uint8_t* out = a.codes + start;
    // Encode, then decode, in loops of their own (as encode_t's and decode_t's):
    // one loop that does both vectorizes neither.
    encode_bucket<FMT, STOCHASTIC>(acc.data(), B, fp8_inv(m, f), key, static_cast<uint32_t>(start), out);
    if (step != step) {  // a NaN scale decodes to NaN (decode_t)
      std::fill(hat.begin(), hat.begin() + valid, NAN);
    } else {
      for (int64_t i = 0; i < valid; ++i) hat[i] = table[out[i]] * step;
    }
    cpu::store_residual(acc.data(), hat.data(), start, valid, a.out);
  }
}

JC_CPU_LOOP void feedback_range(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  if (a.format == kE5M2) {
    if (a.stochastic) return feedback_t<kE5M2, true>(a, b0, b1);
    return feedback_t<kE5M2, false>(a, b0, b1);
  }
  if (a.stochastic) return feedback_t<kE4M3, true>(a, b0, b1);
  feedback_t<kE4M3, false>(a, b0, b1);
}

void encode_feedback(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, const uint32_t* key,
                     uint8_t* codes, float* scales, float* out, int64_t bucket, int64_t format, int64_t stochastic) {
  const FeedbackArgs a{dt,     x,      residual, n,      static_cast<int>(bucket), static_cast<int>(format),
                       stochastic != 0, key[0], key[1], codes, scales, out};
  for_buckets(runner, a, feedback_range);
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h)
// ---------------------------------------------------------------------------
// A bucket of the payload, for decode_sum.
PairUnit fp8_unit(int64_t bucket, int64_t) {
  const Fp8Sizes s = fp8_sizes(bucket, bucket);
  return PairUnit{bucket, s.codes, s.scales};
}

using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kFp8Encode, Handlers::encode<fp8_check_encode, encode>);
JAXCOMP_REGISTER(kFp8Decode, Handlers::decode<fp8_check_decode, decode>);
JAXCOMP_REGISTER(kFp8DecodeSum, Handlers::decode_sum<fp8_check_decode, decode, fp8_unit>);
JAXCOMP_REGISTER(kFp8EncodeFeedback, Handlers::feedback<fp8_check_encode, encode_feedback>);

}  // namespace
}  // namespace jaxcomp
