// 3LC on CUDA (Lim, Andersen, Kaminsky, SysML 2019, section 3): the handlers
// of kThreelcEncode and kThreelcDecode, with the buffers, checks and bytes of
// ffi/threelc.cc. The targets, bodies, sizes and checks in
// ffi/include/jaxcomp/threelc.h; twin in jaxcomp/codecs/threelc.py.
//
// Everything stays on the device and on XLA's stream; nothing synchronizes.
// The work buffer (an extra output the Python side drops) holds the base-3^5
// bytes, a few control words and per-block counters.
//
// Encode: max|x| by atomicMax on abs bits; pack; then zero-run encoding by
// blocks of kBlockBytes base-3^5 bytes:
//   last_nz   per block, the last byte that is not 121;
//   scan      (one block) exclusive max over blocks: where the run that
//             enters each block started;
//   count     per block, the output bytes of its literals and chunk heads (a
//             121 at run position p is a chunk head when p % 14 == 0);
//   scan      (one block) exclusive sum: each block's output offset, total;
//   write     per block, every emitted byte at its offset (bytes at or past
//             the capacity dropped); a chunk head looks ahead at most 14
//             bytes for its length.
// Decode: per block of stream bytes, expanded size and canonical pairs;
// (one block) exclusive sum and the header checks; expand; dequantize. A
// corrupted stream cannot raise without a synchronization here: it decodes to
// NaN everywhere, as the twin does (the CPU handler raises instead).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_runtime.cuh"
#include "jaxcomp/threelc.h"

namespace jaxcomp {
namespace cuda {
namespace {

constexpr int64_t kBlockBytes = kTlcBlockBytes;
constexpr int kPerThread = static_cast<int>(kBlockBytes / kThreads);  // 16

// The work buffer (threelc.h: ThreelcSizes) carved up. Control words: [0]
// max abs bits, [1] decode status (0 ok, else NaN output), [2..3] the total.
struct Work {
  uint8_t* bytes;    // M base-3^5 bytes
  uint32_t* ctrl;    // kTlcCtrlWords
  int64_t* a;        // per-block counters
  int64_t* b;
  int64_t* total;
};

inline int64_t blocks_for(int64_t bytes) { return (bytes + kBlockBytes - 1) / kBlockBytes; }

inline Work carve(uint8_t* base, const ThreelcSizes& sz) {
  Work w;
  w.bytes = base;
  uint8_t* p = base + (sz.bytes + 7) / 8 * 8;
  w.ctrl = reinterpret_cast<uint32_t*>(p);
  w.a = reinterpret_cast<int64_t*>(p + 4 * kTlcCtrlWords);
  w.b = w.a + sz.blocks;
  w.total = reinterpret_cast<int64_t*>(w.ctrl + 2);
  return w;
}

inline unsigned grid(int64_t blocks) { return static_cast<unsigned>(blocks < 1 ? 1 : blocks); }

struct PlusI64 {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a + b; }
};

struct MaxI64 {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

using Scan = cub::BlockScan<int64_t, kThreads>;
using Reduce = cub::BlockReduce<int64_t, kThreads>;

// ---------------------------------------------------------------------------
// Encode kernels
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kThreads) max_kernel(const T* __restrict__ x, int64_t n, uint32_t* ctrl) {
  uint32_t m = 0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint32_t a = abs_bits(to_f32(x[i]));
    m = a > m ? a : m;
  }
  for (int off = 16; off > 0; off /= 2) {
    const uint32_t o = __shfl_down_sync(0xffffffffu, m, off);
    m = o > m ? o : m;
  }
  if ((threadIdx.x & 31) == 0) atomicMax(&ctrl[0], m);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    pack_kernel(const T* __restrict__ x, int64_t n, int64_t M, float s, const uint32_t* ctrl, uint8_t* b,
                float* scale) {
  const float m = threelc_scale(ctrl[0], s);
  if (blockIdx.x == 0 && threadIdx.x == 0) scale[0] = m;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < M;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    uint32_t d[5];
#pragma unroll
    for (int j = 0; j < 5; ++j) {
      const int64_t e = j * M + i;
      d[j] = e < n ? threelc_digit(to_f32(x[e]), m) : 1u;
    }
    b[i] = base3_pack(d[0], d[1], d[2], d[3], d[4]);
  }
}

// Per block: the index of its last byte that is not 121, or -1.
__global__ void __launch_bounds__(kThreads) last_nz_kernel(const uint8_t* b, int64_t M, int64_t* last) {
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlockBytes + threadIdx.x * kPerThread;
  int64_t l = -1;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i < M && b[i] != kTlcZero) l = i;
  }
  const int64_t r = Reduce(tmp).Reduce(l, MaxI64());
  if (threadIdx.x == 0) last[blockIdx.x] = r;
}

