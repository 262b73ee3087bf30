// Per-element and per-bucket bodies of the fixed-rate codecs, shared by the
// CPU handlers and the CUDA kernels. The twins are in jaxcomp/ops/*.py.
//
// Reductions that depend on order (sums) use the halving tree
//   for (w = B/2; w >= 1; w /= 2) a[i] += a[i + w]   (i < w)
// over a power-of-two bucket B padded with zeros: the CPU loops, the
// classic shared-memory CUDA reduction and the jnp twin all add in this order,
// which is what makes the backends bit-identical.
#pragma once

#include "jaxcomp/common.h"

namespace jaxcomp {

// ---------------------------------------------------------------------------
// QSGD (Alistarh et al. 2017; the multi-GPU low-precision study, section 2.3).
// s = 2^(bits-1) - 1 levels; code = sign << (bits-1) | level.
// ---------------------------------------------------------------------------
JC_HD float qsgd_inv(float scale, int s) { return scale > 0.0f ? static_cast<float>(s) / scale : 0.0f; }
// Steps multiply by a float32 reciprocal rather than divide: XLA rewrites a
// division by a constant into that multiplication, so the twins can only
// match this form.
JC_HD float qsgd_step(float scale, int s) { return scale * (1.0f / static_cast<float>(s)); }

// r = |v| * inv is the position on the level grid; the level is floor(r)
// rounded up with probability frac(r), so E[level] = r (unbiased).
JC_HD uint32_t qsgd_code(float v, float inv, int s, int bits, float u) {
  const float fs = static_cast<float>(s);
  float r = (v < 0.0f ? -v : v) * inv;
  r = r < fs ? r : fs;  // rounding slop above s, and NaN, clamp to s
  // r >= 0, so truncation is floor (and vectorizes without SSE4.1).
  const uint32_t fl = static_cast<uint32_t>(static_cast<int32_t>(r));
  const float frac = r - static_cast<float>(fl);  // exact
  uint32_t level = fl + (u < frac ? 1u : 0u);
  level = level < static_cast<uint32_t>(s) ? level : static_cast<uint32_t>(s);
  const uint32_t sign = v < 0.0f ? 1u : 0u;
  return (sign << (bits - 1)) | level;
}

JC_HD float qsgd_value(uint32_t code, float step, int bits) {
  const uint32_t level = code & ((1u << (bits - 1)) - 1u);
  const float mag = static_cast<float>(level) * step;
  return (code >> (bits - 1)) ? -mag : mag;
}

// v^2 as the sum of three exact products: v = h + l with h = v's top 12
// significant bits, so h*h, h*l and l*l are exact in float32. Any FMA
// contraction of this expression (XLA contracts multiplies that feed adds, on
// CPU and GPU; the kernels never do) gives the same bits, which is what lets
// the twins reproduce the L2 norm exactly. Within 2^-23 of the rounded square.
JC_HD float exact_square(float v) {
  const float h = bits_f32(f32_bits(v) & 0xfffff000u);
  const float l = v - h;
  return (h * h + (h * l) * 2.0f) + l * l;
}

// ---------------------------------------------------------------------------
// Int8: 255 levels in [-127, 127], scale = max|v| per bucket, round to
// nearest even (the 3LC paper's "8-bit int" baseline).
// ---------------------------------------------------------------------------
JC_HD float int8_inv(float maxabs) { return maxabs > 0.0f ? 127.0f / maxabs : 0.0f; }
JC_HD float int8_step(float maxabs) { return maxabs * (1.0f / 127.0f); }

JC_HD int8_t int8_code(float v, float inv) {
  float t = v * inv;
  t = t < -127.0f ? -127.0f : t;
  t = t > 127.0f ? 127.0f : t;
  t = (t == t) ? t : 0.0f;  // NaN (only when the bucket scale is not finite)
  // Round half to even: adding and removing 1.5 * 2^23 is exact for |t| < 2^22.
  t = (t + 12582912.0f) - 12582912.0f;
  return static_cast<int8_t>(static_cast<int32_t>(t));
}

JC_HD float int8_value(int8_t q, float step) { return static_cast<float>(q) * step; }

// ---------------------------------------------------------------------------
// 1-bit SGD (Seide et al. 2014; the study, section 2.2, "reshaped" into
// buckets): bit 1 for v >= 0, decoded to avg+; bit 0 to avg-.
// ---------------------------------------------------------------------------
JC_HD float onebit_mean(float sum, uint32_t count) {
  return count > 0 ? sum / static_cast<float>(count) : 0.0f;
}

}  // namespace jaxcomp
