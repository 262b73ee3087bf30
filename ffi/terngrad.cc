// TernGrad on the CPU: the handlers of kTerngradEncode, kTerngradDecode,
// kTerngradEncodeFeedback and kTerngradDecodeSum.
// The targets, bodies, sizes and checks in include/jaxcomp/terngrad.h; twin in
// jaxcomp/codecs/terngrad.py.
//
// Encode is two passes: the scale of every bucket, then the base-3^5 bytes
// (each byte reads one element of each of the five planes, from different
// buckets, so it needs all the scales first).
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/terngrad.h"

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
  uint32_t k0, k1;
  uint8_t* trits;
  float* scales;
};

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  const uint8_t* trits;
  const float* scales;
};

template <typename T>
float max_abs_src(const T* src, int64_t count) {
  uint32_t m = 0;
  for (int64_t i = 0; i < count; ++i) m = std::max(m, abs_bits(to_f32(src[i])));
  return bits_f32(m);
}

// The scales of buckets [b0, b1).
JC_CPU_LOOP void scales_range(const EncodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) {
    const auto* x = static_cast<const decltype(tag)*>(a.x);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * a.bucket;
      // The zero padding of the last bucket cannot raise the max.
      a.scales[b] = max_abs_src(x + start, std::min<int64_t>(a.bucket, a.n - start));
    }
  });
}

// Digits of elements [e0, e0 + len) into dig (1 past n: the padding). The
// digits are kept in 32-bit lanes until the bytes are formed: narrowing
// inside these loops costs more than the arithmetic.
template <typename T>
void digits(const T* x, int64_t n, int B, const float* scales, cpu::RngKey key, int64_t e0, int64_t len,
            uint32_t* dig) {
  int64_t k = 0;
  while (k < len) {
    const int64_t e = e0 + k;
    if (e >= n) {
      for (; k < len; ++k) dig[k] = 1;
      break;
    }
    // A run inside one bucket and below n: one reciprocal, a branch-free loop.
    const int64_t bucket_end = (e / B + 1) * B;
    const int64_t run = std::min<int64_t>({len - k, bucket_end - e, n - e});
    const float inv = terngrad_inv(scales[e / B]);
    const T* src = x + e;
    uint32_t* out = dig + k;
    const uint32_t base = static_cast<uint32_t>(e);
    // 32-bit counters: the element index is a 32-bit lane (an int64 counter
    // would be narrowed lane by lane).
    const uint32_t count = static_cast<uint32_t>(run);
    for (uint32_t i = 0; i < count; ++i)
      out[i] = terngrad_digit(to_f32(src[i]), inv, cpu::rng_uniform_k(key, base + i));
    k += run;
  }
}

// Bytes [c, c + len) of the base-3^5 stream of m bytes, their digits in dig.
constexpr int64_t kPackChunk = 512;
template <typename T>
void pack_chunk(const EncodeArgs& a, const T* x, cpu::RngKey key, int64_t m, int64_t c, int64_t len,
                uint32_t (*dig)[kPackChunk]) {
  for (int j = 0; j < 5; ++j) digits<T>(x, a.n, a.bucket, a.scales, key, j * m + c, len, dig[j]);
  uint8_t* out = a.trits + c;
  for (int64_t i = 0; i < len; ++i) out[i] = base3_pack(dig[0][i], dig[1][i], dig[2][i], dig[3][i], dig[4][i]);
}

// Bytes [i0, i1) of the base-3^5 stream.
JC_CPU_LOOP void pack_range(const EncodeArgs& a, int64_t i0, int64_t i1) {
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t m = base3_bytes(a.n);
    alignas(32) uint32_t dig[5][kPackChunk];
    for (int64_t c = i0; c < i1; c += kPackChunk)
      pack_chunk<T>(a, static_cast<const T*>(a.x), cpu::rng_key(a.k0, a.k1), m, c,
                    std::min<int64_t>(kPackChunk, i1 - c), dig);
  });
}

template <typename T, int PLANE>
void decode_run(const uint8_t* in, float scale, int64_t run, T* out) {
  for (int64_t i = 0; i < run; ++i) out[i] = decoded<T>(terngrad_value(base3_digit(in[i], PLANE), scale));
}

