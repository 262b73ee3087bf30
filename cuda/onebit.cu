// 1-bit SGD on CUDA: the targets jaxcomp_onebit_encode and
// jaxcomp_onebit_decode, with the buffers, checks and bytes of ffi/onebit.cc.
// Bodies, sizes and checks in ffi/include/jaxcomp/onebit.h; twin in
// jaxcomp/ops/onebit.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/onebit.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// The two sums of a bucket and its count of non-negative valid values, added
// together so that one pass and one shared-memory tree serve all three. The
// count is an integer sum, so the tree order does not matter for it.
struct OnebitAcc {
  float pos, neg;
  uint32_t npos;
};

__device__ __forceinline__ OnebitAcc operator+(const OnebitAcc& a, const OnebitAcc& b) {
  return OnebitAcc{a.pos + b.pos, a.neg + b.neg, a.npos + b.npos};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    onebit_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                         uint8_t* __restrict__ bits, float* __restrict__ means, bool vec) {
  __shared__ OnebitAcc sm[kThreads];
  const Slot t = slot(g);
  const OnebitAcc part = lane_tree_sum<OnebitAcc>(g.lane_levels, [&](uint32_t j) {
    const int64_t i = t.start + t.lane + static_cast<int64_t>(j) * g.lanes;
    const float v = load1(x, i, n);
    const bool p = v >= 0.0f;  // NaN goes to the negative side and poisons avg-
    return OnebitAcc{p ? v : 0.0f, p ? 0.0f : v, (p && i < n) ? 1u : 0u};
  });
  const OnebitAcc sum = segment_tree(sm, part, t.lane, g.lanes, Plus{});
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) {
    const int64_t left = n - t.start;
    const uint32_t valid = static_cast<uint32_t>(left < g.bucket ? left : g.bucket);
    means[2 * t.bucket] = onebit_mean(sum.pos, sum.npos);
    means[2 * t.bucket + 1] = onebit_mean(sum.neg, valid - sum.npos);
  }
  uint8_t* out = bits + t.bucket * (g.bucket / 8);
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[j] >= 0.0f ? 1 : 0;
    pack8(c, 1, out + gi);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    onebit_decode_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ means, T* __restrict__ out,
                         int64_t n, int group_shift, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t b = gi >> group_shift;
    const float hi = means[2 * b], lo = means[2 * b + 1];
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = unpack_code(bits + gi, 1, j) ? hi : lo;
    store8(out, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> bits,
                      ffi::ResultBuffer<ffi::F32> means, int64_t bucket) {
  const char* op = "jaxcomp_onebit_encode";
  const DType dt = dtype_of(x.element_type());
  const int64_t n = x.element_count();
  if (const char* e = onebit_check_encode(dt, n, bits->element_count(), means->element_count(), bucket))
    return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  // The bits are written one byte per thread, so only the input needs the
  // alignment check.
  const bool vec = aligned16(x.untyped_data());
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    onebit_encode_kernel<T><<<encode_blocks(nb, g), kThreads, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), n, nb, g, bits->typed_data(), means->typed_data(), vec);
  });
  return launched(op);
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> means,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_onebit_decode";
  const DType dt = dtype_of(out->element_type());
  const int64_t n = out->element_count();
  if (const char* e = onebit_check_decode(dt, n, bits.element_count(), means.element_count(), bucket))
    return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  const bool vec = aligned16(out->untyped_data());
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    onebit_decode_kernel<T><<<flat_blocks(n), kThreads, 0, stream>>>(
        bits.typed_data(), means.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket / 8), vec);
  });
  return launched(op);
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaOnebitEncode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::U8>>()    // sign bits, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_onebit_encode", JaxcompCudaOnebitEncode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaOnebitDecode, jaxcomp::cuda::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // sign bits
                                  .Arg<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_onebit_decode", JaxcompCudaOnebitDecode);
