// XLA FFI handlers for the CPU, and the nanobind module that exposes them.
//
// Each handler validates its buffers, then runs one of the kernel tables of
// kernel_table.h over bucket ranges, split across the thread pool that XLA
// hands to FFI calls when the input is large enough to pay for it.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "cpu_runtime.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace jaxcomp {
namespace {

const char* pick_isa() {
#if defined(JAXCOMP_HAVE_AVX2) && defined(JAXCOMP_X86)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return "avx2";
#endif
  return "base";
}

const KernelTable& kernels() {
  static const KernelTable table = [] {
#if defined(JAXCOMP_HAVE_AVX2)
    if (std::string(pick_isa()) == "avx2") return isa_avx2::table();
#endif
    return isa_base::table();
  }();
  return table;
}

// Common checks of a bucketed encode; returns an error string or "".
std::string check_bucketed(ffi::AnyBuffer& x, int64_t bucket, int64_t body_bytes, int64_t body_expected,
                           int64_t scale_count, int64_t scale_expected, DType* dt) {
  if (!to_dtype(x.element_type(), dt)) return "input must be float32, bfloat16 or float16";
  if (!valid_bucket(bucket)) return "bucket_size must be a power of two in [8, 65536]";
  if (x.element_count() >= (int64_t{1} << 32)) return "inputs are limited to 2^32 - 1 elements";
  if (body_bytes != body_expected) return "payload buffer has the wrong size";
  if (scale_count != scale_expected) return "scale buffer has the wrong size";
  return "";
}

// ---------------------------------------------------------------------------
// QSGD
// ---------------------------------------------------------------------------
ffi::Error QsgdEncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                          ffi::ResultBuffer<ffi::U8> packed, ffi::ResultBuffer<ffi::F32> scales, int64_t bits,
                          int64_t bucket, int64_t l2) {
  const char* op = "jaxcomp_qsgd_encode";
  PoolRunner pool(thread_pool);
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return invalid(op, "bits must be 2, 3, 4 or 8");
  if (seed.element_count() != 2) return invalid(op, "seed must have 2 uint32 words");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  DType dt;
  std::string err = check_bucketed(x, bucket, packed->element_count(), nb * bucket / 8 * bits,
                                   scales->element_count(), nb, &dt);
  if (!err.empty()) return invalid(op, err);
  const uint32_t k0 = seed.typed_data()[0], k1 = seed.typed_data()[1];
  uint8_t* p = packed->typed_data();
  float* s = scales->typed_data();
  const void* xd = x.untyped_data();
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().qsgd_encode(EncodeArgs{dt, xd, n, b0, b1, static_cast<int>(bucket)}, static_cast<int>(bits),
                          l2 != 0, k0, k1, p, s);
  });
  return ffi::Error::Success();
}

ffi::Error QsgdDecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::U8> packed, ffi::Buffer<ffi::F32> scales,
                          ffi::Result<ffi::AnyBuffer> out, int64_t bits, int64_t bucket) {
  const char* op = "jaxcomp_qsgd_decode";
  PoolRunner pool(thread_pool);
  if (bits != 2 && bits != 3 && bits != 4 && bits != 8) return invalid(op, "bits must be 2, 3, 4 or 8");
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (packed.element_count() != nb * bucket / 8 * bits) return invalid(op, "payload buffer has the wrong size");
  if (scales.element_count() != nb) return invalid(op, "scale buffer has the wrong size");
  const uint8_t* p = packed.typed_data();
  const float* s = scales.typed_data();
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().qsgd_decode(DecodeArgs{dt, o, n, b0, b1, static_cast<int>(bucket)}, static_cast<int>(bits), p, s);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Int8
// ---------------------------------------------------------------------------
ffi::Error Int8EncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::S8> q,
                          ffi::ResultBuffer<ffi::F32> scales, int64_t bucket) {
  const char* op = "jaxcomp_int8_encode";
  PoolRunner pool(thread_pool);
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  DType dt;
  std::string err =
      check_bucketed(x, bucket, q->element_count(), nb * bucket, scales->element_count(), nb, &dt);
  if (!err.empty()) return invalid(op, err);
  int8_t* qd = q->typed_data();
  float* s = scales->typed_data();
  hint_huge_pages(qd, q->element_count());
  const void* xd = x.untyped_data();
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().int8_encode(EncodeArgs{dt, xd, n, b0, b1, static_cast<int>(bucket)}, qd, s);
  });
  return ffi::Error::Success();
}

