// QSGD on CUDA: the targets jaxcomp_qsgd_encode, jaxcomp_qsgd_decode and
// jaxcomp_qsgd_decode_sum, with
// the buffers, checks and bytes of ffi/qsgd.cc. Bodies, sizes and checks in
// ffi/include/jaxcomp/qsgd.h; twin in jaxcomp/codecs/qsgd.py. Nothing is
// synchronized or copied to the host: the seed and the scales stay in device
// memory.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_runtime.cuh"
#include "jaxcomp/qsgd.h"

namespace jaxcomp {
namespace cuda {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------
template <typename T, bool L2>
__global__ void __launch_bounds__(kThreads)
    qsgd_encode_kernel(const T* __restrict__ x, int64_t n, int64_t num_buckets, Geometry g, int bits,
                       const uint32_t* __restrict__ seed, uint8_t* __restrict__ packed,
                       float* __restrict__ scales, bool vec) {
  const Slot t = slot(g);
  float scale;
  if constexpr (L2) {
    __shared__ float sm[kThreads];
    const float part = lane_tree_sum<float>(g.lane_levels, [&](uint32_t j) {
      const float v = load1(x, t.start + t.lane + static_cast<int64_t>(j) * g.lanes, n);
      return exact_square(v);
    });
    scale = sqrtf(segment_tree(sm, part, t.lane, g.lanes, Plus{}));
  } else {
    scale = bucket_max_abs(x, n, t.start, g, t.lane);
  }
  if (t.bucket >= num_buckets) return;  // no __syncthreads() after this point
  if (t.lane == 0) scales[t.bucket] = scale;

  const int s = (1 << (bits - 1)) - 1;
  const float inv = qsgd_inv(scale, s);
  const uint32_t k0 = seed[0], k1 = seed[1];  // the seed stays on the device
  const int groups = g.bucket / 8;
  uint8_t* out = packed + t.bucket * groups * bits;
  for (int gi = t.lane; gi < groups; gi += g.lanes) {
    float v[8];
    load8(x, t.start + 8 * gi, n, vec, v);
    uint8_t codes[8];
    // The element index wraps modulo 2^32 exactly like the CPU's uint32 base.
    const uint32_t base = static_cast<uint32_t>(t.start) + static_cast<uint32_t>(8 * gi);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      codes[j] = static_cast<uint8_t>(qsgd_code(v[j], inv, s, bits, rng_uniform(k0, k1, base + j)));
    // pack8 fits codes of up to 4 bits in its 32-bit word; 8-bit codes are
    // stored as they are (ffi/cpu_buckets.h: pack_bucket).
    if (bits == 8)
      store_bytes8(out + 8 * gi, vec, codes);
    else
      pack8(codes, bits, out + bits * gi);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    qsgd_decode_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales, T* __restrict__ out,
                       int64_t n, int group_shift, int bits, bool vec) {
  const int s = (1 << (bits - 1)) - 1;
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    const float step = qsgd_step(scales[gi >> group_shift], s);
    if (bits == 8) {
      uint8_t c[8];
      load_bytes8(packed + 8 * gi, vec, c);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = qsgd_value(c[j], step, bits);
    } else {
      const uint8_t* group = packed + bits * gi;
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = qsgd_value(unpack_code(group, bits, j), step, bits);
    }
  });
}

// The sum, in row order, of `rows` float32 payloads of n values each: every
// group of 8 values decoded from each row as qsgd_decode_kernel decodes it
// and added left to right (--fmad=false: no contraction), with no row
// written out.
__global__ void __launch_bounds__(kThreads)
    qsgd_decode_sum_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ scales,
                           float* __restrict__ out, int64_t n, int64_t rows, int64_t row_bytes, int64_t row_buckets,
                           int group_shift, int bits, bool vec) {
  const int s = (1 << (bits - 1)) - 1;
  store_groups(out, n, vec, [&](int64_t gi, float* v) {
    for (int64_t r = 0; r < rows; ++r) {
      const float step = qsgd_step(scales[r * row_buckets + (gi >> group_shift)], s);
      const uint8_t* row = packed + r * row_bytes;
      uint8_t c[8];
      if (bits == 8) {
        load_bytes8(row + 8 * gi, vec, c);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) c[j] = static_cast<uint8_t>(unpack_code(row + bits * gi, bits, j));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x = qsgd_value(c[j], step, bits);
        v[j] = r == 0 ? x : v[j] + x;
      }
    }
  });
}

