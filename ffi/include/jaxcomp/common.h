// Shared, XLA-free building blocks of every jaxcomp kernel.
//
// Everything here is marked host+device so the CPU handlers (ffi/) and the
// CUDA kernels (cuda/) run the same bodies. The pure-JAX twins in
// jaxcomp/codecs/ and jaxcomp/ops/ implement exactly the same arithmetic; any
// change here must be mirrored there (the bit-exactness tests catch a
// mismatch).
//
// Reductions that depend on order (sums) use the halving tree
//   for (w = B/2; w >= 1; w /= 2) a[i] += a[i + w]   (i < w)
// over a power-of-two bucket B padded with zeros: the CPU loops, the
// classic shared-memory CUDA reduction and the jnp twin all add in this order,
// which is what makes the backends bit-identical.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define JC_HD __host__ __device__ __forceinline__
#else
#define JC_HD inline
#endif

namespace jaxcomp {

// ---------------------------------------------------------------------------
// Bit casts.
// ---------------------------------------------------------------------------
#if defined(__CUDA_ARCH__)
JC_HD uint32_t f32_bits(float f) { return __float_as_uint(f); }
JC_HD float bits_f32(uint32_t u) { return __uint_as_float(u); }
#else
// std::bit_cast (C++20): a copy of the object's bytes.
template <typename To, typename From>
inline To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

JC_HD uint32_t f32_bits(float f) { return bit_cast<uint32_t>(f); }
JC_HD float bits_f32(uint32_t u) { return bit_cast<float>(u); }
#endif

// ---------------------------------------------------------------------------
// Counter-based random bits: a pure function of (k0, k1, element index).
// The key words are mixed first (a = mix32(k0), b = mix32(k1 ^ a): loop
// invariants, hoisted by compilers), so that no two keys give shifted copies
// of one stream; the index, offset by a and masked by b, then goes through
// one round of the "lowbias32" integer hash (Wellons, 2018), a bijection with
// full avalanche. One round, not two: it is the most expensive part of the
// QSGD encode loop.
// Twin: jaxcomp/ops/rng.py.
// ---------------------------------------------------------------------------
JC_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

JC_HD uint32_t rng_bits(uint32_t k0, uint32_t k1, uint32_t index) {
  const uint32_t a = mix32(k0);
  const uint32_t b = mix32(k1 ^ a);
  return mix32((index + a) ^ b);
}

// Uniform in [0, 1) on the 2^-24 grid; exact in float32.
JC_HD float rng_uniform(uint32_t k0, uint32_t k1, uint32_t index) {
  // Through int32: the value fits in 24 bits, and signed conversion vectorizes.
  return static_cast<float>(static_cast<int32_t>(rng_bits(k0, k1, index) >> 8)) * 5.9604644775390625e-08f;
}

// ---------------------------------------------------------------------------
// 16-bit float storage types and conversions, done on integer bits so they do
// not depend on the FPU's denormal mode. Rounding is to nearest even; NaN
// handling follows XLA's CPU conversions (bf16: canonical quiet NaN with the
// sign; f16: quiet NaN keeping the top payload bits).
// ---------------------------------------------------------------------------
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

// Written without branches (every case computed, then selected) so that the
// CPU loops vectorize them.
JC_HD float to_f32(float v) { return v; }
JC_HD float to_f32(bf16_t v) { return bits_f32(static_cast<uint32_t>(v.bits) << 16); }
JC_HD float to_f32(f16_t v) {
  const uint32_t h = v.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // Normal and inf/NaN: rebias the exponent (inf/NaN keep the max exponent;
  // a NaN comes out quiet, as XLA converts it).
  const uint32_t quiet = (exp == 0x1fu && mant != 0) ? 0x400000u : 0u;
  const uint32_t wide = sign | ((exp == 0x1fu ? 0xffu : exp + 112u) << 23) | (mant << 13) | quiet;
  // Subnormal (and zero): mant * 2^-24 is exact and a normal float32.
  const uint32_t sub = sign | f32_bits(static_cast<float>(static_cast<int32_t>(mant)) * 5.9604644775390625e-08f);
  return bits_f32(exp == 0 ? sub : wide);
}

JC_HD uint16_t f32_to_bf16_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t nan = ((u >> 16) & 0x8000u) | 0x7fc0u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

JC_HD uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }
JC_HD uint32_t select_bits(bool c, uint32_t a, uint32_t b) { return (a & mask_if(c)) | (b & ~mask_if(c)); }

