// Float casts on the CPU (the Cast codec's encode and decode): the handler of
// kCast. The target, conversions and checks in include/jaxcomp/cast.h; twin:
// astype (jaxcomp/codecs/cast.py).
#include <cstdint>

#include "cpu_runtime.h"
#include "jaxcomp/cast.h"

namespace jaxcomp {
namespace {

// ---------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------
struct CastArgs {
  DType from, to;
  const void* in;
  void* out;
};

template <typename In, typename Out>
void cast_t(const void* in, void* out, int64_t i0, int64_t i1) {
  const In* src = static_cast<const In*>(in);
  Out* dst = static_cast<Out*>(out);
  for (int64_t i = i0; i < i1; ++i) dst[i] = from_f32<Out>(to_f32(src[i]));
}

// Elements [i0, i1).
JC_CPU_LOOP void cast_range(const CastArgs& a, int64_t i0, int64_t i1) {
  with_type(a.from, [&](auto in_tag) {
    with_type(a.to, [&](auto out_tag) { cast_t<decltype(in_tag), decltype(out_tag)>(a.in, a.out, i0, i1); });
  });
}

// ---------------------------------------------------------------------------
// Handler
// ---------------------------------------------------------------------------
ffi::Error CastImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const Batch b(x, *y);
  const DType from = dtype_of(x.element_type()), to = dtype_of(y->element_type());
  const int64_t n = b.count(0);
  hint_huge_pages(y->untyped_data(), static_cast<int64_t>(y->size_bytes()));
  return run_batch(pool, b, cast_check(from, to, n, b.count(1)), n, [&](int64_t i, Runner& runner) {
    const CastArgs a{from, to, b.at<void>(0, i), b.at<void>(1, i)};
    parallel_for(runner, n, kElementsPerTask, [&](int64_t i0, int64_t i1) { cast_range(a, i0, i1); });
  });
}

JAXCOMP_REGISTER(kCast, CastImpl);

}  // namespace
}  // namespace jaxcomp
