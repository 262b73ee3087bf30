// 1-bit SGD on the CPU: the handlers of kOnebitEncode, kOnebitDecode and
// kOnebitEncodeFeedback. The targets, bodies, sizes and checks in
// include/jaxcomp/onebit.h; twin in jaxcomp/codecs/onebit.py.
//
// Full float32 buckets take hand-written AVX2 paths on CPUs that have AVX2:
// the same compares and the same halving-tree order as the portable loops,
// eight lanes at a time.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/onebit.h"

namespace jaxcomp {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;
using EncodeArgs = Handlers::EncodeArgs;  // codes: the bits; side: (avg+, avg-) per bucket
using DecodeArgs = Handlers::DecodeArgs;

#if JC_CPU_AVX2
// The bucket routines stay out of line: inlined into the flattened loop they
// raise its register pressure, which costs more than one call per bucket
// (docs/benchmarks.md).
namespace avx2 {

// Encode of one full float32 bucket.
JC_AVX2 __attribute__((noinline)) void encode_bucket(const float* x, int B, uint8_t* bits, float* means, __m256* pos,
                                                    __m256* neg) {
  const __m256 zero = _mm256_setzero_ps();
  uint32_t npos = 0;
  for (int g = 0; g < B / 8; ++g) {
    const __m256 v = _mm256_loadu_ps(x + 8 * g);
    const __m256 p = _mm256_cmp_ps(v, zero, _CMP_GE_OQ);  // NaN: false, as in the portable loop
    const int m = _mm256_movemask_ps(p);
    bits[g] = static_cast<uint8_t>(m);
    npos += static_cast<uint32_t>(__builtin_popcount(static_cast<unsigned>(m)));
    pos[g] = _mm256_and_ps(p, v);
    neg[g] = _mm256_andnot_ps(p, v);
  }
  means[0] = onebit_mean(cpu::avx2::tree_sum(pos, B / 8), npos);
  means[1] = onebit_mean(cpu::avx2::tree_sum(neg, B / 8), static_cast<uint32_t>(B) - npos);
}

// Decode of one full bucket into float32.
JC_AVX2 __attribute__((noinline)) void decode_bucket(const uint8_t* bits, float hi, float lo, int B, float* out) {
  const __m256 h = _mm256_set1_ps(hi), l = _mm256_set1_ps(lo);
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int g = 0; g < B / 8; ++g) {
    const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits[g]), bit), bit);
    _mm256_storeu_ps(out + 8 * g, _mm256_blendv_ps(l, h, _mm256_castsi256_ps(m)));
  }
}

}  // namespace avx2
#endif

// The scratch of one bucket: its float32 values, their two sides, its bits
// unpacked and (for error feedback) its decoded values; and the AVX2 paths'.
struct BucketScratch {
  explicit BucketScratch(int B)
      : buf(B),
        pos(B),
        neg(B),
        hat(B),
        codes(B)
#if JC_CPU_AVX2
        ,
        vpos(B / 8),
        vneg(B / 8)
#endif
  {
  }
  std::vector<float> buf, pos, neg, hat;
  std::vector<uint8_t> codes;
#if JC_CPU_AVX2
  cpu::avx2::Scratch vpos, vneg;
#endif
};

// Encode of bucket b, its float32 values in t.buf (valid of them, zeros
// after): the AVX2 path for a full bucket where AVX2 is on, else the portable
// loop.
template <bool AVX2>
inline void encode_bucket(const EncodeArgs& a, int64_t b, int64_t valid, BucketScratch& t) {
  const int B = a.bucket;
  uint8_t* bits = a.codes + b * (B / 8);
#if JC_CPU_AVX2
  if (AVX2 && valid == B) {
    avx2::encode_bucket(t.buf.data(), B, bits, a.side + 2 * b, t.vpos.data(), t.vneg.data());
    return;
  }
#endif
  uint32_t npos = 0;
  for (int i = 0; i < B; ++i) {
    const bool p = t.buf[i] >= 0.0f;  // NaN goes to the negative side and poisons avg-
    t.codes[i] = p ? 1 : 0;
    t.pos[i] = p ? t.buf[i] : 0.0f;
    t.neg[i] = p ? 0.0f : t.buf[i];
    npos += (p && i < valid) ? 1u : 0u;
  }
  const uint32_t nneg = static_cast<uint32_t>(valid) - npos;
  a.side[2 * b] = onebit_mean(cpu::tree_sum(t.pos.data(), B), npos);
  a.side[2 * b + 1] = onebit_mean(cpu::tree_sum(t.neg.data(), B), nneg);
  cpu::pack_bucket<1>(t.codes.data(), B, bits);
}

