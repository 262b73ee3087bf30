// TernGrad on CUDA: the handlers of kTerngradEncode and kTerngradDecode, with
// the buffers, checks and bytes of ffi/terngrad.cc. The targets, bodies, sizes
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
// Phase 1, one segment per bucket: the scale (an integer max, any order).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    terngrad_scales_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                           float* __restrict__ scales) {
  const Slot t = slot(g);
  const float scale = bucket_max_abs(x, n, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) scales[t.bucket] = scale;
}

// Phase 2, a grid-stride loop over the m bytes: byte i reads element j*m + i
// of each plane j (coalesced per plane) and the scale of its bucket, which
// phase 1 wrote earlier on the same stream.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    terngrad_pack_kernel(const T* __restrict__ x, int64_t n, int64_t m, int bucket_shift,
                         const float* __restrict__ scales, const uint32_t* __restrict__ seed,
                         uint8_t* __restrict__ trits) {
  const uint32_t k0 = seed[0], k1 = seed[1];
  grid_stride(m, [&](int64_t i) {
    uint32_t d[5];
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      const int64_t e = j * m + i;
      d[j] = 1u;  // the padding past n is the trit 0
      if (e < n) {
        const float inv = terngrad_inv(scales[e >> bucket_shift]);
        d[j] = terngrad_digit(to_f32(x[e]), inv, rng_uniform(k0, k1, static_cast<uint32_t>(e)));
      }
    }
    trits[i] = base3_pack(d[0], d[1], d[2], d[3], d[4]);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* trits,
            float* scales, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    const auto* xd = static_cast<const decltype(tag)*>(x);
    terngrad_scales_kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, scales);
    terngrad_pack_kernel<<<item_blocks(base3_bytes(n)), kThreads, 0, stream>>>(xd, n, base3_bytes(n), log2_int(bucket),
                                                                              scales, seed, trits);
  });
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

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
