// The XLA side that every handler shares, CPU (ffi/) and CUDA (cuda/): the
// element types as the family headers name them, and errors under the op's
// name. The checks themselves are the family headers'.
#pragma once

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

}  // namespace jaxcomp
