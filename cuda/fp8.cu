// FP8 on CUDA: the handlers of kFp8Encode, kFp8Decode and kFp8EncodeFeedback,
// with the buffers, checks and bytes of ffi/fp8.cc. Rounding in
// ffi/include/jaxcomp/minifloat.h: to nearest even by the conversion
// instruction of sm_89 and later (mini_encode_rn, which keeps NaN and
// infinity on the software path so that the bytes are the CPU's; checked on a
// GPU only by tests/test_gpu.py), stochastically and on older devices by the
// software conversion, bit-identical to the CPU's. The targets, sizes and
// checks in ffi/include/jaxcomp/fp8.h; twin in jaxcomp/codecs/fp8.py.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_runtime.cuh"
#include "jaxcomp/fp8.h"

namespace jaxcomp {
namespace cuda {
namespace {

// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_t: the
// decoded values mini_value * step, NaN for a NaN step, as the decode kernel
// computes them).
template <typename T, bool STOCHASTIC, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    fp8_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, int format,
                      const uint32_t* __restrict__ seed, uint8_t* __restrict__ codes, float* __restrict__ scales,
                      float* __restrict__ new_residual) {
  const Slot t = slot(g);
  const float m = bucket_max_abs(in, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  const MiniFormat f = mini_format(format);
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = fp8_inv(m, f);
  const float step = fp8_step(m, f);
  const uint32_t k0 = seed[0], k1 = seed[1];
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const int64_t i = t.start + e;  // codes are padded to whole buckets
    const float v = in.at(i);
    const float scaled = v * inv;
    const uint32_t code = STOCHASTIC ? mini_encode(scaled, f, rng_uniform(k0, k1, static_cast<uint32_t>(i)))
                                     : mini_encode_rn(scaled, f);
    codes[i] = static_cast<uint8_t>(code);
    if constexpr (Feedback) {
      if (i < in.n) new_residual[i] = v - canonical_nan(step != step ? NAN : mini_value(code & 0xffu, f) * step);
    }
  }
}

// The tile encode (kernels.cuh) of buckets of at most 8 * 32 * kMaxTileGroups
// values: the codes, scales and residual of fp8_encode_kernel, the input
// read once and the codes stored 8 bytes at a time.
template <typename T, bool STOCHASTIC, bool Feedback, int G>
__global__ void __launch_bounds__(kThreads)
    fp8_encode_tile(Input<T, Feedback> in, int64_t num_buckets, int64_t bucket, int lanes_log2, int format,
                    const uint32_t* __restrict__ seed, uint8_t* __restrict__ codes, float* __restrict__ scales,
                    float* __restrict__ new_residual, bool vec) {
  const TileSlot t = tile_slot(lanes_log2, bucket, num_buckets);
  const uint32_t k0 = seed[0], k1 = seed[1];
  float v[G][8];
  load_tile(in, t, vec, v);
  const float m = tile_max_abs(v, t.lanes);
  if (!t.live) return;  // after the last shuffle
  const MiniFormat f = mini_format(format);
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = fp8_inv(m, f);
  const float step = fp8_step(m, f);
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float scaled = v[s][j] * inv;
      const uint32_t u = static_cast<uint32_t>(i0) + static_cast<uint32_t>(j);
      c[j] = static_cast<uint8_t>(STOCHASTIC ? mini_encode(scaled, f, rng_uniform(k0, k1, u))
                                             : mini_encode_rn(scaled, f));
    }
    store_bytes8(codes + i0, vec, c);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = step != step ? NAN : mini_value(c[j], f) * step;
      store_residual8(new_residual, i0, in.n, vec, v[s], hat);
    }
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

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), one tensor at a time
// ---------------------------------------------------------------------------
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                   const uint32_t* seed, uint8_t* codes, float* scales, float* new_residual, int64_t bucket,
                   int64_t format, int64_t stochastic) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  bool vec = aligned16(x) && aligned16(codes);
  if constexpr (Feedback) vec = vec && aligned16(residual) && aligned16(new_residual);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    const int fmt = static_cast<int>(format);
    const bool tile = launch_tile<T, Feedback>(nb, bucket, [&](auto groups, unsigned blocks, int lanes_log2) {
      constexpr int G = decltype(groups)::value;
      auto kernel = stochastic != 0 ? fp8_encode_tile<T, true, Feedback, G> : fp8_encode_tile<T, false, Feedback, G>;
      kernel<<<blocks, kThreads, 0, stream>>>(in, nb, bucket, lanes_log2, fmt, seed, codes, scales, new_residual,
                                              vec);
    });
    if (tile) return;
    auto kernel = stochastic != 0 ? fp8_encode_kernel<T, true, Feedback> : fp8_encode_kernel<T, false, Feedback>;
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, fmt, seed, codes, scales, new_residual);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* codes,
            float* scales, int64_t bucket, int64_t format, int64_t stochastic) {
  launch_encode<false>(stream, dt, x, nullptr, n, seed, codes, scales, nullptr, bucket, format, stochastic);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     const uint32_t* seed, uint8_t* codes, float* scales, float* new_residual, int64_t bucket,
                     int64_t format, int64_t stochastic) {
  launch_encode<true>(stream, dt, x, residual, n, seed, codes, scales, new_residual, bucket, format, stochastic);
}

void decode(cudaStream_t stream, DType dt, const uint8_t* codes, const float* scales, int64_t n, void* out,
            int64_t bucket, int64_t format) {
  with_type(dt, [&](auto tag) {
    fp8_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(codes, scales, static_cast<decltype(tag)*>(out), n,
                                                               log2_int(bucket), static_cast<int>(format));
  });
}

using Handlers = CudaPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kFp8Encode, Handlers::encode<fp8_check_encode, encode>);
JAXCOMP_REGISTER(kFp8Decode, Handlers::decode<fp8_check_decode, decode>);
JAXCOMP_REGISTER(kFp8EncodeFeedback, Handlers::feedback<fp8_check_encode, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
