// MX on the CPU: the handlers of kMxEncode, kMxDecode and kMxEncodeFeedback. Rounding and the
// E8M0 scale in include/jaxcomp/minifloat.h, the targets, packing, sizes and
// checks in include/jaxcomp/mx.h; twin in jaxcomp/codecs/mx.py.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

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

#if JC_CPU_AVX2
// Full float32 blocks on CPUs with AVX2: the operations of the portable loops
// below (mini_encode and mx_pack; table[code] * hi * lo), eight lanes at a
// time, with the packing and unpacking done in registers. The bit-exactness
// tests cover both paths (the portable one runs for partial blocks, 16-bit
// inputs and outputs, and stochastic rounding).
namespace avx2 {

// mini_encode of minifloat.h with u < 0 (nearest even), per lane: the same
// integer and float operations in the same order.
template <int FMT>
JC_AVX2 inline __m256i encode8(__m256 t) {
  constexpr MiniFormat f = mini_format(FMT);
  const __m256i bits = _mm256_castps_si256(t);
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(bits, 31), f.ebits + f.mbits);
  const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(127));
  e = _mm256_max_epi32(e, _mm256_set1_epi32(1 - f.bias));
  // pow2f(mbits - e), e <= 128: a non-negative biased exponent.
  const __m256 p = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(f.mbits + 127), e), 23));
  // min(x, 64) is minps's x < 64 ? x : 64 (NaN: 64), as in mini_encode.
  const __m256 scaled = _mm256_min_ps(_mm256_mul_ps(_mm256_castsi256_ps(a), p), _mm256_set1_ps(64.0f));
  const __m256 magic = _mm256_set1_ps(12582912.0f);
  const __m256i m = _mm256_cvttps_epi32(_mm256_sub_ps(_mm256_add_ps(scaled, magic), magic));
  __m256i code = _mm256_add_epi32(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(f.bias - 1)), f.mbits), m);
  code = _mm256_min_epu32(code, _mm256_set1_epi32(static_cast<int>(f.max_code)));
  const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  return _mm256_andnot_si256(nan, _mm256_or_si256(sign, code));
}

// One full block: max|v| (integer max of the magnitudes' bits, as
// cpu::max_abs), the scale, the codes, packed as mx_pack packs them.
template <int FMT>
JC_AVX2 inline void encode_block(const float* x, uint8_t* out, uint8_t* scale_out) {
  constexpr MiniFormat f = mini_format(FMT);
  constexpr int bits = 1 + f.ebits + f.mbits;
  __m256 v[4];
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  __m256i acc = _mm256_setzero_si256();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_castps_si256(v[k]), absmask));
  }
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(1, 0, 3, 2)));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, _MM_SHUFFLE(2, 3, 0, 1)));
  const uint32_t scale = mx_scale_code(bits_f32(static_cast<uint32_t>(_mm_cvtsi128_si32(m4))), f);
  *scale_out = static_cast<uint8_t>(scale);
  const __m256 inv = _mm256_set1_ps(mx_inverse(scale));
  __m256i c[4];
  for (int k = 0; k < 4; ++k) c[k] = encode8<FMT>(_mm256_mul_ps(v[k], inv));
  // The 32 codes as bytes, in order (the packs interleave the 128-bit halves).
  const __m256i b8 = _mm256_permutevar8x32_epi32(
      _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if constexpr (bits == 8) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), b8);
  } else if constexpr (bits == 4) {
    // The low byte of each 16-bit lane: code 2i | code 2i+1 << 4.
    const __m256i w = _mm256_and_si256(_mm256_or_si256(b8, _mm256_srli_epi16(b8, 4)), _mm256_set1_epi16(0xff));
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(p));
  } else {
    // 4 codes -> c0 | c1 << 6 | c2 << 12 | c3 << 18 in each 32-bit lane, then
    // the lanes' low 3 bytes, contiguous.
    const __m256i w16 = _mm256_maddubs_epi16(b8, _mm256_set1_epi16(0x4001));        // c0 + 64 c1
    const __m256i w32 = _mm256_madd_epi16(w16, _mm256_set1_epi32(0x10000001));      // + 4096 (c2 + 64 c3)
    const __m256i three = _mm256_shuffle_epi8(
        w32, _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,   //
                              0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1));
    const __m256i packed = _mm256_permutevar8x32_epi32(three, _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 16), _mm256_extracti128_si256(packed, 1));
  }
}

