// QSGD on the CPU: the handlers of kQsgdEncode, kQsgdDecode, kQsgdDecodeSum
// and kQsgdEncodeFeedback. The targets, bodies, sizes and checks in
// include/jaxcomp/qsgd.h; twin in jaxcomp/codecs/qsgd.py.
//
// The loops run over whole buckets, branch-free so that they vectorize, in
// the twin's order of floating-point operations. Full float32 buckets take
// hand-written AVX2 paths on CPUs that have AVX2; they compute exactly the
// operations of the portable loops (same compares, same products, the same
// halving-tree order), eight lanes at a time with the bit packing done in
// registers. The bit-exactness tests cover both paths (the portable one runs
// for partial buckets and 16-bit inputs).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/qsgd.h"

namespace jaxcomp {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
// One tensor of n elements in buckets of `bucket`.
struct EncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int bucket, bits;
  bool l2;
  uint32_t k0, k1;
  uint8_t* packed;
  float* scales;
};

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket, bits;
  const uint8_t* packed;
  const float* scales;
};

#if JC_CPU_AVX2
// The bucket routines stay out of line, like OneBit's (ffi/onebit.cc): inlined
// into the flattened loop they raise its register pressure.
namespace avx2 {

JC_AVX2 inline __m256i mix32(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// rng_uniform of common.h for indices base + 0..7, with a = mix32(k0) and
// b = mix32(k1 ^ a) precomputed.
JC_AVX2 inline __m256 uniform8(uint32_t a, uint32_t b, uint32_t base) {
  const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(base)),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i h = mix32(_mm256_xor_si256(_mm256_add_epi32(idx, _mm256_set1_epi32(static_cast<int>(a))),
                                           _mm256_set1_epi32(static_cast<int>(b))));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(5.9604644775390625e-08f));
}

JC_AVX2 inline float max_abs(const float* x, int B) {
  const __m256i m = _mm256_set1_epi32(0x7fffffff);
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < B; i += 8)
    acc = _mm256_max_epu32(acc, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), m));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  uint32_t r = 0;
  for (uint32_t l : lanes) r = r > l ? r : l;
  return bits_f32(r);
}

// OR of (lane j << shift_j) over the 8 lanes.
JC_AVX2 inline uint64_t or_lanes(__m256i v) {
  __m128i s = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_or_si128(s, _mm_unpackhi_epi64(s, s));
  s = _mm_or_si128(s, _mm_srli_si128(s, 4));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(s));
}

