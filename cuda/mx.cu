// MX on CUDA: the handlers of kMxEncode, kMxDecode and kMxEncodeFeedback, with the buffers,
// checks and bytes of ffi/mx.cc. One warp per block of 32 values
// (a lane per value: the max over the warp's shuffles, the codes packed by
// the lanes that own a byte group). Rounding and the E8M0 scale in
// ffi/include/jaxcomp/minifloat.h: software, as the CPU's, except that MXFP8
// elements rounded to nearest even take the conversion instruction of sm_89
// and later (mini_encode_rn: the same bytes by the reasoning there, checked on
// a GPU only by tests/test_gpu.py). The targets, packing, sizes and checks in
// ffi/include/jaxcomp/mx.h; twin in jaxcomp/codecs/mx.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/mx.h"

namespace jaxcomp {
namespace cuda {
namespace {

constexpr unsigned kFull = 0xffffffffu;

// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_f: the
// decoded values as the decode kernel computes them, NaN for the NaN scale).
template <typename T, bool STOCHASTIC, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    mx_encode_kernel(Input<T, Feedback> in, int64_t num_blocks, int format, const uint32_t* __restrict__ seed,
                     uint8_t* __restrict__ codes, uint8_t* __restrict__ scales, float* __restrict__ new_residual) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t block = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  if (block >= num_blocks) return;  // whole warps: the shuffles below see all 32 lanes
  const MiniFormat f = mini_format(format);
  const int bits = mini_bits(f);
  const int64_t i = block * kMxBlock + lane;
  const float v = in.at(i);
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
  if constexpr (Feedback) {
    if (i < in.n) {
      const float hat = scale == 0xffu ? NAN : (mini_value(code, f) * mx_scale_hi(scale)) * mx_scale_lo(scale);
      new_residual[i] = v - canonical_nan(hat);
    }
  }
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

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), one tensor at a time
// ---------------------------------------------------------------------------
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                   const uint32_t* seed, uint8_t* codes, uint8_t* scales, float* new_residual, int64_t format,
                   int64_t stochastic) {
  const int64_t nb = num_buckets(n, kMxBlock);
  const unsigned blocks = static_cast<unsigned>((nb * kMxBlock + kThreads - 1) / kThreads);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = stochastic != 0 ? mx_encode_kernel<T, true, Feedback> : mx_encode_kernel<T, false, Feedback>;
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    kernel<<<blocks, kThreads, 0, stream>>>(in, nb, static_cast<int>(format), seed, codes, scales, new_residual);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* codes,
            uint8_t* scales, int64_t format, int64_t stochastic) {
  launch_encode<false>(stream, dt, x, nullptr, n, seed, codes, scales, nullptr, format, stochastic);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     const uint32_t* seed, uint8_t* codes, uint8_t* scales, float* new_residual, int64_t format,
                     int64_t stochastic) {
  launch_encode<true>(stream, dt, x, residual, n, seed, codes, scales, new_residual, format, stochastic);
}

void decode(cudaStream_t stream, DType dt, const uint8_t* codes, const uint8_t* scales, int64_t n, void* out,
            int64_t format) {
  with_type(dt, [&](auto tag) {
    mx_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(codes, scales, static_cast<decltype(tag)*>(out), n,
                                                              static_cast<int>(format));
  });
}

using Handlers = CudaPairHandlers<ffi::U8, ffi::U8>;
JAXCOMP_REGISTER(kMxEncode, Handlers::encode<mx_check_encode, encode>);
JAXCOMP_REGISTER(kMxDecode, Handlers::decode<mx_check_decode, decode>);
JAXCOMP_REGISTER(kMxEncodeFeedback, Handlers::feedback<mx_check_encode, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
