// Float casts on CUDA (the Cast codec's encode and decode): the target
// jaxcomp_cast, with the checks and bytes of ffi/cast.cc. Conversions and
// checks in ffi/include/jaxcomp/cast.h.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/cast.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const In* __restrict__ x, Out* __restrict__ y, int64_t n, bool vec) {
  const int64_t groups = (n + 7) / 8;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v[8];
    load8(x, 8 * gi, n, vec, v);
    store8(y, 8 * gi, n, vec, v);
  }
}

// ---------------------------------------------------------------------------
// Handler
// ---------------------------------------------------------------------------
ffi::Error CastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "jaxcomp_cast";
  const DType from = dtype_of(x.element_type()), to = dtype_of(y->element_type());
  const int64_t n = x.element_count();
  if (const char* e = cast_check(from, to, n, y->element_count())) return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  with_type(from, [&](auto in_tag) {
    with_type(to, [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      cast_kernel<In, Out><<<flat_blocks(n), kThreads, 0, stream>>>(
          static_cast<const In*>(x.untyped_data()), static_cast<Out*>(y->untyped_data()), n, vec);
    });
  });
  return launched(op);
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaCast, jaxcomp::cuda::CastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::AnyBuffer>());        // x converted, round to nearest even
JAXCOMP_REGISTER("jaxcomp_cast", JaxcompCudaCast);