// One block: in-place exclusive scan of v[0..count) with op and identity;
// the total goes to *total when given.
template <typename Op>
__global__ void __launch_bounds__(kThreads) scan_kernel(int64_t* v, int64_t count, int64_t identity, Op op,
                                                        int64_t* total) {
  __shared__ typename Scan::TempStorage tmp;
  int64_t carry = identity;
  for (int64_t t0 = 0; t0 < count; t0 += kThreads) {
    const int64_t i = t0 + threadIdx.x;
    const int64_t x = i < count ? v[i] : identity;
    int64_t out, agg;
    Scan(tmp).ExclusiveScan(x, out, identity, op, agg);
    __syncthreads();
    if (i < count) v[i] = op(carry, out);
    carry = op(carry, agg);
  }
  if (total != nullptr && threadIdx.x == 0) *total = carry;
}

// The thread's bytes [base, base + kPerThread) and where the run through its
// first byte started (the byte after the last non-121 before it).
__device__ __forceinline__ int64_t thread_run_start(const uint8_t* b, int64_t M, int64_t base,
                                                    int64_t block_carry, typename Scan::TempStorage& tmp) {
  int64_t l = -1;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i < M && b[i] != kTlcZero) l = i;
  }
  int64_t before;
  Scan(tmp).ExclusiveScan(l, before, int64_t{-1}, MaxI64());
  __syncthreads();
  const int64_t prev = before > block_carry ? before : block_carry;
  return prev + 1;
}

// Output bytes of the thread's bytes [base, base + kPerThread): one per
// literal and one per chunk head (a 121 at run position p, p % 14 == 0),
// given where the run through its first byte started.
__device__ __forceinline__ int64_t thread_emits(const uint8_t* b, int64_t M, int64_t base, int64_t start) {
  int64_t c = 0;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i >= M) break;
    if (b[i] != kTlcZero) {
      start = i + 1;
      ++c;
    } else {
      c += (i - start) % kTlcMaxRun == 0;
    }
  }
  return c;
}

__global__ void __launch_bounds__(kThreads)
    count_kernel(const uint8_t* b, int64_t M, const int64_t* carry, int64_t* counts) {
  __shared__ typename Scan::TempStorage tmp;
  __shared__ typename Reduce::TempStorage rtmp;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlockBytes + threadIdx.x * kPerThread;
  const int64_t c = thread_emits(b, M, base, thread_run_start(b, M, base, carry[blockIdx.x], tmp));
  const int64_t total = Reduce(rtmp).Sum(c);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kThreads)
    write_kernel(const uint8_t* b, int64_t M, const int64_t* carry, const int64_t* offs, uint8_t* out, int64_t cap) {
  __shared__ typename Scan::TempStorage tmp;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlockBytes + threadIdx.x * kPerThread;
  const int64_t start0 = thread_run_start(b, M, base, carry[blockIdx.x], tmp);
  int64_t o;
  Scan(tmp).ExclusiveSum(thread_emits(b, M, base, start0), o);
  o += offs[blockIdx.x];
  int64_t start = start0;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i >= M) break;
    const uint32_t v = b[i];
    if (v != kTlcZero) {
      start = i + 1;
      if (o < cap) out[o] = static_cast<uint8_t>(v);
      ++o;
    } else if ((i - start) % kTlcMaxRun == 0) {
      uint32_t len = 1;
      while (len < static_cast<uint32_t>(kTlcMaxRun) && i + len < M && b[i + len] == kTlcZero) ++len;
      if (o < cap) out[o] = static_cast<uint8_t>(threelc_run_byte(len));
      ++o;
    }
  }
}

