// The CPU kernels as a table of plain function pointers, one table per
// instruction set (see cpu_kernels.inc); cpu_ops.cc chooses one at load time.
#pragma once

#include <cstdint>

namespace jaxcomp {

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Encode over buckets [b0, b1) of a flat input of n elements.
struct EncodeArgs {
  DType dtype;
  const void* x;
  int64_t n;
  int64_t b0, b1;
  int bucket;
};

// Decode buckets [b0, b1) into a flat output of n elements.
struct DecodeArgs {
  DType dtype;
  void* out;
  int64_t n;
  int64_t b0, b1;
  int bucket;
};

struct KernelTable {
  void (*qsgd_encode)(const EncodeArgs&, int bits, bool l2, uint32_t k0, uint32_t k1, uint8_t* packed,
                      float* scales);
  void (*qsgd_decode)(const DecodeArgs&, int bits, const uint8_t* packed, const float* scales);
  void (*int8_encode)(const EncodeArgs&, int8_t* q, float* scales);
  void (*int8_decode)(const DecodeArgs&, const int8_t* q, const float* scales);
  void (*onebit_encode)(const EncodeArgs&, uint8_t* bits, float* means);
  void (*onebit_decode)(const DecodeArgs&, const uint8_t* bits, const float* means);
  void (*cast)(DType from, DType to, const void* in, void* out, int64_t i0, int64_t i1);
  // TernGrad: per-bucket max|v| over buckets [b0, b1); then bytes [i0, i1) of
  // the base-3^5 stream (each byte reads elements of five planes, so this pass
  // runs over bytes, after all scales are known); decode elements [e0, e1).
  void (*terngrad_scales)(const EncodeArgs&, float* scales);
  void (*terngrad_pack)(DType dtype, const void* x, int64_t n, int bucket, const float* scales, uint32_t k0,
                        uint32_t k1, int64_t i0, int64_t i1, uint8_t* trits);
  void (*terngrad_decode)(DType dtype, void* out, int64_t n, int bucket, const uint8_t* trits,
                          const float* scales, int64_t e0, int64_t e1);
  // Natural compression over buckets [b0, b1): one code byte per element
  // (codes has n entries, no padding) and the bucket's top exponent.
  void (*natural_encode)(const EncodeArgs&, bool stochastic, uint32_t k0, uint32_t k1, uint8_t* codes,
                         uint8_t* tops);
  void (*natural_decode)(const DecodeArgs&, const uint8_t* codes, const uint8_t* tops);
};

namespace isa_base {
KernelTable table();
}
#if defined(JAXCOMP_HAVE_AVX2)
namespace isa_avx2 {
KernelTable table();
}
#endif

}  // namespace jaxcomp
