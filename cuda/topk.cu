// TopK sparsification on the GPU (Renggli et al., "SparCML", SC19): the
// handlers of kTopkEncode and kTopkDecode. The targets, selection rules, sizes
// and checks of ffi/include/jaxcomp/topk.h, giving the CPU handlers' bytes
// (ffi/topk.cc).
//
// Whole-tensor mode: a radix select of the k-th largest key T, 8 bits per
// round (4 rounds for float32 keys, 2 for 16-bit ones), each round a
// histogram of the keys that match the prefix found so far (shared-memory
// bins, added to global bins) and a one-thread pick of the next digit. Then
// per tile of kTile elements: counts of keys above and equal to T, a
// one-block scan of the tiles (output offset and ties already seen), and an
// emit kernel that writes each tile's chosen elements in index order with
// warp-ballot prefix sums.
//
// k_per_bucket mode: one block per bucket runs the same radix select on its
// bucket in shared memory, then emits in index order the same way.
//
// Decode: a check of the indices, a fill (zeros, or NaN for a malformed
// payload) and a scatter.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "cuda_runtime.cuh"
#include "jaxcomp/topk.h"

namespace jaxcomp {
namespace cuda {
namespace {

constexpr int kTopkThreads = 256;
constexpr int kItems = 16;                          // elements per thread per tile
constexpr int64_t kTile = kTopkThreads * kItems;    // elements per tile
constexpr int kScanThreads = 1024;

// Radix-select state of the whole-tensor mode, in device scratch memory.
struct SelectState {
  uint32_t prefix;               // digits of T found so far
  uint32_t mask;                 // bits of the prefix that are set
  unsigned long long remaining;  // rank of T among the keys matching prefix
  unsigned long long hist[256];
};

template <typename W>
struct KeyRounds {
  static constexpr int value = sizeof(W) == 4 ? 4 : 2;
};

// ---------------------------------------------------------------------------
// Whole-tensor mode.
// ---------------------------------------------------------------------------
__global__ void init_state_kernel(SelectState* st, unsigned long long k) {
  const int t = threadIdx.x;
  if (t == 0) {
    st->prefix = 0;
    st->mask = 0;
    st->remaining = k;
  }
  if (t < 256) st->hist[t] = 0;
}

template <typename W>
__global__ void radix_hist_kernel(const W* __restrict__ x, int64_t n, SelectState* st, int shift) {
  __shared__ unsigned int bins[256];
  for (int b = threadIdx.x; b < 256; b += blockDim.x) bins[b] = 0;
  __syncthreads();
  const uint32_t prefix = st->prefix, mask = st->mask;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t key = topk_key(x[i]);
    if ((key & mask) == prefix) atomicAdd(&bins[(key >> shift) & 255u], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x)
    if (bins[b]) atomicAdd(&st->hist[b], static_cast<unsigned long long>(bins[b]));
}

// One thread: the digit of this round, scanning from the top.
__global__ void radix_pick_kernel(SelectState* st, int shift) {
  unsigned long long above = 0;
  const int d = topk_find_bin(st->hist, 256, st->remaining, &above);
  st->remaining -= above;
  st->prefix |= static_cast<uint32_t>(d) << shift;
  st->mask |= 255u << shift;
  for (int b = 0; b < 256; ++b) st->hist[b] = 0;
}

template <typename W>
__global__ void tile_count_kernel(const W* __restrict__ x, int64_t n, const SelectState* st,
                                  uint32_t* __restrict__ gt, uint32_t* __restrict__ eq) {
  __shared__ unsigned int s_gt, s_eq;
  if (threadIdx.x == 0) s_gt = s_eq = 0;
  __syncthreads();
  const uint32_t t = st->prefix;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t i1 = i0 + kTile < n ? i0 + kTile : n;
  unsigned int g = 0, e = 0;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const uint32_t key = topk_key(x[i]);
    g += key > t;
    e += key == t;
  }
  atomicAdd(&s_gt, g);
  atomicAdd(&s_eq, e);
  __syncthreads();
  if (threadIdx.x == 0) {
    gt[blockIdx.x] = s_gt;
    eq[blockIdx.x] = s_eq;
  }
}

// Exclusive scan of kScanThreads partial sums in shared memory (one thread;
// 1024 additions). Returns nothing; part[] becomes exclusive prefixes.
__device__ void scan_parts(unsigned long long* part) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long run = 0;
    for (int t = 0; t < kScanThreads; ++t) {
      const unsigned long long v = part[t];
      part[t] = run;
      run += v;
    }
  }
  __syncthreads();
}

