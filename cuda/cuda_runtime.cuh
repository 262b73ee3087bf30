// What every CUDA family file shares on the host side: the XLA adapter of the
// handlers (../ffi/handler.h, also the CPU handlers'), launch geometry and the
// launch check. The checks of the buffers are the family headers' (the CPU
// handlers call the same functions).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "handler.h"
#include "jaxcomp/checks.h"
#include "kernels.cuh"

namespace jaxcomp {

// The CUDA handlers' context (handler.h: Handler): the stream XLA runs the
// computation on.
namespace binding {
template <>
struct Bound<cudaStream_t> : AsCtx<ffi::PlatformStream<cudaStream_t>> {};
}  // namespace binding

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

// Launches the tile encode (kernels.cuh) where a bucket of T, under error
// feedback or not, has one: launch(std::integral_constant<int, G>{}, blocks,
// lanes_log2), G the bucket's groups of 8 per lane. False where the bucket
// takes the two-phase kernels (the caller launches those).
template <typename T, bool Feedback, typename Launch>
bool launch_tile(int64_t nb, int64_t bucket, const Launch& launch) {
  if constexpr (tiled<T, Feedback>()) {
    const int lanes_log2 = log2_int(bucket / 8 < 32 ? bucket / 8 : 32);
    const unsigned blocks = tile_blocks(nb, bucket);
    switch (tile_groups(bucket)) {
      case 1:
        launch(std::integral_constant<int, 1>{}, blocks, lanes_log2);
        return true;
      case 2:
        launch(std::integral_constant<int, 2>{}, blocks, lanes_log2);
        return true;
      default:
        break;
    }
  }
  return false;
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
// failure on the stream's device (under the target's name, as every error of
// a handler).
inline ffi::Error launched() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  return ffi::Error::Success();
}

// The end of a CUDA handler: the buffers must form one batch and pass the
// family's check (`error`: nullptr when they do); then launch(i) launches
// entry i's kernels on the stream, for every entry in turn (one launch
// sequence per entry, not a grid over the batch), unless `work` is 0 (an
// empty tensor: nothing to do); then the launch check.
template <size_t N, typename Launch>
ffi::Error launch_batch(const Batch<N>& batch, const char* error, int64_t work, const Launch& launch) {
  if (const char* e = batch.check(error)) return invalid(e);
  if (work == 0) return ffi::Error::Success();
  for (int64_t i = 0; i < batch.size(); ++i) launch(i);
  return launched();
}

}  // namespace cuda

// CUDA as ffi/handler.h's PairHandlers see it: the families' functions
// launch their kernels on the stream.
struct CudaPlatform {
  using Context = cudaStream_t;
  using Work = cudaStream_t;
  static void hint(void*, size_t) {}
  template <size_t N, typename Launch>
  static ffi::Error run(cudaStream_t stream, const Batch<N>& batch, const char* error, int64_t work,
                        const Launch& launch) {
    return cuda::launch_batch(batch, error, work, [&](int64_t i) { launch(i, stream); });
  }
};

namespace cuda {

// The pair families' CUDA handlers, as on the CPU (ffi/cpu_buckets.h):
//   JAXCOMP_REGISTER(kInt8Decode, Handlers::decode<check_pair_decode<int8_sizes>, decode>);
template <ffi::DataType kCodes, ffi::DataType kSide>
using CudaPairHandlers = PairHandlers<CudaPlatform, kCodes, kSide>;

}  // namespace cuda
}  // namespace jaxcomp
