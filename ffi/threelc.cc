// 3LC on the CPU (Lim, Andersen, Kaminsky, SysML 2019, section 3): the
// handlers of kThreelcEncode, kThreelcEncodeFeedback and kThreelcDecode. The targets, bodies, sizes
// and checks in include/jaxcomp/threelc.h; twin in jaxcomp/codecs/threelc.py.
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
// Error feedback (kThreelcEncodeFeedback) reads the gradient and the
// residual in passes 1 and 2, forming acc = f32(x) + residual (one float32
// add per element) in registers each time; pass 2 also writes the new
// residual acc - m * q, the value decode gives, so no acc and no decoded
// tensor are written out. Should the stream overflow its buffer (decode then
// gives NaN), a last pass writes acc - NaN, as the separate calls would.
// Decode: count each partition's expanded size and check it (canonical
// pairs, also across partition boundaries), prefix sum, check the total,
// expand into the work buffer, then dequantize over the elements.
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

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
JC_CPU_LOOP uint32_t max_abs_bits(const T* x, int64_t i0, int64_t i1) {
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
JC_CPU_LOOP void pack_bytes(const T* x, int64_t n, int64_t M, float m, int64_t i0, int64_t i1, uint8_t* b) {
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

// max|f32(x) + residual| over [i0, i1), as abs bits.
template <typename T>
JC_CPU_LOOP uint32_t max_abs_sum_bits(const T* x, const float* r, int64_t i0, int64_t i1) {
  uint32_t m = 0;
  for (int64_t i = i0; i < i1; ++i) m = std::max(m, abs_bits(to_f32(x[i]) + r[i]));
  return m;
}

// Digit of element e of acc = f32(x) + residual; writes its new residual,
// acc minus the value decode gives (the NaN rule of common.h).
template <typename T>
inline uint32_t kept_digit(const T* x, const float* r, int64_t e, float m, float* out) {
  const float acc = to_f32(x[e]) + r[e];
  const uint32_t d = threelc_digit(acc, m);
  out[e] = acc - canonical_nan(threelc_value(d, m));
  return d;
}

// kept_digit over `len` consecutive elements, the digits into d: one plane's
// part of a chunk of bytes, a contiguous loop that vectorizes.
template <typename T>
inline void kept_digits(const T* x, const float* r, float m, int64_t len, uint8_t* d, float* out) {
  for (int64_t j = 0; j < len; ++j) d[j] = static_cast<uint8_t>(kept_digit(x, r, j, m, out));
}

// pack_bytes of acc = f32(x) + residual, writing the new residual of the
// elements of bytes [i0, i1) as well: in chunks of bytes, each plane's
// digits first (in cache), then the bytes.
template <typename T>
JC_CPU_LOOP void pack_bytes_kept(const T* x, const float* r, int64_t n, int64_t M, float m, int64_t i0, int64_t i1,
                                 uint8_t* b, float* out) {
  constexpr int64_t kChunk = 1024;
  uint8_t d[5][kChunk];
  const int64_t full = std::max<int64_t>(i0, std::min<int64_t>(i1, n - 4 * M));
  for (int64_t c0 = i0; c0 < full; c0 += kChunk) {
    const int64_t len = std::min<int64_t>(kChunk, full - c0);
    for (int p = 0; p < 5; ++p) {
      const int64_t e = p * M + c0;
      kept_digits<T>(x + e, r + e, m, len, d[p], out + e);
    }
    for (int64_t j = 0; j < len; ++j)
      b[c0 + j] = static_cast<uint8_t>(d[0][j] * 81u + d[1][j] * 27u + d[2][j] * 9u + d[3][j] * 3u + d[4][j]);
  }
  for (int64_t i = full; i < i1; ++i) {
    uint32_t q[5];
    for (int p = 0; p < 5; ++p) {
      const int64_t e = p * M + i;
      q[p] = e < n ? kept_digit(x, r, e, m, out) : 1u;
    }
    b[i] = base3_pack(q[0], q[1], q[2], q[3], q[4]);
  }
}

// The new residual of an overflowed stream, which decodes to NaN: acc -
// NaN as the processor subtracts, acc's own NaN (quieted) where acc is one,
// else the canonical NaN. (Written as a subtraction of a constant NaN, the
// compiler adds -NaN instead, which flips the sign bit.)
template <typename T>
JC_CPU_LOOP void residual_of_nan(const T* x, const float* r, int64_t i0, int64_t i1, float* out) {
  for (int64_t i = i0; i < i1; ++i) {
    const float acc = to_f32(x[i]) + r[i];
    out[i] = bits_f32(acc != acc ? f32_bits(acc) | 0x00400000u : 0x7fc00000u);
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
  for (int64_t i = 0; i < run; ++i) out[i] = decoded<T>(threelc_value(base3_digit(in[i], PLANE), m));
}

// Elements [e0, e1) from the expanded base-3^5 bytes.
template <typename T>
JC_CPU_LOOP void dequant(const uint8_t* b, int64_t M, float m, int64_t e0, int64_t e1, T* out) {
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

template <typename T>
void fill(T* out, int64_t e0, int64_t e1, T v) {
  for (int64_t e = e0; e < e1; ++e) out[e] = v;
}

// One tensor of n elements and its stream of `cap` bytes.
struct EncodeArgs {
  DType dtype;
  const void* x;
  const float* residual;  // error feedback: x's residual, else null
  float* kept;            // error feedback: the new residual, else null
  int64_t n;
  float s;
  uint8_t* stream;
  int64_t cap;
  float* scale;
  int32_t* length;
  uint8_t* overflow;
  uint8_t* work;
};

struct DecodeArgs {
  DType dtype;
  const uint8_t* stream;
  int64_t cap;
  const float* scale;
  const int32_t* length;
  const uint8_t* overflow;
  void* out;
  int64_t n;
  uint8_t* work;
};

// The largest abs bits of a.x (+ a.residual), over the threads.
uint32_t max_bits(Runner& runner, const EncodeArgs& a) {
  std::atomic<uint32_t> mx{0};
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(a.x);
    parallel_for(runner, a.n, kElementsPerTask, [&](int64_t i0, int64_t i1) {
      const uint32_t local = a.residual ? max_abs_sum_bits<T>(xd, a.residual, i0, i1) : max_abs_bits<T>(xd, i0, i1);
      uint32_t cur = mx.load();
      while (local > cur && !mx.compare_exchange_weak(cur, local)) {
      }
    });
  });
  return mx.load();
}

void encode(Runner& runner, const EncodeArgs& a) {
  const int64_t n = a.n, cap = a.cap;
  const int64_t M = base3_bytes(n);
  uint8_t* out = a.stream;
  uint8_t* b = a.work;

  // 1. The scale.
  const uint32_t mx = max_bits(runner, a);
  float m;
  {
    FlushDenormals fd;  // as XLA computes the product
    m = threelc_scale(mx, a.s);
  }
  a.scale[0] = m;

  // 2. Quantize and pack (and, under error feedback, the new residual).
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(a.x);
    parallel_for(runner, M, kElementsPerTask / 5, [&](int64_t i0, int64_t i1) {
      if (a.residual)
        pack_bytes_kept<T>(xd, a.residual, n, M, m, i0, i1, b, a.kept);
      else
        pack_bytes<T>(xd, n, M, m, i0, i1, b);
    });
  });

  // 3. Zero-run encoding: count per partition, prefix sum, write.
  const int64_t parts = num_parts(M);
  std::vector<int64_t> offs(parts + 1, 0);
  auto part_begin = [&](int64_t p) { return p * M / parts; };
  parallel_for(runner, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      offs[p + 1] = zre_part<false>(b, M, part_begin(p), part_begin(p + 1), nullptr, 0, 0);
  });
  for (int64_t p = 0; p < parts; ++p) offs[p + 1] += offs[p];
  const int64_t total = offs[parts];
  parallel_for(runner, parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) zre_part<true>(b, M, part_begin(p), part_begin(p + 1), out, offs[p], cap);
  });
  if (total < cap) std::memset(out + total, 0, cap - total);
  a.length[0] = static_cast<int32_t>(total);
  a.overflow[0] = total > cap ? 1 : 0;

  // 4. Error feedback of an overflowed stream: it decodes to NaN.
  if (a.residual && total > cap) {
    with_type(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      parallel_for(runner, n, kElementsPerTask, [&](int64_t i0, int64_t i1) {
        residual_of_nan<T>(static_cast<const T*>(a.x), a.residual, i0, i1, a.kept);
      });
    });
  }
}

