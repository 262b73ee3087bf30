// CUDA kernels over the shared bodies of ffi/include/jaxcomp/codecs.h.
//
// This file holds device code only (no launches, no XLA), so that the FFI
// handlers in cuda_ops.cu stay thin. Each kernel produces exactly the bytes of
// the CPU loops in ffi/cpu_kernels.inc; the comments say where the mapping of
// work to threads has to respect the CPU's order of operations.
//
// Layout of the encode kernels. Every block has kThreads threads. A bucket of
// B values is handled by `lanes = min(B / 8, kThreads)` threads (a segment),
// and a block holds kThreads / lanes segments, so small buckets still fill a
// block. The work comes in two phases:
//   1. the per-bucket scale: lane l reduces the strided values
//      l, l + lanes, l + 2 * lanes, ... in registers, then the segment reduces
//      its `lanes` partials in shared memory;
//   2. the codes: each thread encodes groups of 8 consecutive values (the unit
//      of pack8) and writes their packed bytes. For B <= 2048 that is exactly
//      one group per thread.
// The decode and cast kernels are flat grid-stride loops over groups of 8.
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxcomp/int8.h"
#include "jaxcomp/natural.h"
#include "jaxcomp/onebit.h"
#include "jaxcomp/qsgd.h"
#include "jaxcomp/terngrad.h"

