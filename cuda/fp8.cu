// FP8 on CUDA: the targets jaxcomp_fp8_encode and jaxcomp_fp8_decode, with the
// buffers, checks and bytes of ffi/fp8.cc. Rounding in
// ffi/include/jaxcomp/minifloat.h: to nearest even by the conversion
// instruction of sm_89 and later (mini_encode_rn, which keeps NaN and
// infinity on the software path so that the bytes are the CPU's; checked on a
// GPU only by tests/test_gpu.py), stochastically and on older devices by the
// software conversion, bit-identical to the CPU's. Sizes and checks in
// ffi/include/jaxcomp/fp8.h; twin in jaxcomp/codecs/fp8.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/fp8.h"

namespace jaxcomp {
namespace cuda {
namespace {

template <typename T, bool STOCHASTIC>
__global__ void __launch_bounds__(kThreads)
    fp8_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g, int format,
                      const uint32_t* __restrict__ seed, uint8_t* __restrict__ codes, float* __restrict__ scales) {
  const Slot t = slot(g);
  const float m = bucket_max_abs(x, n, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  const MiniFormat f = mini_format(format);
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = fp8_inv(m, f);
  const uint32_t k0 = seed[0], k1 = seed[1];
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const int64_t i = t.start + e;  // codes are padded to whole buckets
    const float scaled = load1(x, i, n) * inv;
    codes[i] = static_cast<uint8_t>(STOCHASTIC ? mini_encode(scaled, f, rng_uniform(k0, k1, static_cast<uint32_t>(i)))
                                               : mini_encode_rn(scaled, f));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    fp8_decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, T* __restrict__ out,
                      int64_t n, int bucket_shift, int format) {
  const MiniFormat f = mini_format(format);
  grid_stride(n, [&](int64_t e) {
    const float step = fp8_step(scales[e >> bucket_shift], f);
    out[e] = decoded<T>(step != step ? NAN : mini_value(codes[e], f) * step);  // as ffi/fp8.cc
  });
}

ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::F32> scales, int64_t bucket,
                      int64_t format, int64_t stochastic) {
  const Batch b(x, seed, *codes, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = fp8_check_encode(dt, n, b.count(1), b.count(2), b.count(3), bucket, format, stochastic);
  return launch_batch("jaxcomp_fp8_encode", b, error, n, [&](int64_t i) {
    const int64_t nb = num_buckets(n, bucket);
    const Geometry g = geometry(bucket);
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      auto kernel = stochastic != 0 ? fp8_encode_kernel<T, true> : fp8_encode_kernel<T, false>;
      kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(b.at<const T>(0, i), n, nb, g, static_cast<int>(format),
                                                            b.at<const uint32_t>(1, i), b.at<uint8_t>(2, i),
                                                            b.at<float>(3, i));
    });
  });
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::F32> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bucket, int64_t format) {
  const Batch b(codes, scales, *out);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(2);
  const char* error = fp8_check_decode(dt, n, b.count(0), b.count(1), bucket, format);
  return launch_batch("jaxcomp_fp8_decode", b, error, n, [&](int64_t i) {
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      fp8_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(b.at<const uint8_t>(0, i), b.at<const float>(1, i),
                                                                 b.at<T>(2, i), n, log2_int(bucket),
                                                                 static_cast<int>(format));
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaFp8Encode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one code per element (padded)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // max|v| per block
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("format")        // 0: e4m3, 1: e5m2
                                  .Attr<int64_t>("stochastic"));  // 1: stochastic, 0: nearest even
JAXCOMP_REGISTER("jaxcomp_fp8_encode", JaxcompCudaFp8Encode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaFp8Decode, jaxcomp::cuda::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // max|v| per block
                                  .Ret<ffi::AnyBuffer>()         // flat output, the input's dtype
                                  .Attr<int64_t>("bucket_size")
                                  .Attr<int64_t>("format"));
JAXCOMP_REGISTER("jaxcomp_fp8_decode", JaxcompCudaFp8Decode);
