// 3LC on the CPU (Lim, Andersen, Kaminsky, SysML 2019, section 3): the FFI
// targets jaxcomp_threelc_encode and jaxcomp_threelc_decode. Bodies in
// include/jaxcomp/threelc.h; twin in jaxcomp/ops/threelc.py.
//
// Encode, each pass threaded:
//   1. max|x| over the elements (integer max of abs bits: order-free);
//   2. quantize and base-3^5 pack into the work buffer (M = ceil(n/5) bytes);
//   3. zero-run encoding, as the paper's parallel sketch (section 3.3): the
//      bytes are cut into partitions; each partition counts the output bytes
//      of the literals and runs that *start* in it (a run crossing into the
//      next partition belongs to the partition where it starts, which reads
//      on past its end; the next one skips the run's tail), an exclusive
//      prefix sum gives each partition's output offset, and a second pass
//      writes. Each run is split greedily from its own start, so the output
//      is byte-identical to the serial encoding whatever the partitioning.
// Decode: count each partition's expanded size and check it (canonical
// pairs, also across partition boundaries), prefix sum, check the total,
// expand into the work buffer, then dequantize over the elements.
#include <cstring>
#include <limits>

#include "cpu_runtime.h"
#include "jaxcomp/threelc.h"

namespace jaxcomp {
namespace {

// Bytes of base-3^5 stream per partition of the zero-run passes.
constexpr int64_t kPartBytes = kElementsPerTask / 5;

int64_t num_parts(int64_t bytes) { return std::max<int64_t>(1, std::min<int64_t>(bytes / kPartBytes, 4096)); }

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
template <typename T>
uint32_t max_abs_bits(const T* x, int64_t i0, int64_t i1) {
  uint32_t m = 0;
  for (int64_t i = i0; i < i1; ++i) m = std::max(m, abs_bits(to_f32(x[i])));
  return m;
}

template <typename T>
uint32_t digit_at(const T* x, int64_t n, int64_t e, float m) {
  return e < n ? threelc_digit(to_f32(x[e]), m) : 1u;
}

// Bytes [i0, i1) of the base-3^5 packing of the digits.
template <typename T>
void pack_bytes(const T* x, int64_t n, int64_t M, float m, int64_t i0, int64_t i1, uint8_t* b) {
  // Below `full`, all five planes hold real elements (the padding is at the
  // end of plane 4).
  const int64_t full = std::max<int64_t>(0, std::min<int64_t>(i1, n - 4 * M));
  const T* x0 = x;
  const T* x1 = x + M;
  const T* x2 = x + 2 * M;
  const T* x3 = x + 3 * M;
  const T* x4 = x + 4 * M;
  int64_t i = i0;
  for (; i < full; ++i) {
    const uint32_t v = threelc_digit(to_f32(x0[i]), m) * 81u + threelc_digit(to_f32(x1[i]), m) * 27u +
                       threelc_digit(to_f32(x2[i]), m) * 9u + threelc_digit(to_f32(x3[i]), m) * 3u +
                       threelc_digit(to_f32(x4[i]), m);
    b[i] = static_cast<uint8_t>(v);
  }
  for (; i < i1; ++i) {
    b[i] = base3_pack(digit_at(x, n, i, m), digit_at(x, n, M + i, m), digit_at(x, n, 2 * M + i, m),
                      digit_at(x, n, 3 * M + i, m), digit_at(x, n, 4 * M + i, m));
  }
}

// End of the run of 121s that starts at i (first index past it, <= M).
inline int64_t run_end(const uint8_t* b, int64_t M, int64_t i) {
  constexpr uint64_t kZeros = 0x7979797979797979ull;  // eight 121s
  while (i + 8 <= M) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    const uint64_t diff = w ^ kZeros;
    if (diff != 0) return i + (__builtin_ctzll(diff) >> 3);  // little-endian: first differing byte
    i += 8;
  }
  while (i < M && b[i] == kTlcZero) ++i;
  return i;
}

// Zero-run encoding of the literals and runs that start in [i0, i1): returns
// their output length; with WRITE, also writes them at out[o0...], dropping
// bytes at or past cap.
template <bool WRITE>
int64_t zre_part(const uint8_t* b, int64_t M, int64_t i0, int64_t i1, uint8_t* out, int64_t o0, int64_t cap) {
  int64_t i = i0;
  // The tail of a run that started in an earlier partition belongs to it.
  if (i > 0 && b[i - 1] == kTlcZero) i = run_end(b, M, i);
  int64_t o = o0;
  while (i < i1) {
    // Literals up to the next 121.
    const uint8_t* p = static_cast<const uint8_t*>(std::memchr(b + i, static_cast<int>(kTlcZero), i1 - i));
    const int64_t lit_end = p ? p - b : i1;
    if (WRITE && o < cap) std::memcpy(out + o, b + i, std::min<int64_t>(lit_end - i, cap - o));
    o += lit_end - i;
    i = lit_end;
    if (i >= i1) break;
    const int64_t end = run_end(b, M, i);
    int64_t len = end - i;
    while (len > 0) {
      const int64_t k = std::min<int64_t>(len, kTlcMaxRun);
      if (WRITE && o < cap) out[o] = static_cast<uint8_t>(threelc_run_byte(static_cast<uint32_t>(k)));
      ++o;
      len -= k;
    }
    i = end;
  }
  return o - o0;
}

template <typename T, int PLANE>
void dequant_run(const uint8_t* in, float m, int64_t run, T* out) {
  for (int64_t i = 0; i < run; ++i) out[i] = from_f32<T>(threelc_value(base3_digit(in[i], PLANE), m));
}

// Elements [e0, e1) from the expanded base-3^5 bytes.
template <typename T>
void dequant(const uint8_t* b, int64_t M, float m, int64_t e0, int64_t e1, T* out) {
  int64_t e = e0;
  while (e < e1) {
    const int64_t plane = e / M;
    const int64_t run = std::min<int64_t>(e1 - e, (plane + 1) * M - e);
    const uint8_t* in = b + (e - plane * M);
    switch (plane) {
      case 0: dequant_run<T, 0>(in, m, run, out + e); break;
      case 1: dequant_run<T, 1>(in, m, run, out + e); break;
      case 2: dequant_run<T, 2>(in, m, run, out + e); break;
      case 3: dequant_run<T, 3>(in, m, run, out + e); break;
      default: dequant_run<T, 4>(in, m, run, out + e); break;
    }
    e += run;
  }
}

// AVX2 builds of the hot loops (flatten inlines the loops into them, so they
// vectorize with 32-byte vectors), chosen at run time like the kernel tables
// of cpu_ops.cc. Same arithmetic: only the vector width changes.
#if defined(JAXCOMP_HAVE_AVX2) && defined(JAXCOMP_X86)
#define JC_TLC_AVX2 1
template <typename T>
__attribute__((target("avx2"), flatten)) uint32_t max_abs_bits_avx2(const T* x, int64_t i0, int64_t i1) {
  return max_abs_bits<T>(x, i0, i1);
}
template <typename T>
__attribute__((target("avx2"), flatten)) void pack_bytes_avx2(const T* x, int64_t n, int64_t M, float m, int64_t i0,
                                                              int64_t i1, uint8_t* b) {
  pack_bytes<T>(x, n, M, m, i0, i1, b);
}
template <typename T>
__attribute__((target("avx2"), flatten)) void dequant_avx2(const uint8_t* b, int64_t M, float m, int64_t e0,
                                                           int64_t e1, T* out) {
  dequant<T>(b, M, m, e0, e1, out);
}
bool use_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
#endif

template <typename T>
uint32_t max_abs_bits_isa(const T* x, int64_t i0, int64_t i1) {
#if defined(JC_TLC_AVX2)
  if (use_avx2()) return max_abs_bits_avx2<T>(x, i0, i1);
#endif
  return max_abs_bits<T>(x, i0, i1);
}

template <typename T>
void pack_bytes_isa(const T* x, int64_t n, int64_t M, float m, int64_t i0, int64_t i1, uint8_t* b) {
#if defined(JC_TLC_AVX2)
  if (use_avx2()) return pack_bytes_avx2<T>(x, n, M, m, i0, i1, b);
#endif
  pack_bytes<T>(x, n, M, m, i0, i1, b);
}

template <typename T>
void dequant_isa(const uint8_t* b, int64_t M, float m, int64_t e0, int64_t e1, T* out) {
#if defined(JC_TLC_AVX2)
  if (use_avx2()) return dequant_avx2<T>(b, M, m, e0, e1, out);
#endif
  dequant<T>(b, M, m, e0, e1, out);
}

template <typename T>
void fill(T* out, int64_t e0, int64_t e1, T v) {
  for (int64_t e = e0; e < e1; ++e) out[e] = v;
}

// Runs fn(tag) with tag a value of the storage type of dtype.
template <typename Fn>
void with_type(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kF32: return fn(float{});
    case DType::kBF16: return fn(bf16_t{});
    case DType::kF16: return fn(f16_t{});
  }
}

