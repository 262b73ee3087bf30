// 3LC (Lim, Andersen, Kaminsky, SysML 2019, section 3), shared by
// ffi/threelc.cc and cuda/threelc.cu: the bodies, the buffer sizes and the
// checks. Twin: jaxcomp/codecs/threelc.py.
//
// - Quantization (section 3.1): m = max|x| * s in float32; q = round(x / m),
//   half to even, which for |x| <= m is sign(x) when 2|x| > m and 0 otherwise
//   (2|x| is exact, so no division is needed). Digit q + 1 in {0, 1, 2}.
// - Base-3^5 packing (section 3.2): ternary.h.
// - Zero-run encoding (section 3.3): k consecutive bytes 121, 2 <= k <= 14,
//   become 243 + (k - 2), greedily from the start of each run; a chunk of one
//   stays 121. A stream is canonical (the only encoding the encoder writes)
//   when no 121 and no run byte below 255 is followed by a 121 or a run byte.
#pragma once

#include "jaxcomp/checks.h"
#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"
#include "jaxcomp/ternary.h"

namespace jaxcomp {

constexpr uint32_t kTlcZero = 121;  // five zero digits
constexpr uint32_t kTlcRunBase = 243;
constexpr int kTlcMaxRun = 14;

// The scale: max|x| (as abs bits, see abs_bits) times the multiplier.
JC_HD float threelc_scale(uint32_t max_abs_bits, float s) { return bits_f32(max_abs_bits) * s; }

// Digit q + 1 of one value; branch-free (vectorizes on CPU). NaN or an
// infinite m gives 1 (q = 0), and the decoded m * 0 is then NaN.
JC_HD uint32_t threelc_digit(float v, float m) {
  const uint32_t u = f32_bits(v);
  const float a2 = bits_f32(u & 0x7fffffffu) * 2.0f;
  const uint32_t big = a2 > m ? 1u : 0u;
  return 1u + big - 2u * (big & (u >> 31));
}

// The byte that encodes a chunk of k (1..14) consecutive 121s.
JC_HD uint32_t threelc_run_byte(uint32_t k) { return k == 1 ? kTlcZero : kTlcRunBase - 2u + k; }

// Base-3^5 bytes that one stream byte expands to.
JC_HD uint32_t threelc_expand_count(uint32_t b) { return b >= kTlcRunBase ? b - (kTlcRunBase - 2u) : 1u; }

// Whether stream bytes (a, b) may stand next to each other in a canonical
// stream: b may be a 121 or a run byte only after a literal or a run of 14.
JC_HD bool threelc_pair_ok(uint32_t a, uint32_t b) {
  const bool a_continues = a == kTlcZero || (a >= kTlcRunBase && a != 255u);
  const bool b_zero = b == kTlcZero || b >= kTlcRunBase;
  return !(a_continues && b_zero);
}

// Decoded value of digit d: (d - 1) * m (NaN when m is NaN or infinite and
// q = 0, as the twin computes it).
JC_HD float threelc_value(uint32_t d, float m) { return static_cast<float>(static_cast<int32_t>(d) - 1) * m; }

// ---------------------------------------------------------------------------
// Buffer sizes and checks
// ---------------------------------------------------------------------------
// Stream bytes per block of the CUDA scans; it sizes the work buffer. Must
// match BLOCK_BYTES in jaxcomp/codecs/threelc.py.
constexpr int64_t kTlcBlockBytes = 4096;
// Control words at the start of the CUDA part of the work buffer.
constexpr int64_t kTlcCtrlWords = 8;

// Buffers of n elements and a stream of `capacity` bytes: the stream and one
// scale, length and overflow flag are the payload; `work` (uint8) holds the
// M base-3^5 bytes, rounded up to 8, then the CUDA scans' control words and
// two int64 counters per block (the CPU uses only the bytes).
struct ThreelcSizes {
  int64_t bytes;   // M = ceil(n / 5) base-3^5 bytes
  int64_t blocks;  // blocks of kTlcBlockBytes over the longer of M and the stream
  int64_t work;
};

JC_HD ThreelcSizes threelc_sizes(int64_t n, int64_t capacity) {
  const int64_t m = base3_bytes(n);
  const int64_t longer = m > capacity ? m : capacity;
  const int64_t blocks = (longer + kTlcBlockBytes - 1) / kTlcBlockBytes;
  return ThreelcSizes{m, blocks, (m + 7) / 8 * 8 + 4 * kTlcCtrlWords + 2 * 8 * blocks};
}

// The sparsity multiplier s, passed as its float32 bits.
JC_HD float threelc_sparsity(int64_t bits) { return bits_f32(static_cast<uint32_t>(bits)); }

// The checks both directions share, after the element type and count.
inline const char* threelc_check_buffers(int64_t n, int64_t capacity, int64_t scale, int64_t length,
                                         int64_t overflow, int64_t work) {
  if (scale != 1 || length != 1 || overflow != 1) return "scale, length and overflow must have one element each";
  if (work < threelc_sizes(n, capacity).work) return "work buffer is too small";
  return nullptr;
}

// x of n elements -> stream of `capacity` bytes, scale, length, overflow, work.
inline const char* threelc_check_encode(DType x, int64_t n, int64_t sparsity_bits, int64_t capacity, int64_t scale,
                                        int64_t length, int64_t overflow, int64_t work) {
  if (x == DType::kOther) return kBadInputType;
  if (n >= kElementLimit) return kTooManyInputs;
  if (sparsity_bits < 0 || sparsity_bits > 0xffffffffll) return "sparsity_bits must be float32 bits";
  const float s = threelc_sparsity(sparsity_bits);
  if (!(s >= 1.0f && s < 2.0f)) return "sparsity must be in [1.0, 2.0)";
  return threelc_check_buffers(n, capacity, scale, length, overflow, work);
}

// Error feedback: x of n elements and its float32 residual -> the encode's
// buffers and the new residual (float32, n elements).
inline const char* threelc_check_feedback(DType x, int64_t n, int64_t sparsity_bits, int64_t capacity,
                                          int64_t residual, int64_t scale, int64_t length, int64_t overflow,
                                          int64_t kept, int64_t work) {
  if (residual != n || kept != n) return "the residual and the new residual must have x's length";
  return threelc_check_encode(x, n, sparsity_bits, capacity, scale, length, overflow, work);
}

// Stream of `capacity` bytes, scale, length, overflow -> out of n elements, work.
inline const char* threelc_check_decode(DType out, int64_t n, int64_t capacity, int64_t scale, int64_t length,
                                        int64_t overflow, int64_t work) {
  if (out == DType::kOther) return kBadOutputType;
  if (n >= kElementLimit) return "outputs are limited to 2^32 - 1 elements";
  return threelc_check_buffers(n, capacity, scale, length, overflow, work);
}

// ---------------------------------------------------------------------------
// FFI targets
// ---------------------------------------------------------------------------
// The targets of ffi/threelc.cc and cuda/threelc.cu (jaxcomp/registry.h).
// Their handlers take the operands and results, then the attributes, in
// order:
//   encode: x (flat f32/bf16/f16) -> stream (capacity bytes), scale m [1],
//           length of the whole stream [1], overflow flag [1], work
//           (threelc_sizes; what it holds is each backend's)
inline constexpr Target kThreelcEncode{"jaxcomp_threelc_encode",
                                       "sparsity_bits"};  // float32 bits of s
//   encode_feedback (CPU): x, residual (f32, x's length) -> stream, scale,
//           length, overflow, the new residual (f32), work: the payload of
//           f32(x) + residual and what it leaves out, in one call
inline constexpr Target kThreelcEncodeFeedback{"jaxcomp_threelc_encode_feedback", "sparsity_bits"};
//   decode: stream, scale [1], length [1], overflow [1] -> flat output, work
inline constexpr Target kThreelcDecode{"jaxcomp_threelc_decode"};

}  // namespace jaxcomp