// Encode of one full float32 bucket (qsgd_code of qsgd.h per lane). With
// KEEP, error feedback's new residual too: x - the value decode_bucket
// gives each code, computed from the level and sign in the register (the
// same product, sign flip and NaN rule), written to kept[0..B).
template <int BITS, bool KEEP = false>
JC_AVX2 __attribute__((noinline)) void encode_bucket(const float* x, int B, bool l2, uint32_t a, uint32_t b,
                                                    uint32_t base, uint8_t* out, float* scale_out, __m256* scratch,
                                                    float* kept = nullptr) {
  const int s = (1 << (BITS - 1)) - 1;
  float scale;
  if (l2) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xfffff000u));
    for (int i = 0; i < B / 8; ++i) {
      const __m256 v = _mm256_loadu_ps(x + 8 * i);
      const __m256 h = _mm256_and_ps(v, _mm256_castsi256_ps(hi_mask));
      const __m256 l = _mm256_sub_ps(v, h);
      const __m256 hh = _mm256_mul_ps(h, h);
      const __m256 hl2 = _mm256_mul_ps(_mm256_mul_ps(h, l), _mm256_set1_ps(2.0f));
      scratch[i] = _mm256_add_ps(_mm256_add_ps(hh, hl2), _mm256_mul_ps(l, l));  // exact_square
    }
    scale = sqrtf(cpu::avx2::tree_sum(scratch, B / 8));
  } else {
    scale = max_abs(x, B);
  }
  *scale_out = scale;
  const __m256 inv = _mm256_set1_ps(qsgd_inv(scale, s));
  const __m256 step = _mm256_set1_ps(qsgd_step(scale, s));  // decode_bucket's, for KEEP
  const __m256 fs = _mm256_set1_ps(static_cast<float>(s));
  const __m256i si = _mm256_set1_epi32(s);
  const __m256 zero = _mm256_setzero_ps();
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS % 32, 5 * BITS % 32,
                                           6 * BITS % 32, 7 * BITS % 32);
  for (int g = 0; g < B / 8; ++g) {
    const __m256 v = _mm256_loadu_ps(x + 8 * g);
    __m256 r = _mm256_mul_ps(_mm256_and_ps(v, _mm256_castsi256_ps(absmask)), inv);
    r = _mm256_blendv_ps(fs, r, _mm256_cmp_ps(r, fs, _CMP_LT_OQ));  // r < s ? r : s
    const __m256i fl = _mm256_cvttps_epi32(r);
    const __m256 frac = _mm256_sub_ps(r, _mm256_cvtepi32_ps(fl));
    const __m256 u = uniform8(a, b, base + 8 * g);
    const __m256i up = _mm256_castps_si256(_mm256_cmp_ps(u, frac, _CMP_LT_OQ));  // -1 where u < frac
    __m256i level = _mm256_min_epu32(_mm256_sub_epi32(fl, up), si);
    const __m256i sign = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_LT_OQ)), 31);
    const __m256i code = _mm256_or_si256(_mm256_slli_epi32(sign, BITS - 1), level);
    if constexpr (KEEP) {
      const __m256 mag = _mm256_mul_ps(_mm256_cvtepi32_ps(level), step);
      const __m256 hat = _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(sign, 31)));
      const __m256 canonical = _mm256_blendv_ps(hat, _mm256_set1_ps(NAN), _mm256_cmp_ps(hat, hat, _CMP_UNORD_Q));
      _mm256_storeu_ps(kept + 8 * g, _mm256_sub_ps(v, canonical));
    }
    if (BITS == 8) {
      const __m256i p16 = _mm256_packus_epi32(code, code);  // lanes 0-3, 0-3 | 4-7, 4-7
      const __m256i p8 = _mm256_packus_epi16(p16, p16);
      const uint32_t lo = static_cast<uint32_t>(_mm256_extract_epi32(p8, 0));
      const uint32_t hi = static_cast<uint32_t>(_mm256_extract_epi32(p8, 4));
      std::memcpy(out + 8 * g, &lo, 4);
      std::memcpy(out + 8 * g + 4, &hi, 4);
    } else {
      // 8 codes fit one 32-bit word (pack8's layout); its low BITS bytes are
      // the group (3 bits: a 24-bit word).
      const uint32_t w = static_cast<uint32_t>(or_lanes(_mm256_sllv_epi32(code, shifts)));
      std::memcpy(out + BITS * g, &w, BITS);
    }
  }
}

// Decode of one full bucket into float32 (qsgd_value of qsgd.h per lane):
// the group's word is broadcast, each lane shifts out its own code.
template <int BITS>
JC_AVX2 __attribute__((noinline)) void decode_bucket(const uint8_t* in, float scale, int B, float* out) {
  const int s = (1 << (BITS - 1)) - 1;
  const __m256 step = _mm256_set1_ps(qsgd_step(scale, s));
  const __m256i level_mask = _mm256_set1_epi32(s);
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS % 32, 5 * BITS % 32,
                                           6 * BITS % 32, 7 * BITS % 32);
  for (int g = 0; g < B / 8; ++g) {
    __m256i code;
    if (BITS == 8) {
      code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in + 8 * g)));
    } else {
      uint32_t w = 0;
      std::memcpy(&w, in + BITS * g, BITS);
      code = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts);
    }
    const __m256 mag = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(code, level_mask)), step);
    // Negation is a sign-bit flip, as -mag is in the portable loop.
    const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(code, BITS - 1), 31);
    const __m256i sign_bit = _mm256_and_si256(sign, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const __m256 v = _mm256_xor_ps(mag, _mm256_castsi256_ps(sign_bit));
    // common.h: canonical_nan.
    _mm256_storeu_ps(out + 8 * g, _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
}

}  // namespace avx2
#endif

