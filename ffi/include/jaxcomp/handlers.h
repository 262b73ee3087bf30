// The registry through which handler files outside cpu_ops.cc and
// cuda_ops.cu hand their XLA FFI handlers to the nanobind modules. Plain C++,
// so that both the host compiler and nvcc can include it.
#pragma once

#include <vector>

namespace jaxcomp {

// One FFI target: its registered name and the handler symbol's address.
struct HandlerEntry {
  const char* name;
  void* handler;
};

// One list per codec family file.
std::vector<HandlerEntry> threelc_cpu_handlers();   // ffi/threelc_ops.cc
std::vector<HandlerEntry> topk_cpu_handlers();      // ffi/topk_ops.cc
std::vector<HandlerEntry> threelc_cuda_handlers();  // cuda/threelc_ops.cu
std::vector<HandlerEntry> topk_cuda_handlers();     // cuda/topk_ops.cu

}  // namespace jaxcomp
