// Scaled sign on the CPU: the handlers of kSignsgdEncode and kSignsgdDecode.
// The targets, bodies, sizes and checks in include/jaxcomp/signsgd.h; twin in
// jaxcomp/codecs/signsgd.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/signsgd.h"

namespace jaxcomp {
namespace {

using Handlers = CpuPairHandlers<ffi::U8, ffi::F32>;

// ---------------------------------------------------------------------------
// Kernels: the buckets [b0, b1) of one tensor
// ---------------------------------------------------------------------------
JC_CPU_LOOP void encode_range(const Handlers::EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  std::vector<uint8_t> signs(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, B, buf.data());
    for (int i = 0; i < B; ++i) {
      signs[i] = buf[i] < 0.0f ? 1 : 0;
      buf[i] = std::fabs(buf[i]);
    }
    a.side[b] = signsgd_scale(cpu::tree_sum(buf.data(), B), valid);
    cpu::pack_bucket<1>(signs.data(), B, a.codes + b * (B / 8));
  }
}

// -scale is scale with its sign bit flipped, so a value is the scale's bits
// XOR (bit << 31): no select, and the loop over a byte's eight bits
// vectorizes.
JC_CPU_LOOP void decode_range(const Handlers::DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const uint32_t scale = f32_bits(a.side[b]);
    const uint8_t* signs = a.codes + b * (B / 8);
    const bool direct = a.dtype == DType::kF32 && valid == B;
    float* out = direct ? static_cast<float*>(a.out) + start : buf.data();
    if (a.side[b] != a.side[b]) {
      // A NaN scale: the whole bucket is the decoders' NaN (common.h), of
      // either sign bit; decided once per bucket, so the loop below stays a
      // plain XOR.
      std::fill(out, out + B, canonical_nan(a.side[b]));
    } else {
      for (int g = 0; g < B / 8; ++g) {
        const uint32_t byte = signs[g];
        for (int j = 0; j < 8; ++j) out[8 * g + j] = bits_f32(scale ^ (((byte >> j) & 1u) << 31));
      }
    }
    if (!direct) cpu::store_any(a.dtype, buf.data(), start, valid, a.out);
  }
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), the signs being the codes and
// the scales the side data
// ---------------------------------------------------------------------------
JAXCOMP_REGISTER(kSignsgdEncode,
                 Handlers::encode<check_pair_encode<signsgd_sizes>, Handlers::encode_buckets<encode_range>>);
JAXCOMP_REGISTER(kSignsgdDecode,
                 Handlers::decode<check_pair_decode<signsgd_sizes>, Handlers::decode_buckets<decode_range>>);

}  // namespace
}  // namespace jaxcomp