// Encode of one bucket's float32 values buf[0..B), whose first element is
// element `base` of the tensor, by the portable loop; tmp and codes are
// B-sized scratch.
template <int BITS>
inline void encode_bucket_portable(const EncodeArgs& a, const float* buf, uint32_t base, float* tmp,
                                   uint8_t* codes, uint8_t* out, float* scale_out) {
  const int B = a.bucket;
  const int s = (1 << (BITS - 1)) - 1;
  float scale;
  if (a.l2) {
    for (int i = 0; i < B; ++i) tmp[i] = exact_square(buf[i]);
    scale = sqrtf(cpu::tree_sum(tmp, B));
  } else {
    scale = cpu::max_abs(buf, B);
  }
  *scale_out = scale;
  const float inv = qsgd_inv(scale, s);
  for (int i = 0; i < B; ++i)
    codes[i] =
        static_cast<uint8_t>(qsgd_code(buf[i], inv, s, BITS, rng_uniform(a.k0, a.k1, base + static_cast<uint32_t>(i))));
  cpu::pack_bucket<BITS>(codes, B, out);
}

// The scratch of the encode loops: one bucket's float32 values and squares,
// its codes, the AVX2 path's vectors and the key words mixed once.
struct EncodeScratch {
  EncodeScratch(const EncodeArgs& a, bool avx2)
      : buf(a.bucket),
        tmp(a.bucket),
        codes(a.bucket),
#if JC_CPU_AVX2
        vectors(avx2 ? a.bucket / 8 : 0),
#endif
        ka(mix32(a.k0)),
        kb(mix32(a.k1 ^ mix32(a.k0))) {
    (void)avx2;
  }
  std::vector<float> buf, tmp;
  std::vector<uint8_t> codes;
#if JC_CPU_AVX2
  cpu::avx2::Scratch vectors;
#endif
  uint32_t ka, kb;
};

// Buckets [b0, b1); with AVX2, full float32 buckets take the AVX2 path.
template <int BITS, bool AVX2>
void encode_buckets_t(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  EncodeScratch t(a, AVX2);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    uint8_t* out = a.packed + b * (B / 8) * BITS;
#if JC_CPU_AVX2
    if (AVX2 && a.dtype == DType::kF32 && valid == B) {
      avx2::encode_bucket<BITS>(static_cast<const float*>(a.x) + start, B, a.l2, t.ka, t.kb,
                                static_cast<uint32_t>(start), out, a.scales + b, t.vectors.data());
      continue;
    }
#endif
    cpu::load_any(a.dtype, a.x, start, valid, B, t.buf.data());
    encode_bucket_portable<BITS>(a, t.buf.data(), static_cast<uint32_t>(start), t.tmp.data(), t.codes.data(), out,
                                 a.scales + b);
  }
}

template <bool AVX2>
void encode_buckets(const EncodeArgs& a, int64_t b0, int64_t b1) {
  switch (a.bits) {
    case 2: return encode_buckets_t<2, AVX2>(a, b0, b1);
    case 3: return encode_buckets_t<3, AVX2>(a, b0, b1);
    case 4: return encode_buckets_t<4, AVX2>(a, b0, b1);
    default: return encode_buckets_t<8, AVX2>(a, b0, b1);
  }
}

// One bucket's B values, decoded to float32 into out[0..B): the AVX2 path on
// CPUs that have it, else the portable loop (the same values).
template <int BITS, bool AVX2>
inline void decode_bucket_f32(const uint8_t* in, float scale, int B, uint8_t* codes, float* out) {
#if JC_CPU_AVX2
  if (AVX2) {
    avx2::decode_bucket<BITS>(in, scale, B, out);
    return;
  }
#endif
  cpu::unpack_bucket<BITS>(in, B, codes);
  const float step = qsgd_step(scale, (1 << (BITS - 1)) - 1);
  for (int i = 0; i < B; ++i) out[i] = canonical_nan(qsgd_value(codes[i], step, BITS));
}

// The scratch of decode_bucket_f32's callers: one bucket's codes, and its
// values where they do not go straight to the output.
struct DecodeScratch {
  explicit DecodeScratch(int B) : values(B), codes(B) {}
  std::vector<float> values;
  std::vector<uint8_t> codes;
};

// Error feedback in one pass over buckets [b0, b1): each bucket's acc =
// f32(x) + residual, encoded as encode_buckets_t encodes a float32 tensor,
// decoded as decode_buckets_t decodes it, and acc - decoded written out;
// acc and the decoded values stay in cache. On the AVX2 path (full
// buckets) the decoded values never leave the registers: the encode's loop
// forms each from the level and sign it has just computed.
struct FeedbackArgs {
  EncodeArgs enc;  // x, n, the attributes, the key, the payload
  const float* residual;
  float* out;
};

