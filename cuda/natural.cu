// Natural compression on CUDA: the handlers of kNaturalEncode and
// kNaturalDecode, with the buffers, checks and bytes of ffi/natural.cc. The
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
template <typename T, bool STOCHASTIC>
__global__ void __launch_bounds__(kThreads)
    natural_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                          const uint32_t* __restrict__ seed, uint8_t* __restrict__ codes,
                          uint8_t* __restrict__ tops) {
  __shared__ uint32_t sm[kThreads];
  const Slot t = slot(g);
  uint32_t m = 0;
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const uint32_t a = natural_finite_abs(load1(x, t.start + e, n));
    m = a > m ? a : m;
  }
  m = segment_tree(sm, m, t.lane, g.lanes, Max{});
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  const uint32_t top = (m >> 23) + 1u;
  if (t.lane == 0) tops[t.bucket] = static_cast<uint8_t>(top);
  const uint32_t cap = natural_cap<T>();
  const uint32_t k0 = seed[0], k1 = seed[1];
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const int64_t i = t.start + e;
    if (i >= n) break;
    const uint32_t rb = STOCHASTIC ? rng_bits(k0, k1, static_cast<uint32_t>(i)) : 0u;
    codes[i] = static_cast<uint8_t>(natural_code(to_f32(x[i]), top, cap, STOCHASTIC, rb));
  }
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* codes,
            uint8_t* tops, int64_t bucket, int64_t stochastic) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    auto kernel = stochastic != 0 ? natural_encode_kernel<T, true> : natural_encode_kernel<T, false>;
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(static_cast<const T*>(x), n, nb, g, seed, codes, tops);
  });
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

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