// Returns "" or what makes the stream corrupted.
std::string decode(Runner& runner, const DecodeArgs& a) {
  const int64_t n = a.n, cap = a.cap;
  const int64_t M = base3_bytes(n);
  const int64_t used = a.length[0];
  const uint32_t flag = a.overflow[0];
  if (used < 0) return "corrupted stream: negative length";
  if (flag > 1) return "corrupted stream: overflow flag is not 0 or 1";
  if ((flag == 1) != (used > cap)) {
    return flag == 1 ? "corrupted stream: overflow flag set but the length fits the buffer"
                     : "corrupted stream: length " + std::to_string(used) + " exceeds the buffer (" +
                           std::to_string(cap) + " bytes)";
  }
  void* o = a.out;
  if (flag == 1) {
    // Overflowed: the stream is incomplete; NaN everywhere, never plausible numbers.
    with_type(a.dtype, [&](auto tag) {
      using T = decltype(tag);
      const T nan = decoded<T>(std::numeric_limits<float>::quiet_NaN());
      parallel_for(runner, n, kElementsPerTask,
                   [&](int64_t e0, int64_t e1) { fill<T>(static_cast<T*>(o), e0, e1, nan); });
    });
    return "";
  }
  const uint8_t* in = a.stream;
  uint8_t* b = a.work;
  const float m = a.scale[0];

  // Expanded size and canonical form of each partition of the stream.
  const int64_t parts = num_parts(used);
  std::vector<int64_t> offs(parts + 1, 0);
  std::vector<int64_t> bad(parts, -1);
  auto part_begin = [&](int64_t p) { return p * used / parts; };
  parallel_for(runner, parts, 1, [&](int64_t p0, int64_t p1) {
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
      return "corrupted stream: byte " + std::to_string(bad[p]) + " (" + std::to_string(in[bad[p]]) +
             ") cannot follow " + std::to_string(in[bad[p] - 1]) + " in a zero-run encoding";
    offs[p + 1] += offs[p];
  }
  if (offs[parts] != M) {
    return "corrupted stream: it expands to " + std::to_string(offs[parts]) + " base-3^5 bytes, " +
           std::to_string(n) + " elements need " + std::to_string(M);
  }
  // Expand (every offset is now within [0, M]).
  parallel_for(runner, parts, 1, [&](int64_t p0, int64_t p1) {
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
  with_type(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    parallel_for(runner, n, kElementsPerTask,
                 [&](int64_t e0, int64_t e1) { dequant<T>(b, M, m, e0, e1, static_cast<T*>(o)); });
  });
  return "";
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> stream,
                      ffi::ResultBuffer<ffi::F32> scale, ffi::ResultBuffer<ffi::S32> length,
                      ffi::ResultBuffer<ffi::U8> overflow, ffi::ResultBuffer<ffi::U8> work, int64_t sparsity_bits) {
  const Batch b(x, *stream, *scale, *length, *overflow, *work);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0), cap = b.count(1);
  const char* error =
      threelc_check_encode(dt, n, sparsity_bits, cap, b.count(2), b.count(3), b.count(4), b.count(5));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    encode(runner, EncodeArgs{dt, b.at<void>(0, i), nullptr, nullptr, n, threelc_sparsity(sparsity_bits),
                              b.at<uint8_t>(1, i), cap, b.at<float>(2, i), b.at<int32_t>(3, i), b.at<uint8_t>(4, i),
                              b.at<uint8_t>(5, i)});
  });
}