template <int BITS, bool AVX2>
void feedback_buckets_t(const FeedbackArgs& f, int64_t b0, int64_t b1) {
  const EncodeArgs& a = f.enc;
  const int B = a.bucket;
  EncodeScratch t(a, AVX2);  // t.buf: the bucket's acc
  DecodeScratch hat(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    uint8_t* out = a.packed + b * (B / 8) * BITS;
    cpu::load_sum(a.dtype, a.x, f.residual, start, valid, B, t.buf.data());
#if JC_CPU_AVX2
    if (AVX2 && valid == B) {  // the residual comes out of the encode's loop
      avx2::encode_bucket<BITS, true>(t.buf.data(), B, a.l2, t.ka, t.kb, static_cast<uint32_t>(start), out,
                                      a.scales + b, t.vectors.data(), f.out + start);
      continue;
    }
#endif
    encode_bucket_portable<BITS>(a, t.buf.data(), static_cast<uint32_t>(start), t.tmp.data(), t.codes.data(), out,
                                 a.scales + b);
    decode_bucket_f32<BITS, AVX2>(out, a.scales[b], B, hat.codes.data(), hat.values.data());
    cpu::store_residual(t.buf.data(), hat.values.data(), start, valid, f.out);
  }
}

template <bool AVX2>
void feedback_buckets(const FeedbackArgs& f, int64_t b0, int64_t b1) {
  switch (f.enc.bits) {
    case 2: return feedback_buckets_t<2, AVX2>(f, b0, b1);
    case 3: return feedback_buckets_t<3, AVX2>(f, b0, b1);
    case 4: return feedback_buckets_t<4, AVX2>(f, b0, b1);
    default: return feedback_buckets_t<8, AVX2>(f, b0, b1);
  }
}

template <int BITS, bool AVX2>
void decode_buckets_t(const DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  DecodeScratch scratch(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const uint8_t* in = a.packed + b * (B / 8) * BITS;
    // Full float32 buckets straight into the output; the rest through the scratch.
    const bool direct = a.dtype == DType::kF32 && valid == B;
    float* dst = direct ? static_cast<float*>(a.out) + start : scratch.values.data();
    decode_bucket_f32<BITS, AVX2>(in, a.scales[b], B, scratch.codes.data(), dst);
    if (!direct) cpu::store_any(a.dtype, scratch.values.data(), start, valid, a.out);
  }
}

template <bool AVX2>
void decode_buckets(const DecodeArgs& a, int64_t b0, int64_t b1) {
  switch (a.bits) {
    case 2: return decode_buckets_t<2, AVX2>(a, b0, b1);
    case 3: return decode_buckets_t<3, AVX2>(a, b0, b1);
    case 4: return decode_buckets_t<4, AVX2>(a, b0, b1);
    default: return decode_buckets_t<8, AVX2>(a, b0, b1);
  }
}

// Decode-and-accumulate: the sum, in row order, of `rows` float32 payloads of
// n values each (the chunks a device receives in a reduce-scatter), one
// bucket at a time through a bucket-sized buffer, so that no row is ever
// written out in full: out = ((row 0 + row 1) + row 2) + ..., every row
// decoded as the decode target decodes it (no contraction: -ffp-contract=off).
struct DecodeSumArgs {
  float* out;
  int64_t n;
  int bucket, bits;
  int64_t rows, row_bytes, row_buckets;
  const uint8_t* packed;
  const float* scales;
};

template <int BITS, bool AVX2>
void decode_sum_buckets_t(const DecodeSumArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  DecodeScratch scratch(B);
  const float* buf = scratch.values.data();
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    float* out = a.out + start;
    for (int64_t r = 0; r < a.rows; ++r) {
      const uint8_t* in = a.packed + r * a.row_bytes + b * (B / 8) * BITS;
      const bool direct = r == 0 && valid == B;  // row 0 of a full bucket: the output itself
      float* dst = direct ? out : scratch.values.data();
      decode_bucket_f32<BITS, AVX2>(in, a.scales[r * a.row_buckets + b], B, scratch.codes.data(), dst);
      if (r == 0) {
        if (!direct) std::memcpy(out, buf, static_cast<size_t>(valid) * sizeof(float));
      } else {
        for (int64_t i = 0; i < valid; ++i) out[i] += buf[i];
      }
    }
    // The NaN rule (common.h): a sum of rows can make a NaN (inf + -inf).
    for (int64_t i = 0; i < valid; ++i) out[i] = canonical_nan(out[i]);
  }
}

