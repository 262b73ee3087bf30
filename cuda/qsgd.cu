// QSGD on CUDA: the handlers of kQsgdEncode, kQsgdDecode, kQsgdDecodeSum and
// kQsgdEncodeFeedback,
// with the buffers, checks and bytes of ffi/qsgd.cc. The targets, bodies,
// sizes and checks in ffi/include/jaxcomp/qsgd.h; twin in
// jaxcomp/codecs/qsgd.py. Nothing is
// synchronized or copied to the host: the seed and the scales stay in device
// memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda_runtime.cuh"
#include "jaxcomp/qsgd.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
// The encode, and with Feedback the encode of acc = float32(x) + residual
// that also writes the new residual acc - decoded (the CPU's feedback_range:
// the decoded values qsgd_value, as the decode kernel computes them).
template <typename T, bool L2, bool Feedback>
__global__ void __launch_bounds__(kThreads)
    qsgd_encode_kernel(Input<T, Feedback> in, int64_t num_buckets, Geometry g, int bits,
                       const uint32_t* __restrict__ seed, uint8_t* __restrict__ packed,
                       float* __restrict__ scales, float* __restrict__ new_residual, bool vec) {
  const Slot t = slot(g);
  float scale;
  if constexpr (L2) {
    __shared__ float sm[kThreads];
    const float part = lane_tree_sum<float>(g.lane_levels, [&](uint32_t j) {
      return exact_square(in.at(t.start + t.lane + static_cast<int64_t>(j) * g.lanes));
    });
    scale = sqrtf(segment_tree(sm, part, t.lane, g.lanes, Plus{}));
  } else {
    scale = bucket_max_abs(in, t.start, g, t.lane);
  }
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  if (t.lane == 0) scales[t.bucket] = scale;

  const int s = (1 << (bits - 1)) - 1;
  const float inv = qsgd_inv(scale, s);
  const uint32_t k0 = seed[0], k1 = seed[1];  // the seed stays on the device
  const int groups = g.bucket / 8;
  uint8_t* out = packed + t.bucket * groups * bits;
  for (int gi = t.lane; gi < groups; gi += g.lanes) {
    float v[8];
    in.group(t.start + 8 * gi, vec, v);
    uint8_t codes[8];
    // The element index wraps modulo 2^32 exactly like the CPU's uint32 base.
    const uint32_t base = static_cast<uint32_t>(t.start) + static_cast<uint32_t>(8 * gi);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      codes[j] = static_cast<uint8_t>(qsgd_code(v[j], inv, s, bits, rng_uniform(k0, k1, base + j)));
    // pack8 fits codes of up to 4 bits in its 32-bit word; 8-bit codes are
    // stored as they are (ffi/cpu_buckets.h: pack_bucket).
    if (bits == 8)
      store_bytes8(out + 8 * gi, vec, codes);
    else
      pack8(codes, bits, out + bits * gi);
    if constexpr (Feedback) {
      const float step = qsgd_step(scale, s);
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = qsgd_value(codes[j], step, bits);
      store_residual8(new_residual, t.start + 8 * gi, in.n, vec, v, hat);
    }
  }
}

// The tile encode (kernels.cuh) of buckets of at most 8 * 32 * kMaxTileGroups
// values: the codes, scales and residual of qsgd_encode_kernel, the input
// read once; the L2 norm is the same halving tree over the registers.
template <typename T, bool L2, bool Feedback, int G>
__global__ void __launch_bounds__(kThreads)
    qsgd_encode_tile(Input<T, Feedback> in, int64_t num_buckets, int64_t bucket, int lanes_log2, int bits,
                     const uint32_t* __restrict__ seed, uint8_t* __restrict__ packed, float* __restrict__ scales,
                     float* __restrict__ new_residual, bool vec) {
  const TileSlot t = tile_slot(lanes_log2, bucket, num_buckets);
  const uint32_t k0 = seed[0], k1 = seed[1];  // the seed stays on the device
  float v[G][8];
  load_tile(in, t, vec, v);
  float scale;
  if constexpr (L2) {
    float sq[G][8];
#pragma unroll
    for (int s = 0; s < G; ++s)
#pragma unroll
      for (int j = 0; j < 8; ++j) sq[s][j] = exact_square(v[s][j]);
    scale = sqrtf(tile_tree_sum(sq, t.lanes));
  } else {
    scale = tile_max_abs(v, t.lanes);
  }
  if (!t.live) return;  // after the last shuffle
  if (t.lane == 0) scales[t.bucket] = scale;
  const int s_levels = (1 << (bits - 1)) - 1;
  const float inv = qsgd_inv(scale, s_levels);
  const float step = qsgd_step(scale, s_levels);
#pragma unroll
  for (int s = 0; s < G; ++s) {
    const int64_t i0 = tile_group_start(t, s);
    // The element index wraps modulo 2^32 exactly like the CPU's uint32 base.
    const uint32_t base = static_cast<uint32_t>(i0);
    uint8_t codes[8];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      codes[j] = static_cast<uint8_t>(qsgd_code(v[s][j], inv, s_levels, bits, rng_uniform(k0, k1, base + j)));
    store_packed8(packed + (i0 / 8) * bits, bits, vec, codes);
    if constexpr (Feedback) {
      float hat[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) hat[j] = qsgd_value(codes[j], step, bits);
      store_residual8(new_residual, i0, in.n, vec, v[s], hat);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    qsgd_decode_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, int bits, bool vec) {
  const int s = (1 << (bits - 1)) - 1;
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    const float step = qsgd_step(scales[gi >> group_shift], s);
    if (bits == 8) {
      uint8_t c[8];
      load_bytes8(packed + 8 * gi, vec, c);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = qsgd_value(c[j], step, bits);
    } else {
      const uint8_t* group = packed + bits * gi;
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = qsgd_value(unpack_code(group, bits, j), step, bits);
    }
  });
}