// The value of 8 FP6 or FP4 codes (in the low bits of each lane, higher bits
// ignored) from the scaled magnitudes mag[j] = table[j] * hi * lo, 8 per
// vector: (-v) * hi * lo is -(v * hi * lo) bit for bit (a product by
// positive factors rounds and flushes symmetrically), so the sign is the
// code's sign bit moved to bit 31.
template <int EM>
JC_AVX2 inline __m256 value8(__m256i code, const __m256* mag) {
  __m256 v = _mm256_permutevar8x32_ps(mag[0], code);  // the low 3 bits
  if constexpr (EM == 5) {
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(code, 28));  // blendv reads bit 31
    const __m256 v01 = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(mag[1], code), b3);
    const __m256 v23 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(mag[2], code),
                                        _mm256_permutevar8x32_ps(mag[3], code), b3);
    v = _mm256_blendv_ps(v01, v23, _mm256_castsi256_ps(_mm256_slli_epi32(code, 27)));
  }
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 31 - EM), _mm256_set1_epi32(INT32_MIN));
  return _mm256_or_ps(v, _mm256_castsi256_ps(sign));
}

// FP8: the value of each code built from its bits (mini_value: a normal
// code's fields moved into a float32's, a subnormal's mantissa converted and
// scaled, FP8's inf and NaN codes selected), times hi, times lo. Cheaper
// than a gather from the table of the codes' values on CPUs of this kind.
template <int FMT>
JC_AVX2 inline void decode_fp8(const uint8_t* in, __m256 hi, __m256 lo, float* out) {
  constexpr MiniFormat f = mini_format(FMT);
  const __m256i mag_mask = _mm256_set1_epi32(0x7f);
  const __m256i rebias = _mm256_set1_epi32((127 - f.bias) << 23);
  const __m256 sub_step = _mm256_set1_ps(pow2f(1 - f.bias - f.mbits));
  const __m256i first_normal = _mm256_set1_epi32(1 << f.mbits);
  const __m256i max_code = _mm256_set1_epi32(static_cast<int>(f.max_code));
  for (int k = 0; k < 4; ++k) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + 8 * k)));
    const __m256i mag = _mm256_and_si256(c, mag_mask);
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 23 - f.mbits), rebias));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), sub_step);
    __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(_mm256_cmpgt_epi32(first_normal, mag)));
    // Above the largest finite code: NaN (E4M3's 0x7f; E5M2's 0x7d..0x7f), inf (E5M2's 0x7c).
    __m256 special = _mm256_set1_ps(NAN);
    if (FMT == kE5M2)
      special = _mm256_blendv_ps(special, _mm256_set1_ps(INFINITY),
                                 _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7c))));
    v = _mm256_blendv_ps(v, special, _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, max_code)));
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(c, 7), 31);
    v = _mm256_or_ps(v, _mm256_castsi256_ps(sign));
    _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(_mm256_mul_ps(v, hi), lo));
  }
}

// FP4: the 8 codes of a 32-bit word, lane j shifted right by 4j.
JC_AVX2 inline void decode_fp4(const uint8_t* in, const __m256* mag, float* out) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  for (int k = 0; k < 4; ++k) {
    uint32_t w;
    std::memcpy(&w, in + 4 * k, 4);
    const __m256i c = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts);
    _mm256_storeu_ps(out + 8 * k, value8<3>(c, mag));
  }
}