template <bool AVX2>
void decode_sum_buckets(const DecodeSumArgs& a, int64_t b0, int64_t b1) {
  switch (a.bits) {
    case 2: return decode_sum_buckets_t<2, AVX2>(a, b0, b1);
    case 3: return decode_sum_buckets_t<3, AVX2>(a, b0, b1);
    case 4: return decode_sum_buckets_t<4, AVX2>(a, b0, b1);
    default: return decode_sum_buckets_t<8, AVX2>(a, b0, b1);
  }
}

JC_CPU_LOOP_WITH_AVX2_PATHS(encode_range, EncodeArgs, encode_buckets)
JC_CPU_LOOP_WITH_AVX2_PATHS(decode_sum_range, DecodeSumArgs, decode_sum_buckets)
JC_CPU_LOOP_WITH_AVX2_PATHS(decode_range, DecodeArgs, decode_buckets)
JC_CPU_LOOP_WITH_AVX2_PATHS(feedback_range, FeedbackArgs, feedback_buckets)

// ---------------------------------------------------------------------------
// Handlers: encode and decode are the pair families' (cpu_buckets.h), one
// tensor at a time; decode_sum sums the rows of one call
// ---------------------------------------------------------------------------
void encode(Runner& runner, DType dt, const void* x, int64_t n, const uint32_t* key, uint8_t* packed, float* scales,
            int64_t bits, int64_t bucket, int64_t l2) {
  const EncodeArgs a{dt,     x,      n,      static_cast<int>(bucket), static_cast<int>(bits), l2 != 0,
                     key[0], key[1], packed, scales};
  for_buckets(runner, a, encode_range);
}

void encode_feedback(Runner& runner, DType dt, const void* x, const float* residual, int64_t n, const uint32_t* key,
                     uint8_t* packed, float* scales, float* out, int64_t bits, int64_t bucket, int64_t l2) {
  const EncodeArgs a{dt,     x,      n,      static_cast<int>(bucket), static_cast<int>(bits), l2 != 0,
                     key[0], key[1], packed, scales};
  const FeedbackArgs f{a, residual, out};
  parallel_for(runner, (n + bucket - 1) / bucket, buckets_per_task(bucket),
               [&](int64_t b0, int64_t b1) { feedback_range(f, b0, b1); });
}

void decode(Runner& runner, DType dt, const uint8_t* packed, const float* scales, int64_t n, void* out, int64_t bits,
            int64_t bucket) {
  for_buckets(runner, DecodeArgs{dt, out, n, static_cast<int>(bucket), static_cast<int>(bits), packed, scales},
              decode_range);
}

ffi::Error DecodeSumImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits, int64_t bucket) {
  const Stacked s(packed.dimensions(), scales.dimensions(), out->dimensions());
  const int64_t rows = s.rows(), n = s.n();
  if (const char* e = s.check(qsgd_check_decode(DType::kF32, n, s.bytes(), s.buckets(), bits, bucket)))
    return invalid(e);
  hint_huge_pages(out->typed_data(), static_cast<int64_t>(out->size_bytes()));
  if (rows == 0) {
    std::fill(out->typed_data(), out->typed_data() + n, 0.0f);
    return ffi::Error::Success();
  }
  const DecodeSumArgs a{out->typed_data(), n,         static_cast<int>(bucket), static_cast<int>(bits),
                        rows,              s.bytes(), s.buckets(),              packed.typed_data(),
                        scales.typed_data()};
  PoolRunner runner(pool);
  // The buckets per task of a plain decode, divided among the rows' work.
  parallel_for(runner, (n + bucket - 1) / bucket, std::max<int64_t>(1, buckets_per_task(bucket) / rows),
               [&](int64_t b0, int64_t b1) { decode_sum_range(a, b0, b1); });
  return ffi::Error::Success();
}

using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kQsgdEncode, Handlers::encode<qsgd_check_encode, encode>);
JAXCOMP_REGISTER(kQsgdDecode, Handlers::decode<qsgd_check_decode, decode>);
JAXCOMP_REGISTER(kQsgdDecodeSum, DecodeSumImpl);
JAXCOMP_REGISTER(kQsgdEncodeFeedback, Handlers::feedback<qsgd_check_encode, encode_feedback>);

}  // namespace
}  // namespace jaxcomp