// One block: for each tile, the ties seen before it and its output offset.
__global__ void tile_scan_kernel(const uint32_t* __restrict__ gt, const uint32_t* __restrict__ eq, int64_t tiles,
                                 const SelectState* st, unsigned long long* __restrict__ out0,
                                 unsigned long long* __restrict__ eq0) {
  __shared__ unsigned long long part[kScanThreads];
  const unsigned long long need_eq = st->remaining;
  const int64_t per = (tiles + kScanThreads - 1) / kScanThreads;
  const int64_t t0 = threadIdx.x * per;
  const int64_t t1 = t0 + per < tiles ? t0 + per : tiles;
  unsigned long long s = 0;
  for (int64_t t = t0; t < t1; ++t) s += eq[t];
  part[threadIdx.x] = s;
  scan_parts(part);
  unsigned long long seen = part[threadIdx.x], sel = 0;
  for (int64_t t = t0; t < t1; ++t) {
    eq0[t] = seen;
    sel += topk_part_emits(gt[t], eq[t], need_eq, seen);
    seen += eq[t];
  }
  __syncthreads();
  part[threadIdx.x] = sel;
  scan_parts(part);
  unsigned long long pos = part[threadIdx.x];
  for (int64_t t = t0; t < t1; ++t) {
    out0[t] = pos;
    pos += topk_part_emits(gt[t], eq[t], need_eq, eq0[t]);
  }
}

// Block-wide exclusive prefix of a 0/1 flag over kTopkThreads threads; *total
// receives the block's count. Uses 8 words of shared memory.
__device__ unsigned int block_prefix(bool flag, unsigned int* warp_sums, unsigned int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned int ballot = __ballot_sync(0xffffffffu, flag);
  const unsigned int before = __popc(ballot & ((1u << lane) - 1u));
  __syncthreads();
  if (lane == 0) warp_sums[warp] = __popc(ballot);
  __syncthreads();
  unsigned int off = 0, all = 0;
  for (int w = 0; w < kTopkThreads / 32; ++w) {
    off += w < warp ? warp_sums[w] : 0u;
    all += warp_sums[w];
  }
  *total = all;
  return off + before;
}

// Emits the chosen elements of the elements [i0, i1) in index order: key > t,
// or key == t among the first need_eq such (eq_base already seen before i0).
// Output starts at out_base. All threads of the block must call it.
template <typename W, typename I>
__device__ void emit_range(const W* __restrict__ x, int64_t i0, int64_t i1, uint32_t t,
                           unsigned long long need_eq, unsigned long long eq_base, unsigned long long out_base,
                           int64_t index_base, I* __restrict__ idx, W* __restrict__ val) {
  __shared__ unsigned int warp_sums[kTopkThreads / 32];
  for (int64_t r0 = i0; r0 < i1; r0 += kTopkThreads) {
    const int64_t i = r0 + threadIdx.x;
    const bool in = i < i1;
    const W w = in ? x[i] : W{};
    const uint32_t key = topk_key(w);
    const bool is_eq = in && key == t;
    unsigned int eq_total = 0, sel_total = 0;
    const unsigned int eq_rank = block_prefix(is_eq, warp_sums, &eq_total);
    const bool chosen = in && topk_chosen(key, t, eq_base + eq_rank, need_eq);
    const unsigned int pos = block_prefix(chosen, warp_sums, &sel_total);
    if (chosen) {
      idx[out_base + pos] = static_cast<I>(i - index_base);
      val[out_base + pos] = w;
    }
    eq_base += eq_total;
    out_base += sel_total;
  }
}

template <typename W, typename I>
__global__ void tile_emit_kernel(const W* __restrict__ x, int64_t n, const SelectState* st,
                                 const unsigned long long* __restrict__ out0,
                                 const unsigned long long* __restrict__ eq0, I* __restrict__ idx,
                                 W* __restrict__ val) {
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t i1 = i0 + kTile < n ? i0 + kTile : n;
  emit_range<W, I>(x, i0, i1, st->prefix, st->remaining, eq0[blockIdx.x], out0[blockIdx.x], 0, idx, val);
}

