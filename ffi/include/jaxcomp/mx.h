// MX (OCP Microscaling v1.0: blocks of 32 values, one E8M0 scale each, FP8 /
// FP6 / FP4 elements bit-packed), shared by ffi/mx.cc and cuda/mx.cu: the
// element packing, the payload sizes and the checks. The rounding and the
// scale rule are minifloat.h's. Twin: jaxcomp/codecs/mx.py.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/minifloat.h"
#include "jaxcomp/registry.h"

namespace jaxcomp {

constexpr int kMxBlock = 32;

// Codes of `bits` (8, 6 or 4) bits, LSB first: FP6 as 4 codes in 3 bytes,
// FP4 as 2 per byte (the low nibble first). One block: 32 codes.
JC_HD void mx_pack(const uint8_t* codes, int bits, uint8_t* out) {
  if (bits == 8) {
    for (int i = 0; i < kMxBlock; ++i) out[i] = codes[i];
  } else if (bits == 4) {
    for (int i = 0; i < kMxBlock / 2; ++i) out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
  } else {
    for (int g = 0; g < kMxBlock / 4; ++g) {
      const uint32_t w = codes[4 * g] | (codes[4 * g + 1] << 6) | (codes[4 * g + 2] << 12) |
                         (static_cast<uint32_t>(codes[4 * g + 3]) << 18);
      out[3 * g] = static_cast<uint8_t>(w);
      out[3 * g + 1] = static_cast<uint8_t>(w >> 8);
      out[3 * g + 2] = static_cast<uint8_t>(w >> 16);
    }
  }
}

// Code i of a packed block.
JC_HD uint32_t mx_code(const uint8_t* in, int bits, int i) {
  if (bits == 8) return in[i];
  if (bits == 4) return (in[i >> 1] >> ((i & 1) * 4)) & 0xfu;
  const uint8_t* g = in + 3 * (i >> 2);
  const uint32_t w = g[0] | (g[1] << 8) | (static_cast<uint32_t>(g[2]) << 16);
  return (w >> (6 * (i & 3))) & 0x3fu;
}

struct MxSizes {
  int64_t codes;
  int64_t scales;
};

JC_HD MxSizes mx_sizes(int64_t n, int bits) {
  const int64_t nb = num_buckets(n, kMxBlock);
  return MxSizes{nb * kMxBlock * bits / 8, nb};
}

inline const char* mx_check_format(int64_t format) {
  return (format >= 0 && format < kNumMiniFormats) ? nullptr : "format must be in 0..4";
}

inline const char* mx_check_encode(DType x, int64_t n, int64_t seed, int64_t codes, int64_t scales, int64_t format,
                                   int64_t stochastic) {
  if (const char* e = check_seed(seed)) return e;
  if (const char* e = mx_check_format(format)) return e;
  if (stochastic != 0 && stochastic != 1) return "stochastic must be 0 or 1";
  if (const char* e = check_bucketed_input(x, n, kMxBlock)) return e;
  const MxSizes want = mx_sizes(n, mini_bits(mini_format(static_cast<int>(format))));
  return check_payload(codes, want.codes, scales, want.scales);
}

inline const char* mx_check_decode(DType out, int64_t n, int64_t codes, int64_t scales, int64_t format) {
  if (const char* e = mx_check_format(format)) return e;
  if (const char* e = check_bucketed_output(out, kMxBlock)) return e;
  const MxSizes want = mx_sizes(n, mini_bits(mini_format(static_cast<int>(format))));
  return check_payload(codes, want.codes, scales, want.scales);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/mx.cc and cuda/mx.cu (jaxcomp/registry.h). Their
// handlers take the operands and results, then the attributes, in order:
//   encode: x (flat f32/bf16/f16), seed (2 uint32 words)
//           -> packed element codes, scales (one E8M0 byte per block of 32)
inline constexpr Target kMxEncode{"jaxcomp_mx_encode",
                                  "format",       // element format, minifloat.h
                                  "stochastic"};  // 1: stochastic, 0: nearest even
//   decode: codes, scales -> flat output, the input's dtype
inline constexpr Target kMxDecode{"jaxcomp_mx_decode", "format"};
//   decode_sum (CPU): codes [rows, bytes], side [rows, buckets] -> the rows'
//               sum, flat float32; the decoder's attributes
inline constexpr Target kMxDecodeSum{"jaxcomp_mx_decode_sum", "format"};
//   encode_feedback (CPU): x, residual (f32, x's length), seed -> codes, scales
//           of acc = float32(x) + residual, and acc - decode (f32)
inline constexpr Target kMxEncodeFeedback{"jaxcomp_mx_encode_feedback", "format", "stochastic"};

}  // namespace jaxcomp