namespace jaxcomp {
namespace cuda {

constexpr int kThreads = 256;
// Tree levels a lane reduces on its own: log2(65536 / kThreads).
constexpr int kMaxLaneLevels = 8;

// How the buckets of an encode map onto blocks (see the top of this file).
struct Geometry {
  int bucket;       // B, a power of two in [8, 65536]
  int lanes;        // threads per bucket, min(B / 8, kThreads)
  int lane_levels;  // log2(B / lanes): tree levels each lane reduces alone
  int per_block;    // buckets per block, kThreads / lanes
};

// ---------------------------------------------------------------------------
// Loads and stores of groups of 8 consecutive elements. `vec` says that the
// base pointers are 16-byte aligned; a group starts at a multiple of 8
// elements, so it is then aligned for 16-byte accesses too. Elements at or
// past n read as 0 (the zero padding of the last bucket) and are not written.
// ---------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ float load1(const T* __restrict__ x, int64_t i, int64_t n) {
  return i < n ? to_f32(x[i]) : 0.0f;
}

__device__ __forceinline__ uint16_t lo16(uint32_t w) { return static_cast<uint16_t>(w & 0xffffu); }
__device__ __forceinline__ uint16_t hi16(uint32_t w) { return static_cast<uint16_t>(w >> 16); }

template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ x, int64_t i0, int64_t n, bool vec, float v[8]) {
  if (vec && i0 + 8 <= n) {
    if constexpr (sizeof(T) == 4) {
      const float4 a = *reinterpret_cast<const float4*>(x + i0);
      const float4 b = *reinterpret_cast<const float4*>(x + i0 + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
      v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
      // Two 16-bit elements per word, the lower address in the low half.
      const uint4 w = *reinterpret_cast<const uint4*>(x + i0);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = to_f32(T{lo16(words[k])});
        v[2 * k + 1] = to_f32(T{hi16(words[k])});
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = load1(x, i0 + j, n);
}

template <typename T>
__device__ __forceinline__ uint32_t bits16_pair(float a, float b) {
  return static_cast<uint32_t>(from_f32<T>(a).bits) | (static_cast<uint32_t>(from_f32<T>(b).bits) << 16);
}

template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ out, int64_t i0, int64_t n, bool vec, const float v[8]) {
  if (vec && i0 + 8 <= n) {
    if constexpr (sizeof(T) == 4) {
      *reinterpret_cast<float4*>(out + i0) = make_float4(v[0], v[1], v[2], v[3]);
      *reinterpret_cast<float4*>(out + i0 + 4) = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      *reinterpret_cast<uint4*>(out + i0) = make_uint4(bits16_pair<T>(v[0], v[1]), bits16_pair<T>(v[2], v[3]),
                                                       bits16_pair<T>(v[4], v[5]), bits16_pair<T>(v[6], v[7]));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (i0 + j < n) out[i0 + j] = from_f32<T>(v[j]);
}

// 8 one-byte codes as they are stored when no packing applies (8-bit QSGD,
// Int8): one 8-byte store when aligned.
__device__ __forceinline__ void store_bytes8(uint8_t* __restrict__ out, bool vec, const uint8_t c[8]) {
  if (vec) {
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j / 4] |= static_cast<uint32_t>(c[j]) << (8 * (j % 4));
    *reinterpret_cast<uint2*>(out) = make_uint2(w[0], w[1]);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = c[j];
}

__device__ __forceinline__ void load_bytes8(const uint8_t* __restrict__ in, bool vec, uint8_t c[8]) {
  if (vec) {
    const uint2 w = *reinterpret_cast<const uint2*>(in);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      c[j] = static_cast<uint8_t>(w.x >> (8 * j));
      c[j + 4] = static_cast<uint8_t>(w.y >> (8 * j));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) c[j] = in[j];
}

// ---------------------------------------------------------------------------
// Sums in the halving-tree order of codecs.h.
//
// The tree over a bucket of B values, `for (w = B/2; w >= 1; w /= 2)
// a[i] += a[i + w]`, splits at any power of two L <= B: the levels w >= L only
// ever add values whose indices agree modulo L, so after them a[l] (l < L) is
// the halving tree over the strided values l, l + L, l + 2L, ...; the levels
// w < L are then the halving tree over a[0..L). With L = lanes, lane l computes
// the first part alone and the segment does the second in shared memory.
// ---------------------------------------------------------------------------

// Lane part. The halving tree over v[0..R) equals the pairwise sum of v in
// bit-reversed index order (the last addition joins the even-indexed half to
// the odd-indexed half, recursively), and a pairwise sum can be streamed with
// one pending partial per level, like a binary counter: value k completes
// levels 0, 1, ... while bit l of k is set, each time as pending[l] + s with
// the earlier (lower-index) partial on the left as in a[i] + a[i + w]. So the
// lane never holds more than `levels` partials, all in registers.
template <typename V, typename F>
__device__ __forceinline__ V lane_tree_sum(int levels, F value) {
  V pending[kMaxLaneLevels] = {};  // each read follows its write; the init only quiets compilers
  V s{};
  const uint32_t count = 1u << levels;
  for (uint32_t k = 0; k < count; ++k) {
    s = value(levels > 0 ? __brev(k) >> (32 - levels) : 0u);
    // Written without `break` so that the loop unrolls and pending[] stays in
    // registers. After the last value every level carries: s is the total.
    bool carry = true;
#pragma unroll
    for (int l = 0; l < kMaxLaneLevels; ++l) {
      if (carry && l < levels) {
        if ((k >> l) & 1u) {
          s = pending[l] + s;
        } else {
          pending[l] = s;
          carry = false;
        }
      }
    }
  }
  return s;
}

// Segment part: the halving tree over the `lanes` partials of each segment
// (lanes is a power of two and segments are aligned to it). Every thread of
// the block must call it; every thread gets its segment's result.
template <typename V, typename Op>
__device__ __forceinline__ V segment_tree(V* sm, V v, int lane, int lanes, Op op) {
  const int tid = static_cast<int>(threadIdx.x);
  sm[tid] = v;
  __syncthreads();
  for (int w = lanes / 2; w >= 1; w /= 2) {
    if (lane < w) sm[tid] = op(sm[tid], sm[tid + w]);
    __syncthreads();
  }
  const V r = sm[tid - lane];
  __syncthreads();  // before anyone writes sm again
  return r;
}

struct Plus {
  template <typename V>
  __device__ __forceinline__ V operator()(V a, V b) const {
    return a + b;
  }
};

struct Max {
  __device__ __forceinline__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

// max|x| over the bucket as abs_bits: an integer max, so any order gives the
// same (exact) result and the segment tree is used only to combine lanes.
template <typename T>
__device__ __forceinline__ float bucket_max_abs(const T* __restrict__ x, int64_t n, int64_t start,
                                                const Geometry& g, int lane) {
  __shared__ uint32_t sm[kThreads];
  uint32_t m = 0;
  for (int e = lane; e < g.bucket; e += g.lanes) {
    const uint32_t a = abs_bits(load1(x, start + e, n));
    m = a > m ? a : m;
  }
  return bits_f32(segment_tree(sm, m, lane, g.lanes, Max{}));
}

// The segment and lane of this thread, and its bucket.
struct Slot {
  int lane;
  int64_t bucket;  // may be >= the bucket count in the last block
  int64_t start;   // first element of the bucket
};

__device__ __forceinline__ Slot slot(const Geometry& g) {
  const int tid = static_cast<int>(threadIdx.x);
  Slot s;
  s.lane = tid & (g.lanes - 1);
  s.bucket = static_cast<int64_t>(blockIdx.x) * g.per_block + tid / g.lanes;
  s.start = s.bucket * g.bucket;
  return s;
}

// ---------------------------------------------------------------------------
// QSGD (cpu_kernels.inc: qsgd_encode_t / qsgd_decode_t)
// ---------------------------------------------------------------------------
template <typename T, bool L2>
__global__ void __launch_bounds__(kThreads)
    qsgd_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g, int bits,
                       const uint32_t* __restrict__ seed, uint8_t* __restrict__ packed,
                       float* __restrict__ scales, bool vec) {
  const Slot t = slot(g);
  float scale;
  if constexpr (L2) {
    __shared__ float sm[kThreads];
    const float part = lane_tree_sum<float>(g.lane_levels, [&](uint32_t j) {
      const float v = load1(x, t.start + t.lane + static_cast<int64_t>(j) * g.lanes, n);
      return exact_square(v);
    });
    scale = sqrtf(segment_tree(sm, part, t.lane, g.lanes, Plus{}));
  } else {
    scale = bucket_max_abs(x, n, t.start, g, t.lane);
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
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t codes[8];
    // The element index wraps modulo 2^32 exactly like the CPU's uint32 base.
    const uint32_t base = static_cast<uint32_t>(t.start) + static_cast<uint32_t>(8 * gi);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      codes[j] = static_cast<uint8_t>(qsgd_code(v[j], inv, s, bits, rng_uniform(k0, k1, base + j)));
    // pack8 fits codes of up to 4 bits in its 32-bit word; 8-bit codes are
    // stored as they are (cpu_kernels.inc: pack_bucket).
    if (bits == 8)
      store_bytes8(out + 8 * gi, vec, codes);
    else
      pack8(codes, bits, out + bits * gi);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    qsgd_decode_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, int bits, bool vec) {
  const int s = (1 << (bits - 1)) - 1;
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float step = qsgd_step(scales[gi >> group_shift], s);
    float v[8];
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
    store8(out, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// Int8 (cpu_kernels.inc: int8_encode / int8_decode)
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads)
    int8_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g,
                       int8_t* __restrict__ q, float* __restrict__ scales, bool vec) {
  const Slot t = slot(g);
  const float m = bucket_max_abs(x, n, t.start, g, t.lane);
  if (t.bucket >= num_buckets) return;
  if (t.lane == 0) scales[t.bucket] = m;
  const float inv = int8_inv(m);
  uint8_t* out = reinterpret_cast<uint8_t*>(q) + t.start;
  for (int gi = t.lane; gi < g.bucket / 8; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t c[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(int8_code(v[j], inv));
    store_bytes8(out + 8 * gi, vec, c);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    int8_decode_kernel(const int8_t* __restrict__ q, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float step = int8_step(scales[gi >> group_shift]);
    uint8_t c[8];
    load_bytes8(reinterpret_cast<const uint8_t*>(q) + 8 * gi, vec, c);
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = int8_value(static_cast<int8_t>(c[j]), step);
    store8(out, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// 1-bit SGD (cpu_kernels.inc: onebit_encode / onebit_decode)
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

template <typename T>
__global__ void __launch_bounds__(kThreads)
    onebit_decode_kernel(const uint8_t* __restrict__ bits, const float* __restrict__ means, T* __restrict__ out,
                         int64_t n, int group_shift, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t b = gi >> group_shift;
    const float hi = means[2 * b], lo = means[2 * b + 1];
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = unpack_code(bits + gi, 1, j) ? hi : lo;
    store8(out, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// Float casts (cpu_kernels.inc: cast_t)
// ---------------------------------------------------------------------------
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const In* __restrict__ x, Out* __restrict__ y, int64_t n, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v[8];
    load8(x, 8 * gi, n, vec, v);
    store8(y, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// TernGrad (cpu_kernels.inc: terngrad_scales / terngrad_pack / terngrad_decode)
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
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < m;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
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
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    terngrad_decode_kernel(const uint8_t* __restrict__ trits, const float* __restrict__ scales, T* __restrict__ out,
                           int64_t n, int64_t m, int bucket_shift) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int plane = static_cast<int>(e / m);
    const uint32_t digit = base3_digit(trits[e - plane * m], plane);
    out[e] = from_f32<T>(terngrad_value(digit, scales[e >> bucket_shift]));
  }
}

// ---------------------------------------------------------------------------
// Natural compression (cpu_kernels.inc: natural_encode_t / natural_decode_t)
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
  const uint32_t cap = sizeof(T) == 2 && !std::is_same<T, bf16_t>::value ? 142u : 254u;
  const uint32_t k0 = seed[0], k1 = seed[1];
  for (int e = t.lane; e < g.bucket; e += g.lanes) {
    const int64_t i = t.start + e;
    if (i >= n) break;
    const uint32_t rb = STOCHASTIC ? rng_bits(k0, k1, static_cast<uint32_t>(i)) : 0u;
    codes[i] = static_cast<uint8_t>(natural_code(to_f32(x[i]), top, cap, STOCHASTIC, rb));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    natural_decode_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ tops, T* __restrict__ out,
                          int64_t n, int bucket_shift) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    out[e] = from_f32<T>(natural_value(codes[e], tops[e >> bucket_shift]));
  }
}

}  // namespace cuda
}  // namespace jaxcomp
