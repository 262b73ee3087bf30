// XLA FFI handlers for CUDA (module.cc exposes them to Python).
//
// The targets, their buffers, attributes, checks and error messages are those
// of ffi/cpu_ops.cc; only the context differs (the CUDA stream instead of the
// thread pool). Each handler validates, then launches one kernel of
// kernels.cuh on XLA's stream and checks the launch. Nothing is synchronized
// or copied to the host: the seed and the scales stay in device memory.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_runtime.cuh"
#include "kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxcomp {
namespace cuda {
namespace {


// ---------------------------------------------------------------------------
// QSGD
// ---------------------------------------------------------------------------
ffi::Error QsgdEncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                          ffi::ResultBuffer<ffi::U8> packed, ffi::ResultBuffer<ffi::F32> scales, int64_t bits,
                          int64_t bucket, int64_t l2) {
  const char* op = "jaxcomp_qsgd_encode";
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return invalid(op, "bits must be 2, 3, 4 or 8");
  if (count(seed) != 2) return invalid(op, "seed must have 2 uint32 words");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  std::string err =
      check_bucketed(x, bucket, packed->element_count(), nb * bucket / 8 * bits, scales->element_count(), nb);
  if (!err.empty()) return invalid(op, err);
  if (n == 0) return ffi::Error::Success();
  const Geometry g = geometry(bucket);
  uint8_t* p = packed->typed_data();
  const bool vec = aligned16(x.untyped_data()) && aligned16(p);
  with_type(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(x.untyped_data());
    auto kernel = l2 != 0 ? qsgd_encode_kernel<T, true> : qsgd_encode_kernel<T, false>;
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, static_cast<int>(bits), seed.typed_data(),
                                                          p, scales->typed_data(), vec);
  });
  return launched(op);
}

ffi::Error QsgdDecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                          ffi::Result<ffi::AnyBuffer> out, int64_t bits, int64_t bucket) {
  const char* op = "jaxcomp_qsgd_decode";
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return invalid(op, "bits must be 2, 3, 4 or 8");
  if (!is_float(out->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (count(packed) != nb * bucket / 8 * bits) return invalid(op, "payload buffer has the wrong size");
  if (count(scales) != nb) return invalid(op, "scale buffer has the wrong size");
  if (n == 0) return ffi::Error::Success();
  const uint8_t* p = packed.typed_data();
  const bool vec = aligned16(p) && aligned16(out->untyped_data());
  with_type(out->element_type(), [&](auto tag) {
    using T = decltype(tag);
    qsgd_decode_kernel<T><<<flat_blocks(n), kThreads, 0, stream>>>(
        p, scales.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket / 8),
        static_cast<int>(bits), vec);
  });
  return launched(op);
}

// ---------------------------------------------------------------------------
// Int8
// ---------------------------------------------------------------------------
ffi::Error Int8EncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::S8> q,
                          ffi::ResultBuffer<ffi::F32> scales, int64_t bucket) {
  const char* op = "jaxcomp_int8_encode";
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  std::string err = check_bucketed(x, bucket, q->element_count(), nb * bucket, scales->element_count(), nb);
  if (!err.empty()) return invalid(op, err);
  if (n == 0) return ffi::Error::Success();
  const Geometry g = geometry(bucket);
  int8_t* qd = q->typed_data();
  const bool vec = aligned16(x.untyped_data()) && aligned16(qd);
  with_type(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    int8_encode_kernel<T><<<encode_blocks(nb, g), kThreads, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), n, nb, g, qd, scales->typed_data(), vec);
  });
  return launched(op);
}

ffi::Error Int8DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scales,
                          ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_int8_decode";
  if (!is_float(out->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (count(q) != nb * bucket) return invalid(op, "payload buffer has the wrong size");
  if (count(scales) != nb) return invalid(op, "scale buffer has the wrong size");
  if (n == 0) return ffi::Error::Success();
  const int8_t* qd = q.typed_data();
  const bool vec = aligned16(qd) && aligned16(out->untyped_data());
  with_type(out->element_type(), [&](auto tag) {
    using T = decltype(tag);
    int8_decode_kernel<T><<<flat_blocks(n), kThreads, 0, stream>>>(
        qd, scales.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket / 8), vec);
  });
  return launched(op);
}