// fn(plane, in, scale, e, run) for the runs of elements [e0, e1) of a
// tensor of n in buckets of B that lie inside one plane and one bucket:
// plane an std::integral_constant (base3_digit's), in the run's bytes of
// `trits`, scale its bucket's of `scales`.
template <typename Fn>
inline void for_runs(int64_t n, int64_t B, const uint8_t* trits, const float* scales, int64_t e0, int64_t e1,
                     const Fn& fn) {
  const int64_t m = base3_bytes(n);
  int64_t e = e0;
  while (e < e1) {
    const int64_t plane = e / m;
    const int64_t run = std::min<int64_t>({e1 - e, (plane + 1) * m - e, (e / B + 1) * B - e});
    const uint8_t* in = trits + (e - plane * m);
    const float s = scales[e / B];
    switch (plane) {
      case 0: fn(std::integral_constant<int, 0>{}, in, s, e, run); break;
      case 1: fn(std::integral_constant<int, 1>{}, in, s, e, run); break;
      case 2: fn(std::integral_constant<int, 2>{}, in, s, e, run); break;
      case 3: fn(std::integral_constant<int, 3>{}, in, s, e, run); break;
      default: fn(std::integral_constant<int, 4>{}, in, s, e, run); break;
    }
    e += run;
  }
}

// Elements [e0, e1).
JC_CPU_LOOP void decode_range(const DecodeArgs& a, int64_t e0, int64_t e1) {
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(a.out);
    for_runs(a.n, a.bucket, a.trits, a.scales, e0, e1,
             [&](auto plane, const uint8_t* in, float s, int64_t e, int64_t run) {
               decode_run<T, decltype(plane)::value>(in, s, run, out + e);
             });
  });
}

// Decode-and-accumulate: the sum, in row order, of `rows` float32 payloads
// (the trits and scales of each row one after the other), a chunk of
// elements at a time: each row's values as decode_range writes them (the
// decoders' NaN rule), added into the output, so that no row is written
// out; then the NaN rule on the sum (inf + -inf).
struct DecodeSumArgs {
  float* out;
  int64_t n;
  int bucket;
  int64_t rows, row_bytes, row_buckets;
  const uint8_t* trits;
  const float* scales;
};

template <int PLANE, bool FIRST>
void sum_run(const uint8_t* in, float scale, int64_t run, float* out) {
  for (int64_t i = 0; i < run; ++i) {
    const float v = canonical_nan(terngrad_value(base3_digit(in[i], PLANE), scale));
    out[i] = FIRST ? v : out[i] + v;
  }
}

template <bool FIRST>
void sum_row(const DecodeSumArgs& a, const uint8_t* trits, const float* scales, int64_t e0, int64_t e1) {
  for_runs(a.n, a.bucket, trits, scales, e0, e1,
           [&](auto plane, const uint8_t* in, float s, int64_t e, int64_t run) {
             sum_run<decltype(plane)::value, FIRST>(in, s, run, a.out + e);
           });
}

JC_CPU_LOOP void decode_sum_range(const DecodeSumArgs& a, int64_t e0, int64_t e1) {
  sum_row<true>(a, a.trits, a.scales, e0, e1);
  for (int64_t r = 1; r < a.rows; ++r)
    sum_row<false>(a, a.trits + r * a.row_bytes, a.scales + r * a.row_buckets, e0, e1);
  for (int64_t e = e0; e < e1; ++e) a.out[e] = canonical_nan(a.out[e]);
}

ffi::Error DecodeSumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> trits, ffi::Buffer<ffi::F32> scales,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bucket) {
  const Stacked s(trits.dimensions(), scales.dimensions(), out->dimensions());
  const int64_t rows = s.rows(), n = s.n();
  if (const char* e = s.check(check_pair_decode<terngrad_sizes>(DType::kF32, n, s.bytes(), s.buckets(), bucket)))
    return invalid(e);
  float* o = out->typed_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  if (rows == 0) {
    std::fill(o, o + n, 0.0f);
    return ffi::Error::Success();
  }
  const DecodeSumArgs a{o, n, static_cast<int>(bucket), rows, s.bytes(), s.buckets(), trits.typed_data(),
                        scales.typed_data()};
  PoolRunner runner(pool);
  // A plain decode's elements per task, divided among the rows; the chunks
  // stay in cache while every row is added.
  const int64_t chunk = std::max<int64_t>(1024, kElementsPerTask / rows);
  parallel_for(runner, n, chunk, [&](int64_t i0, int64_t i1) {
    for (int64_t c = i0; c < i1; c += chunk) decode_sum_range(a, c, std::min(i1, c + chunk));
  });
  return ffi::Error::Success();
}

