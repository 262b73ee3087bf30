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

struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int bucket;
  const int8_t* q;
  const float* scales;
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

void encode(Runner& runner, const EncodeArgs& a) {
  parallel_for(runner, num_buckets(a.n, a.bucket), buckets_per_task(a.bucket),
               [&](int64_t b0, int64_t b1) { encode_range(a, b0, b1); });
}

void decode(Runner& runner, const DecodeArgs& a) {
  parallel_for(runner, num_buckets(a.n, a.bucket), buckets_per_task(a.bucket),
               [&](int64_t b0, int64_t b1) { decode_range(a, b0, b1); });
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::S8> q,
                      ffi::ResultBuffer<ffi::F32> scales, int64_t bucket) {
  const char* op = "jaxcomp_int8_encode";
  const DType dt = dtype_of(x.element_type());
  const int64_t n = x.element_count();
  if (const char* e = int8_check_encode(dt, n, q->element_count(), scales->element_count(), bucket))
    return invalid(op, e);
  hint_huge_pages(q->typed_data(), q->element_count());
  PoolRunner runner(pool);
  encode(runner, EncodeArgs{dt, x.untyped_data(), n, static_cast<int>(bucket), q->typed_data(), scales->typed_data()});
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_int8_decode";
  const DType dt = dtype_of(out->element_type());
  const int64_t n = out->element_count();
  if (const char* e = int8_check_decode(dt, n, q.element_count(), scales.element_count(), bucket))
    return invalid(op, e);
  hint_huge_pages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  PoolRunner runner(pool);
  decode(runner, DecodeArgs{dt, out->untyped_data(), n, static_cast<int>(bucket), q.typed_data(), scales.typed_data()});
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompInt8Encode, jaxcomp::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::S8>>()    // q in [-127, 127]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_int8_encode", JaxcompInt8Encode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompInt8Decode, jaxcomp::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_int8_decode", JaxcompInt8Decode);
