// Float casts (the Cast codec's encode and decode), shared by ffi/cast.cc and
// cuda/cast.cu. The conversions themselves are common.h's to_f32 and
// from_f32 (round to nearest even, XLA's NaN handling); twin: astype
// (jaxcomp/codecs/cast.py).
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

// One output element per input element.
JC_HD int64_t cast_size(int64_t n) { return n; }

inline const char* cast_check(DType from, DType to, int64_t n, int64_t out) {
  if (from == DType::kOther) return kBadInputType;
  if (to == DType::kOther) return kBadOutputType;
  if (out != cast_size(n)) return "input and output sizes differ";
  return nullptr;
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The target of ffi/cast.cc and cuda/cast.cu (jaxcomp/registry.h):
//   x -> x converted, round to nearest even (the output's dtype)
inline constexpr Target kCast{"jaxcomp_cast"};
//   encode_feedback (CPU): x (f32/bf16/f16), residual (f32, x's length) ->
//   values (bfloat16 or float16, the result's dtype), new residual (f32):
//   acc = f32(x) + residual converted, and acc - f32(values)
inline constexpr Target kCastEncodeFeedback{"jaxcomp_cast_encode_feedback"};
//   decode_sum (CPU): values [rows, n] (bfloat16 or float16) -> the rows'
//   sum, flat float32: ((row 0 + row 1) + row 2) + ..., then common.h's NaN
//   rule
inline constexpr Target kCastDecodeSum{"jaxcomp_cast_decode_sum"};

}  // namespace jaxcomp
