// What every CUDA family file shares on the host side: the XLA adapter of the
// handlers (../ffi/handler.h, also the CPU handlers'), launch geometry and the
// launch check. The checks of the buffers are the family headers' (the CPU
// handlers call the same functions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler.h"
#include "jaxcomp/checks.h"
#include "kernels.cuh"

namespace jaxcomp {
namespace cuda {

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

constexpr int64_t kMaxBlocks = 8192;

// Blocks for a grid-stride loop over the groups of 8 of n elements: enough to
// fill any current GPU several times over, never more than there is work.
inline unsigned flat_blocks(int64_t n) {
  const int64_t groups = (n + 7) / 8;
  const int64_t blocks = (groups + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Blocks for a grid-stride loop over `count` items, one per thread (at least
// one block).
inline unsigned item_blocks(int64_t count) {
  const int64_t b = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : (b < kMaxBlocks ? b : kMaxBlocks));
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
