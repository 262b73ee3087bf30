// Scaled sign on CUDA: the handlers of kSignsgdEncode, kSignsgdDecode and
// kSignsgdEncodeFeedback, with the buffers, checks and bytes of ffi/signsgd.cc. The targets, bodies,
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
// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_range:
// the decoded values signsgd_value, as the decode kernel computes them).
template <typename T, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    signsgd_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, uint8_t* __restrict__ signs,
                          float* __restrict__ scales, float* __restrict__ new_residual, bool vec) {
  __shared__ float sm[kThreads];
  const Slot t = slot(g);
  // The halving tree of |v| over the zero-padded bucket: each lane's part,
  // then the lanes' parts in shared memory (kernels.cuh).
  const float part = lane_tree_sum<float>(g.lane_levels, [&](uint32_t j) {
    return fabsf(in.at(t.start + t.lane + static_cast<int64_t>(j) * g.lanes));
  });
  const float sum = segment_tree(sm, part, t.lane, g.lanes, Plus{});
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  const int64_t left = in.n - t.start;
  const float scale = signsgd_scale(sum, left < g.bucket ? left : g.bucket);
  if (t.lane == 0) scales[t.bucket] = scale;
  uint8_t* out = signs + t.bucket * (g.bucket / 8);
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    in.group(t.start + 8 * gi, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[j] < 0.0f ? 1 : 0;
    pack8(c, 1, out + gi);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = signsgd_value(c[j] != 0, scale);
      store_residual8(new_residual, t.start + 8 * gi, in.n, vec, v, hat);
    }
  }
}

// The tile encode (kernels.cuh) of buckets of at most 8 * 32 * kMaxTileGroups
// values: the signs, scales and residual of signsgd_encode_kernel, the
// input read once and the sum of |v| the same halving tree over the registers.
template <typename T, bool Feedback, int G>
__global__ void __launch_bounds__(kThreads)
    signsgd_encode_tile(Input<T, Feedback> in, int64_t num_buckets, int64_t bucket, int lanes_log2,
                        uint8_t* __restrict__ signs, float* __restrict__ scales, float* __restrict__ new_residual,
                        bool vec) {
  const TileSlot t = tile_slot(lanes_log2, bucket, num_buckets);
  float v[G][8];
  load_tile(in, t, vec, v);
  float a[G][8];
#pragma unroll
  for (int s = 0; s < G; ++s)
#pragma unroll
    for (int j = 0; j < 8; ++j) a[s][j] = fabsf(v[s][j]);
  const float sum = tile_tree_sum(a, t.lanes);
  if (!t.live) return;  // after the last shuffle
  const int64_t left = in.n - t.start;
  const float scale = signsgd_scale(sum, left < bucket ? left : bucket);
  if (t.lane == 0) scales[t.bucket] = scale;
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = v[s][j] < 0.0f ? 1 : 0;
    store_packed8(signs + i0 / 8, 1, vec, c);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = signsgd_value(c[j] != 0, scale);
      store_residual8(new_residual, i0, in.n, vec, v[s], hat);
    }
  }
}

// The encode (residual nullptr) or the encode under error feedback: the tile
// kernel where the bucket fits one, else the two-phase kernel. The signs are
// written one byte per thread, so only the input (and under error feedback
// the residuals) needs the alignment check.
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n, uint8_t* signs,
                   float* scales, float* new_residual, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  bool vec = aligned16(x);
  if constexpr (Feedback) vec = vec && aligned16(residual) && aligned16(new_residual);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    const bool tile = launch_tile<T, Feedback>(nb, bucket, [&](auto groups, unsigned blocks, int lanes_log2) {
      signsgd_encode_tile<T, Feedback, decltype(groups)::value>
          <<<blocks, kThreads, 0, stream>>>(in, nb, bucket, lanes_log2, signs, scales, new_residual, vec);
    });
    if (tile) return;
    const Geometry g = geometry(bucket);
    signsgd_encode_kernel<T, Feedback>
        <<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, signs, scales, new_residual, vec);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, uint8_t* signs, float* scales,
            int64_t bucket) {
  launch_encode<false>(stream, dt, x, nullptr, n, signs, scales, nullptr, bucket);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     uint8_t* signs, float* scales, float* new_residual, int64_t bucket) {
  launch_encode<true>(stream, dt, x, residual, n, signs, scales, new_residual, bucket);
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
JAXCOMP_REGISTER(kSignsgdEncodeFeedback, Handlers::feedback<check_pair_encode<signsgd_sizes>, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
