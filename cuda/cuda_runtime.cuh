// What every CUDA FFI handler file shares: validation (word for word that of
// the CPU handlers), launch geometry and launch checks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "jaxcomp/registry.h"
#include "kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace jaxcomp {
namespace cuda {

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------
// Validation, shared word for word with cpu_ops.cc.
// ---------------------------------------------------------------------------
inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

inline bool is_float(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// Typed buffers count in size_t, AnyBuffer in int64_t; compare in int64_t.
template <typename B>
inline int64_t count(const B& b) {
  return static_cast<int64_t>(b.element_count());
}

inline int64_t num_buckets(int64_t n, int64_t bucket) { return (n + bucket - 1) / bucket; }

inline bool valid_bucket(int64_t b) { return b >= 8 && b <= (1 << 16) && (b & (b - 1)) == 0; }

// Common checks of a bucketed encode; returns an error string or "".
inline std::string check_bucketed(ffi::AnyBuffer& x, int64_t bucket, int64_t body_bytes, int64_t body_expected,
                           int64_t scale_count, int64_t scale_expected) {
  if (!is_float(x.element_type())) return "input must be float32, bfloat16 or float16";
  if (!valid_bucket(bucket)) return "bucket_size must be a power of two in [8, 65536]";
  if (x.element_count() >= (int64_t{1} << 32)) return "inputs are limited to 2^32 - 1 elements";
  if (body_bytes != body_expected) return "payload buffer has the wrong size";
  if (scale_count != scale_expected) return "scale buffer has the wrong size";
  return "";
}

// ---------------------------------------------------------------------------
// Launch helpers.
// ---------------------------------------------------------------------------

// Runs fn(T{}) with T the storage type of a float dtype (checked before).
template <typename Fn>
inline void with_type(ffi::DataType t, Fn&& fn) {
  switch (t) {
    case ffi::DataType::BF16: return fn(bf16_t{});
    case ffi::DataType::F16: return fn(f16_t{});
    default: return fn(float{});
  }
}

// XLA's buffers are normally aligned well beyond 16 bytes, which the kernels
// use for 16-byte accesses; the check keeps them correct on any other pointer
// (with scalar accesses).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int log2_int(int64_t v) {
  int l = 0;
  while ((int64_t{1} << l) < v) ++l;
  return l;
}

inline Geometry geometry(int64_t bucket) {
  Geometry g;
  g.bucket = static_cast<int>(bucket);
  g.lanes = static_cast<int>(bucket / 8 < kThreads ? bucket / 8 : kThreads);
  g.lane_levels = log2_int(bucket / g.lanes);
  g.per_block = kThreads / g.lanes;
  return g;
}

// Blocks for an encode: one segment per bucket (at most 2^29 buckets, so the
// count fits a grid dimension).
inline unsigned encode_blocks(int64_t nb, const Geometry& g) {
  return static_cast<unsigned>((nb + g.per_block - 1) / g.per_block);
}

// Blocks for a grid-stride loop over the groups of 8 of n elements: enough to
// fill any current GPU several times over, never more than there is work.
inline unsigned flat_blocks(int64_t n) {
  constexpr int64_t kMaxBlocks = 8192;
  const int64_t groups = (n + 7) / 8;
  const int64_t blocks = (groups + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Launches are asynchronous; this reports a bad configuration or an earlier
// failure on the stream's device under the op's name.
inline ffi::Error launched(const char* op) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(op) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace cuda
}  // namespace jaxcomp
