// Scaled sign on CUDA: the handlers of kSignsgdEncode and kSignsgdDecode,
// with the buffers, checks and bytes of ffi/signsgd.cc. The targets, bodies,
// sizes and checks in ffi/include/jaxcomp/signsgd.h; twin in
// jaxcomp/codecs/signsgd.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/signsgd.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels and their launches
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    signsgd_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                          uint8_t* __restrict__ signs, float* __restrict__ scales, bool vec) {
  __shared__ float sm[kThreads];
  const Slot t = slot(g);
  // The halving tree of |v| over the zero-padded bucket: each lane's part,
  // then the lanes' parts in shared memory (kernels.cuh).
  const float part = lane_tree_sum<float>(g.lane_levels, [&](uint32_t j) {
    return fabsf(load1(x, t.start + t.lane + static_cast<int64_t>(j) * g.lanes, n));
  });
  const float sum = segment_tree(sm, part, t.lane, g.lanes, Plus{});
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  if (t.lane == 0) {
    const int64_t left = n - t.start;
    scales[t.bucket] = signsgd_scale(sum, left < g.bucket ? left : g.bucket);
  }
  uint8_t* out = signs + t.bucket * (g.bucket / 8);
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[j] < 0.0f ? 1 : 0;
    pack8(c, 1, out + gi);
  }
}

// The signs are written one byte per thread, so only the input needs the
// alignment check.
void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, uint8_t* signs, float* scales,
            int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    const auto* xd = static_cast<const decltype(tag)*>(x);
    signsgd_encode_kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, signs, scales,
                                                                           aligned16(xd));
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    signsgd_decode_kernel(const uint8_t* __restrict__ signs, const float* __restrict__ scales,
                          T* __restrict__ out, int64_t n, int group_shift, bool vec) {
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    const float scale = scales[gi >> group_shift];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = signsgd_value(unpack_code(signs + gi, 1, j) != 0, scale);
  });
}

void decode(cudaStream_t stream, DType dt, const uint8_t* signs, const float* scales, int64_t n, void* out,
            int64_t bucket) {
  with_type(dt, [&](auto tag) {
    auto* o = static_cast<decltype(tag)*>(out);
    signsgd_decode_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(signs, scales, o, n, log2_int(bucket / 8),
                                                                     aligned16(o));
  });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), the signs being the codes
// ---------------------------------------------------------------------------
using Handlers = CudaPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kSignsgdEncode, Handlers::encode<check_pair_encode<signsgd_sizes>, encode>);
JAXCOMP_REGISTER(kSignsgdDecode, Handlers::decode<check_pair_decode<signsgd_sizes>, decode>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