// ---------------------------------------------------------------------------
// 1-bit SGD
// ---------------------------------------------------------------------------
ffi::Error OnebitEncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> bits,
                            ffi::ResultBuffer<ffi::F32> means, int64_t bucket) {
  const char* op = "jaxcomp_onebit_encode";
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  std::string err =
      check_bucketed(x, bucket, bits->element_count(), nb * bucket / 8, means->element_count(), 2 * nb);
  if (!err.empty()) return invalid(op, err);
  if (n == 0) return ffi::Error::Success();
  const Geometry g = geometry(bucket);
  // The bits are written one byte per thread, so only the input needs the
  // alignment check.
  const bool vec = aligned16(x.untyped_data());
  with_type(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    onebit_encode_kernel<T><<<encode_blocks(nb, g), kThreads, 0, stream>>>(
        static_cast<const T*>(x.untyped_data()), n, nb, g, bits->typed_data(), means->typed_data(), vec);
  });
  return launched(op);
}

ffi::Error OnebitDecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> means,
                            ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_onebit_decode";
  if (!is_float(out->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (count(bits) != nb * bucket / 8) return invalid(op, "payload buffer has the wrong size");
  if (count(means) != 2 * nb) return invalid(op, "means buffer has the wrong size");
  if (n == 0) return ffi::Error::Success();
  const bool vec = aligned16(out->untyped_data());
  with_type(out->element_type(), [&](auto tag) {
    using T = decltype(tag);
    onebit_decode_kernel<T><<<flat_blocks(n), kThreads, 0, stream>>>(
        bits.typed_data(), means.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket / 8), vec);
  });
  return launched(op);
}

// ---------------------------------------------------------------------------
// Float casts (the Cast codec's encode and decode)
// ---------------------------------------------------------------------------
ffi::Error CastImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "jaxcomp_cast";
  if (!is_float(x.element_type())) return invalid(op, "input must be float32, bfloat16 or float16");
  if (!is_float(y->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (count(x) != count(*y)) return invalid(op, "input and output sizes differ");
  const int64_t n = x.element_count();
  if (n == 0) return ffi::Error::Success();
  const bool vec = aligned16(x.untyped_data()) && aligned16(y->untyped_data());
  with_type(x.element_type(), [&](auto in_tag) {
    with_type(y->element_type(), [&](auto out_tag) {
      using In = decltype(in_tag);
      using Out = decltype(out_tag);
      cast_kernel<In, Out><<<flat_blocks(n), kThreads, 0, stream>>>(
          static_cast<const In*>(x.untyped_data()), static_cast<Out*>(y->untyped_data()), n, vec);
    });
  });
  return launched(op);
}

// ---------------------------------------------------------------------------
// TernGrad: the scales, then the base-3^5 bytes (two launches on one stream)
// ---------------------------------------------------------------------------
// Blocks for a grid-stride loop over `count` items, one per thread.
unsigned item_blocks(int64_t count) {
  constexpr int64_t kMaxBlocks = 8192;
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

ffi::Error TerngradEncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                              ffi::ResultBuffer<ffi::U8> trits, ffi::ResultBuffer<ffi::F32> scales,
                              int64_t bucket) {
  const char* op = "jaxcomp_terngrad_encode";
  if (count(seed) != 2) return invalid(op, "seed must have 2 uint32 words");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  const int64_t m = (n + 4) / 5;
  std::string err = check_bucketed(x, bucket, trits->element_count(), m, scales->element_count(), nb);
  if (!err.empty()) return invalid(op, err);
  if (n == 0) return ffi::Error::Success();
  const Geometry g = geometry(bucket);
  float* s = scales->typed_data();
  with_type(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xd = static_cast<const T*>(x.untyped_data());
    terngrad_scales_kernel<T><<<encode_blocks(nb, g), kThreads, 0, stream>>>(xd, n, nb, g, s);
    terngrad_pack_kernel<T><<<item_blocks(m), kThreads, 0, stream>>>(xd, n, m, log2_int(bucket), s,
                                                                     seed.typed_data(), trits->typed_data());
  });
  return launched(op);
}

