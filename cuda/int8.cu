// Int8 on CUDA: the handlers of kInt8Encode, kInt8Decode and
// kInt8EncodeFeedback, with the buffers,
// checks and bytes of ffi/int8.cc. The targets, bodies, sizes and checks in
// ffi/include/jaxcomp/int8.h; twin in jaxcomp/codecs/int8.py.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/int8.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels and their launches
// ---------------------------------------------------------------------------
// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_range:
// the decoded values int8_value, as the decode kernel computes them).
template <typename T, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    int8_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, int8_t* __restrict__ q,
                       float* __restrict__ scales, float* __restrict__ new_residual, bool vec) {
  const Slot t = slot(g);
  const float m = bucket_max_abs(in, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = int8_inv(m);
  uint8_t* out = reinterpret_cast<uint8_t*>(q) + t.start;
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    in.group(t.start + 8 * gi, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(int8_code(v[j], inv));
    store_bytes8(out + 8 * gi, vec, c);
    if constexpr (Feedback) {
      const float step = int8_step(m);
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = int8_value(static_cast<int8_t>(c[j]), step);
      store_residual8(new_residual, t.start + 8 * gi, in.n, vec, v, hat);
    }
  }
}

// The tile encode (kernels.cuh) of buckets of at most 8 * 32 * kMaxTileGroups
// values: the same codes, scales and residual, the input read once.
template <typename T, bool Feedback, int G>
__global__ void __launch_bounds__(kThreads)
    int8_encode_tile(Input<T, Feedback> in, int64_t num_buckets, int64_t bucket, int lanes_log2,
                     int8_t* __restrict__ q, float* __restrict__ scales, float* __restrict__ new_residual, bool vec) {
  const TileSlot t = tile_slot(lanes_log2, bucket, num_buckets);
  float v[G][8];
  load_tile(in, t, vec, v);
  const float m = tile_max_abs(v, t.lanes);
  if (!t.live) return;  // after the last shuffle
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = int8_inv(m);
  const float step = int8_step(m);
  uint8_t* out = reinterpret_cast<uint8_t*>(q);
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(int8_code(v[s][j], inv));
    store_bytes8(out + i0, vec, c);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = int8_value(static_cast<int8_t>(c[j]), step);
      store_residual8(new_residual, i0, in.n, vec, v[s], hat);
    }
  }
}

// The encode (residual nullptr) or the encode under error feedback: the tile
// kernel where the bucket fits one, else the two-phase kernel.
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n, int8_t* q,
                   float* scales, float* new_residual, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  bool vec = aligned16(x) && aligned16(q);
  if constexpr (Feedback) vec = vec && aligned16(residual) && aligned16(new_residual);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    const bool tile = launch_tile<T, Feedback>(nb, bucket, [&](auto groups, unsigned blocks, int lanes_log2) {
      int8_encode_tile<T, Feedback, decltype(groups)::value>
          <<<blocks, kThreads, 0, stream>>>(in, nb, bucket, lanes_log2, q, scales, new_residual, vec);
    });
    if (tile) return;
    const Geometry g = geometry(bucket);
    int8_encode_kernel<T, Feedback>
        <<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, q, scales, new_residual, vec);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, int8_t* q, float* scales, int64_t bucket) {
  launch_encode<false>(stream, dt, x, nullptr, n, q, scales, nullptr, bucket);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n, int8_t* q,
                     float* scales, float* new_residual, int64_t bucket) {
  launch_encode<true>(stream, dt, x, residual, n, q, scales, new_residual, bucket);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    int8_decode_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, bool vec) {
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    const float step = int8_step(scales[gi >> group_shift]);
    uint8_t c[8];
    load_bytes8(reinterpret_cast<const uint8_t*>(q) + 8 * gi, vec, c);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = int8_value(static_cast<int8_t>(c[j]), step);
  });
}

void decode(cudaStream_t stream, DType dt, const int8_t* q, const float* scales, int64_t n, void* out, int64_t bucket) {
  with_type(dt, [&](auto tag) {
    auto* o = static_cast<decltype(tag)*>(out);
    int8_decode_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(q, scales, o, n, log2_int(bucket / 8),
                                                                aligned16(q) && aligned16(o));
  });
}

// ---------------------------------------------------------------------------
// Handlers: the pair families' (cuda_runtime.cuh), q being the codes
// ---------------------------------------------------------------------------
using Handlers = CudaPairHandlers<ffi::S8, ffi::F32>;
JAXCOMP_REGISTER(kInt8Encode, Handlers::encode<check_pair_encode<int8_sizes>, encode>);
JAXCOMP_REGISTER(kInt8Decode, Handlers::decode<check_pair_decode<int8_sizes>, decode>);
JAXCOMP_REGISTER(kInt8EncodeFeedback, Handlers::feedback<check_pair_encode<int8_sizes>, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
