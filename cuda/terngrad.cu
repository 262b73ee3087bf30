// TernGrad on CUDA: the handlers of kTerngradEncode, kTerngradDecode and
// kTerngradEncodeFeedback, with the buffers, checks and bytes of ffi/terngrad.cc. The targets, bodies, sizes
// and checks in ffi/include/jaxcomp/terngrad.h; twin in
// jaxcomp/codecs/terngrad.py. Encode is two launches on one stream: the
// scales, then the base-3^5 bytes.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/terngrad.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels and their launches
// ---------------------------------------------------------------------------
// Phase 1, one segment per bucket: the scale (an integer max, any order) of
// x, or under error feedback of acc = float32(x) + residual.
template <typename T, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    terngrad_scales_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, float* __restrict__ scales) {
  const Slot t = slot(g);
  const float scale = bucket_max_abs(in, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) scales[t.bucket] = scale;
}

// Phase 2, a grid-stride loop over the m bytes: byte i reads element j*m + i
// of each plane j (coalesced per plane) and the scale of its bucket, which
// phase 1 wrote earlier on the same stream. Under error feedback each
// element's acc is formed again and its new residual, acc minus the value
// the decode gives (terngrad_value: the CPU's pack_kept_range), written.
template <typename T, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    terngrad_pack_kernel(Input<T, Feedback> in, int64_t m, int bucket_shift, const float* __restrict__ scales,
                         const uint32_t* __restrict__ seed, uint8_t* __restrict__ trits,
                         float* __restrict__ new_residual) {
  const uint32_t k0 = seed[0], k1 = seed[1];
  grid_stride(m, [&](int64_t i) {
    uint32_t d[5];
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      const int64_t e = j * m + i;
      d[j] = 1u;  // the padding past n is the trit 0
      if (e < in.n) {
        const float scale = scales[e >> bucket_shift];
        const float v = in.at(e);
        d[j] = terngrad_digit(v, terngrad_inv(scale), rng_uniform(k0, k1, static_cast<uint32_t>(e)));
        if constexpr (Feedback) new_residual[e] = v - canonical_nan(terngrad_value(d[j], scale));
      }
    }
    trits[i] = base3_pack(d[0], d[1], d[2], d[3], d[4]);
  });
}

template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                   const uint32_t* seed, uint8_t* trits, float* scales, float* new_residual, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    terngrad_scales_kernel<T, Feedback><<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, scales);
    terngrad_pack_kernel<T, Feedback><<<item_blocks(base3_bytes(n)), kThreads, 0, stream>>>(
        in, base3_bytes(n), log2_int(bucket), scales, seed, trits, new_residual);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* trits,
            float* scales, int64_t bucket) {
  launch_encode<false>(stream, dt, x, nullptr, n, seed, trits, scales, nullptr, bucket);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     const uint32_t* seed, uint8_t* trits, float* scales, float* new_residual, int64_t bucket) {
  launch_encode<true>(stream, dt, x, residual, n, seed, trits, scales, new_residual, bucket);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    terngrad_decode_kernel(const uint8_t* __restrict__ trits, const float* __restrict__ scales, T* __restrict__ out,
                           int64_t n, int64_t m, int bucket_shift) {
  grid_stride(n, [&](int64_t e) {
    const int plane = static_cast<int>(e / m);
    const uint32_t digit = base3_digit(trits[e - plane * m], plane);
    out[e] = decoded<T>(terngrad_value(digit, scales[e >> bucket_shift]));
  });
}

void decode(cudaStream_t stream, DType dt, const uint8_t* trits, const float* scales, int64_t n, void* out,
            int64_t bucket) {
  with_type(dt, [&](auto tag) {
    terngrad_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(trits, scales, static_cast<decltype(tag)*>(out), n,
                                                                    base3_bytes(n), log2_int(bucket));
  });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), the trits being the codes
// ---------------------------------------------------------------------------
using Handlers = CudaPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kTerngradEncode, Handlers::encode<terngrad_check_encode, encode>);
JAXCOMP_REGISTER(kTerngradDecode, Handlers::decode<check_pair_decode<terngrad_sizes>, decode>);
JAXCOMP_REGISTER(kTerngradEncodeFeedback, Handlers::feedback<terngrad_check_encode, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