__global__ void finish_encode_kernel(const int64_t* total, int64_t cap, int32_t* length, uint8_t* overflow) {
  length[0] = static_cast<int32_t>(*total);
  overflow[0] = *total > cap ? 1 : 0;
}

// ---------------------------------------------------------------------------
// Decode kernels
// ---------------------------------------------------------------------------
__device__ __forceinline__ int64_t used_of(const int32_t* length, int64_t cap) {
  const int64_t l = length[0];
  return l < 0 ? 0 : (l > cap ? cap : l);
}

__global__ void __launch_bounds__(kThreads)
    expand_count_kernel(const uint8_t* s, const int32_t* length, int64_t cap, int64_t* counts, uint32_t* ctrl) {
  __shared__ typename Reduce::TempStorage tmp;
  const int64_t used = used_of(length, cap);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlockBytes + threadIdx.x * kPerThread;
  int64_t c = 0;
  bool ok = true;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i >= used) break;
    c += threelc_expand_count(s[i]);
    if (i > 0) ok = ok && threelc_pair_ok(s[i - 1], s[i]);
  }
  if (!ok) atomicOr(&ctrl[1], 1u);
  const int64_t total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0) counts[blockIdx.x] = total;
}

__global__ void check_kernel(const int32_t* length, const uint8_t* overflow, int64_t cap, int64_t M,
                             const int64_t* total, uint32_t* ctrl) {
  const int64_t l = length[0];
  const uint32_t f = overflow[0];
  // Overflowed (NaN by definition) or corrupted (NaN, where the CPU raises).
  const bool bad = l < 0 || f != 0 || l > cap || *total != M;
  if (bad) ctrl[1] |= 2u;
}