// ---------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------
ffi::Error EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                      ffi::ResultBuffer<ffi::U8> packed, ffi::ResultBuffer<ffi::F32> scales, int64_t bits,
                      int64_t bucket, int64_t l2) {
  const Batch b(x, seed, *packed, *scales);
  const DType dt = dtype_of(x.element_type());
  const int64_t n = b.count(0);
  const char* error = qsgd_check_encode(dt, n, b.count(1), b.count(2), b.count(3), bits, bucket);
  return launch_batch("jaxcomp_qsgd_encode", b, error, n, [&](int64_t i) {
    const int64_t nb = num_buckets(n, bucket);
    const Geometry g = geometry(bucket);
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      auto kernel = l2 != 0 ? qsgd_encode_kernel<T, true> : qsgd_encode_kernel<T, false>;
      const T* xd = b.at<const T>(0, i);
      uint8_t* p = b.at<uint8_t>(2, i);
      kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, static_cast<int>(bits),
                                                            b.at<const uint32_t>(1, i), p, b.at<float>(3, i),
                                                            aligned16(xd) && aligned16(p));
    });
  });
}

ffi::Error DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                      ffi::Result<ffi::AnyBuffer> out, int64_t bits, int64_t bucket) {
  const Batch b(packed, scales, *out);
  const DType dt = dtype_of(out->element_type());
  const int64_t n = b.count(2);
  const char* error = qsgd_check_decode(dt, n, b.count(0), b.count(1), bits, bucket);
  return launch_batch("jaxcomp_qsgd_decode", b, error, n, [&](int64_t i) {
    with_type(dt, [&](auto tag) {
      const uint8_t* p = b.at<const uint8_t>(0, i);
      auto* o = b.at<decltype(tag)>(2, i);
      qsgd_decode_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(p, b.at<const float>(1, i), o, n, log2_int(bucket / 8),
                                                                  static_cast<int>(bits), aligned16(p) && aligned16(o));
    });
  });
}

ffi::Error DecodeSumImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t bits, int64_t bucket) {
  constexpr const char* op = "jaxcomp_qsgd_decode_sum";
  const auto pd = packed.dimensions();
  const auto sd = scales.dimensions();
  if (pd.size() != 2 || sd.size() != 2 || pd[0] != sd[0] || out->dimensions().size() != 1)
    return invalid(op, "expects codes [rows, bytes] and scales [rows, buckets] with the same rows, "
                       "and a flat output");
  const int64_t rows = pd[0];
  const int64_t n = out->dimensions()[0];
  if (const char* e = qsgd_check_decode(DType::kF32, n, pd[1], sd[1], bits, bucket)) return invalid(op, e);
  if (n == 0) return ffi::Error::Success();
  if (rows == 0) {
    cudaMemsetAsync(out->typed_data(), 0, n * sizeof(float), stream);
    return launched(op);
  }
  const uint8_t* p = packed.typed_data();
  float* o = out->typed_data();
  // Rows start 16-byte aligned when the codes of a row are a multiple of 16 bytes.
  const bool vec = aligned16(p) && aligned16(o) && pd[1] % 16 == 0;
  qsgd_decode_sum_kernel<<<flat_blocks(n), kThreads, 0, stream>>>(p, scales.typed_data(), o, n, rows, pd[1], sd[1],
                                                                   log2_int(bucket / 8), static_cast<int>(bits), vec);
  return launched(op);
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

// The symbols carry "Cuda" so that they can never be confused with the CPU
// module's handlers of the same targets.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaQsgdEncode, jaxcomp::cuda::EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Attr<int64_t>("bits")          // 2, 3, 4 or 8
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("l2"));          // 1: L2 norm, 0: max norm
JAXCOMP_REGISTER("jaxcomp_qsgd_encode", JaxcompCudaQsgdEncode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaQsgdDecode, jaxcomp::cuda::DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Ret<ffi::AnyBuffer>()          // flat output, input dtype
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_qsgd_decode", JaxcompCudaQsgdDecode);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaQsgdDecodeSum, jaxcomp::cuda::DecodeSumImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed codes, [rows, bytes]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket scale, [rows, buckets]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // the rows' sum, flat float32
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));
JAXCOMP_REGISTER("jaxcomp_qsgd_decode_sum", JaxcompCudaQsgdDecodeSum);