ffi::Error Int8DecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> scales,
                          ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_int8_decode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (q.element_count() != nb * bucket) return invalid(op, "payload buffer has the wrong size");
  if (scales.element_count() != nb) return invalid(op, "scale buffer has the wrong size");
  const int8_t* qd = q.typed_data();
  const float* s = scales.typed_data();
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().int8_decode(DecodeArgs{dt, o, n, b0, b1, static_cast<int>(bucket)}, qd, s);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// 1-bit SGD
// ---------------------------------------------------------------------------
ffi::Error OnebitEncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::ResultBuffer<ffi::U8> bits,
                            ffi::ResultBuffer<ffi::F32> means, int64_t bucket) {
  const char* op = "jaxcomp_onebit_encode";
  PoolRunner pool(thread_pool);
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  DType dt;
  std::string err =
      check_bucketed(x, bucket, bits->element_count(), nb * bucket / 8, means->element_count(), 2 * nb, &dt);
  if (!err.empty()) return invalid(op, err);
  uint8_t* bd = bits->typed_data();
  float* m = means->typed_data();
  const void* xd = x.untyped_data();
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().onebit_encode(EncodeArgs{dt, xd, n, b0, b1, static_cast<int>(bucket)}, bd, m);
  });
  return ffi::Error::Success();
}

ffi::Error OnebitDecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::U8> bits, ffi::Buffer<ffi::F32> means,
                            ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_onebit_decode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (bits.element_count() != nb * bucket / 8) return invalid(op, "payload buffer has the wrong size");
  if (means.element_count() != 2 * nb) return invalid(op, "means buffer has the wrong size");
  const uint8_t* bd = bits.typed_data();
  const float* m = means.typed_data();
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().onebit_decode(DecodeArgs{dt, o, n, b0, b1, static_cast<int>(bucket)}, bd, m);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Float casts (the Cast codec's encode and decode)
// ---------------------------------------------------------------------------
ffi::Error CastImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "jaxcomp_cast";
  PoolRunner pool(thread_pool);
  DType from, to;
  if (!to_dtype(x.element_type(), &from)) return invalid(op, "input must be float32, bfloat16 or float16");
  if (!to_dtype(y->element_type(), &to)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (x.element_count() != y->element_count()) return invalid(op, "input and output sizes differ");
  const void* in = x.untyped_data();
  void* out = y->untyped_data();
  hint_huge_pages(out, static_cast<int64_t>(y->size_bytes()));
  parallel_for(pool, x.element_count(), kElementsPerTask,
               [&](int64_t i0, int64_t i1) { kernels().cast(from, to, in, out, i0, i1); });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// TernGrad: scales per bucket first, then the base-3^5 bytes (each byte
// reads one element of each of the five planes, from different buckets).
// ---------------------------------------------------------------------------
ffi::Error TerngradEncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                              ffi::ResultBuffer<ffi::U8> trits, ffi::ResultBuffer<ffi::F32> scales,
                              int64_t bucket) {
  const char* op = "jaxcomp_terngrad_encode";
  PoolRunner pool(thread_pool);
  if (seed.element_count() != 2) return invalid(op, "seed must have 2 uint32 words");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  const int64_t m = (n + 4) / 5;
  DType dt;
  std::string err = check_bucketed(x, bucket, trits->element_count(), m, scales->element_count(), nb, &dt);
  if (!err.empty()) return invalid(op, err);
  const uint32_t k0 = seed.typed_data()[0], k1 = seed.typed_data()[1];
  uint8_t* t = trits->typed_data();
  float* s = scales->typed_data();
  const void* xd = x.untyped_data();
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().terngrad_scales(EncodeArgs{dt, xd, n, b0, b1, static_cast<int>(bucket)}, s);
  });
  parallel_for(pool, m, kElementsPerTask / 5, [&](int64_t i0, int64_t i1) {
    kernels().terngrad_pack(dt, xd, n, static_cast<int>(bucket), s, k0, k1, i0, i1, t);
  });
  return ffi::Error::Success();
}

