// Int8 on the CPU: the targets jaxcomp_int8_encode and jaxcomp_int8_decode.
// Bodies, sizes and checks in include/jaxcomp/int8.h; twin in
// jaxcomp/ops/int8.py.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_buckets.h"
#include "cpu_runtime.h"
#include "jaxcomp/int8.h"

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
  int8_t* q;
  float* scales;
};

// Buckets [b0, b1).
JC_CPU_LOOP void encode_range(const EncodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    cpu::load_any(a.dtype, a.x, start, valid, B, buf.data());
    const float m = cpu::max_abs(buf.data(), B);
    a.scales[b] = m;
    const float inv = int8_inv(m);
    int8_t* qb = a.q + start;
    for (int i = 0; i < B; ++i) qb[i] = int8_code(buf[i], inv);
  }
}

void encode(Runner& runner, DType dt, const void* x, int64_t n, int bucket, int8_t* q, float* scales) {
  for_buckets(runner, EncodeArgs{dt, x, n, bucket, q, scales}, encode_range);
}

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  const int8_t* q;
  const float* scales;
};

JC_CPU_LOOP void decode_range(const DecodeArgs& a, int64_t b0, int64_t b1) {
  const int B = a.bucket;
  std::vector<float> buf(B);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * B;
    const int64_t valid = std::min<int64_t>(B, a.n - start);
    const float step = int8_step(a.scales[b]);
    const int8_t* qb = a.q + start;
    for (int i = 0; i < B; ++i) buf[i] = int8_value(qb[i], step);
    cpu::store_any(a.dtype, buf.data(), start, valid, a.out);
  }
}

void decode(Runner& runner, DType dt, const int8_t* q, const float* scales, int64_t n, int bucket, void* out) {
  for_buckets(runner, DecodeArgs{dt, out, n, bucket, q, scales}, decode_range);
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cpu_buckets.h), q being the codes
// ---------------------------------------------------------------------------
using Handlers = PairHandlers<ffi::S8, ffi::F32>;
constexpr char kEncode[] = "jaxcomp_int8_encode";
constexpr char kDecode[] = "jaxcomp_int8_decode";
JAXCOMP_REGISTER(kEncode, (Handlers::encode<kEncode, int8_check_encode, encode>));
JAXCOMP_REGISTER(kDecode, (Handlers::decode<kDecode, int8_check_decode, decode>));

}  // namespace
}  // namespace jaxcomp