// One tensor, for the pair families' handlers (cpu_buckets.h).
void encode(Runner& runner, DType dt, const void* x, int64_t n, const uint32_t* key, uint8_t* trits, float* scales,
            int64_t bucket) {
  const EncodeArgs a{dt, x, n, static_cast<int>(bucket), key[0], key[1], trits, scales};
  for_buckets(runner, a, scales_range);
  parallel_for(runner, base3_bytes(a.n), kElementsPerTask / 5,
               [&](int64_t i0, int64_t i1) { pack_range(a, i0, i1); });
}

void decode(Runner& runner, DType dt, const uint8_t* trits, const float* scales, int64_t n, void* out,
            int64_t bucket) {
  const DecodeArgs a{dt, out, n, static_cast<int>(bucket), trits, scales};
  parallel_for(runner, n, kElementsPerTask, [&](int64_t e0, int64_t e1) { decode_range(a, e0, e1); });
}

// Error feedback in two passes instead of four: acc = float32(x) + residual
// goes straight into the new residual while the scales are taken from it
// (per bucket, in cache); then, per chunk of bytes, the digits of acc's five
// planes are drawn, packed, decoded and subtracted from acc in place. No
// decoded tensor is written; each element belongs to one byte, so the
// chunks never touch each other's elements.
using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;  // trits, scales

// The first pass: acc into the new residual, and each bucket's scale from it.
JC_CPU_LOOP void acc_scales_range(const Handlers::FeedbackArgs& a, int64_t b0, int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.bucket;
    const int64_t valid = std::min<int64_t>(a.bucket, a.n - start);
    cpu::sum_range(a.dtype, a.x, a.residual, start, start + valid, a.out);
    a.side[b] = max_abs_src(a.out + start, valid);
  }
}

// Bytes [i0, i1): pack_range's digits of acc, and acc minus their values.
JC_CPU_LOOP void pack_kept_range(const EncodeArgs& a, float* acc, int64_t i0, int64_t i1) {
  const int64_t m = base3_bytes(a.n);
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  alignas(32) uint32_t dig[5][kPackChunk];
  for (int64_t c = i0; c < i1; c += kPackChunk) {
    const int64_t len = std::min<int64_t>(kPackChunk, i1 - c);
    pack_chunk<float>(a, acc, key, m, c, len, dig);
    for (int j = 0; j < 5; ++j) {
      // Runs inside one bucket: one scale each, a loop that vectorizes.
      const int64_t e0 = j * m + c, e1 = std::min<int64_t>(e0 + len, a.n);
      for (int64_t e = e0; e < e1;) {
        const int64_t run = std::min<int64_t>(e1, (e / a.bucket + 1) * a.bucket) - e;
        const float s = a.scales[e / a.bucket];
        const uint32_t* d = dig[j] + (e - e0);
        float* v = acc + e;
        for (int64_t i = 0; i < run; ++i) v[i] = v[i] - canonical_nan(terngrad_value(d[i], s));
        e += run;
      }
    }
  }
}

void encode_feedback(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, const uint32_t* key,
                     uint8_t* trits, float* scales, float* out, int64_t bucket) {
  for_buckets(runner, Handlers::FeedbackArgs{dt, x, residual, n, static_cast<int>(bucket), trits, scales, out},
              acc_scales_range);
  const EncodeArgs a{DType::kF32, out, n, static_cast<int>(bucket), key[0], key[1], trits, scales};
  parallel_for(runner, base3_bytes(n), kElementsPerTask / 5,
               [&](int64_t i0, int64_t i1) { pack_kept_range(a, out, i0, i1); });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), the trits being the codes
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kTerngradEncode, Handlers::encode<terngrad_check_encode, encode>);
JAXCOMP_REGISTER(kTerngradDecode, Handlers::decode<check_pair_decode<terngrad_sizes>, decode>);
JAXCOMP_REGISTER(kTerngradDecodeSum, DecodeSumImpl);
JAXCOMP_REGISTER(kTerngradEncodeFeedback, Handlers::feedback<terngrad_check_encode, encode_feedback>);

}  // namespace
}  // namespace jaxcomp