// The sum, in row order, of `rows` float32 payloads of n values each: every
// group of 8 values decoded from each row as qsgd_decode_kernel decodes it
// and added left to right (--fmad=false: no contraction), with no row
// written out.
__global__ void __launch_bounds__(kThreads)
    qsgd_decode_sum_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                           float* __restrict__ out, int64_t n, int64_t rows, int64_t row_bytes, int64_t row_buckets,
                           int group_shift, int bits, bool vec) {
  const int s = (1 << (bits - 1)) - 1;
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    for (int64_t r = 0; r < rows; ++r) {
      const float step = qsgd_step(scales[r * row_buckets + (gi >> group_shift)], s);
      const uint8_t* row = packed + r * row_bytes;
      uint8_t c[8];
      if (bits == 8) {
        load_bytes8(row + 8 * gi, vec, c);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(unpack_code(row + bits * gi, bits, j));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x = qsgd_value(c[j], step, bits);
        v[j] = r == 0 ? x : v[j] + x;
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Handlers: encode and decode are the pair families' (cuda_runtime.cuh), one
// tensor at a time; decode_sum sums the rows of one call
// ---------------------------------------------------------------------------
// The encode (residual nullptr) or the encode under error feedback.
template <bool Feedback>
void launch_encode(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                   const uint32_t* seed, uint8_t* packed, float* scales, float* new_residual, int64_t bits,
                   int64_t bucket, int64_t l2) {
  const int64_t nb = num_buckets(n, bucket);
  const Geometry g = geometry(bucket);
  bool vec = aligned16(x) && aligned16(packed);
  if constexpr (Feedback) vec = vec && aligned16(residual) && aligned16(new_residual);
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const Input<T, Feedback> in{static_cast<const T*>(x), residual, n};
    const int b = static_cast<int>(bits);
    const bool tile = launch_tile<T, Feedback>(nb, bucket, [&](auto groups, unsigned blocks, int lanes_log2) {
      constexpr int G = decltype(groups)::value;
      auto kernel = l2 != 0 ? qsgd_encode_tile<T, true, Feedback, G> : qsgd_encode_tile<T, false, Feedback, G>;
      kernel<<<blocks, kThreads, 0, stream>>>(in, nb, bucket, lanes_log2, b, seed, packed, scales, new_residual, vec);
    });
    if (tile) return;
    auto kernel = l2 != 0 ? qsgd_encode_kernel<T, true, Feedback> : qsgd_encode_kernel<T, false, Feedback>;
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(in, nb, g, b, seed, packed, scales, new_residual, vec);
  });
}

void encode(cudaStream_t stream, DType dt, const void* x, int64_t n, const uint32_t* seed, uint8_t* packed,
            float* scales, int64_t bits, int64_t bucket, int64_t l2) {
  launch_encode<false>(stream, dt, x, nullptr, n, seed, packed, scales, nullptr, bits, bucket, l2);
}

void encode_feedback(cudaStream_t stream, DType dt, const void* x, const float* residual, int64_t n,
                     const uint32_t* seed, uint8_t* packed, float* scales, float* new_residual, int64_t bits,
                     int64_t bucket, int64_t l2) {
  launch_encode<true>(stream, dt, x, residual, n, seed, packed, scales, new_residual, bits, bucket, l2);
}

void decode(cudaStream_t stream, DType dt, const uint8_t* packed, const float* scales, int64_t n, void* out,
            int64_t bits, int64_t bucket) {
  with_type(dt, [&](auto tag) {
    auto* o = static_cast<decltype(tag)*>(out);
    const bool vec = aligned16(packed) && aligned16(o);
    qsgd_decode_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(packed, scales, o, n, log2_int(bucket / 8),
                                                                static_cast<int>(bits), vec);
  });
}

ffi::Error DecodeSumImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits, int64_t bucket) {
  const Stacked s(packed.dimensions(), scales.dimensions(), out->dimensions());
  const int64_t rows = s.rows(), n = s.n();
  if (const char* e = s.check(qsgd_check_decode(DType::kF32, n, s.bytes(), s.buckets(), bits, bucket)))
    return invalid(e);
  if (n == 0) return ffi::Error::Success();
  if (rows == 0) {
    cudaMemsetAsync(out->typed_data(), 0, n * sizeof(float), stream);
    return launched();
  }
  const uint8_t* p = packed.typed_data();
  float* o = out->typed_data();
  // Rows start 16-byte aligned when the codes of a row are a multiple of 16 bytes.
  const bool vec = aligned16(p) && aligned16(o) && s.bytes() % 16 == 0;
  qsgd_decode_sum_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(p, scales.typed_data(), o, n, rows, s.bytes(),
                                                                   s.buckets(), log2_int(bucket / 8),
                                                                   static_cast<int>(bits), vec);
  return launched();
}

using Handlers = CudaPairHandlers<ffi::U8, ffi::F32>;
JAXCOMP_REGISTER(kQsgdEncode, Handlers::encode<qsgd_check_encode, encode>);
JAXCOMP_REGISTER(kQsgdDecode, Handlers::decode<qsgd_check_decode, decode>);
JAXCOMP_REGISTER(kQsgdDecodeSum, DecodeSumImpl);
JAXCOMP_REGISTER(kQsgdEncodeFeedback, Handlers::feedback<qsgd_check_encode, encode_feedback>);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