bool valid_sparsity(float s) { return s >= 1.0f && s < 2.0f; }

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> stream,
                      ffi::ResultBuffer<ffi::F32> scale, ffi::ResultBuffer<ffi::S32> length,
                      ffi::ResultBuffer<ffi::U8> overflow, ffi::ResultBuffer<ffi::U8> work, int64_t sparsity_bits) {
  const char* op = "jaxcomp_threelc_encode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(x.element_type(), &dt)) return invalid(op, "input must be float32, bfloat16 or float16");
  const int64_t n = x.element_count();
  if (n >= (int64_t{1} << 32)) return invalid(op, "inputs are limited to 2^32 - 1 elements");
  if (sparsity_bits < 0 || sparsity_bits > 0xffffffffll) return invalid(op, "sparsity_bits must be float32 bits");
  const float s = bits_f32(static_cast<uint32_t>(sparsity_bits));
  if (!valid_sparsity(s)) return invalid(op, "sparsity must be in [1.0, 2.0)");
  const int64_t M = base3_bytes(n);
  if (scale->element_count() != 1 || length->element_count() != 1 || overflow->element_count() != 1)
    return invalid(op, "scale, length and overflow must have one element each");
  if (static_cast<int64_t>(work->element_count()) < M) return invalid(op, "work buffer is too small");
  const int64_t cap = stream->element_count();
  uint8_t* out = stream->typed_data();
  uint8_t* b = work->typed_data();

  // 1. The scale.
  std::atomic<uint32_t> mx{0};
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(x.untyped_data());
    parallel_for(pool, n, kElementsPerTask, [&](int64_t i0, int64_t i1) {
      const uint32_t local = max_abs_bits_isa<T>(xd, i0, i1);
      uint32_t cur = mx.load();
      while (local > cur && !mx.compare_exchange_weak(cur, local)) {
      }
    });
  });
  float m;
  {
    FlushDenormals fd;  // as XLA computes the product
    m = threelc_scale(mx.load(), s);
  }
  scale->typed_data()[0] = m;

  // 2. Quantize and pack.
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(x.untyped_data());
    parallel_for(pool, M, kElementsPerTask / 5,
                 [&](int64_t i0, int64_t i1) { pack_bytes_isa<T>(xd, n, M, m, i0, i1, b); });
  });

  // 3. Zero-run encoding: count per partition, prefix sum, write.
  const int64_t parts = num_parts(M);
  std::vector<int64_t> offs(parts + 1, 0);
  auto part_begin = [&](int64_t p) { return p * M / parts; };
  parallel_for(pool, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      offs[p + 1] = zre_part<false>(b, M, part_begin(p), part_begin(p + 1), nullptr, 0, 0);
  });
  for (int64_t p = 0; p < parts; ++p) offs[p + 1] += offs[p];
  const int64_t total = offs[parts];
  parallel_for(pool, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) zre_part<true>(b, M, part_begin(p), part_begin(p + 1), out, offs[p], cap);
  });
  if (total < cap) std::memset(out + total, 0, cap - total);
  length->typed_data()[0] = static_cast<int32_t>(total);
  overflow->typed_data()[0] = total > cap ? 1 : 0;
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::U8> stream, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::U8> overflow, ffi::Result<ffi::AnyBuffer> out,
                      ffi::ResultBuffer<ffi::U8> work) {
  const char* op = "jaxcomp_threelc_decode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  const int64_t n = out->element_count();
  if (n >= (int64_t{1} << 32)) return invalid(op, "outputs are limited to 2^32 - 1 elements");
  const int64_t M = base3_bytes(n);
  if (scale.element_count() != 1 || length.element_count() != 1 || overflow.element_count() != 1)
    return invalid(op, "scale, length and overflow must have one element each");
  if (static_cast<int64_t>(work->element_count()) < M) return invalid(op, "work buffer is too small");
  const int64_t cap = stream.element_count();
  const int64_t used = length.typed_data()[0];
  const uint32_t flag = overflow.typed_data()[0];
  if (used < 0) return invalid(op, "corrupted stream: negative length");
  if (flag > 1) return invalid(op, "corrupted stream: overflow flag is not 0 or 1");
  if ((flag == 1) != (used > cap)) {
    return invalid(op, flag == 1 ? "corrupted stream: overflow flag set but the length fits the buffer"
                                 : "corrupted stream: length " + std::to_string(used) + " exceeds the buffer (" +
                                       std::to_string(cap) + " bytes)");
  }
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  if (flag == 1) {
    // Overflowed: the stream is incomplete; NaN everywhere, never plausible numbers.
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      const T nan = from_f32<T>(std::numeric_limits<float>::quiet_NaN());
      parallel_for(pool, n, kElementsPerTask,
                   [&](int64_t e0, int64_t e1) { fill<T>(static_cast<T*>(o), e0, e1, nan); });
    });
    return ffi::Error::Success();
  }
  const uint8_t* in = stream.typed_data();
  uint8_t* b = work->typed_data();
  const float m = scale.typed_data()[0];

  // Expanded size and canonical form of each partition of the stream.
  const int64_t parts = num_parts(used);
  std::vector<int64_t> offs(parts + 1, 0);
  std::vector<int64_t> bad(parts, -1);
  auto part_begin = [&](int64_t p) { return p * used / parts; };
  parallel_for(pool, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i0 = part_begin(p), i1 = part_begin(p + 1);
      int64_t cnt = 0;
      uint32_t ok = 1;
      for (int64_t i = i0; i < i1; ++i) {
        cnt += threelc_expand_count(in[i]);
        if (i > 0) ok &= threelc_pair_ok(in[i - 1], in[i]) ? 1u : 0u;
      }
      offs[p + 1] = cnt;
      if (!ok) {
        for (int64_t i = std::max<int64_t>(i0, 1); i < i1; ++i) {
          if (!threelc_pair_ok(in[i - 1], in[i])) {
            bad[p] = i;
            break;
          }
        }
      }
    }
  });
  for (int64_t p = 0; p < parts; ++p) {
    if (bad[p] >= 0)
      return invalid(op, "corrupted stream: byte " + std::to_string(bad[p]) + " (" + std::to_string(in[bad[p]]) +
                             ") cannot follow " + std::to_string(in[bad[p] - 1]) + " in a zero-run encoding");
    offs[p + 1] += offs[p];
  }
  if (offs[parts] != M) {
    return invalid(op, "corrupted stream: it expands to " + std::to_string(offs[parts]) + " base-3^5 bytes, " +
                           std::to_string(n) + " elements need " + std::to_string(M));
  }
  // Expand (every offset is now within [0, M]).
  parallel_for(pool, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int64_t w = offs[p];
      for (int64_t i = part_begin(p), i1 = part_begin(p + 1); i < i1; ++i) {
        const uint32_t v = in[i];
        if (v < kTlcRunBase) {
          b[w++] = static_cast<uint8_t>(v);
        } else {
          const int64_t k = threelc_expand_count(v);
          std::memset(b + w, static_cast<int>(kTlcZero), k);
          w += k;
        }
      }
    }
  });
  with_type(dt, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(pool, n, kElementsPerTask,
                 [&](int64_t e0, int64_t e1) { dequant_isa<T>(b, M, m, e0, e1, static_cast<T*>(o)); });
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomp

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompThreelcEncode, jaxcomp::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::U8>>()    // stream, capacity bytes
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scale m, [1]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // length of the whole stream, [1]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // overflow flag, [1]
                                  .Ret<ffi::Buffer<ffi::U8>>()    // work: base-3^5 bytes (+ CUDA counters)
                                  .Attr<int64_t>("sparsity_bits"));  // float32 bits of s

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompThreelcDecode, jaxcomp::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // stream
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale, [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // length, [1]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // overflow, [1]
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Ret<ffi::Buffer<ffi::U8>>());  // work: expanded base-3^5 bytes

JAXCOMP_REGISTER("jaxcomp_threelc_encode", JaxcompThreelcEncode);
JAXCOMP_REGISTER("jaxcomp_threelc_decode", JaxcompThreelcDecode);
