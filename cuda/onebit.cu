// 1-bit SGD on CUDA: the handlers of kOnebitEncode, kOnebitDecode and
// kOnebitEncodeFeedback, with the buffers, checks and bytes of ffi/onebit.cc. The targets, bodies, sizes and
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

// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_body:
// the decoded values, hi or lo, as the decode kernel writes them).
template <typename T, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    onebit_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, uint8_t* __restrict__ bits,
                         float* __restrict__ means, float* __restrict__ new_residual, bool vec) {
  __shared__ OnebitAcc sm[kThreads];
  const Slot t = slot(g);
  const OnebitAcc part = lane_tree_sum<OnebitAcc>(g.lane_levels, [&](uint32_t j) {
    const int64_t i = t.start + t.lane + static_cast<int64_t>(j) * g.lanes;
    const float v = in.at(i);
    const bool p = v >= 0.0f;  // NaN goes to the negative side and poisons avg-
    return OnebitAcc{p ? v : 0.0f, p ? 0.0f : v, (p && i < in.n) ? 1u : 0u};
  });
  // Every thread of the segment gets the sums, so each has the means.
  const OnebitAcc sum = segment_tree(sm, part, t.lane, g.lanes, Plus{});
  if (t.bucket >= num_buckets) return;
  const int64_t left = in.n - t.start;
  const uint32_t valid = static_cast<uint32_t>(left < g.bucket ? left : g.bucket);
  const float hi = onebit_mean(sum.pos, sum.npos), lo = onebit_mean(sum.neg, valid - sum.npos);
  if (t.lane == 0) {
    means[2 * t.bucket] = hi;
    means[2 * t.bucket + 1] = lo;
  }
  uint8_t* out = bits + t.bucket * (g.bucket / 8);
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    in.group(t.start + 8 * gi, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[j] >= 0.0f ? 1 : 0;
    pack8(c, 1, out + gi);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = c[j] ? hi : lo;
      store_residual8(new_residual, t.start + 8 * gi, in.n, vec, v, hat);
    }
  }
}

// The tile encode (kernels.cuh) of buckets of at most 8 * 32 * kMaxTileGroups
// values: the bits, means and residual of onebit_encode_kernel, the input
// read once and the sums the same halving tree over the registers.
template <typename T, bool Feedback, int G>
__global__ void __launch_bounds__(kThreads)
    onebit_encode_tile(Input<T, Feedback> in, int64_t num_buckets, int64_t bucket, int lanes_log2,
                       uint8_t* __restrict__ bits, float* __restrict__ means, float* __restrict__ new_residual,
                       bool vec) {
  const TileSlot t = tile_slot(lanes_log2, bucket, num_buckets);
  float v[G][8];
  load_tile(in, t, vec, v);
  OnebitAcc a[G][8];
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const bool p = v[s][j] >= 0.0f;  // NaN goes to the negative side and poisons avg-
      a[s][j] = OnebitAcc{p ? v[s][j] : 0.0f, p ? 0.0f : v[s][j], (p && i0 + j < in.n) ? 1u : 0u};
    }
  }
  const OnebitAcc sum = tile_tree_sum(a, t.lanes);
  if (!t.live) return;  // after the last shuffle
  const int64_t left = in.n - t.start;
  const uint32_t valid = static_cast<uint32_t>(left < bucket ? left : bucket);
  const float hi = onebit_mean(sum.pos, sum.npos), lo = onebit_mean(sum.neg, valid - sum.npos);
  if (t.lane == 0) {
    means[2 * t.bucket] = hi;
    means[2 * t.bucket + 1] = lo;
  }
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[s][j] >= 0.0f ? 1 : 0;
    store_packed8(bits + i0 / 8, 1, vec, c);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = c[j] ? hi : lo;
      store_residual8(new_residual, i0, in.n, vec, v[s], hat);
    }
  }
}

// The encode (residual nullptr) or the encode under error feedback: the tile
// kernel where the bucket fits one, else the two-phase kernel. The bits are
// written one byte per thread, so only the input (and the residuals) need
// the alignment check.
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n, uint8_t* bits,
                   float* means, float* new_residual, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  bool vec = aligned16(x);
  if constexpr (Feedback) vec = vec && aligned16(residual) && aligned16(new_residual);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    const bool tile = launch_tile<T, Feedback>(nb, bucket, [&](auto groups, unsigned blocks, int lanes_log2) {
      onebit_encode_tile<T, Feedback, decltype(groups)::value>
          <<<blocks, kThreads, 0, stream>>>(in, nb, bucket, lanes_log2, bits, means, new_residual, vec);
    });
    if (tile) return;
    const Geometry g = geometry(bucket);
    onebit_encode_kernel<T, Feedback>
        <<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, bits, means, new_residual, vec);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, uint8_t* bits, float* means, int64_t bucket) {
  launch_encode<false>(stream, dt, x, nullptr, n, bits, means, nullptr, bucket);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     uint8_t* bits, float* means, float* new_residual, int64_t bucket) {
  launch_encode<true>(stream, dt, x, residual, n, bits, means, new_residual, bucket);
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
JAXCOMP_REGISTER(kOnebitEncodeFeedback, Handlers::feedback<check_pair_encode<onebit_sizes>, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
