// FP8 on the CPU: the targets jaxcomp_fp8_encode and jaxcomp_fp8_decode.
// Rounding in include/jaxcomp/minifloat.h, sizes and checks in
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
    const float inv = fp8_inv(m, f);
    uint8_t* out = a.codes + start;
    const uint32_t base = static_cast<uint32_t>(start);
    for (int i = 0; i < B; ++i) {
      const float u = STOCHASTIC ? cpu::rng_uniform_k(key, base + static_cast<uint32_t>(i)) : -1.0f;
      out[i] = static_cast<uint8_t>(mini_encode(buf[i] * inv, f, u));
    }
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

ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::F32> scales, int64_t bucket,
                      int64_t format, int64_t stochastic) {
  const Batch b(x, seed, *codes, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = fp8_check_encode(dt, n, b.count(1), b.count(2), b.count(3), bucket, format, stochastic);
  return run_batch(pool, "jaxcomp_fp8_encode", b, error, n, [&](int64_t i, Runner& runner) {
    const uint32_t* key = b.at<uint32_t>(1, i);
    const EncodeArgs a{dt,        b.at<void>(0, i), n,       static_cast<int>(bucket), static_cast<int>(format),
                       stochastic != 0, key[0],     key[1], b.at<uint8_t>(2, i),     b.at<float>(3, i)};
    for_buckets(runner, a, encode_range);
  });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bucket, int64_t format) {
  const Batch b(codes, scales, *out);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(2);
  const char* error = fp8_check_decode(dt, n, b.count(0), b.count(1), bucket, format);
  return run_batch(pool, "jaxcomp_fp8_decode", b, error, n, [&](int64_t i, Runner& runner) {
    const DecodeArgs a{dt, b.at<void>(2, i), n, static_cast<int>(bucket), static_cast<int>(format),
                       b.at<uint8_t>(0, i), b.at<float>(1, i)};
    for_buckets(runner, a, decode_range);
  });
}

}  // namespace
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompFp8Encode, jaxcomp::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one code per element (padded)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // max|v| per block
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("format")        // 0: e4m3, 1: e5m2
                                  .Attr<int64_t>("stochastic"));  // 1: stochastic, 0: nearest even
JAXCOMP_REGISTER("jaxcomp_fp8_encode", JaxcompFp8Encode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompFp8Decode, jaxcomp::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // max|v| per block
                                  .Ret<ffi::AnyBuffer>()         // flat output, the input's dtype
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("format"));
JAXCOMP_REGISTER("jaxcomp_fp8_decode", JaxcompFp8Decode);