ffi::Error TerngradDecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::U8> trits, ffi::Buffer<ffi::F32> scales,
                              ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_terngrad_decode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (trits.element_count() != (n + 4) / 5) return invalid(op, "payload buffer has the wrong size");
  if (scales.element_count() != nb) return invalid(op, "scale buffer has the wrong size");
  const uint8_t* t = trits.typed_data();
  const float* s = scales.typed_data();
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  parallel_for(pool, n, kElementsPerTask, [&](int64_t e0, int64_t e1) {
    kernels().terngrad_decode(dt, o, n, static_cast<int>(bucket), t, s, e0, e1);
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Natural compression
// ---------------------------------------------------------------------------
ffi::Error NaturalEncodeImpl(ffi::ThreadPool thread_pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed,
                             ffi::ResultBuffer<ffi::U8> codes, ffi::ResultBuffer<ffi::U8> tops, int64_t bucket,
                             int64_t stochastic) {
  const char* op = "jaxcomp_natural_encode";
  PoolRunner pool(thread_pool);
  if (seed.element_count() != 2) return invalid(op, "seed must have 2 uint32 words");
  if (stochastic != 0 && stochastic != 1) return invalid(op, "stochastic must be 0 or 1");
  const int64_t n = x.element_count();
  const int64_t nb = num_buckets(n, bucket);
  DType dt;
  std::string err = check_bucketed(x, bucket, codes->element_count(), n, tops->element_count(), nb, &dt);
  if (!err.empty()) return invalid(op, err);
  const uint32_t k0 = seed.typed_data()[0], k1 = seed.typed_data()[1];
  uint8_t* c = codes->typed_data();
  uint8_t* tp = tops->typed_data();
  hint_huge_pages(c, codes->element_count());
  const void* xd = x.untyped_data();
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().natural_encode(EncodeArgs{dt, xd, n, b0, b1, static_cast<int>(bucket)}, stochastic != 0, k0, k1, c,
                             tp);
  });
  return ffi::Error::Success();
}

