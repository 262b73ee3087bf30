// Float casts on CUDA (the Cast codec's encode and decode): the handler of
// kCast, with the checks and bytes of ffi/cast.cc. The target, conversions and
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
  store_groups<false>(y, n, vec, [&](int64_t gi, float* v) { load8(x, 8 * gi, n, vec, v); });
}

// ---------------------------------------------------------------------------
// Handler
// ---------------------------------------------------------------------------
ffi::Error CastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const Batch b(x, *y);
  const DType from = dtype_of(x.element_type()), to = dtype_of(y->element_type());
  const int64_t n = b.count(0);
  return launch_batch(b, cast_check(from, to, n, b.count(1)), n, [&](int64_t i) {
    with_type(from, [&](auto in_tag) {
      with_type(to, [&](auto out_tag) {
        const auto* xd = b.at<const decltype(in_tag)>(0, i);
        auto* yd = b.at<decltype(out_tag)>(1, i);
        cast_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(xd, yd, n, aligned16(xd) && aligned16(yd));
      });
    });
  });
}

JAXCOMP_REGISTER(kCast, CastImpl);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