// FP6: codes 8k..8k+7 lie in bytes 6k..6k+5; lane j takes the byte (or the
// two) holding bits 6j..6j+5 and shifts right by 6j % 8. Bytes 0..15 and
// 8..23 of the block, each in both 128-bit halves (pshufb stays in a half).
JC_AVX2 inline void decode_fp6(const uint8_t* in, const __m256* mag, float* out) {
  const __m256i src[2] = {
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in))),
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8)))};
  const __m256i shifts = _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2);
  // The byte indices of codes 0..7 from byte 0 (-128: a zero byte); byte 6k
  // is at 6k of src[0] (k < 2) or at 6k - 8 of src[1].
  const __m256i idx = _mm256_setr_epi8(0, -128, -128, -128, 0, 1, -128, -128, 1, 2, -128, -128, 2, -128, -128, -128,
                                       3, -128, -128, -128, 3, 4, -128, -128, 4, 5, -128, -128, 5, -128, -128, -128);
  for (int k = 0; k < 4; ++k) {
    const __m256i at = _mm256_add_epi8(idx, _mm256_set1_epi8(static_cast<char>(k < 2 ? 6 * k : 6 * k - 8)));
    const __m256i c = _mm256_srlv_epi32(_mm256_shuffle_epi8(src[k / 2], at), shifts);
    _mm256_storeu_ps(out + 8 * k, value8<5>(c, mag));
  }
}

// One full block into float32.
template <int FMT>
JC_AVX2 inline void decode_block(const uint8_t* in, uint32_t scale, const float* table, float* out) {
  constexpr MiniFormat f = mini_format(FMT);
  constexpr int em = f.ebits + f.mbits;
  if (scale == 0xffu) {  // the canonical NaN, whatever the codes (see decode_t)
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + 8 * k, _mm256_set1_ps(NAN));
    return;
  }
  const __m256 hi = _mm256_set1_ps(mx_scale_hi(scale)), lo = _mm256_set1_ps(mx_scale_lo(scale));
  if constexpr (em == 7) {
    decode_fp8<FMT>(in, hi, lo, out);
  } else {
    // The magnitudes' values scaled once per block: a lookup of 8 lanes in 1
    // (FP4) or 4 (FP6) registers instead of a gather and two products.
    __m256 mag[(1 << em) / 8];
    for (int j = 0; j < (1 << em) / 8; ++j)
      mag[j] = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(table + 8 * j), hi), lo);
    if constexpr (em == 3) {
      decode_fp4(in, mag, out);
    } else {
      decode_fp6(in, mag, out);
    }
  }
}

}  // namespace avx2
#endif

// Runs fn(std::integral_constant<int, FMT>{}) for the element format.
template <typename F>
inline void with_format(int format, const F& fn) {
  switch (format) {
    case kE5M2: return fn(std::integral_constant<int, kE5M2>{});
    case kE3M2: return fn(std::integral_constant<int, kE3M2>{});
    case kE2M3: return fn(std::integral_constant<int, kE2M3>{});
    case kE2M1: return fn(std::integral_constant<int, kE2M1>{});
    default: return fn(std::integral_constant<int, kE4M3>{});
  }
}

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

// With AVX2, the full float32 blocks of a nearest-even encode take the AVX2
// path, the rest (a partial last block) the portable one.
template <int FMT, bool STOCHASTIC, bool AVX2>
void encode_f(const EncodeArgs& a, int64_t b0, int64_t b1) {
#if JC_CPU_AVX2
  if (AVX2 && !STOCHASTIC && a.dtype == DType::kF32) {
    constexpr int bytes = kMxBlock * mini_bits(mini_format(FMT)) / 8;
    const int64_t full = std::min<int64_t>(b1, a.n / kMxBlock);
    const float* x = static_cast<const float*>(a.x);
    for (; b0 < full; ++b0) avx2::encode_block<FMT>(x + b0 * kMxBlock, a.codes + b0 * bytes, a.scales + b0);
  }
#endif
  if (b0 < b1) encode_t<FMT, STOCHASTIC>(a, b0, b1);
}

