// 1-bit SGD (Seide et al. 2014; the study, section 2.2, "reshaped" into
// buckets), shared by ffi/onebit.cc and cuda/onebit.cu: the bodies, the
// payload sizes and the checks. Twin: jaxcomp/codecs/onebit.py.
//
// Bit 1 for v >= 0, decoded to avg+ (the mean of the bucket's non-negative
// values), bit 0 to avg-; both means are halving-tree sums (common.h) divided
// by the counts.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"

namespace jaxcomp {

JC_HD float onebit_mean(float sum, uint32_t count) {
  return count > 0 ? sum / static_cast<float>(count) : 0.0f;
}

// ---------------------------------------------------------------------------
// Payload sizes and checks
// ---------------------------------------------------------------------------
// Element counts of the payload of n elements: one bit per element of every
// bucket, packed (uint8), and (avg+, avg-) per bucket (float32).
struct OnebitSizes {
  int64_t bits;
  int64_t means;
};

JC_HD OnebitSizes onebit_sizes(int64_t n, int64_t bucket) {
  const int64_t nb = num_buckets(n, bucket);
  return OnebitSizes{nb * bucket / 8, 2 * nb};
}

inline const char* onebit_check_encode(DType x, int64_t n, int64_t bits, int64_t means, int64_t bucket) {
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const OnebitSizes want = onebit_sizes(n, bucket);
  return check_payload(bits, want.bits, means, want.means);
}

inline const char* onebit_check_decode(DType out, int64_t n, int64_t bits, int64_t means, int64_t bucket) {
  if (const char* e = check_bucketed_output(out, bucket)) return e;
  const OnebitSizes want = onebit_sizes(n, bucket);
  return check_payload(bits, want.bits, means, want.means, "means buffer has the wrong size");
}

}  // namespace jaxcomp
