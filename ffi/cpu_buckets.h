// CPU loop pieces that several bucketed families share (QSGD, Int8, OneBit,
// TernGrad, Natural, SignSGD): loading and storing a bucket as float32,
// max|v|, the halving-tree sum of common.h, bit packing of a bucket, the RNG
// key mixed once, and the AVX2 building blocks of the hand-written paths, all
// free of XLA types and inlined into the loops that use them (cpu_runtime.h:
// JC_CPU_LOOP); then the pair families' CPU handlers, which are XLA's side.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_runtime.h"
#include "jaxcomp/common.h"

#if JC_CPU_AVX2
#include <immintrin.h>
#endif

namespace jaxcomp {
namespace cpu {

template <typename T>
inline void load_bucket(const void* x, int64_t start, int64_t valid, int B, float* buf) {
  const T* src = static_cast<const T*>(x) + start;
  for (int64_t i = 0; i < valid; ++i) buf[i] = to_f32(src[i]);
  for (int64_t i = valid; i < B; ++i) buf[i] = 0.0f;
}

inline void load_any(DType t, const void* x, int64_t start, int64_t valid, int B, float* buf) {
  switch (t) {
    case DType::kBF16: return load_bucket<bf16_t>(x, start, valid, B, buf);
    case DType::kF16: return load_bucket<f16_t>(x, start, valid, B, buf);
    default: return load_bucket<float>(x, start, valid, B, buf);
  }
}

template <typename T>
inline void store_bucket(const float* buf, int64_t start, int64_t valid, void* out) {
  T* dst = static_cast<T*>(out) + start;
  for (int64_t i = 0; i < valid; ++i) dst[i] = decoded<T>(buf[i]);
}

inline void store_any(DType t, const float* buf, int64_t start, int64_t valid, void* out) {
  switch (t) {
    case DType::kBF16: return store_bucket<bf16_t>(buf, start, valid, out);
    case DType::kF16: return store_bucket<f16_t>(buf, start, valid, out);
    default: return store_bucket<float>(buf, start, valid, out);
  }
}

// acc = float32(x) + residual over elements [i0, i1), written at out + i0
// (one float32 add per element): the input of error feedback's compression
// where it goes straight into the new residual (TopK, TernGrad).
template <typename T>
inline void sum_into(const T* x, const float* residual, int64_t i0, int64_t i1, float* out) {
  for (int64_t i = i0; i < i1; ++i) out[i] = to_f32(x[i]) + residual[i];
}

inline void sum_range(DType t, const void* x, const float* residual, int64_t i0, int64_t i1, float* out) {
  switch (t) {
    case DType::kBF16: return sum_into(static_cast<const bf16_t*>(x), residual, i0, i1, out);
    case DType::kF16: return sum_into(static_cast<const f16_t*>(x), residual, i0, i1, out);
    default: return sum_into(static_cast<const float*>(x), residual, i0, i1, out);
  }
}

// acc = float32(x) + residual over one bucket (one float32 add per element),
// zero past the tensor's end: the input of error feedback's compression.
inline void load_sum(DType t, const void* x, const float* residual, int64_t start, int64_t valid, int B,
                     float* buf) {
  load_any(t, x, start, valid, B, buf);
  for (int64_t i = 0; i < valid; ++i) buf[i] += residual[start + i];
}

// The new residual of one bucket: acc - decoded, the decoded values as the
// decoders write them (the NaN rule of common.h).
inline void store_residual(const float* acc, const float* decoded_values, int64_t start, int64_t valid,
                           float* out) {
  for (int64_t i = 0; i < valid; ++i) out[start + i] = acc[i] - canonical_nan(decoded_values[i]);
}

inline float max_abs(const float* buf, int B) {
  uint32_t m = 0;
  for (int i = 0; i < B; ++i) m = std::max(m, abs_bits(buf[i]));
  return bits_f32(m);
}

// The halving tree of common.h, in place over tmp[0..B). Same pairs, same
// order; the levels are written in blocks of 8 lanes (one AVX2 add each) and
// the last three levels by hand, which is what makes small buckets cheap.
inline float tree_sum(float* tmp, int B) {
  for (int w = B / 2; w >= 8; w /= 2)
    for (int i = 0; i < w; i += 8)
      for (int j = 0; j < 8; ++j) tmp[i + j] += tmp[i + w + j];
  if (B >= 8)
    for (int j = 0; j < 4; ++j) tmp[j] += tmp[j + 4];
  tmp[0] += tmp[2];
  tmp[1] += tmp[3];
  tmp[0] += tmp[1];
  return tmp[0];
}

// When BITS divides 8, byte k of the stream holds codes k*(8/BITS) .. +8/BITS-1,
// which is pack8's layout written byte by byte (and vectorizes).
template <int BITS>
inline void pack_bucket(const uint8_t* codes, int B, uint8_t* out) {
  if (BITS == 8) {
    std::memcpy(out, codes, B);
  } else if (8 % BITS == 0) {
    constexpr int per = 8 / (BITS == 3 ? 1 : BITS);
    for (int k = 0; k < B / per; ++k) {
      uint32_t byte = 0;
      for (int j = 0; j < per; ++j) byte |= static_cast<uint32_t>(codes[per * k + j]) << (j * BITS);
      out[k] = static_cast<uint8_t>(byte);
    }
  } else {
    for (int g = 0; g < B / 8; ++g) pack8(codes + 8 * g, BITS, out + BITS * g);
  }
}

template <int BITS>
inline void unpack_bucket(const uint8_t* in, int B, uint8_t* codes) {
  if (BITS == 8) {
    std::memcpy(codes, in, B);
  } else if (8 % BITS == 0) {
    constexpr int per = 8 / (BITS == 3 ? 1 : BITS);
    for (int k = 0; k < B / per; ++k)
      for (int j = 0; j < per; ++j)
        codes[per * k + j] = static_cast<uint8_t>((in[k] >> (j * BITS)) & ((1u << BITS) - 1u));
  } else {
    for (int g = 0; g < B / 8; ++g) {
      uint32_t w = 0;
      for (int b = 0; b < BITS; ++b) w |= static_cast<uint32_t>(in[BITS * g + b]) << (8 * b);
      for (int j = 0; j < 8; ++j)
        codes[8 * g + j] = static_cast<uint8_t>((w >> (j * BITS)) & ((1u << BITS) - 1u));
    }
  }
}

// rng_bits / rng_uniform of common.h with the key words mixed once, outside
// the loops (the compiler does not always hoist them).
struct RngKey {
  uint32_t a, b;
};
inline RngKey rng_key(uint32_t k0, uint32_t k1) {
  const uint32_t a = mix32(k0);
  return RngKey{a, mix32(k1 ^ a)};
}
inline uint32_t rng_bits_k(RngKey k, uint32_t index) { return mix32((index + k.a) ^ k.b); }
inline float rng_uniform_k(RngKey k, uint32_t index) {
  return static_cast<float>(static_cast<int32_t>(rng_bits_k(k, index) >> 8)) * 5.9604644775390625e-08f;
}

#if JC_CPU_AVX2
namespace avx2 {

// Scratch of AVX2 vectors, 32-byte aligned as __m256 loads and stores need
// (a std::vector<__m256> would drop the type's alignment, and its storage
// would be only 16-byte aligned).
class Scratch {
 public:
  explicit Scratch(int vectors)
      : floats_(8 * static_cast<size_t>(vectors) + 8),
        data_(reinterpret_cast<__m256*>((reinterpret_cast<uintptr_t>(floats_.data()) + 31) & ~uintptr_t{31})) {}
  __m256* data() const { return data_; }

