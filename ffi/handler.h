// The XLA side that every handler shares, CPU (ffi/) and CUDA (cuda/): the
// element types as the family headers name them, errors under the op's name,
// and the batch dimensions that jax.vmap adds. The checks themselves are the
// family headers'.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxcomp {

inline DType dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return DType::kOther;
  }
}

// Width in bytes of an unsigned index type (uint8, uint16, uint32); 0 for
// any other type.
inline int index_bytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: return 1;
    case ffi::DataType::U16: return 2;
    case ffi::DataType::U32: return 4;
    default: return 0;
  }
}

inline ffi::Error invalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// The buffers of one call, seen as a batch of entries. Under jax.vmap
// (ffi_call's vmap_method="broadcast_all") every operand and result has the
// same leading batch dimensions, [*batch, item]; the item part is what an
// unbatched call passes, a flat array, so the batch is every dimension but
// the last. An unbatched call is a batch of one. (The comments on the
// handlers' bindings describe one entry.)
template <size_t N>
class Batch {
 public:
  template <typename... B>
  explicit Batch(const B&... buffers) {
    static_assert(sizeof...(B) == N, "one Batch slot per buffer");
    size_t k = 0;
    (add(k++, buffers.dimensions(), buffers.element_type(), buffers.untyped_data()), ...);
  }

  // nullptr, or why the buffers do not form one batch.
  const char* error() const { return error_; }
  // The first error of a call: the batch's, else the family check's.
  const char* check(const char* family_error) const { return error_ != nullptr ? error_ : family_error; }
  // Entries in the batch.
  int64_t size() const { return size_; }
  // Elements of one entry of buffer k (the buffers in the order given).
  int64_t count(size_t k) const { return count_[k]; }
  // Entry i of buffer k.
  template <typename T>
  T* at(size_t k, int64_t i) const {
    return static_cast<T*>(static_cast<void*>(data_[k] + i * bytes_[k]));
  }

 private:
  void add(size_t k, ffi::AnyBuffer::Dimensions dims, ffi::DataType type, void* data) {
    const size_t rank = dims.size();
    const ffi::AnyBuffer::Dimensions lead = dims.first(rank > 0 ? rank - 1 : 0);
    count_[k] = rank > 0 ? dims.back() : 1;
    bytes_[k] = count_[k] * static_cast<int64_t>(ffi::ByteWidth(type));
    data_[k] = static_cast<char*>(data);
    if (k == 0) {
      lead_ = lead;
      for (int64_t d : lead) size_ *= d;
    } else if (!(lead == lead_)) {
      error_ = "operands and results must have the same leading (batch) dimensions";
    }
  }

  const char* error_ = nullptr;
  int64_t size_ = 1;
  ffi::AnyBuffer::Dimensions lead_;
  std::array<int64_t, N> count_{};
  std::array<int64_t, N> bytes_{};
  std::array<char*, N> data_{};
};

template <typename... B>
Batch(const B&...) -> Batch<sizeof...(B)>;

// ---------------------------------------------------------------------------
// The pair families: those whose payload is codes plus one value per bucket,
// with bucket_size their only attribute (Int8, OneBit and SignSGD both ways,
// TernGrad and Natural decode). Their handlers share one signature, bound here once
// for both platforms (Context: ffi::ThreadPool or the CUDA stream); the
// platform's PairHandlers (ffi/cpu_buckets.h, cuda/cuda_runtime.cuh) provide
// the body, kImpl.
// ---------------------------------------------------------------------------
template <typename Context, ffi::DataType kCodes, ffi::DataType kSide, auto kImpl>
XLA_FFI_Error* pair_encode_handler(XLA_FFI_CallFrame* frame) {
  static auto* handler = ffi::Ffi::Bind()
                             .template Ctx<Context>()
                             .template Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                             .template Ret<ffi::Buffer<kCodes>>()     // codes
                             .template Ret<ffi::Buffer<kSide>>()      // one value per bucket
                             .template Attr<int64_t>("bucket_size")   // power of two
                             .To(kImpl)
                             .release();
  return handler->Call(frame);
}

template <typename Context, ffi::DataType kCodes, ffi::DataType kSide, auto kImpl>
XLA_FFI_Error* pair_decode_handler(XLA_FFI_CallFrame* frame) {
  static auto* handler = ffi::Ffi::Bind()
                             .template Ctx<Context>()
                             .template Arg<ffi::Buffer<kCodes>>()     // codes
                             .template Arg<ffi::Buffer<kSide>>()      // one value per bucket
                             .template Ret<ffi::AnyBuffer>()          // flat output, the input's dtype
                             .template Attr<int64_t>("bucket_size")
                             .To(kImpl)
                             .release();
  return handler->Call(frame);
}

// The signature of a pair family's check (its header's *_check_encode or
// *_check_decode): element type, n, codes and side counts, bucket size.
using PairCheck = const char* (*)(DType, int64_t, int64_t, int64_t, int64_t);

}  // namespace jaxcomp