template <bool STOCHASTIC, bool AVX2>
void encode_s(const EncodeArgs& a, int64_t b0, int64_t b1) {
  with_format(a.format, [&](auto fmt) { encode_f<decltype(fmt)::value, STOCHASTIC, AVX2>(a, b0, b1); });
}

template <bool AVX2>
void encode_body(const EncodeArgs& a, int64_t b0, int64_t b1) {
  if (a.stochastic) return encode_s<true, AVX2>(a, b0, b1);
  encode_s<false, AVX2>(a, b0, b1);
}

JC_CPU_LOOP_WITH_AVX2_PATHS(encode_range, EncodeArgs, encode_body)

// One tensor, for the handlers.
void encode(Runner& runner, DType dt, const void* x, int64_t n, const uint32_t* key, uint8_t* codes, uint8_t* scales,
            int64_t format, int64_t stochastic) {
  const EncodeArgs a{dt, x, n, kMxBlock, static_cast<int>(format), stochastic != 0, key[0], key[1], codes, scales};
  for_buckets(runner, a, encode_range);
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

template <int FMT, typename T, bool AVX2>
void decode_t(const DecodeArgs& a, int64_t b0, int64_t b1) {
  constexpr MiniFormat f = mini_format(FMT);
  constexpr int bits = 1 + f.ebits + f.mbits;
  constexpr int kChunk = 64;  // blocks decoded together: loops long enough to vectorize
  T* out = static_cast<T*>(a.out);
  // The value of every code, once per call: a table lookup (a gather)
  // vectorizes where the format's arithmetic with its special cases does not.
  float table[1 << bits];
  for (uint32_t c = 0; c < (1u << bits); ++c) table[c] = mini_value(c, f);
#if JC_CPU_AVX2
  if (AVX2 && std::is_same<T, float>::value) {
    const int64_t full = std::min<int64_t>(b1, a.n / kMxBlock);
    for (; b0 < full; ++b0)
      avx2::decode_block<FMT>(a.codes + b0 * (kMxBlock * bits / 8), a.scales[b0], table,
                              reinterpret_cast<float*>(out) + b0 * kMxBlock);
  }
#endif
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
    for (int64_t i = 0; i < valid; ++i) dst[i] = decoded<T>(values[i]);
  }
}

template <int FMT, bool AVX2>
void decode_f(const DecodeArgs& a, int64_t b0, int64_t b1) {
  with_type(a.dtype, [&](auto tag) { decode_t<FMT, decltype(tag), AVX2>(a, b0, b1); });
}

template <bool AVX2>
void decode_body(const DecodeArgs& a, int64_t b0, int64_t b1) {
  with_format(a.format, [&](auto fmt) { decode_f<decltype(fmt)::value, AVX2>(a, b0, b1); });
}

JC_CPU_LOOP_WITH_AVX2_PATHS(decode_range, DecodeArgs, decode_body)

void decode(Runner& runner, DType dt, const uint8_t* codes, const uint8_t* scales, int64_t n, void* out,
            int64_t format) {
  for_buckets(runner, DecodeArgs{dt, out, n, kMxBlock, static_cast<int>(format), codes, scales}, decode_range);
}

// Error feedback in one pass: each block's acc = float32(x) + residual,
// encoded as a float32 block is (the AVX2 block path, or encode_t's loop for
// stochastic rounding and without AVX2), decoded as decode_t decodes it, and
// acc minus the decoded values, in registers and on the stack.
struct FeedbackArgs {
  DType dtype;
  const void* x;
  const float* residual;
  int64_t n;
  int bucket;  // kMxBlock (for_buckets)
  int format;
  bool stochastic;
  uint32_t k0, k1;
  uint8_t* codes;
  uint8_t* scales;
  float* out;
};