JC_HD uint16_t f32_to_f16_bits(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  // Normal half: round the low 13 bits to nearest even, rebias by 112.
  const uint32_t normal = (a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13;
  // Subnormal half: shift the full significand by 126 - e in [14, 24] (the
  // clamp only keeps the shift defined in lanes where it is not selected).
  const int32_t e = static_cast<int32_t>(a >> 23);
  const int32_t sh = 126 - e;
  const uint32_t shift = static_cast<uint32_t>(sh < 14 ? 14 : (sh > 24 ? 24 : sh));
  const uint32_t m = (a & 0x7fffffu) | 0x800000u;
  const uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t up = static_cast<uint32_t>(rem > half) | (static_cast<uint32_t>(rem == half) & q);
  const uint32_t sub = q + (up & 1u);
  // Selects through masks: GCC turns a chain of ternaries on one value into
  // range-check branches, which do not vectorize.
  uint32_t r = sub & mask_if(a >= 0x33000000u);  // below half the smallest subnormal: 0
  r = select_bits(a >= 0x38800000u, normal, r);
  r = select_bits(a >= 0x477ff000u, 0x7c00u, r);  // rounds to >= 65520: inf
  r = select_bits(a > 0x7f800000u, nan, r);
  return static_cast<uint16_t>(sign | r);
}

template <typename T>
JC_HD T from_f32(float v);
template <>
JC_HD float from_f32<float>(float v) {
  return v;
}
template <>
JC_HD bf16_t from_f32<bf16_t>(float v) {
  return bf16_t{f32_to_bf16_bits(v)};
}
template <>
JC_HD f16_t from_f32<f16_t>(float v) {
  return f16_t{f32_to_f16_bits(v)};
}

// The NaN rule of the decoders: every NaN a decoder writes is the quiet NaN
// 0x7fc00000 (0x7fc0 as bfloat16, 0x7e00 as float16: the conversions above
// keep it so), whatever NaN the arithmetic made (x86 gives 0xffc00000 for an
// invalid operation or passes an operand's payload on; NVIDIA GPUs give
// 0x7fffffff). Cast, TopK and Identity copy values and keep their NaNs.
JC_HD float canonical_nan(float v) { return v != v ? bits_f32(0x7fc00000u) : v; }

template <typename T>
JC_HD T decoded(float v) {
  return from_f32<T>(canonical_nan(v));
}

// The element types of the float buffers, as the handlers see them.
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kOther = 3 };

// Runs fn(T{}) with T the storage type of dt (one of the three floats; the
// handlers have checked it).
template <typename Fn>
inline void with_type(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kBF16: return fn(bf16_t{});
    case DType::kF16: return fn(f16_t{});
    default: return fn(float{});
  }
}

// |v| as ordered integer bits: for non-negative floats the integer order is
// the float order, and every NaN sorts above +inf, so an integer max over a
// bucket is an exact, order-independent max|v| that propagates NaN.
JC_HD uint32_t abs_bits(float v) { return f32_bits(v) & 0x7fffffffu; }

// ---------------------------------------------------------------------------
// Bit packing: groups of 8 codes of `bits` bits (1..4) become `bits` bytes,
// code j of a group at bit offset j*bits, little-endian. 8-bit codes are
// stored as they are.
// ---------------------------------------------------------------------------
JC_HD void pack8(const uint8_t* codes, int bits, uint8_t* out) {
  uint32_t w = 0;
  for (int j = 0; j < 8; ++j) w |= static_cast<uint32_t>(codes[j]) << (j * bits);
  for (int b = 0; b < bits; ++b) out[b] = static_cast<uint8_t>(w >> (8 * b));
}

JC_HD uint32_t unpack_code(const uint8_t* group, int bits, int j) {
  uint32_t w = 0;
  for (int b = 0; b < bits; ++b) w |= static_cast<uint32_t>(group[b]) << (8 * b);
  return (w >> (j * bits)) & ((1u << bits) - 1u);
}

}  // namespace jaxcomp
