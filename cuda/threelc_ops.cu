#include "cuda_runtime.cuh"

namespace jaxcomp {
std::vector<HandlerEntry> threelc_cuda_handlers() { return {}; }
}  // namespace jaxcomp
