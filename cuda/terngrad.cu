// TernGrad on CUDA: the targets jaxcomp_terngrad_encode and
// jaxcomp_terngrad_decode, with the buffers, checks and bytes of
// ffi/terngrad.cc. Bodies, sizes and checks in ffi/include/jaxcomp/terngrad.h;
// twin in jaxcomp/codecs/terngrad.py. Encode is two launches on one stream: the
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

void decode(cudaStream_t stream, DType dt, const uint8_t* trits, const float* scales, int64_t n, int64_t bucket,
            void* out) {
  with_type(dt, [&](auto tag) {
    terngrad_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(trits, scales, static_cast<decltype(tag)*>(out), n,
                                                                    base3_bytes(n), log2_int(bucket));
  });
}

// ---------------------------------------------------------------------------
// Handlers: decode is the pair families' (cuda_runtime.cuh)
// ---------------------------------------------------------------------------
using Handlers = PairHandlers<ffi::U8, ffi::F32>;
constexpr char kDecode[] = "jaxcomp_terngrad_decode";
JAXCOMP_REGISTER(kDecode, (Handlers::decode<kDecode, terngrad_check_decode, decode>));

ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> trits, ffi::ResultBuffer<ffi::F32> scales, int64_t bucket) {
  const Batch b(x, seed, *trits, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = terngrad_check_encode(dt, n, b.count(1), b.count(2), b.count(3), bucket);
  return launch_batch("jaxcomp_terngrad_encode", b, error, n, [&](int64_t i) {
    const int64_t nb = num_buckets(n, bucket);
    const Geometry g = geometry(bucket);
    float* s = b.at<float>(3, i);
    with_type(dt, [&](auto tag) {
      const auto* xd = b.at<const decltype(tag)>(0, i);
      terngrad_scales_kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, s);
      terngrad_pack_kernel<<<item_blocks(base3_bytes(n)), kThreads, 0, stream>>>(
          xd, n, base3_bytes(n), log2_int(bucket), s, b.at<const uint32_t>(1, i), b.at<uint8_t>(2, i));
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaTerngradEncode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // base-3^5 bytes, ceil(n/5)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));  // power of two
JAXCOMP_REGISTER("jaxcomp_terngrad_encode", JaxcompCudaTerngradEncode);