// Buckets [b0, b1); with AVX2, full float32 buckets take the AVX2 path
// (straight from the input).
template <bool AVX2>
void encode_body(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  BucketScratch t(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
#if JC_CPU_AVX2
    if (AVX2 && a.dtype == DType::kF32 && valid == B) {
      avx2::encode_bucket(static_cast<const float*>(a.x) + start, B, a.codes + b * (B / 8), a.side + 2 * b,
                          t.vpos.data(), t.vneg.data());
      continue;
    }
#endif
    cpu::load_any(a.dtype, a.x, start, valid, B, t.buf.data());
    encode_bucket<AVX2>(a, b, valid, t);
  }
}

JC_CPU_LOOP_WITH_AVX2_PATHS(encode_range, EncodeArgs, encode_body)

// Error feedback in one pass: each bucket's acc = f32(x) + residual, encoded
// as a float32 tensor's bucket is, decoded as decode_body decodes it, and
// acc - decoded written out.
template <bool AVX2>
void feedback_body(const Handlers::FeedbackArgs& f, int64_t b0, int64_t b1) {
  const int B = f.bucket;
  const EncodeArgs a{DType::kF32, nullptr, f.n, B, f.codes, f.side};
  BucketScratch t(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, f.n - start);
    cpu::load_sum(f.dtype, f.x, f.residual, start, valid, B, t.buf.data());
    encode_bucket<AVX2>(a, b, valid, t);
    const uint8_t* bits = f.codes + b * (B / 8);
    const float hi = canonical_nan(f.side[2 * b]), lo = canonical_nan(f.side[2 * b + 1]);
#if JC_CPU_AVX2
    if (AVX2) {
      avx2::decode_bucket(bits, hi, lo, B, t.hat.data());
      cpu::store_residual(t.buf.data(), t.hat.data(), start, valid, f.out);
      continue;
    }
#endif
    cpu::unpack_bucket<1>(bits, B, t.codes.data());
    for (int i = 0; i < B; ++i) t.hat[i] = t.codes[i] ? hi : lo;
    cpu::store_residual(t.buf.data(), t.hat.data(), start, valid, f.out);
  }
}

JC_CPU_LOOP_WITH_AVX2_PATHS(feedback_range, Handlers::FeedbackArgs, feedback_body)

template <bool AVX2>
void decode_body(const DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  std::vector<uint8_t> codes(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    // Every value is one of the two means: the NaN rule (common.h) applied to them.
    const float hi = canonical_nan(a.side[2 * b]), lo = canonical_nan(a.side[2 * b + 1]);
#if JC_CPU_AVX2
    if (AVX2 && a.dtype == DType::kF32 && valid == B) {
      avx2::decode_bucket(a.codes + b * (B / 8), hi, lo, B, static_cast<float*>(a.out) + start);
      continue;
    }
#endif
    cpu::unpack_bucket<1>(a.codes + b * (B / 8), B, codes.data());
    for (int i = 0; i < B; ++i) buf[i] = codes[i] ? hi : lo;
    cpu::store_any(a.dtype, buf.data(), start, valid, a.out);
  }
}

JC_CPU_LOOP_WITH_AVX2_PATHS(decode_range, DecodeArgs, decode_body)

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), the bits being the codes
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kOnebitEncode,
                 Handlers::encode<check_pair_encode<onebit_sizes>, Handlers::encode_buckets<encode_range>>);
JAXCOMP_REGISTER(kOnebitDecode,
                 Handlers::decode<check_pair_decode<onebit_sizes, kBadMeans>, Handlers::decode_buckets<decode_range>>);
JAXCOMP_REGISTER(kOnebitDecodeSum,
                 Handlers::decode_sum<check_pair_decode<onebit_sizes, kBadMeans>, Handlers::decode_buckets<decode_range>,
                                      bucket_unit<onebit_sizes>>);
JAXCOMP_REGISTER(kOnebitEncodeFeedback,
                 Handlers::feedback<check_pair_encode<onebit_sizes>, Handlers::feedback_buckets<feedback_range>>);

}  // namespace
}  // namespace jaxcomp
