// MX on the CPU: the targets jaxcomp_mx_encode and jaxcomp_mx_decode.
// Rounding and the E8M0 scale in include/jaxcomp/minifloat.h, packing, sizes
// and checks in include/jaxcomp/mx.h; twin in jaxcomp/codecs/mx.py.
#include <algorithm>
#include <cstdint>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/mx.h"

namespace jaxcomp {
namespace {

struct EncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int bucket;  // kMxBlock (for_buckets)
  int format;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  uint8_t* scales;
};

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  int format;
  const uint8_t* codes;
  const uint8_t* scales;
};

// The format a compile-time constant: the rounding's shifts and limits fold.
template <int FMT, bool STOCHASTIC>
void encode_t(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const MiniFormat f = mini_format(FMT);
  const int bits = mini_bits(f);
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  float buf[kMxBlock];
  uint8_t codes[kMxBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * kMxBlock;
    const int64_t valid = std::min<int64_t>(kMxBlock, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, kMxBlock, buf);
    const uint32_t scale = mx_scale_code(cpu::max_abs(buf, kMxBlock), f);
    a.scales[b] = static_cast<uint8_t>(scale);
    const float inv = mx_inverse(scale);
    const uint32_t base = static_cast<uint32_t>(start);
    for (int i = 0; i < kMxBlock; ++i) {
      const float u = STOCHASTIC ? cpu::rng_uniform_k(key, base + static_cast<uint32_t>(i)) : -1.0f;
      codes[i] = static_cast<uint8_t>(mini_encode(buf[i] * inv, f, u));
    }
    mx_pack(codes, bits, a.codes + b * (kMxBlock * bits / 8));
  }
}

template <bool STOCHASTIC>
void encode_s(const EncodeArgs& a, int64_t b0, int64_t b1) {
  switch (a.format) {
    case kE5M2: return encode_t<kE5M2, STOCHASTIC>(a, b0, b1);
    case kE3M2: return encode_t<kE3M2, STOCHASTIC>(a, b0, b1);
    case kE2M3: return encode_t<kE2M3, STOCHASTIC>(a, b0, b1);
    case kE2M1: return encode_t<kE2M1, STOCHASTIC>(a, b0, b1);
    default: return encode_t<kE4M3, STOCHASTIC>(a, b0, b1);
  }
}

JC_CPU_LOOP void encode_range(const EncodeArgs& a, int64_t b0, int64_t b1) {
  if (a.stochastic) return encode_s<true>(a, b0, b1);
  encode_s<false>(a, b0, b1);
}

// The codes of one block, unpacked one per byte (bits a constant: the loops
// vectorize).
template <int BITS>
inline void unpack_block(const uint8_t* in, uint8_t* codes) {
  if (BITS == 8) {
    for (int i = 0; i < kMxBlock; ++i) codes[i] = in[i];
  } else if (BITS == 4) {
    for (int i = 0; i < kMxBlock / 2; ++i) {
      codes[2 * i] = in[i] & 0xfu;
      codes[2 * i + 1] = in[i] >> 4;
    }
  } else {
    for (int g = 0; g < kMxBlock / 4; ++g) {
      const uint32_t w = in[3 * g] | (in[3 * g + 1] << 8) | (static_cast<uint32_t>(in[3 * g + 2]) << 16);
      for (int j = 0; j < 4; ++j) codes[4 * g + j] = static_cast<uint8_t>((w >> (6 * j)) & 0x3fu);
    }
  }
}

