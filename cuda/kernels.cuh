// Device building blocks that the bucketed families' kernels share (cuda/qsgd.cu,
// int8.cu, onebit.cu, cast.cu, terngrad.cu, natural.cu, signsgd.cu): loads and stores of
// groups of 8 elements, sums in the halving-tree order of common.h, max|x|
// and the map of buckets onto blocks. Device code only, no XLA. Each kernel
// produces exactly the bytes of its family's CPU loops (ffi/<family>.cc); the
// comments say where the mapping of work to threads has to respect the CPU's
// order of operations.
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
// The decode and cast kernels are flat grid-stride loops over groups of 8
// (store_groups).
#pragma once

#include <cstdint>
#include <type_traits>

#include "jaxcomp/common.h"

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
// Grid-stride loops.
// ---------------------------------------------------------------------------
// fn(i) for every i in [0, count), spread over the grid of kThreads-thread
// blocks.
template <typename F>
__device__ __forceinline__ void grid_stride(int64_t count, F fn) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    fn(i);
}

// The loop of the decode and cast kernels: value(gi, v) writes the 8 values
// of group gi (elements 8gi .. 8gi+7) of the output into v, which are stored;
// a decoder's NaNs as common.h's NaN rule says (Canonical), a cast's as they are.
template <bool Canonical = true, typename T, typename F>
__device__ __forceinline__ void store_groups(T* __restrict__ out, int64_t n, bool vec, F value) {
  grid_stride((n + 7) / 8, [&](int64_t gi) {
    float v[8];
    value(gi, v);
    if constexpr (Canonical) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = canonical_nan(v[j]);
    }
    store8(out, 8 * gi, n, vec, v);
  });
}

// ---------------------------------------------------------------------------
// Sums in the halving-tree order of common.h.
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

// What an encode kernel compresses: x itself, or under error feedback (the
// encode_feedback targets) acc = float32(x) + residual, one float32 add per
// element, as the CPU's load_sum forms it (ffi/cpu_buckets.h). Elements at
// or past n read as 0 (+0.0 + +0.0 under error feedback: the CPU's zero
// padding, to the bit).
template <typename T, bool Feedback>
struct Input {
  const T* __restrict__ x;
  const float* __restrict__ residual;  // read only with Feedback
  int64_t n;

  __device__ __forceinline__ float at(int64_t i) const {
    if constexpr (Feedback) {
      return i < n ? to_f32(x[i]) + residual[i] : 0.0f;
    } else {
      return load1(x, i, n);
    }
  }

  // Group of 8 at i0 (a multiple of 8); `vec`: x, and with Feedback the
  // residual, 16-byte aligned.
  __device__ __forceinline__ void group(int64_t i0, bool vec, float v[8]) const {
    load8(x, i0, n, vec, v);
    if constexpr (Feedback) {
      float r[8];
      load8(residual, i0, n, vec, r);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = v[j] + r[j];
    }
  }
};

