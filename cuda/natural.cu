// Natural compression on CUDA: the handlers of kNaturalEncode,
// kNaturalDecode and kNaturalEncodeFeedback, with the buffers, checks and bytes of ffi/natural.cc. The
// targets, bodies, sizes and checks in ffi/include/jaxcomp/natural.h; twin in
// jaxcomp/codecs/natural.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/natural.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels and their launches
// ---------------------------------------------------------------------------
// The encode, and with Feedback the encode of acc = float32(x) + residual
// (coded as a float32 tensor is: natural_cap<float>) that also writes the
// new residual acc - decoded (the CPU's feedback_t: the decoded values
// natural_value, as the decode kernel computes them).
template <typename T, bool STOCHASTIC, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    natural_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, const uint32_t* __restrict__ seed,
                          uint8_t* __restrict__ codes, uint8_t* __restrict__ tops, float* __restrict__ new_residual) {
  __shared__ uint32_t sm[kThreads];
  const Slot t = slot(g);
  uint32_t m = 0;
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const uint32_t a = natural_finite_abs(in.at(t.start + e));
    m = a > m ? a : m;
  }
  m = segment_tree(sm, m, t.lane, g.lanes, Max{});
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  const uint32_t top = (m >> 23) + 1u;
  if (t.lane == 0) tops[t.bucket] = static_cast<uint8_t>(top);
  const uint32_t cap = Feedback ? natural_cap<float>() : natural_cap<T>();
  const uint32_t k0 = seed[0], k1 = seed[1];
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const int64_t i = t.start + e;
    if (i >= in.n) break;
    const float v = in.at(i);
    const uint32_t rb = STOCHASTIC ? rng_bits(k0, k1, static_cast<uint32_t>(i)) : 0u;
    const uint32_t code = natural_code(v, top, cap, STOCHASTIC, rb);
    codes[i] = static_cast<uint8_t>(code);
    if constexpr (Feedback) new_residual[i] = v - canonical_nan(natural_value(code & 0xffu, top));
  }
}

template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                   const uint32_t* seed, uint8_t* codes, uint8_t* tops, float* new_residual, int64_t bucket,
                   int64_t stochastic) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    auto kernel =
        stochastic != 0 ? natural_encode_kernel<T, true, Feedback> : natural_encode_kernel<T, false, Feedback>;
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, seed, codes, tops, new_residual);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* codes,
            uint8_t* tops, int64_t bucket, int64_t stochastic) {
  launch_encode<false>(stream, dt, x, nullptr, n, seed, codes, tops, nullptr, bucket, stochastic);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     const uint32_t* seed, uint8_t* codes, uint8_t* tops, float* new_residual, int64_t bucket,
                     int64_t stochastic) {
  launch_encode<true>(stream, dt, x, residual, n, seed, codes, tops, new_residual, bucket, stochastic);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    natural_decode_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ tops, T* __restrict__ out,
                          int64_t n, int bucket_shift) {
  grid_stride(n, [&](int64_t e) { out[e] = decoded<T>(natural_value(codes[e], tops[e >> bucket_shift])); });
}

void decode(cudaStream_t stream, DType dt, const uint8_t* codes, const uint8_t* tops, int64_t n, void* out,
            int64_t bucket) {
  with_type(dt, [&](auto tag) {
    natural_decode_kernel<<<item_blocks(n), kThreads, 0, stream>>>(codes, tops, static_cast<decltype(tag)*>(out), n,
                                                                   log2_int(bucket));
  });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh)
// ---------------------------------------------------------------------------
using Handlers = CudaPairHandlers<ffi::U8, ffi::U8>;
JAXCOMP_REGISTER(kNaturalEncode, Handlers::encode<natural_check_encode, encode>);
JAXCOMP_REGISTER(kNaturalDecode, Handlers::decode<check_pair_decode<natural_sizes, kBadTops>, decode>);
JAXCOMP_REGISTER(kNaturalEncodeFeedback, Handlers::feedback<natural_check_encode, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