 private:
  std::vector<float> floats_;
  __m256* data_;
};

// The halving tree over nv vectors of 8 lanes (element i of the bucket is
// lane i % 8 of vector i / 8): vector levels first, then the lanes.
JC_AVX2 inline float tree_sum(__m256* v, int nv) {
  for (int w = nv / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) v[i] = _mm256_add_ps(v[i], v[i + w]);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v[0]), _mm256_extractf128_ps(v[0], 1));  // j += j+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                              // j += j+2
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                               // 0 += 1
  return _mm_cvtss_f32(s);
}

}  // namespace avx2
#endif

}  // namespace cpu
}  // namespace jaxcomp

// ---------------------------------------------------------------------------
// The pair families' CPU handlers: handler.h's PairHandlers on the CPU, and
// for the families whose function for one tensor is only their loop over its
// buckets, that function:
//   JAXCOMP_REGISTER(kInt8Decode,
//                    Handlers::decode<check_pair_decode<int8_sizes>, Handlers::decode_buckets<decode_range>>);
// ---------------------------------------------------------------------------
namespace jaxcomp {

// What the bucket loops of a pair family read: one tensor of n elements in
// buckets of `bucket`, x -> (codes, side) and back.
template <typename Codes, typename Side>
struct PairEncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int bucket;
  Codes* codes;
  Side* side;
};

// Fused error feedback: x and the residual -> (codes, side) and the new
// residual.
template <typename Codes, typename Side>
struct PairFeedbackArgs {
  DType dtype;
  const void* x;
  const float* residual;
  int64_t n;
  int bucket;
  Codes* codes;
  Side* side;
  float* out;
};

template <typename Codes, typename Side>
struct PairDecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  const Codes* codes;
  const Side* side;
};

// One bucket of a family whose payload is bucket-contiguous (bucket u's codes
// and side data follow bucket u - 1's): its elements, and its codes and side
// items in the payload.
struct PairUnit {
  int64_t elements, codes, side;
};

// The PairUnit of a family whose sizes are kSizes(n, bucket) -> PairSizes.
template <auto kSizes>
inline PairUnit bucket_unit(int64_t bucket) {
  const auto s = kSizes(bucket, bucket);
  return PairUnit{bucket, s.codes, s.side};
}