__global__ void __launch_bounds__(kThreads) expand_kernel(const uint8_t* s, const int32_t* length, int64_t cap,
                                                          const int64_t* offs, const uint32_t* ctrl, uint8_t* b,
                                                          int64_t M) {
  __shared__ typename Scan::TempStorage tmp;
  if (ctrl[1] != 0) return;  // uniform across the grid
  const int64_t used = used_of(length, cap);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlockBytes + threadIdx.x * kPerThread;
  int64_t c = 0;
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i < used) c += threelc_expand_count(s[i]);
  }
  int64_t o;
  Scan(tmp).ExclusiveSum(c, o);
  o += offs[blockIdx.x];
  for (int k = 0; k < kPerThread; ++k) {
    const int64_t i = base + k;
    if (i >= used) break;
    const uint32_t v = s[i];
    const int64_t cnt = threelc_expand_count(v);
    const uint8_t w = static_cast<uint8_t>(v >= kTlcRunBase ? kTlcZero : v);
    for (int64_t j = 0; j < cnt && o + j < M; ++j) b[o + j] = w;
    o += cnt;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const uint8_t* b, const float* scale,
                                                           const uint32_t* ctrl, T* out, int64_t n, int64_t M) {
  const bool bad = ctrl[1] != 0;
  const float m = bad ? __int_as_float(0x7fc00000) : scale[0];
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    float v;
    if (bad) {
      v = m;
    } else {
      const int64_t plane = e / M;
      v = threelc_value(base3_digit(b[e - plane * M], static_cast<int>(plane)), m);
    }
    out[e] = decoded<T>(v);
  }
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> out,
                      ffi::ResultBuffer<ffi::F32> scale, ffi::ResultBuffer<ffi::S32> length,
                      ffi::ResultBuffer<ffi::U8> overflow, ffi::ResultBuffer<ffi::U8> work, int64_t sparsity_bits) {
  const Batch b(x, *out, *scale, *length, *overflow, *work);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0), cap = b.count(1);
  if (const char* e = b.check(
          threelc_check_encode(dt, n, sparsity_bits, cap, b.count(2), b.count(3), b.count(4), b.count(5))))
    return invalid(e);
  const float s = threelc_sparsity(sparsity_bits);
  const ThreelcSizes sz = threelc_sizes(n, cap);
  const int64_t M = sz.bytes;
  const int64_t mb = blocks_for(M);
  for (int64_t i = 0; i < b.size(); ++i) {
    const Work w = carve(b.at<uint8_t>(5, i), sz);
    uint8_t* o = b.at<uint8_t>(1, i);
    cudaMemsetAsync(w.ctrl, 0, 4 * kTlcCtrlWords, stream);
    if (cap > 0) cudaMemsetAsync(o, 0, cap, stream);
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      const T* xd = b.at<const T>(0, i);
      max_kernel<T><<<item_blocks(n), kThreads, 0, stream>>>(xd, n, w.ctrl);
      pack_kernel<T><<<item_blocks(M), kThreads, 0, stream>>>(xd, n, M, s, w.ctrl, w.bytes, b.at<float>(2, i));
    });
    if (M > 0) {
      last_nz_kernel<<<grid(mb), kThreads, 0, stream>>>(w.bytes, M, w.a);
      scan_kernel<<<1, kThreads, 0, stream>>>(w.a, mb, int64_t{-1}, MaxI64(), nullptr);
      count_kernel<<<grid(mb), kThreads, 0, stream>>>(w.bytes, M, w.a, w.b);
      scan_kernel<<<1, kThreads, 0, stream>>>(w.b, mb, int64_t{0}, PlusI64(), w.total);
      write_kernel<<<grid(mb), kThreads, 0, stream>>>(w.bytes, M, w.a, w.b, o, cap);
    }
    finish_encode_kernel<<<1, 1, 0, stream>>>(w.total, cap, b.at<int32_t>(3, i), b.at<uint8_t>(4, i));
  }
  return launched();
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> in, ffi::Buffer<ffi::F32> scale,
                      ffi::Buffer<ffi::S32> length, ffi::Buffer<ffi::U8> overflow, ffi::Result<ffi::AnyBuffer> out,
                      ffi::ResultBuffer<ffi::U8> work) {
  const Batch b(in, scale, length, overflow, *out, *work);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(4), cap = b.count(0);
  if (const char* e = b.check(threelc_check_decode(dt, n, cap, b.count(1), b.count(2), b.count(3), b.count(5))))
    return invalid(e);
  const ThreelcSizes sz = threelc_sizes(n, cap);
  const int64_t M = sz.bytes;
  const int64_t sb = blocks_for(cap);
  for (int64_t i = 0; i < b.size(); ++i) {
    const Work w = carve(b.at<uint8_t>(5, i), sz);
    const uint8_t* s = b.at<const uint8_t>(0, i);
    const int32_t* len = b.at<const int32_t>(2, i);
    cudaMemsetAsync(w.ctrl, 0, 4 * kTlcCtrlWords, stream);
    if (cap > 0) {
      expand_count_kernel<<<grid(sb), kThreads, 0, stream>>>(s, len, cap, w.a, w.ctrl);
      scan_kernel<<<1, kThreads, 0, stream>>>(w.a, sb, int64_t{0}, PlusI64(), w.total);
    }
    check_kernel<<<1, 1, 0, stream>>>(len, b.at<const uint8_t>(3, i), cap, M, w.total, w.ctrl);
    if (cap > 0) expand_kernel<<<grid(sb), kThreads, 0, stream>>>(s, len, cap, w.a, w.ctrl, w.bytes, M);
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      dequant_kernel<T><<<item_blocks(n), kThreads, 0, stream>>>(w.bytes, b.at<const float>(1, i), w.ctrl,
                                                                 b.at<T>(4, i), n, M);
    });
  }
  return launched();
}

JAXCOMP_REGISTER(kThreelcEncode, EncodeImpl);
JAXCOMP_REGISTER(kThreelcDecode, DecodeImpl);

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp
