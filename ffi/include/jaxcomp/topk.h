// TopK sparsification (Renggli et al., "SparCML", SC19, section 5.1 and the
// top-k selection of their CNN experiments): the rules every backend follows,
// the payload sizes and the checks, written once for ffi/topk.cc and
// cuda/topk.cu. Twin: jaxcomp/codecs/topk.py.
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

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

// Storage word of a float dtype: float32 -> uint32_t, 16-bit floats -> uint16_t.
template <typename W>
JC_HD uint32_t topk_key(W w) {
  return sizeof(W) == 4 ? static_cast<uint32_t>(w) & 0x7fffffffu : static_cast<uint32_t>(w) & 0x7fffu;
}


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

// Malformed payloads. The encoder writes indices in ascending order below
// their range's limit (n for the whole tensor; the bucket size for
// bucket-local ones, padding entries included). A payload where an entry
// breaks that (an index out of range, repeated, or not above the one before
// it in its range) is malformed, and every backend decodes it to NaN
// everywhere instead of scattering it: never an access outside the output,
// never a result that depends on which of two writes to one element lands
// last. Entry j is checked against entry j - 1 (`prev`) unless it starts its
// range.
JC_HD bool topk_entry_ok(int64_t j, uint32_t stored, uint32_t prev, int64_t n, int64_t k, int64_t bucket) {
  const int64_t limit = bucket == 0 ? n : bucket;
  const bool first = bucket == 0 ? j == 0 : j % k == 0;
  return static_cast<int64_t>(stored) < limit && (first || stored > prev);
}

// The quiet NaN of the output's storage word (what the twin's NaN constant
// is): float32 0x7fc00000, bfloat16 0x7fc0, float16 0x7e00.
JC_HD uint32_t topk_nan_word(DType dt) {
  return dt == DType::kF32 ? 0x7fc00000u : dt == DType::kBF16 ? 0x7fc0u : 0x7e00u;
}

// The bin of a histogram (counts per key bin, bins in key order) that holds
// the k-th largest key, 1 <= k <= the total: the largest b with
// #{keys in bins >= b} >= k. *above receives #{keys in bins > b}. Radix
// selects run it once per digit, narrowing the rank k to k - *above.
template <typename C>
JC_HD int topk_find_bin(const C* hist, int bins, C k, C* above) {
  C cum = 0;
  for (int b = bins - 1; b >= 0; --b) {
    if (cum + hist[b] >= k) {
      *above = cum;
      return b;
    }
    cum += hist[b];
  }
  *above = cum;
  return 0;
}

// Emission of the k largest of a range, given T and need_eq = k - #{key > T}:
// an element is chosen when its key is above T, or equal to T with fewer
// than need_eq ties before it (in index order, across the whole range).
JC_HD bool topk_chosen(uint32_t key, uint32_t t, uint64_t ties_before, uint64_t need_eq) {
  return key > t || (key == t && ties_before < need_eq);
}

// How many elements a part of the range (a group of chunks, a CUDA tile)
// emits, given its `gt` keys above T and `eq` keys equal to T, and the ties
// in the parts before it: its output offset is the sum over those parts.
JC_HD uint64_t topk_part_emits(uint64_t gt, uint64_t eq, uint64_t need_eq, uint64_t ties_before) {
  const uint64_t left = need_eq > ties_before ? need_eq - ties_before : 0;
  return gt + (eq < left ? eq : left);
}

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Entries of the payload (as many indices as values): k in the whole-tensor
// mode, k per bucket otherwise. The Python side computes the whole-tensor k
// (k = min(n, max(1, ceil(fraction * n))) for n > 0) and passes it as an
// attribute; kernels only check 0 < k <= n.
JC_HD int64_t topk_entries(int64_t n, int64_t k, int64_t bucket) {
  return bucket == 0 ? k : num_buckets(n, bucket) * k;
}