template <ffi::DataType kCodes, ffi::DataType kSide>
struct CpuPairHandlers : PairHandlers<CpuPlatform, kCodes, kSide> {
  using Codes = ffi::NativeType<kCodes>;
  using Side = ffi::NativeType<kSide>;
  using EncodeArgs = PairEncodeArgs<Codes, Side>;
  using DecodeArgs = PairDecodeArgs<Codes, Side>;
  using FeedbackArgs = PairFeedbackArgs<Codes, Side>;

  // The loops over the buckets [b0, b1) of one tensor, run over all its
  // buckets by for_buckets; bucket_size is the only attribute.
  template <void (*kLoop)(const EncodeArgs&, int64_t, int64_t)>
  static void encode_buckets(Runner& r, DType dt, const void* x, int64_t n, Codes* codes, Side* side, int64_t bucket) {
    for_buckets(r, EncodeArgs{dt, x, n, static_cast<int>(bucket), codes, side}, kLoop);
  }

  template <void (*kLoop)(const FeedbackArgs&, int64_t, int64_t)>
  static void feedback_buckets(Runner& r, DType dt, const void* x, const float* residual, int64_t n, Codes* codes,
                               Side* side, float* out, int64_t bucket) {
    for_buckets(r, FeedbackArgs{dt, x, residual, n, static_cast<int>(bucket), codes, side, out}, kLoop);
  }

  template <void (*kLoop)(const DecodeArgs&, int64_t, int64_t)>
  static void decode_buckets(Runner& r, DType dt, const Codes* codes, const Side* side, int64_t n, void* out,
                             int64_t bucket) {
    for_buckets(r, DecodeArgs{dt, out, n, static_cast<int>(bucket), codes, side}, kLoop);
  }

  // Decode-and-accumulate, for the families whose payload is
  // bucket-contiguous (kUnit(attributes...) -> PairUnit): codes [rows,
  // bytes] and side [rows, buckets] -> the float32 sum of the rows in row
  // order, out = ((row 0 + row 1) + row 2) + ..., then the NaN rule of
  // common.h (a sum can make one: inf + -inf). A chunk of buckets at a
  // time, each row's part decoded by the family's decoder (kFn, the decode
  // target's, on this thread) as a tensor of its own, into the output for
  // row 0 and into a buffer that stays in cache for the others: every row
  // decoded as the decode target decodes it, and no row written out in
  // full. The decoder's attributes, its check.
  template <auto kCheck, auto kFn, auto kUnit, typename Fn = decltype(kFn)>
  struct DecodeSum {
    static_assert(sizeof(Fn) == 0, "a decoder is fn(runner, dtype, codes, side, n, out, attributes...)");
  };

  template <auto kCheck, auto kFn, auto kUnit, typename... A>
  struct DecodeSum<kCheck, kFn, kUnit, void (*)(Runner&, DType, const Codes*, const Side*, int64_t, void*, A...)> {
    static ffi::Error impl(ffi::ThreadPool pool, ffi::Buffer<kCodes> codes, ffi::Buffer<kSide> side,
                           ffi::Result<ffi::Buffer<ffi::F32>> out, A... attrs) {
      const Stacked s(codes.dimensions(), side.dimensions(), out->dimensions());
      const int64_t rows = s.rows(), n = s.n();
      if (const char* e = s.check(kCheck(DType::kF32, n, s.bytes(), s.buckets(), attrs...))) return invalid(e);
      float* o = out->typed_data();
      hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
      if (rows == 0 || n == 0) {
        std::fill(o, o + n, 0.0f);
        return ffi::Error::Success();
      }
      const PairUnit u = kUnit(attrs...);
      const int64_t units = (n + u.elements - 1) / u.elements;
      // About a plain decode's elements per task, divided among the rows.
      const int64_t chunk = std::max<int64_t>(1, kElementsPerTask / u.elements / rows);
      const Codes* c = codes.typed_data();
      const Side* sd = side.typed_data();
      PoolRunner runner(pool);
      parallel_for(runner, units, chunk, [&](int64_t u0, int64_t u1) {
        InlineRunner here;
        std::vector<float> buf(static_cast<size_t>(std::min(chunk, u1 - u0) * u.elements));
        for (int64_t c0 = u0; c0 < u1; c0 += chunk) {
          const int64_t c1 = std::min(u1, c0 + chunk);
          const int64_t e0 = c0 * u.elements, len = std::min(n, c1 * u.elements) - e0;
          float* dst = o + e0;
          for (int64_t r = 0; r < rows; ++r) {
            const Codes* cr = c + r * s.bytes() + c0 * u.codes;
            const Side* sr = sd + r * s.buckets() + c0 * u.side;
            kFn(here, DType::kF32, cr, sr, len, r == 0 ? static_cast<void*>(dst) : buf.data(), attrs...);
            if (r > 0)
              for (int64_t i = 0; i < len; ++i) dst[i] += buf[i];
          }
          for (int64_t i = 0; i < len; ++i) dst[i] = canonical_nan(dst[i]);
        }
      });
      return ffi::Error::Success();
    }
  };

  template <auto kCheck, auto kFn, auto kUnit>
  static constexpr auto decode_sum = &DecodeSum<kCheck, kFn, kUnit>::impl;
};

}  // namespace jaxcomp
