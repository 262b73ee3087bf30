// MX on CUDA: the targets jaxcomp_mx_encode and jaxcomp_mx_decode, with the
// buffers, checks and bytes of ffi/mx.cc. One warp per block of 32 values
// (a lane per value: the max over the warp's shuffles, the codes packed by
// the lanes that own a byte group). Rounding and the E8M0 scale in
// ffi/include/jaxcomp/minifloat.h: software, as the CPU's, except that MXFP8
// elements rounded to nearest even take the conversion instruction of sm_89
// and later (mini_encode_rn: the same bytes by the reasoning there, checked on
// a GPU only by tests/test_gpu.py). Packing, sizes and checks in
// ffi/include/jaxcomp/mx.h; twin in jaxcomp/codecs/mx.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/mx.h"

namespace jaxcomp {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

template <typename T, bool STOCHASTIC>
__global__ void __launch_bounds__(kThreads)
    mx_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_blocks, int format,
                     const uint32_t* __restrict__ seed, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t block = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (block >= num_blocks) return;  // whole warps: the shuffles below see all 32 lanes
  const MiniFormat f = mini_format(format);
  const int bits = mini_bits(f);
  const int64_t i = block * kMxBlock + lane;
  const float v = load1(x, i, n);
  uint32_t m = abs_bits(v);
  for (int d = 16; d >= 1; d /= 2) {
    const uint32_t o = __shfl_xor_sync(kFull, m, d);
    m = o > m ? o : m;
  }
  const uint32_t scale = mx_scale_code(bits_f32(m), f);
  if (lane == 0) scales[block] = static_cast<uint8_t>(scale);
  const float t = v * mx_inverse(scale);
  const uint32_t code =
      STOCHASTIC ? mini_encode(t, f, rng_uniform(seed[0], seed[1], static_cast<uint32_t>(i))) : mini_encode_rn(t, f);
  uint8_t* out = codes + block * (kMxBlock * bits / 8);
  if (bits == 8) {
    out[lane] = static_cast<uint8_t>(code);
  } else if (bits == 4) {
    const uint32_t next = __shfl_down_sync(kFull, code, 1);
    if ((lane & 1) == 0) out[lane >> 1] = static_cast<uint8_t>(code | (next << 4));
  } else {
    const uint32_t c1 = __shfl_down_sync(kFull, code, 1);
    const uint32_t c2 = __shfl_down_sync(kFull, code, 2);
    const uint32_t c3 = __shfl_down_sync(kFull, code, 3);
    if ((lane & 3) == 0) {
      const uint32_t w = code | (c1 << 6) | (c2 << 12) | (c3 << 18);
      uint8_t* g = out + 3 * (lane >> 2);
      g[0] = static_cast<uint8_t>(w);
      g[1] = static_cast<uint8_t>(w >> 8);
      g[2] = static_cast<uint8_t>(w >> 16);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    mx_decode_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, T* __restrict__ out,
                     int64_t n, int format) {
  const MiniFormat f = mini_format(format);
  const int bits = mini_bits(f);
  grid_stride(n, [&](int64_t e) {
    const int64_t block = e >> 5;
    const uint32_t code = mx_code(codes + block * (kMxBlock * bits / 8), bits, static_cast<int>(e & 31));
    const uint32_t s = scales[block];
    out[e] = decoded<T>(s == 0xffu ? NAN : (mini_value(code, f) * mx_scale_hi(s)) * mx_scale_lo(s));
  });
}

ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::U8> scales, int64_t format,
                      int64_t stochastic) {
  const Batch b(x, seed, *codes, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = mx_check_encode(dt, n, b.count(1), b.count(2), b.count(3), format, stochastic);
  return launch_batch("jaxcomp_mx_encode", b, error, n, [&](int64_t i) {
    const int64_t nb = num_buckets(n, kMxBlock);
    const unsigned blocks = static_cast<unsigned>((nb * kMxBlock + kThreads - 1) / kThreads);
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      auto kernel = stochastic != 0 ? mx_encode_kernel<T, true> : mx_encode_kernel<T, false>;
      kernel<<<blocks, kThreads, 0, stream>>>(b.at<const T>(0, i), n, nb, static_cast<int>(format),
                                              b.at<const uint32_t>(1, i), b.at<uint8_t>(2, i), b.at<uint8_t>(3, i));
    });
  });
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t format) {
  const Batch b(codes, scales, *out);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(2);
  const char* error = mx_check_decode(dt, n, b.count(0), b.count(1), format);
  return launch_batch("jaxcomp_mx_decode", b, error, n, [&](int64_t i) {
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      mx_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(b.at<const uint8_t>(0, i), b.at<const uint8_t>(1, i),
                                                                b.at<T>(2, i), n, static_cast<int>(format));
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaMxEncode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // packed element codes
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one E8M0 scale per block of 32
                                  .Attr<int64_t>("format")        // element format, minifloat.h
                                  .Attr<int64_t>("stochastic"));  // 1: stochastic, 0: nearest even
JAXCOMP_REGISTER("jaxcomp_mx_encode", JaxcompCudaMxEncode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaMxDecode, jaxcomp::cuda::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()  // packed element codes
                                  .Arg<ffi::Buffer<ffi::U8>>()  // E8M0 scales
                                  .Ret<ffi::AnyBuffer>()        // flat output, the input's dtype
                                  .Attr<int64_t>("format"));
JAXCOMP_REGISTER("jaxcomp_mx_decode", JaxcompCudaMxDecode);