// The new residual of a group under error feedback: acc - decoded, the
// decoded values as the decoders write them (common.h's NaN rule), as the
// CPU's store_residual computes it; elements past n are not written.
__device__ __forceinline__ void store_residual8(float* __restrict__ out, int64_t i0, int64_t n, bool vec,
                                                const float acc[8], const float decoded[8]) {
  float r[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = acc[j] - canonical_nan(decoded[j]);
  store8(out, i0, n, vec, r);
}

// max|v| over the bucket of an Input as abs_bits: an integer max, so any
// order gives the same (exact) result and the segment tree is used only to
// combine lanes.
template <typename In>
__device__ __forceinline__ float bucket_max_abs(const In& in, int64_t start, const Geometry& g, int lane) {
  __shared__ uint32_t sm[kThreads];
  uint32_t m = 0;
  for (int e = lane; e < g.bucket; e += g.lanes) {
    const uint32_t a = abs_bits(in.at(start + e));
    m = a > m ? a : m;
  }
  return bits_f32(segment_tree(sm, m, lane, g.lanes, Max{}));
}

// max|x| over the bucket of x itself.
template <typename T>
__device__ __forceinline__ float bucket_max_abs(const T* __restrict__ x, int64_t n, int64_t start,
                                                const Geometry& g, int lane) {
  return bucket_max_abs(Input<T, false>{x, nullptr, n}, start, g, lane);
}

// ---------------------------------------------------------------------------
// Buckets held in registers (the tile encodes). A bucket of B <= 8 * 32 *
// kMaxTileGroups values is handled by lanes = min(B / 8, 32) threads of one
// warp (a segment, aligned within the warp); lane l holds the groups of 8
// l, l + lanes, ..., l + (G - 1) * lanes, G = B / (8 * lanes), in registers.
// The input (and under error feedback the residual) is read from memory
// once, with every group slot a contiguous, 16-byte-per-access load across
// the warp and all of a lane's loads in flight together; the bucket's
// reduction runs over the registers and warp shuffles (no shared memory, no
// barrier); the codes and the new residual are then formed from the same
// registers. Larger buckets take the two-phase kernels above: each G is
// another kernel per codec, dtype and variant to compile, and the codecs'
// default buckets are at most 512 values.
// ---------------------------------------------------------------------------
constexpr int kMaxTileGroups = 2;
constexpr unsigned kFullWarp = 0xffffffffu;

// Whether encodes of T (under error feedback: Feedback) have tile kernels.
// Error feedback compresses float32 sums in training (compress_gradients),
// so its 16-bit inputs keep the two-phase kernels: a third fewer kernels
// to compile.
template <typename T, bool Feedback>
constexpr bool tiled() {
  return !Feedback || std::is_same<T, float>::value;
}

// G for a bucket, or 0 where the bucket takes the two-phase kernels.
inline int tile_groups(int64_t bucket) {
  const int64_t lanes = bucket / 8 < 32 ? bucket / 8 : 32;
  const int64_t groups = bucket / (8 * lanes);
  return groups <= kMaxTileGroups ? static_cast<int>(groups) : 0;
}

struct TileSlot {
  int lane;        // within the segment
  int lanes;       // the segment's threads: a power of two <= 32
  int64_t bucket;  // may be >= the bucket count in the last block
  int64_t start;   // first element of the bucket
  bool live;       // bucket < the bucket count
};

// Every warp is whole (kThreads is a multiple of 32) and no thread returns
// before the reductions, so the full-warp shuffles see all 32 lanes; a
// segment past the last bucket reads zeros and stores nothing.
__device__ __forceinline__ TileSlot tile_slot(int lanes_log2, int64_t bucket_size, int64_t num_buckets) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  TileSlot s;
  s.lanes = 1 << lanes_log2;
  s.lane = static_cast<int>(threadIdx.x) & (s.lanes - 1);
  s.bucket = tid >> lanes_log2;
  s.start = s.bucket * bucket_size;
  s.live = s.bucket < num_buckets;
  return s;
}

// Blocks for a tile encode: lanes threads per bucket.
inline unsigned tile_blocks(int64_t nb, int64_t bucket) {
  const int64_t lanes = bucket / 8 < 32 ? bucket / 8 : 32;
  return static_cast<unsigned>((nb * lanes + kThreads - 1) / kThreads);
}

// The first element of group slot s of this lane.
__device__ __forceinline__ int64_t tile_group_start(const TileSlot& t, int s) {
  return t.start + 8 * (static_cast<int64_t>(t.lane) + static_cast<int64_t>(s) * t.lanes);
}

// The lane's G groups of the input (acc under error feedback), all loads
// issued before any is used.
template <int G, typename In>
__device__ __forceinline__ void load_tile(const In& in, const TileSlot& t, bool vec, float (&v)[G][8]) {
#pragma unroll
  for (int s = 0; s < G; ++s) in.group(tile_group_start(t, s), vec, v[s]);
}