// ---------------------------------------------------------------------------
// k_per_bucket mode: one block per bucket.
// ---------------------------------------------------------------------------
template <typename W, typename I>
__global__ void bucket_select_kernel(const W* __restrict__ x, int64_t n, int64_t k, int64_t bucket,
                                     I* __restrict__ idx, W* __restrict__ val) {
  __shared__ unsigned int bins[256];
  __shared__ uint32_t s_prefix, s_mask;
  __shared__ unsigned int s_remaining;
  const int64_t b = blockIdx.x;
  const int64_t i0 = b * bucket;
  const int64_t len = n - i0 < bucket ? n - i0 : bucket;
  const int64_t kb = k < len ? k : len;
  I* ib = idx + b * k;
  W* vb = val + b * k;
  if (kb == len) {
    // Everything is kept; then padding entries L .. k-1 with value 0.
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
      ib[j] = static_cast<I>(j);
      vb[j] = j < len ? x[i0 + j] : W{};
    }
    return;
  }
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_remaining = static_cast<unsigned int>(kb);
  }
  for (int round = 0; round < KeyRounds<W>::value; ++round) {
    const int shift = 8 * (KeyRounds<W>::value - 1 - round);
    for (int d = threadIdx.x; d < 256; d += blockDim.x) bins[d] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix, mask = s_mask;
    for (int64_t j = threadIdx.x; j < len; j += blockDim.x) {
      const uint32_t key = topk_key(x[i0 + j]);
      if ((key & mask) == prefix) atomicAdd(&bins[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned int above = 0;
      const int d = topk_find_bin(bins, 256, s_remaining, &above);
      s_remaining -= above;
      s_prefix |= static_cast<uint32_t>(d) << shift;
      s_mask |= 255u << shift;
    }
    __syncthreads();
  }
  emit_range<W, I>(x, i0, i0 + len, s_prefix, s_remaining, 0, 0, i0, ib, vb);
}

// ---------------------------------------------------------------------------
// Decode.
// ---------------------------------------------------------------------------
// A malformed payload (topk_entry_ok) sets *bad; the fill then writes NaN
// everywhere and the scatter does nothing, as on the CPU and in the twin.
template <typename I>
__global__ void check_kernel(const I* __restrict__ idx, int64_t entries, int64_t n, int64_t k, int64_t bucket,
                             uint32_t* bad) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  bool ok = true;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < entries; j += stride) {
    const uint32_t prev = j > 0 ? static_cast<uint32_t>(idx[j - 1]) : 0u;
    ok = ok && topk_entry_ok(j, static_cast<uint32_t>(idx[j]), prev, n, k, bucket);
  }
  if (!ok) atomicOr(bad, 1u);
}

template <typename W>
__global__ void fill_kernel(W* __restrict__ out, int64_t n, const uint32_t* bad, W nan) {
  const W v = *bad != 0 ? nan : W{0};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = v;
}

template <typename W, typename I>
__global__ void scatter_kernel(const I* __restrict__ idx, const W* __restrict__ val, int64_t entries, int64_t n,
                               int64_t k, int64_t bucket, const uint32_t* bad, W* __restrict__ out) {
  if (*bad != 0) return;  // uniform across the grid
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < entries; j += stride) {
    const int64_t g = topk_global_index(j, static_cast<uint32_t>(idx[j]), k, bucket);
    if (g < n) out[g] = val[j];
  }
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
unsigned grid_for(int64_t items) {
  constexpr int64_t kMaxGrid = 4096;
  const int64_t blocks = (items + kTopkThreads - 1) / kTopkThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < kMaxGrid ? blocks : kMaxGrid));
}

// Scratch of the whole-tensor select for n elements: the state, then per-tile
// counts (uint32) and offsets (uint64).
size_t whole_scratch_bytes(int64_t n) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  return sizeof(SelectState) + 2 * tiles * sizeof(uint32_t) + 2 * tiles * sizeof(unsigned long long);
}

template <typename W, typename I>
void encode_whole(cudaStream_t stream, void* scratch, const W* x, int64_t n, int64_t k, I* idx, W* val) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  char* base = static_cast<char*>(scratch);
  SelectState* st = reinterpret_cast<SelectState*>(base);
  unsigned long long* out0 = reinterpret_cast<unsigned long long*>(base + sizeof(SelectState));
  unsigned long long* eq0 = out0 + tiles;
  uint32_t* gt = reinterpret_cast<uint32_t*>(eq0 + tiles);
  uint32_t* eq = gt + tiles;
  init_state_kernel<<<1, 256, 0, stream>>>(st, static_cast<unsigned long long>(k));
  for (int round = 0; round < KeyRounds<W>::value; ++round) {
    const int shift = 8 * (KeyRounds<W>::value - 1 - round);
    radix_hist_kernel<W><<<grid_for(n), kTopkThreads, 0, stream>>>(x, n, st, shift);
    radix_pick_kernel<<<1, 1, 0, stream>>>(st, shift);
  }
  tile_count_kernel<W><<<static_cast<unsigned>(tiles), kTopkThreads, 0, stream>>>(x, n, st, gt, eq);
  tile_scan_kernel<<<1, kScanThreads, 0, stream>>>(gt, eq, tiles, st, out0, eq0);
  tile_emit_kernel<W, I><<<static_cast<unsigned>(tiles), kTopkThreads, 0, stream>>>(x, n, st, out0, eq0, idx, val);
}

