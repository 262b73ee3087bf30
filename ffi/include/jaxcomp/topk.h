// TopK sparsification (Renggli et al., "SparCML", SC19, section 5.1 and the
// top-k selection of their CNN experiments): the rules every backend follows,
// written once for the CPU handlers (ffi/topk_ops.cc) and the CUDA kernels
// (cuda/topk_ops.cu). Twin: jaxcomp/ops/topk.py.
//
// Ranking. An element's key is its absolute value's bits as an unsigned
// integer (the storage word with the sign bit cleared: 31 bits for float32,
// 15 for bfloat16/float16). Keys order magnitudes exactly, put +-Inf above
// every finite value and NaN above Inf (so NaNs are always kept), and need no
// floating-point arithmetic, so every backend ranks identically. Among equal
// keys the lower index wins.
//
// Selection of the k largest of a range, given its k-th largest key T:
// every element with key > T, plus the first (k - #{key > T}) elements with
// key == T, in index order. The output lists the chosen elements by
// ascending index, values as raw storage words.
#pragma once

#include <cstdint>

#include "jaxcomp/common.h"

namespace jaxcomp {

// Storage word of a float dtype: float32 -> uint32_t, 16-bit floats -> uint16_t.
template <typename W>
JC_HD uint32_t topk_key(W w) {
  return sizeof(W) == 4 ? static_cast<uint32_t>(w) & 0x7fffffffu : static_cast<uint32_t>(w) & 0x7fffu;
}

// Number of selected elements of the whole-tensor mode. The Python side
// computes it (k = min(n, max(1, ceil(fraction * n))) for n > 0) and passes it
// as an attribute; kernels only check 0 < k <= n.

// Histogram split of a key: 15 high bits first, then the 16 low bits of a
// 32-bit key (16-bit keys are exact after the first level).
constexpr int kTopkHiBins = 1 << 15;
constexpr int kTopkLoBins = 1 << 16;

template <typename W>
JC_HD uint32_t topk_hi(uint32_t key) {
  return sizeof(W) == 4 ? key >> 16 : key;
}

// Global index of entry j of a payload: whole-tensor mode (bucket == 0) stores
// global indices; k_per_bucket mode stores bucket-local ones, k per bucket.
// Padding entries (the last bucket shorter than k) have a global index >= n.
JC_HD int64_t topk_global_index(int64_t j, uint32_t stored, int64_t k, int64_t bucket) {
  return bucket == 0 ? static_cast<int64_t>(stored) : (j / k) * bucket + static_cast<int64_t>(stored);
}

}  // namespace jaxcomp