ffi::Error TerngradDecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> trits, ffi::Buffer<ffi::F32> scales,
                              ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_terngrad_decode";
  if (!is_float(out->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  const int64_t m = (n + 4) / 5;
  if (count(trits) != m) return invalid(op, "payload buffer has the wrong size");
  if (count(scales) != nb) return invalid(op, "scale buffer has the wrong size");
  if (n == 0) return ffi::Error::Success();
  with_type(out->element_type(), [&](auto tag) {
    using T = decltype(tag);
    terngrad_decode_kernel<T><<<item_blocks(n), kThreads, 0, stream>>>(
        trits.typed_data(), scales.typed_data(), static_cast<T*>(out->untyped_data()), n, m, log2_int(bucket));
  });
  return launched(op);
}

// ---------------------------------------------------------------------------
// Natural compression
// ---------------------------------------------------------------------------
ffi::Error NaturalEncodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                             ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::U8> tops, int64_t bucket,
                             int64_t stochastic) {
  const char* op = "jaxcomp_natural_encode";
  if (count(seed) != 2) return invalid(op, "seed must have 2 uint32 words");
  if (stochastic != 0 && stochastic != 1) return invalid(op, "stochastic must be 0 or 1");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  std::string err = check_bucketed(x, bucket, codes->element_count(), n, tops->element_count(), nb);
  if (!err.empty()) return invalid(op, err);
  if (n == 0) return ffi::Error::Success();
  const Geometry g = geometry(bucket);
  with_type(x.element_type(), [&](auto tag) {
    using T = decltype(tag);
    auto kernel = stochastic != 0 ? natural_encode_kernel<T, true> : natural_encode_kernel<T, false>;
    kernel<<<encode_blocks(nb, g), kThreads, 0, stream>>>(static_cast<const T*>(x.untyped_data()), n, nb, g,
                                                          seed.typed_data(), codes->typed_data(),
                                                          tops->typed_data());
  });
  return launched(op);
}

ffi::Error NaturalDecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> tops,
                             ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_natural_decode";
  if (!is_float(out->element_type())) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (count(codes) != n) return invalid(op, "payload buffer has the wrong size");
  if (count(tops) != nb) return invalid(op, "tops buffer has the wrong size");
  if (n == 0) return ffi::Error::Success();
  with_type(out->element_type(), [&](auto tag) {
    using T = decltype(tag);
    natural_decode_kernel<T><<<item_blocks(n), kThreads, 0, stream>>>(
        codes.typed_data(), tops.typed_data(), static_cast<T*>(out->untyped_data()), n, log2_int(bucket));
  });
  return launched(op);
}

}  // namespace
}  // namespace cuda
}  // namespace jaxcomp

// The symbols carry "Cuda" so that they can never be confused with the CPU
// module's handlers of the same targets.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaQsgdEncode, jaxcomp::cuda::QsgdEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Attr<int64_t>("bits")          // 2, 3, 4 or 8
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("l2"));          // 1: L2 norm, 0: max norm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaQsgdDecode, jaxcomp::cuda::QsgdDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Ret<ffi::AnyBuffer>()          // flat output, input dtype
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaInt8Encode, jaxcomp::cuda::Int8EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::S8>>()    // q in [-127, 127]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaInt8Decode, jaxcomp::cuda::Int8DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaOnebitEncode, jaxcomp::cuda::OnebitEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::U8>>()    // sign bits, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaOnebitDecode, jaxcomp::cuda::OnebitDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // sign bits
                                  .Arg<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaCast, jaxcomp::cuda::CastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::AnyBuffer>());        // x converted, round to nearest even

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaTerngradEncode, jaxcomp::cuda::TerngradEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // base-3^5 bytes, ceil(n/5)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));  // power of two

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaTerngradDecode, jaxcomp::cuda::TerngradDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // base-3^5 bytes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output, input dtype
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaNaturalEncode, jaxcomp::cuda::NaturalEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words, on the device
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one code per element
                                  .Ret<ffi::Buffer<ffi::U8>>()    // per-bucket top exponent
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("stochastic"));  // 1: unbiased, 0: nearest

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCudaNaturalDecode, jaxcomp::cuda::NaturalDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes
                                  .Arg<ffi::Buffer<ffi::U8>>()    // per-bucket top exponent
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

JAXCOMP_REGISTER("jaxcomp_qsgd_encode", JaxcompCudaQsgdEncode);
JAXCOMP_REGISTER("jaxcomp_qsgd_decode", JaxcompCudaQsgdDecode);
JAXCOMP_REGISTER("jaxcomp_int8_encode", JaxcompCudaInt8Encode);
JAXCOMP_REGISTER("jaxcomp_int8_decode", JaxcompCudaInt8Decode);
JAXCOMP_REGISTER("jaxcomp_onebit_encode", JaxcompCudaOnebitEncode);
JAXCOMP_REGISTER("jaxcomp_onebit_decode", JaxcompCudaOnebitDecode);
JAXCOMP_REGISTER("jaxcomp_cast", JaxcompCudaCast);
JAXCOMP_REGISTER("jaxcomp_terngrad_encode", JaxcompCudaTerngradEncode);
JAXCOMP_REGISTER("jaxcomp_terngrad_decode", JaxcompCudaTerngradDecode);
JAXCOMP_REGISTER("jaxcomp_natural_encode", JaxcompCudaNaturalEncode);
JAXCOMP_REGISTER("jaxcomp_natural_decode", JaxcompCudaNaturalDecode);