template <int FMT, bool STOCHASTIC, bool AVX2>
void feedback_f(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  constexpr MiniFormat f = mini_format(FMT);
  constexpr int bits = 1 + f.ebits + f.mbits;
  constexpr int bytes = kMxBlock * bits / 8;
  const cpu::RngKey key = cpu::rng_key(a.k0, a.k1);
  float table[1 << bits];
  for (uint32_t c = 0; c < (1u << bits); ++c) table[c] = mini_value(c, f);
  float acc[kMxBlock], hat[kMxBlock];
  uint8_t codes[kMxBlock];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * kMxBlock;
    const int64_t valid = std::min<int64_t>(kMxBlock, a.n - start);
    cpu::load_sum(a.dtype, a.x, a.residual, start, valid, kMxBlock, acc);
    uint8_t* packed = a.codes + b * bytes;
#if JC_CPU_AVX2
    if (AVX2 && !STOCHASTIC) {
      avx2::encode_block<FMT>(acc, packed, a.scales + b);
      avx2::decode_block<FMT>(packed, a.scales[b], table, hat);
      cpu::store_residual(acc, hat, start, valid, a.out);
      continue;
    }
#endif
    const uint32_t scale = mx_scale_code(cpu::max_abs(acc, kMxBlock), f);
    a.scales[b] = static_cast<uint8_t>(scale);
    const float inv = mx_inverse(scale);
    const uint32_t base = static_cast<uint32_t>(start);
    for (int i = 0; i < kMxBlock; ++i) {
      const float u = STOCHASTIC ? cpu::rng_uniform_k(key, base + static_cast<uint32_t>(i)) : -1.0f;
      codes[i] = static_cast<uint8_t>(mini_encode(acc[i] * inv, f, u));
    }
    mx_pack(codes, bits, packed);
    if (scale == 0xffu) {  // the canonical NaN, whatever the codes (decode_t)
      std::fill(hat, hat + kMxBlock, NAN);
    } else {
      const float hi = mx_scale_hi(scale), lo = mx_scale_lo(scale);
      for (int i = 0; i < kMxBlock; ++i) hat[i] = (table[codes[i]] * hi) * lo;
    }
    cpu::store_residual(acc, hat, start, valid, a.out);
  }
}

template <bool STOCHASTIC, bool AVX2>
void feedback_s(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  with_format(a.format, [&](auto fmt) { feedback_f<decltype(fmt)::value, STOCHASTIC, AVX2>(a, b0, b1); });
}

template <bool AVX2>
void feedback_body(const FeedbackArgs& a, int64_t b0, int64_t b1) {
  if (a.stochastic) return feedback_s<true, AVX2>(a, b0, b1);
  feedback_s<false, AVX2>(a, b0, b1);
}

JC_CPU_LOOP_WITH_AVX2_PATHS(feedback_range, FeedbackArgs, feedback_body)

void encode_feedback(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, const uint32_t* key,
                     uint8_t* codes, uint8_t* scales, float* out, int64_t format, int64_t stochastic) {
  const FeedbackArgs a{dt,     x,      residual, n,      kMxBlock, static_cast<int>(format), stochastic != 0,
                       key[0], key[1], codes,    scales, out};
  for_buckets(runner, a, feedback_range);
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h)
// ---------------------------------------------------------------------------
// A block of the payload, for decode_sum.
PairUnit mx_unit(int64_t format) {
  const MxSizes s = mx_sizes(kMxBlock, mini_bits(mini_format(static_cast<int>(format))));
  return PairUnit{kMxBlock, s.codes, s.scales};
}

using Handlers = CpuPairHandlers<ffi::U8, ffi::U8>;
JAXCOMP_REGISTER(kMxEncode, Handlers::encode<mx_check_encode, encode>);
JAXCOMP_REGISTER(kMxDecode, Handlers::decode<mx_check_decode, decode>);
JAXCOMP_REGISTER(kMxDecodeSum, Handlers::decode_sum<mx_check_decode, decode, mx_unit>);
JAXCOMP_REGISTER(kMxEncodeFeedback, Handlers::feedback<mx_check_encode, encode_feedback>);

}  // namespace
}  // namespace jaxcomp
