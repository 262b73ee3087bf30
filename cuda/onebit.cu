// 1-bit SGD on CUDA: the handlers of kOnebitEncode and kOnebitDecode, with the
// buffers, checks and bytes of ffi/onebit.cc. The targets, bodies, sizes and
// checks in ffi/include/jaxcomp/onebit.h; twin in jaxcomp/codecs/onebit.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/onebit.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels and their launches
// ---------------------------------------------------------------------------

// The two sums of a bucket and its count of non-negative valid values, added
// together so that one pass and one shared-memory tree serve all three. The
// count is an integer sum, so the tree order does not matter for it.
struct OnebitAcc {
  float pos, neg;
  uint32_t npos;
};

__device__ __forceinline__ OnebitAcc operator+(const OnebitAcc& a, const OnebitAcc& b) {
  return OnebitAcc{a.pos + b.pos, a.neg + b.neg, a.npos + b.npos};
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    onebit_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                         uint8_t* __restrict__ bits, float* __restrict__ means, bool vec) {
  __shared__ OnebitAcc sm[kThreads];
  const Slot t = slot(g);
  const OnebitAcc part = lane_tree_sum<OnebitAcc>(g.lane_levels, [&](uint32_t j) {
    const int64_t i = t.start + t.lane + static_cast<int64_t>(j) * g.lanes;
    const float v = load1(x, i, n);
    const bool p = v >= 0.0f;  // NaN goes to the negative side and poisons avg-
    return OnebitAcc{p ? v : 0.0f, p ? 0.0f : v, (p && i < n) ? 1u : 0u};
  });
  const OnebitAcc sum = segment_tree(sm, part, t.lane, g.lanes, Plus{});
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) {
    const int64_t left = n - t.start;
    const uint32_t valid = static_cast<uint32_t>(left < g.bucket ? left : g.bucket);
    means[2 * t.bucket] = onebit_mean(sum.pos, sum.npos);
    means[2 * t.bucket + 1] = onebit_mean(sum.neg, valid - sum.npos);
  }
  uint8_t* out = bits + t.bucket * (g.bucket / 8);
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[j] >= 0.0f ? 1 : 0;
    pack8(c, 1, out + gi);
  }
}

// The bits are written one byte per thread, so only the input needs the
// alignment check.
void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, uint8_t* bits, float* means, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  with_type(dt, [&](auto tag) {
    const auto* xd = static_cast<const decltype(tag)*>(x);
    onebit_encode_kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, bits, means, aligned16(xd));
  });
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    onebit_decode_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ means, T* __restrict__ out,
                         int64_t n, int group_shift, bool vec) {
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    const int64_t b = gi >> group_shift;
    const float hi = means[2 * b], lo = means[2 * b + 1];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = unpack_code(bits + gi, 1, j) ? hi : lo;
  });
}

void decode(cudaStream_t stream, DType dt, const uint8_t* bits, const float* means, int64_t n, void* out,
            int64_t bucket) {
  with_type(dt, [&](auto tag) {
    auto* o = static_cast<decltype(tag)*>(out);
    onebit_decode_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(bits, means, o, n, log2_int(bucket / 8), aligned16(o));
  });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), the bits being the codes
// ---------------------------------------------------------------------------
using Handlers = CudaPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kOnebitEncode, Handlers::encode<check_pair_encode<onebit_sizes>, encode>);
JAXCOMP_REGISTER(kOnebitDecode, Handlers::decode<check_pair_decode<onebit_sizes, kBadMeans>, decode>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