// Error feedback: x and its float32 residual -> the payload of f32(x) +
// residual and the new residual, in one call.
ffi::Error EncodeFeedbackImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> residual,
                              ffi::ResultBuffer<ffi::U8> stream, ffi::ResultBuffer<ffi::F32> scale,
                              ffi::ResultBuffer<ffi::S32> length, ffi::ResultBuffer<ffi::U8> overflow,
                              ffi::ResultBuffer<ffi::F32> kept, ffi::ResultBuffer<ffi::U8> work,
                              int64_t sparsity_bits) {
  const Batch b(x, residual, *stream, *scale, *length, *overflow, *kept, *work);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0), cap = b.count(2);
  const char* error = threelc_check_feedback(dt, n, sparsity_bits, cap, b.count(1), b.count(3), b.count(4),
                                             b.count(5), b.count(6), b.count(7));
  hint_huge_pages(kept->untyped_data(), static_cast<int64_t>(kept->size_bytes()));
  return run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    encode(runner, EncodeArgs{dt, b.at<void>(0, i), b.at<const float>(1, i), b.at<float>(6, i), n,
                              threelc_sparsity(sparsity_bits), b.at<uint8_t>(2, i), cap, b.at<float>(3, i),
                              b.at<int32_t>(4, i), b.at<uint8_t>(5, i), b.at<uint8_t>(7, i)});
  });
}

// A corrupted stream in any entry fails the call, with the first such
// entry's reason.
ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> stream, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::U8> overflow, ffi::Result<ffi::AnyBuffer> out,
                      ffi::ResultBuffer<ffi::U8> work) {
  const Batch b(stream, scale, length, overflow, *out, *work);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(4), cap = b.count(0);
  const char* error = threelc_check_decode(dt, n, cap, b.count(1), b.count(2), b.count(3), b.count(5));
  hint_huge_pages(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
  std::vector<std::string> corrupted(b.error() == nullptr && error == nullptr ? b.size() : 0);
  const ffi::Error result = run_batch(pool, b, error, n, [&](int64_t i, Runner& runner) {
    corrupted[i] = decode(runner, DecodeArgs{dt, b.at<uint8_t>(0, i), cap, b.at<float>(1, i), b.at<int32_t>(2, i),
                                             b.at<uint8_t>(3, i), b.at<void>(4, i), n, b.at<uint8_t>(5, i)});
  });
  for (const std::string& why : corrupted)
    if (!why.empty()) return invalid(why);
  return result;
}

JAXCOMP_REGISTER(kThreelcEncode, EncodeImpl);
JAXCOMP_REGISTER(kThreelcEncodeFeedback, EncodeFeedbackImpl);
JAXCOMP_REGISTER(kThreelcDecode, DecodeImpl);

}  // namespace
}  // namespace jaxcomp