// The mode's k and bucket against n, the payload's entries and the width of
// its index type in bytes (1, 2 or 4; 0 for any other type).
inline const char* topk_check_config(int64_t n, int64_t k, int64_t bucket, int64_t entries, int index_bytes) {
  if (n >= kElementLimit) return kTooManyInputs;
  if (index_bytes == 0) return "indices must be uint8, uint16 or uint32";
  const int64_t index_max = index_bytes < 4 ? (int64_t{1} << (8 * index_bytes)) - 1 : int64_t{0xffffffff};
  if (bucket == 0) {
    if (n > 0 && (k < 1 || k > n)) return "k must be in [1, n]";
    if (n == 0 && k != 0) return "k must be 0 for an empty input";
    if (entries != topk_entries(n, k, bucket)) return "index buffer must have k entries";
    if (n > 0 && n - 1 > index_max) return "index type too narrow for n";
  } else {
    if (!valid_bucket(bucket)) return "bucket_size must be 0 or a power of two in [8, 65536]";
    if (k < 1 || k > bucket) return "k must be in [1, bucket_size]";
    if (entries != topk_entries(n, k, bucket)) return "index buffer must have k entries per bucket";
    if (bucket - 1 > index_max) return "index type too narrow for the bucket";
  }
  return nullptr;
}

// x of n elements -> `indices` indices and `values` values (of x's type).
inline const char* topk_check_encode(DType x, DType values_type, int index_bytes, int64_t n, int64_t k,
                                     int64_t bucket, int64_t indices, int64_t values) {
  if (x == DType::kOther) return kBadInputType;
  if (values_type != x) return "values must have the input's dtype";
  if (const char* e = topk_check_config(n, k, bucket, indices, index_bytes)) return e;
  return values != indices ? "values must match indices" : nullptr;
}

// `indices` indices and `values` values -> out of n elements (of the values' type).
inline const char* topk_check_decode(DType out, DType values_type, int index_bytes, int64_t n, int64_t k,
                                     int64_t bucket, int64_t indices, int64_t values) {
  if (out == DType::kOther) return kBadOutputType;
  if (values_type != out) return "values must have the output's dtype";
  if (const char* e = topk_check_config(n, k, bucket, indices, index_bytes)) return e;
  return values != indices ? "values must match indices" : nullptr;
}

// Error feedback's one-pass encoder (CPU): x of n elements and a float32
// residual of n -> the payload of acc = float32(x) + residual (float32
// values) and the new residual, n float32.
inline const char* topk_check_feedback(DType x, DType values_type, int index_bytes, int64_t n, int64_t k,
                                       int64_t bucket, int64_t residual, int64_t indices, int64_t values,
                                       int64_t out) {
  if (x == DType::kOther) return kBadInputType;
  if (residual != n || out != n) return "the residual and the new residual must have the gradient's size";
  return topk_check_encode(DType::kF32, values_type, index_bytes, n, k, bucket, indices, values);
}

// Runs fn(W{}, I{}) with W the storage word of dt (uint32_t for float32,
// uint16_t for the 16-bit floats) and I the index type of index_bytes.
template <typename F>
inline void topk_with_types(DType dt, int index_bytes, const F& fn) {
  auto by_index = [&](auto w) {
    switch (index_bytes) {
      case 1: return fn(w, uint8_t{});
      case 2: return fn(w, uint16_t{});
      default: return fn(w, uint32_t{});
    }
  };
  if (dt == DType::kF32) return by_index(uint32_t{});
  return by_index(uint16_t{});
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/topk.cc and cuda/topk.cu (jaxcomp/registry.h). Their
// handlers take the operands and results, then the attributes, in order:
//   encode: x (flat f32/bf16/f16)
//           -> indices (u8/u16/u32, ascending), values (x's dtype)
inline constexpr Target kTopkEncode{"jaxcomp_topk_encode",
                                    "k",             // total (bucket 0) or per bucket
                                    "bucket_size"};  // 0: whole tensor
//   encode_feedback (CPU): x (flat f32/bf16/f16), residual (f32, x's length)
//           -> indices, values (f32) of acc = float32(x) + residual, and the
//           new residual acc - decode(payload) (f32)
inline constexpr Target kTopkEncodeFeedback{"jaxcomp_topk_encode_feedback", "k", "bucket_size"};
//   decode: indices, values -> flat output, the values' dtype
inline constexpr Target kTopkDecode{"jaxcomp_topk_decode", "k", "bucket_size"};

}  // namespace jaxcomp