// max over the segment of a per-lane integer (an exact max: any order).
__device__ __forceinline__ uint32_t segment_max(uint32_t m, int lanes) {
  for (int o = lanes / 2; o >= 1; o /= 2) {
    const uint32_t other = __shfl_xor_sync(kFullWarp, m, o);
    m = other > m ? other : m;
  }
  return m;
}

// max|v| over the tile's bucket (abs_bits: NaN propagates).
template <int G>
__device__ __forceinline__ float tile_max_abs(const float (&v)[G][8], int lanes) {
  uint32_t m = 0;
#pragma unroll
  for (int s = 0; s < G; ++s)
#pragma unroll
    for (int j = 0; j < 8; ++j) m = abs_bits(v[s][j]) > m ? abs_bits(v[s][j]) : m;
  return bits_f32(segment_max(m, lanes));
}

// A shuffle of any value made of 32-bit words.
template <typename V>
__device__ __forceinline__ V shfl_words(V v, int src_or_delta, bool down) {
  static_assert(sizeof(V) % 4 == 0, "a value of 32-bit words");
  uint32_t w[sizeof(V) / 4];
  memcpy(w, &v, sizeof(V));
#pragma unroll
  for (int k = 0; k < static_cast<int>(sizeof(V) / 4); ++k)
    w[k] = down ? __shfl_down_sync(kFullWarp, w[k], src_or_delta) : __shfl_sync(kFullWarp, w[k], src_or_delta);
  memcpy(&v, w, sizeof(V));
  return v;
}

// The halving tree of common.h over the tile's bucket, in its exact order:
// element i = 8 * (lane + s * lanes) + j. The levels w >= 8 * lanes add
// slot s + w / (8 lanes) into slot s of the same lane and position; the
// levels 8 <= w < 8 * lanes add lane l + w / 8 into lane l (slot 0); the
// levels w < 8 add position j + w into j (lane 0, slot 0). Each addition
// keeps the lower index on the left, as a[i] + a[i + w]. a is consumed;
// every lane of the segment gets the total.
template <typename V, int G>
__device__ __forceinline__ V tile_tree_sum(V (&a)[G][8], int lanes) {
#pragma unroll
  for (int h = G / 2; h >= 1; h /= 2)
#pragma unroll
    for (int s = 0; s < h; ++s)
#pragma unroll
      for (int j = 0; j < 8; ++j) a[s][j] = a[s][j] + a[s + h][j];
  for (int o = lanes / 2; o >= 1; o /= 2) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const V other = shfl_words(a[0][j], o, true);  // lanes >= o add what they will never use
      a[0][j] = a[0][j] + other;
    }
  }
#pragma unroll
  for (int w = 4; w >= 1; w /= 2)
#pragma unroll
    for (int j = 0; j < w; ++j) a[0][j] = a[0][j] + a[0][j + w];
  const int base = (static_cast<int>(threadIdx.x) & 31) & ~(lanes - 1);
  return shfl_words(a[0][0], base, false);
}

// Packed codes of a group of 8 (pack8's bytes), stored as one 1-, 2-, 4- or
// 8-byte word where the layout allows it: `out` is the group's first byte,
// `vec` says the packed buffer is 16-byte aligned (so the group's word is
// aligned for bits 1, 2, 4 and 8).
__device__ __forceinline__ void store_packed8(uint8_t* __restrict__ out, int bits, bool vec, const uint8_t c[8]) {
  if (bits == 8) {
    store_bytes8(out, vec, c);
    return;
  }
  uint32_t w = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) w |= static_cast<uint32_t>(c[j]) << (j * bits);
  if (vec && bits == 4) {
    *reinterpret_cast<uint32_t*>(out) = w;
  } else if (vec && bits == 2) {
    *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>(w);
  } else {
    for (int b = 0; b < bits; ++b) out[b] = static_cast<uint8_t>(w >> (8 * b));
  }
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

}  // namespace cuda
}  // namespace jaxcomp
