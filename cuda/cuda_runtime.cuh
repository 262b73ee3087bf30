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

// The end of a CUDA handler: the buffers must form one batch and pass the
// family's check (`error`: nullptr when they do); then launch(i) launches
// entry i's kernels on the stream, for every entry in turn (one launch
// sequence per entry, not a grid over the batch), unless `work` is 0 (an
// empty tensor: nothing to do); then the launch check.
template <size_t N, typename Launch>
ffi::Error launch_batch(const char* op, const Batch<N>& batch, const char* error, int64_t work, const Launch& launch) {
  if (const char* e = batch.check(error)) return invalid(op, e);
  if (work == 0) return ffi::Error::Success();
  for (int64_t i = 0; i < batch.size(); ++i) launch(i);
  return launched(op);
}

// The CUDA handlers of the pair families (ffi/handler.h). A family names its
// op, its check and the function that launches the kernels of one tensor,
// and registers the result, as on the CPU (ffi/cpu_buckets.h).
template <ffi::DataType kCodes, ffi::DataType kSide>
struct PairHandlers {
  using Codes = ffi::NativeType<kCodes>;
  using Side = ffi::NativeType<kSide>;
  using Encode = void (*)(cudaStream_t, DType, const void* x, int64_t n, int64_t bucket, Codes*, Side*);
  using Decode = void (*)(cudaStream_t, DType, const Codes*, const Side*, int64_t n, int64_t bucket, void* out);

  template <const char* kOp, PairCheck kCheck, Encode kEncode>
  static ffi::Error encode_impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<kCodes> codes,
                                ffi::ResultBuffer<kSide> side, int64_t bucket) {
    const Batch<3> b(x, *codes, *side);
    const DType dt = dtype_of(x.element_type());
    const int64_t n = b.count(0);
    return launch_batch(kOp, b, kCheck(dt, n, b.count(1), b.count(2), bucket), n, [&](int64_t i) {
      kEncode(stream, dt, b.at<void>(0, i), n, bucket, b.at<Codes>(1, i), b.at<Side>(2, i));
    });
  }

  template <const char* kOp, PairCheck kCheck, Decode kDecode>
  static ffi::Error decode_impl(cudaStream_t stream, ffi::Buffer<kCodes> codes, ffi::Buffer<kSide> side,
                                ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
    const Batch<3> b(codes, side, *out);
    const DType dt = dtype_of(out->element_type());
    const int64_t n = b.count(2);
    return launch_batch(kOp, b, kCheck(dt, n, b.count(0), b.count(1), bucket), n, [&](int64_t i) {
      kDecode(stream, dt, b.at<Codes>(0, i), b.at<Side>(1, i), n, bucket, b.at<void>(2, i));
    });
  }

  template <const char* kOp, PairCheck kCheck, Encode kEncode>
  static XLA_FFI_Error* encode(XLA_FFI_CallFrame* frame) {
    return pair_encode_handler<ffi::PlatformStream<cudaStream_t>, kCodes, kSide, encode_impl<kOp, kCheck, kEncode>>(
        frame);
  }

  template <const char* kOp, PairCheck kCheck, Decode kDecode>
  static XLA_FFI_Error* decode(XLA_FFI_CallFrame* frame) {
    return pair_decode_handler<ffi::PlatformStream<cudaStream_t>, kCodes, kSide, decode_impl<kOp, kCheck, kDecode>>(
        frame);
  }
};

}  // namespace cuda
}  // namespace jaxcomp
