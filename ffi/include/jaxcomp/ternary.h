// Base-3^5 packing of ternary values (the 3LC paper, section 3.2), shared by
// TernGrad and 3LC, on CPU and CUDA. Twin: jaxcomp/ops/ternary.py.
//
// A stream of n trits t in {-1, 0, 1} is shifted to digits t + 1 in {0, 1, 2},
// zero-padded (digit 1) to 5m values, m = ceil(n / 5), and split into five
// planes P0..P4 of m digits each (plane j holds elements j*m .. j*m + m - 1).
// Byte i is P0[i]*81 + P1[i]*27 + P2[i]*9 + P3[i]*3 + P4[i], in [0, 242];
// five zeros (digit 1) give 121.
#pragma once

#include "jaxcomp/common.h"

namespace jaxcomp {

// Number of bytes for n trits.
JC_HD int64_t base3_bytes(int64_t n) { return (n + 4) / 5; }

// Digits (0, 1 or 2) of planes 0..4 -> one byte.
JC_HD uint8_t base3_pack(uint32_t d0, uint32_t d1, uint32_t d2, uint32_t d3, uint32_t d4) {
  return static_cast<uint8_t>(d0 * 81u + d1 * 27u + d2 * 9u + d3 * 3u + d4);
}

// Digit of plane j (0..4) of a byte: (byte / 3^(4-j)) % 3. The divisions are
// multiply-shifts, exact for every byte value 0..255 (checked exhaustively),
// so they vectorize; bytes above 242 (never written) give the same digits as
// the exact integer formula the twin uses.
JC_HD uint32_t base3_digit(uint32_t byte, int plane) {
  const uint32_t mul = plane == 0 ? 810u : plane == 1 ? 2428u : plane == 2 ? 7282u : plane == 3 ? 21846u : 65536u;
  const uint32_t q = (byte * mul) >> 16;        // byte / 3^(4-plane)
  return q - 3u * ((q * 21846u) >> 16);         // q % 3 (q <= 255)
}

}  // namespace jaxcomp
