// Int8 on CUDA: the targets jaxcomp_int8_encode and jaxcomp_int8_decode, with
// the buffers, checks and bytes of ffi/int8.cc. Bodies, sizes and checks in
// ffi/include/jaxcomp/int8.h; twin in jaxcomp/ops/int8.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/int8.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    int8_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                       int8_t* __restrict__ q, float* __restrict__ scales, bool vec) {
  const Slot t = slot(g);
  const float m = bucket_max_abs(x, n, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = int8_inv(m);
  uint8_t* out = reinterpret_cast<uint8_t*>(q) + t.start;
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(int8_code(v[j], inv));
    store_bytes8(out + 8 * gi, vec, c);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    int8_decode_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float step = int8_step(scales[gi >> group_shift]);
    uint8_t c[8];
    load_bytes8(reinterpret_cast<const uint8_t*>(q) + 8 * gi, vec, c);
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = int8_value(static_cast<int8_t>(c[j]), step);
    store8(out, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::S8> q,
                      ffi::ResultBuffer<ffi::F32> scales, int64_t bucket) {
  const char* op = "jaxcomp_int8_encode";
  const DType dt = dtype_of(x.element_type());
  const int64_t n = x.element_count();
  if (const char* e = int8_check_encode(dt, n, q->element_count(), scales->element_count(), bucket))
    return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  int8_t* qd = q->typed_data();
  const bool vec = aligned16(x.untyped_data()) && aligned16(qd);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    int8_encode_kernel<T><<<encode_blocks(nb, g), kThreads, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), n, nb, g, qd, scales->typed_data(), vec);
  });
  return launched(op);
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_int8_decode";
  const DType dt = dtype_of(out->element_type());
  const int64_t n = out->element_count();
  if (const char* e = int8_check_decode(dt, n, q.element_count(), scales.element_count(), bucket))
    return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  const int8_t* qd = q.typed_data();
  const bool vec = aligned16(qd) && aligned16(out->untyped_data());
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    int8_decode_kernel<T><<<flat_blocks(n), kThreads, 0, stream>>>(
        qd, scales.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket / 8), vec);
  });
  return launched(op);
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaInt8Encode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::S8>>()    // q in [-127, 127]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_int8_encode", JaxcompCudaInt8Encode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaInt8Decode, jaxcomp::cuda::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_int8_decode", JaxcompCudaInt8Decode);