template <int FMT, typename T>
void decode_t(const DecodeArgs& a, int64_t b0, int64_t b1) {
  constexpr MiniFormat f = mini_format(FMT);
  constexpr int bits = 1 + f.ebits + f.mbits;
  constexpr int kChunk = 64;  // blocks decoded together: loops long enough to vectorize
  T* out = static_cast<T*>(a.out);
  // The value of every code, once per call: a table lookup (a gather)
  // vectorizes where the format's arithmetic with its special cases does not.
  float table[1 << bits];
  for (uint32_t c = 0; c < (1u << bits); ++c) table[c] = mini_value(c, f);
  uint8_t codes[kChunk * kMxBlock];
  float values[kChunk * kMxBlock];
  float hi[kChunk], lo[kChunk];
  for (int64_t c0 = b0; c0 < b1; c0 += kChunk) {
    const int nb = static_cast<int>(std::min<int64_t>(kChunk, b1 - c0));
    for (int k = 0; k < nb; ++k) {
      hi[k] = mx_scale_hi(a.scales[c0 + k]);
      lo[k] = mx_scale_lo(a.scales[c0 + k]);
      unpack_block<bits>(a.codes + (c0 + k) * (kMxBlock * bits / 8), codes + k * kMxBlock);
    }
    const int m = nb * kMxBlock;
    for (int i = 0; i < m; ++i) values[i] = (table[codes[i]] * hi[i / kMxBlock]) * lo[i / kMxBlock];
    // The NaN scale: the canonical NaN, whatever the codes (a NaN code times
    // the NaN scale would give either operand's NaN, as the compiler orders
    // the product).
    for (int k = 0; k < nb; ++k)
      if (a.scales[c0 + k] == 0xffu)
        for (int i = 0; i < kMxBlock; ++i) values[k * kMxBlock + i] = NAN;
    const int64_t start = c0 * kMxBlock;
    const int64_t valid = std::min<int64_t>(m, a.n - start);
    T* dst = out + start;
    for (int64_t i = 0; i < valid; ++i) dst[i] = from_f32<T>(values[i]);
  }
}

template <int FMT>
void decode_f(const DecodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) { decode_t<FMT, decltype(tag)>(a, b0, b1); });
}

JC_CPU_LOOP void decode_range(const DecodeArgs& a, int64_t b0, int64_t b1) {
  switch (a.format) {
    case kE5M2: return decode_f<kE5M2>(a, b0, b1);
    case kE3M2: return decode_f<kE3M2>(a, b0, b1);
    case kE2M3: return decode_f<kE2M3>(a, b0, b1);
    case kE2M1: return decode_f<kE2M1>(a, b0, b1);
    default: return decode_f<kE4M3>(a, b0, b1);
  }
}

ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::U8> scales, int64_t format,
                      int64_t stochastic) {
  const Batch b(x, seed, *codes, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = mx_check_encode(dt, n, b.count(1), b.count(2), b.count(3), format, stochastic);
  return run_batch(pool, "jaxcomp_mx_encode", b, error, n, [&](int64_t i, Runner& runner) {
    const uint32_t* key = b.at<uint32_t>(1, i);
    const EncodeArgs a{dt,     b.at<void>(0, i), n,      kMxBlock,            static_cast<int>(format),
                       stochastic != 0, key[0],  key[1], b.at<uint8_t>(2, i), b.at<uint8_t>(3, i)};
    for_buckets(runner, a, encode_range);
  });
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t format) {
  const Batch b(codes, scales, *out);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(2);
  const char* error = mx_check_decode(dt, n, b.count(0), b.count(1), format);
  return run_batch(pool, "jaxcomp_mx_decode", b, error, n, [&](int64_t i, Runner& runner) {
    const DecodeArgs a{dt, b.at<void>(2, i), n, kMxBlock, static_cast<int>(format),
                       b.at<uint8_t>(0, i), b.at<uint8_t>(1, i)};
    for_buckets(runner, a, decode_range);
  });
}

}  // namespace
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMxEncode, jaxcomp::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words
                                  .Ret<ffi::Buffer<ffi::U8>>()    // packed element codes
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one E8M0 scale per block of 32
                                  .Attr<int64_t>("format")        // element format, minifloat.h
                                  .Attr<int64_t>("stochastic"));  // 1: stochastic, 0: nearest even
JAXCOMP_REGISTER("jaxcomp_mx_encode", JaxcompMxEncode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompMxDecode, jaxcomp::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()  // packed element codes
                                  .Arg<ffi::Buffer<ffi::U8>>()  // E8M0 scales
                                  .Ret<ffi::AnyBuffer>()        // flat output, the input's dtype
                                  .Attr<int64_t>("format"));
JAXCOMP_REGISTER("jaxcomp_mx_decode", JaxcompMxDecode);
