// What the families' buffer checks share. Each family header validates its
// buffers with plain functions over element counts and configuration that
// return nullptr or an error message; the CPU and the CUDA handlers call the
// same function and put the op name in front of the message, so both
// backends reject the same calls with the same words.
#pragma once

#include <cstdint>

#include "jaxcomp/common.h"

namespace jaxcomp {

// Element indices are 32-bit (the RNG counter, packed indices), so a tensor
// has fewer elements than this.
constexpr int64_t kElementLimit = int64_t{1} << 32;

JC_HD int64_t num_buckets(int64_t n, int64_t bucket) { return (n + bucket - 1) / bucket; }

JC_HD bool valid_bucket(int64_t b) { return b >= 8 && b <= (1 << 16) && (b & (b - 1)) == 0; }

constexpr const char* kBadInputType = "input must be float32, bfloat16 or float16";
constexpr const char* kBadOutputType = "output must be float32, bfloat16 or float16";
constexpr const char* kBadBucket = "bucket_size must be a power of two in [8, 65536]";
constexpr const char* kTooManyInputs = "inputs are limited to 2^32 - 1 elements";
constexpr const char* kBadPayload = "payload buffer has the wrong size";
constexpr char kBadScales[] = "scale buffer has the wrong size";  // an array: a template argument below

// A payload of a body (codes) and per-bucket side data (scales, means, tops)
// against the element counts its layout gives.
inline const char* check_payload(int64_t body, int64_t body_want, int64_t side, int64_t side_want,
                                 const char* bad_side = kBadScales) {
  if (body != body_want) return kBadPayload;
  if (side != side_want) return bad_side;
  return nullptr;
}

inline const char* check_seed(int64_t words) { return words != 2 ? "seed must have 2 uint32 words" : nullptr; }

// The first checks of every bucketed encoder: the input, the bucket size and
// the element limit, in this order.
inline const char* check_bucketed_input(DType x, int64_t n, int64_t bucket) {
  if (x == DType::kOther) return kBadInputType;
  if (!valid_bucket(bucket)) return kBadBucket;
  if (n >= kElementLimit) return kTooManyInputs;
  return nullptr;
}

// The first checks of every bucketed decoder.
inline const char* check_bucketed_output(DType out, int64_t bucket) {
  if (out == DType::kOther) return kBadOutputType;
  if (!valid_bucket(bucket)) return kBadBucket;
  return nullptr;
}

// ---------------------------------------------------------------------------
// The pair families' checks: a payload of codes and per-bucket side data
// (scales, means, tops), whose element counts for n elements in buckets of
// `bucket` the family's sizes function gives, and bucket_size the only
// attribute. A pair family's header defines the sizes; its handlers check
// with check_pair_encode<sizes> and check_pair_decode<sizes>.
// ---------------------------------------------------------------------------
struct PairSizes {
  int64_t codes;
  int64_t side;
};

// x of n elements -> codes and side data.
template <PairSizes (*kSizes)(int64_t n, int64_t bucket)>
inline const char* check_pair_encode(DType x, int64_t n, int64_t codes, int64_t side, int64_t bucket) {
  if (const char* e = check_bucketed_input(x, n, bucket)) return e;
  const PairSizes want = kSizes(n, bucket);
  return check_payload(codes, want.codes, side, want.side);
}

// Codes and side data -> out of n elements; kBadSide: the error for side
// data of the wrong size.
template <PairSizes (*kSizes)(int64_t n, int64_t bucket), const char* kBadSide = kBadScales>
inline const char* check_pair_decode(DType out, int64_t n, int64_t codes, int64_t side, int64_t bucket) {
  if (const char* e = check_bucketed_output(out, bucket)) return e;
  const PairSizes want = kSizes(n, bucket);
  return check_payload(codes, want.codes, side, want.side, kBadSide);
}

}  // namespace jaxcomp