// The entries of a batch run one after the other on the stream, so the
// whole-tensor mode's scratch (the radix select's state, the tile counts) is
// allocated once and reused.
ffi::Error EncodeImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer x,
                      ffi::Result<ffi::AnyBuffer> indices, ffi::Result<ffi::AnyBuffer> values, int64_t k,
                      int64_t bucket) {
  const Batch b(x, *indices, *values);
  const DType dt = dtype_of(x.element_type());
  const int ibytes = index_bytes(indices->element_type());
  const int64_t n = b.count(0);
  if (const char* e = b.check(topk_check_encode(dt, dtype_of(values->element_type()), ibytes, n, k, bucket,
                                                b.count(1), b.count(2))))
    return invalid(e);
  if (n == 0) return ffi::Error::Success();
  void* mem = nullptr;
  if (bucket == 0) {
    std::optional<void*> allocated = scratch.Allocate(whole_scratch_bytes(n), 16);
    if (!allocated.has_value()) return ffi::Error::Internal("scratch allocation failed");
    mem = *allocated;
  }
  topk_with_types(dt, ibytes, [&](auto w, auto ix) {
    using W = decltype(w);
    using I = decltype(ix);
    for (int64_t i = 0; i < b.size(); ++i) {
      const W* xd = b.at<const W>(0, i);
      if (bucket == 0) {
        encode_whole<W, I>(stream, mem, xd, n, k, b.at<I>(1, i), b.at<W>(2, i));
      } else {
        bucket_select_kernel<W, I><<<static_cast<unsigned>(num_buckets(n, bucket)), kTopkThreads, 0, stream>>>(
            xd, n, k, bucket, b.at<I>(1, i), b.at<W>(2, i));
      }
    }
  });
  return launched();
}

// One malformed flag per entry of the batch, in scratch memory.
ffi::Error DecodeImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer indices,
                      ffi::AnyBuffer values, ffi::Result<ffi::AnyBuffer> out, int64_t k, int64_t bucket) {
  const Batch b(indices, values, *out);
  const DType dt = dtype_of(out->element_type());
  const int ibytes = index_bytes(indices.element_type());
  const int64_t n = b.count(2), entries = b.count(0);
  if (const char* e = b.check(topk_check_decode(dt, dtype_of(values.element_type()), ibytes, n, k, bucket, entries,
                                                b.count(1))))
    return invalid(e);
  if (n == 0) return ffi::Error::Success();
  std::optional<void*> allocated = scratch.Allocate(static_cast<size_t>(b.size()) * sizeof(uint32_t), 16);
  if (!allocated.has_value()) return ffi::Error::Internal("scratch allocation failed");
  uint32_t* bad = static_cast<uint32_t*>(*allocated);
  cudaMemsetAsync(bad, 0, static_cast<size_t>(b.size()) * sizeof(uint32_t), stream);
  topk_with_types(dt, ibytes, [&](auto w, auto ix) {
    using W = decltype(w);
    using I = decltype(ix);
    const W nan = static_cast<W>(topk_nan_word(dt));
    for (int64_t i = 0; i < b.size(); ++i) {
      if (entries > 0)
        check_kernel<I><<<grid_for(entries), kTopkThreads, 0, stream>>>(b.at<const I>(0, i), entries, n, k, bucket,
                                                                        bad + i);
      fill_kernel<W><<<grid_for(n), kTopkThreads, 0, stream>>>(b.at<W>(2, i), n, bad + i, nan);
      if (entries > 0)
        scatter_kernel<W, I><<<grid_for(entries), kTopkThreads, 0, stream>>>(
            b.at<const I>(0, i), b.at<const W>(1, i), entries, n, k, bucket, bad + i, b.at<W>(2, i));
    }
  });
  return launched();
}

JAXCOMP_REGISTER(kTopkEncode, EncodeImpl);
JAXCOMP_REGISTER(kTopkDecode, DecodeImpl);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
