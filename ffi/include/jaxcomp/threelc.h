// 3LC (Lim, Andersen, Kaminsky, SysML 2019, section 3) bodies shared by the
// CPU handlers (ffi/threelc_ops.cc) and the CUDA kernels (cuda/threelc_ops.cu).
// Twin: jaxcomp/ops/threelc.py.
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

#include "jaxcomp/common.h"
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

}  // namespace jaxcomp