ffi::Error NaturalDecodeImpl(ffi::ThreadPool thread_pool, ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::U8> tops,
                             ffi::Result<ffi::AnyBuffer> out, int64_t bucket) {
  const char* op = "jaxcomp_natural_decode";
  PoolRunner pool(thread_pool);
  DType dt;
  if (!to_dtype(out->element_type(), &dt)) return invalid(op, "output must be float32, bfloat16 or float16");
  if (!valid_bucket(bucket)) return invalid(op, "bucket_size must be a power of two in [8, 65536]");
  const int64_t n = out->element_count();
  const int64_t nb = num_buckets(n, bucket);
  if (codes.element_count() != n) return invalid(op, "payload buffer has the wrong size");
  if (tops.element_count() != nb) return invalid(op, "tops buffer has the wrong size");
  const uint8_t* c = codes.typed_data();
  const uint8_t* tp = tops.typed_data();
  void* o = out->untyped_data();
  hint_huge_pages(o, static_cast<int64_t>(out->size_bytes()));
  parallel_for(pool, nb, std::max<int64_t>(1, kElementsPerTask / bucket), [&](int64_t b0, int64_t b1) {
    kernels().natural_decode(DecodeArgs{dt, o, n, b0, b1, static_cast<int>(bucket)}, c, tp);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomp

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdEncode, jaxcomp::QsgdEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words
                                  .Ret<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Attr<int64_t>("bits")          // 2, 3, 4 or 8
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("l2"));          // 1: L2 norm, 0: max norm

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompQsgdDecode, jaxcomp::QsgdDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // packed codes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket scale
                                  .Ret<ffi::AnyBuffer>()          // flat output, input dtype
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompInt8Encode, jaxcomp::Int8EncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::S8>>()    // q in [-127, 127]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompInt8Decode, jaxcomp::Int8DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()    // q
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompOnebitEncode, jaxcomp::OnebitEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Ret<ffi::Buffer<ffi::U8>>()    // sign bits, packed
                                  .Ret<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompOnebitDecode, jaxcomp::OnebitDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // sign bits
                                  .Arg<ffi::Buffer<ffi::F32>>()   // (avg+, avg-) per bucket
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompCast, jaxcomp::CastImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x
                                  .Ret<ffi::AnyBuffer>());        // x converted, round to nearest even

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTerngradEncode, jaxcomp::TerngradEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words
                                  .Ret<ffi::Buffer<ffi::U8>>()    // base-3^5 bytes, ceil(n/5)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Attr<int64_t>("bucket_size"));  // power of two

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompTerngradDecode, jaxcomp::TerngradDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // base-3^5 bytes
                                  .Arg<ffi::Buffer<ffi::F32>>()   // per-bucket max|x|
                                  .Ret<ffi::AnyBuffer>()          // flat output, input dtype
                                  .Attr<int64_t>("bucket_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompNaturalEncode, jaxcomp::NaturalEncodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x: flat f32/bf16/f16
                                  .Arg<ffi::Buffer<ffi::U32>>()   // seed: 2 words
                                  .Ret<ffi::Buffer<ffi::U8>>()    // one code per element
                                  .Ret<ffi::Buffer<ffi::U8>>()    // per-bucket top exponent
                                  .Attr<int64_t>("bucket_size")   // power of two
                                  .Attr<int64_t>("stochastic"));  // 1: unbiased, 0: nearest

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcompNaturalDecode, jaxcomp::NaturalDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes
                                  .Arg<ffi::Buffer<ffi::U8>>()    // per-bucket top exponent
                                  .Ret<ffi::AnyBuffer>()          // flat output
                                  .Attr<int64_t>("bucket_size"));

JAXCOMP_REGISTER("jaxcomp_qsgd_encode", JaxcompQsgdEncode);
JAXCOMP_REGISTER("jaxcomp_qsgd_decode", JaxcompQsgdDecode);
JAXCOMP_REGISTER("jaxcomp_int8_encode", JaxcompInt8Encode);
JAXCOMP_REGISTER("jaxcomp_int8_decode", JaxcompInt8Decode);
JAXCOMP_REGISTER("jaxcomp_onebit_encode", JaxcompOnebitEncode);
JAXCOMP_REGISTER("jaxcomp_onebit_decode", JaxcompOnebitDecode);
JAXCOMP_REGISTER("jaxcomp_cast", JaxcompCast);
JAXCOMP_REGISTER("jaxcomp_terngrad_encode", JaxcompTerngradEncode);
JAXCOMP_REGISTER("jaxcomp_terngrad_decode", JaxcompTerngradDecode);
JAXCOMP_REGISTER("jaxcomp_natural_encode", JaxcompNaturalEncode);
JAXCOMP_REGISTER("jaxcomp_natural_decode", JaxcompNaturalDecode);

NB_MODULE(_jaxcomp_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const jaxcomp::HandlerEntry& e : jaxcomp::registered_handlers()) {
      if (d.contains(e.name)) throw std::runtime_error(std::string("two handlers registered as ") + e.name);
      d[e.name] = nb::capsule(e.handler);
    }
    return d;
  });
  m.def("isa", []() { return std::string(jaxcomp::pick_isa()); }, "Instruction set the CPU kernels use.");
}
