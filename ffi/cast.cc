// Float casts on the CPU (the Cast codec's encode and decode): the handlers of
// kCast, kCastEncodeFeedback and kCastDecodeSum. The target, conversions and checks in include/jaxcomp/cast.h; twin:
// astype (jaxcomp/codecs/cast.py).
#include <algorithm>
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

// Error feedback in one pass: acc = f32(x) + residual, its conversion, and
// acc - the conversion read back (the decode's values, with the decoders'
// NaN rule as cpu_buckets.h's store_residual applies it), acc never
// written out.
struct CastFeedbackArgs {
  DType from, to;
  const void* in;
  const float* residual;
  void* out;
  float* new_residual;
};

// In chunks that stay in cache, each step its own simple loop (the
// compiler vectorizes each; one loop doing all three did not, and ran
// slower than the separate kernels).
template <typename In, typename Out>
void cast_feedback_t(const CastFeedbackArgs& a, int64_t i0, int64_t i1) {
  constexpr int64_t kChunk = 2048;
  alignas(64) float acc[kChunk];
  const In* src = static_cast<const In*>(a.in);
  Out* dst = static_cast<Out*>(a.out);
  for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
    const int64_t m = std::min(kChunk, i1 - c0);
    const In* s = src + c0;
    const float* r = a.residual + c0;
    Out* d = dst + c0;
    float* nr = a.new_residual + c0;
    for (int64_t k = 0; k < m; ++k) acc[k] = to_f32(s[k]) + r[k];
    for (int64_t k = 0; k < m; ++k) d[k] = from_f32<Out>(acc[k]);
    for (int64_t k = 0; k < m; ++k) nr[k] = acc[k] - canonical_nan(to_f32(d[k]));
  }
}

JC_CPU_LOOP void cast_feedback_range(const CastFeedbackArgs& a, int64_t i0, int64_t i1) {
  with_type(a.from, [&](auto in_tag) {
    with_type(a.to, [&](auto out_tag) { cast_feedback_t<decltype(in_tag), decltype(out_tag)>(a, i0, i1); });
  });
}

// ---------------------------------------------------------------------------
// Handlers
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

ffi::Error CastFeedbackImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> residual,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> new_residual) {
  const Batch b(x, residual, *y, *new_residual);
  const DType from = dtype_of(x.element_type()), to = dtype_of(y->element_type());
  const int64_t n = b.count(0);
  hint_huge_pages(new_residual->typed_data(), static_cast<int64_t>(new_residual->size_bytes()));
  const char* error = b.count(1) != n || b.count(3) != n
                          ? "the residual and the new residual must have the gradient's size"
                          : cast_check(from, to, n, b.count(2));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    const CastFeedbackArgs a{from,
                             to,
                             b.at<void>(0, i),
                             b.at<const float>(1, i),
                             b.at<void>(2, i),
                             b.at<float>(3, i)};
    parallel_for(runner, n, kElementsPerTask, [&](int64_t i0, int64_t i1) { cast_feedback_range(a, i0, i1); });
  });
}

// Decode-and-accumulate: the rows converted and added in row order, a chunk
// of elements at a time (each row's part a loop of its own, which
// vectorizes), so that no float32 row is written out.
template <typename In>
JC_CPU_LOOP void sum_rows_t(const In* v, int64_t rows, int64_t n, int64_t i0, int64_t i1, float* out) {
  for (int64_t i = i0; i < i1; ++i) out[i] = to_f32(v[i]);
  for (int64_t r = 1; r < rows; ++r) {
    const In* row = v + r * n;
    for (int64_t i = i0; i < i1; ++i) out[i] = out[i] + to_f32(row[i]);
  }
  for (int64_t i = i0; i < i1; ++i) out[i] = canonical_nan(out[i]);
}

ffi::Error CastDecodeSumImpl(ffi::ThreadPool pool, ffi::AnyBuffer values, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto dims = values.dimensions();
  const DType from = dtype_of(values.element_type());
  if (dims.size() != 2 || out->dimensions().size() != 1 || dims[1] != out->dimensions()[0])
    return invalid("expects values [rows, n] and a flat output of n");
  if (from != DType::kBF16 && from != DType::kF16) return invalid("values must be bfloat16 or float16");
  const int64_t rows = dims[0], n = dims[1];
  float* o = out->typed_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  if (rows == 0) {
    std::fill(o, o + n, 0.0f);
    return ffi::Error::Success();
  }
  PoolRunner runner(pool);
  const int64_t chunk = std::max<int64_t>(1024, kElementsPerTask / rows);
  parallel_for(runner, n, chunk, [&](int64_t i0, int64_t i1) {
    for (int64_t c = i0; c < i1; c += chunk) {
      const int64_t c1 = std::min(i1, c + chunk);
      if (from == DType::kBF16)
        sum_rows_t(static_cast<const bf16_t*>(values.untyped_data()), rows, n, c, c1, o);
      else
        sum_rows_t(static_cast<const f16_t*>(values.untyped_data()), rows, n, c, c1, o);
    }
  });
  return ffi::Error::Success();
}

JAXCOMP_REGISTER(kCast, CastImpl);
JAXCOMP_REGISTER(kCastEncodeFeedback, CastFeedbackImpl);
JAXCOMP_REGISTER(kCastDecodeSum, CastDecodeSumImpl);

}  // namespace
}  // namespace jaxcomp
