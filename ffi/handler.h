// The XLA side that every handler shares, CPU (ffi/) and CUDA (cuda/): the
// element types as the family headers name them, the batch dimensions that
// jax.vmap adds, and the one way a target's implementation is bound and
// registered (Handler, JAXCOMP_REGISTER). The checks themselves are the
// family headers'.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "jaxcomp/common.h"
#include "jaxcomp/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxcomp {

inline DType dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return DType::kOther;
  }
}

// Width in bytes of an unsigned index type (uint8, uint16, uint32); 0 for
// any other type.
inline int index_bytes(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::U8: return 1;
    case ffi::DataType::U16: return 2;
    case ffi::DataType::U32: return 4;
    default: return 0;
  }
}

// An invalid call; the handler puts the target's name in front of `what`.
inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// The buffers of one call, seen as a batch of entries. Under jax.vmap
// (ffi_call's vmap_method="broadcast_all") every operand and result has the
// same leading batch dimensions, [*batch, item]; the item part is what an
// unbatched call passes, a flat array, so the batch is every dimension but
// the last. An unbatched call is a batch of one. (The comments on the
// handlers' bindings describe one entry.)
template <size_t N>
class Batch {
 public:
  template <typename... B>
  explicit Batch(const B&... buffers) {
    static_assert(sizeof...(B) == N, "one Batch slot per buffer");
    size_t k = 0;
    (add(k++, buffers.dimensions(), buffers.element_type(), buffers.untyped_data()), ...);
  }

  // nullptr, or why the buffers do not form one batch.
  const char* error() const { return error_; }
  // The first error of a call: the batch's, else the family check's.
  const char* check(const char* family_error) const { return error_ != nullptr ? error_ : family_error; }
  // Entries in the batch.
  int64_t size() const { return size_; }
  // Elements of one entry of buffer k (the buffers in the order given).
  int64_t count(size_t k) const { return count_[k]; }
  // Entry i of buffer k.
  template <typename T>
  T* at(size_t k, int64_t i) const {
    return static_cast<T*>(static_cast<void*>(data_[k] + i * bytes_[k]));
  }

 private:
  void add(size_t k, ffi::AnyBuffer::Dimensions dims, ffi::DataType type, void* data) {
    const size_t rank = dims.size();
    const ffi::AnyBuffer::Dimensions lead = dims.first(rank > 0 ? rank - 1 : 0);
    count_[k] = rank > 0 ? dims.back() : 1;
    bytes_[k] = count_[k] * static_cast<int64_t>(ffi::ByteWidth(type));
    data_[k] = static_cast<char*>(data);
    if (k == 0) {
      lead_ = lead;
      for (int64_t d : lead) size_ *= d;
    } else if (!(lead == lead_)) {
      error_ = "operands and results must have the same leading (batch) dimensions";
    }
  }

  const char* error_ = nullptr;
  int64_t size_ = 1;
  ffi::AnyBuffer::Dimensions lead_;
  std::array<int64_t, N> count_{};
  std::array<int64_t, N> bytes_{};
  std::array<char*, N> data_{};
};

template <typename... B>
Batch(const B&...) -> Batch<sizeof...(B)>;

// The buffers of a decode-and-accumulate call (a family's decode_sum
// target): the codes [rows, bytes] and the side data [rows, buckets] of
// `rows` payloads, and the sum of the decoded rows, flat.
class Stacked {
 public:
  using Dims = ffi::AnyBuffer::Dimensions;
  Stacked(Dims codes, Dims side, Dims out)
      : ok_(codes.size() == 2 && side.size() == 2 && codes[0] == side[0] && out.size() == 1),
        rows_(ok_ ? codes[0] : 0),
        bytes_(ok_ ? codes[1] : 0),
        buckets_(ok_ ? side[1] : 0),
        n_(ok_ ? out[0] : 0) {}

  // The first error of a call: the shapes', else the family check's (of
  // one row: n, bytes, buckets).
  const char* check(const char* family_error) const {
    return ok_ ? family_error
               : "expects codes [rows, bytes] and scales [rows, buckets] with the same rows, and a flat output";
  }
  int64_t rows() const { return rows_; }
  int64_t bytes() const { return bytes_; }
  int64_t buckets() const { return buckets_; }
  int64_t n() const { return n_; }

 private:
  bool ok_;
  int64_t rows_, bytes_, buckets_, n_;
};

// ---------------------------------------------------------------------------
// Handlers: one pattern for every target, CPU and CUDA alike. A target's
// implementation is a function
//   ffi::Error impl(contexts..., operands..., results..., attributes...)
// whose parameter types are its binding (Bound below: the platform's
// context, ffi::ThreadPool or cudaStream_t, then ffi::ScratchAllocator where
// it needs one; an operand is an ffi::AnyBuffer or ffi::Buffer, a result an
// ffi::Result; any other parameter an attribute), and the target, declared
// in the family's header (jaxcomp/registry.h: Target), names the attributes
// in order, so that a handler cannot bind other buffers than its
// implementation takes. The header's comment on the target says what each
// operand, result and attribute is, once for both platforms. At namespace
// scope,
//   JAXCOMP_REGISTER(kQsgdEncode, EncodeImpl);
// registers the handler under the target's name. An error the
// implementation returns reaches XLA as "<target name>: <message>".
// ---------------------------------------------------------------------------
namespace binding {

// How a parameter of an implementation is bound: by default as the next
// attribute, by name; a context, an operand or a result by its type.
template <typename T>
struct AsAttr {
  static constexpr size_t kAttributes = 1;
  template <const auto& kTarget, size_t kAttr, typename B>
  static auto add(B&& b) {
    static_assert(std::is_arithmetic_v<T>, "a parameter is a context, an operand, a result or a scalar attribute");
    static_assert(kAttr < kTarget.attributes.size(), "the implementation takes more attributes than its target names");
    return std::move(b).template Attr<T>(kTarget.attributes[kAttr]);
  }
};

template <typename T>
struct AsCtx {
  static constexpr size_t kAttributes = 0;
  template <const auto&, size_t, typename B>
  static auto add(B&& b) {
    return std::move(b).template Ctx<T>();
  }
};

template <typename T>
struct AsArg {
  static constexpr size_t kAttributes = 0;
  template <const auto&, size_t, typename B>
  static auto add(B&& b) {
    return std::move(b).template Arg<T>();
  }
};

template <typename T>
struct AsRet {
  static constexpr size_t kAttributes = 0;
  template <const auto&, size_t, typename B>
  static auto add(B&& b) {
    return std::move(b).template Ret<T>();
  }
};

template <typename P>
struct Bound : AsAttr<P> {};
template <>
struct Bound<ffi::ThreadPool> : AsCtx<ffi::ThreadPool> {};
template <>
struct Bound<ffi::ScratchAllocator> : AsCtx<ffi::ScratchAllocator> {};
template <>
struct Bound<ffi::AnyBuffer> : AsArg<ffi::AnyBuffer> {};
template <ffi::DataType kType, size_t kRank>
struct Bound<ffi::Buffer<kType, kRank>> : AsArg<ffi::Buffer<kType, kRank>> {};
template <typename T>
struct Bound<ffi::Result<T>> : AsRet<T> {};
// cuda/cuda_runtime.cuh: Bound<cudaStream_t>, the CUDA platform stream.

template <typename... P>
struct Params {};

// Binds the parameters P of fn one by one (each step a new type of XLA's
// Binding, which can only be moved into the next), then binds fn itself.
template <const auto& kTarget, size_t kAttr, typename Fn, typename B>
auto bind(Fn fn, B&& b, Params<>) {
  static_assert(kAttr == kTarget.attributes.size(), "the implementation takes fewer attributes than its target names");
  return b.To(fn);
}

template <const auto& kTarget, size_t kAttr, typename Fn, typename B, typename P, typename... Rest>
auto bind(Fn fn, B&& b, Params<P, Rest...>) {
  return bind<kTarget, kAttr + Bound<P>::kAttributes>(fn, Bound<P>::template add<kTarget, kAttr>(std::move(b)),
                                                      Params<Rest...>{});
}

}  // namespace binding

template <const auto& kTarget, auto kImpl, typename Fn = decltype(kImpl)>
struct Handler;

template <const auto& kTarget, auto kImpl, typename... P>
struct Handler<kTarget, kImpl, ffi::Error (*)(P...)> {
  // The implementation, its error put under the target's name.
  static ffi::Error named(P... p) {
    ffi::Error e = kImpl(std::move(p)...);
    if (e.success()) return e;
    return ffi::Error(*e.errc(), std::string(kTarget.name) + ": " + e.message());
  }

  // The XLA_FFI_Handler: the binding is built on the first call.
  static XLA_FFI_Error* call(XLA_FFI_CallFrame* frame) {
    static auto* handler = binding::bind<kTarget, 0>(named, ffi::Ffi::Bind(), binding::Params<P...>{}).release();
    return handler->Call(frame);
  }
};

// Registers `impl`, a function (or a pointer to one, as PairHandlers'
// encode and decode, whose template arguments may hold commas), as the
// handler of `target`.
#define JAXCOMP_REGISTER(target, ...)                                                        \
  static const ::jaxcomp::Registration JAXCOMP_CONCAT(jaxcomp_registration_, __LINE__)( \
      (target).name, reinterpret_cast<void*>(&::jaxcomp::Handler<target, __VA_ARGS__>::call))

// ---------------------------------------------------------------------------
// The pair families: those whose payload is codes plus side data per bucket
// (QSGD, Int8, OneBit, SignSGD, TernGrad, Natural, FP8, MX). Their
// implementations are written once, here, for both platforms: Platform is
// CpuPlatform (cpu_runtime.h) or CudaPlatform (cuda/cuda_runtime.cuh). A
// family gives its check (its header's *_check_encode or *_check_decode, or
// checks.h's check_pair_encode and check_pair_decode over its sizes) and the
// function that runs one tensor of the batch on the platform's Work (a
// Runner, a CUDA stream):
//   encode: fn(work, dtype, x, n, [seed,] codes, side, attributes...)
//           check(dtype, n, [seed words,] codes, side, attributes...)
//   decode: fn(work, dtype, codes, side, n, out, attributes...)
//           check(dtype, n, codes, side, attributes...)
//   feedback (fused error feedback, CPU): fn(work, dtype, x, residual, n,
//           [seed,] codes, side, new_residual, attributes...), with the
//           encoder's check
// (counts of elements in the checks). The attributes are the target's, in
// its order: the handler (Handler) takes what fn takes after its buffers, and
// an encoder with a seed operand takes its two words after n. E.g.
//   JAXCOMP_REGISTER(kFp8Encode, Handlers::encode<fp8_check_encode, encode>);
// ---------------------------------------------------------------------------
template <typename Platform, ffi::DataType kCodes, ffi::DataType kSide>
struct PairHandlers {
  using Codes = ffi::NativeType<kCodes>;
  using Side = ffi::NativeType<kSide>;
  using Context = typename Platform::Context;
  using Work = typename Platform::Work;

  template <auto kCheck, auto kFn, typename Fn = decltype(kFn)>
  struct Encode {
    static_assert(sizeof(Fn) == 0, "an encoder is fn(work, dtype, x, n, [seed,] codes, side, attributes...)");
  };

  template <auto kCheck, auto kFn, typename Fn = decltype(kFn)>
  struct Decode {
    static_assert(sizeof(Fn) == 0, "a decoder is fn(work, dtype, codes, side, n, out, attributes...)");
  };

  // x -> (codes, side)
  template <auto kCheck, auto kFn, typename... A>
  struct Encode<kCheck, kFn, void (*)(Work, DType, const void*, int64_t, Codes*, Side*, A...)> {
    static ffi::Error impl(Context ctx, ffi::AnyBuffer x, ffi::ResultBuffer<kCodes> codes,
                           ffi::ResultBuffer<kSide> side, A... attrs) {
      const Batch<3> b(x, *codes, *side);
      const DType dt = dtype_of(x.element_type());
      const int64_t n = b.count(0);
      Platform::hint(codes->untyped_data(), codes->size_bytes());
      return Platform::run(ctx, b, kCheck(dt, n, b.count(1), b.count(2), attrs...), n, [&](int64_t i, Work w) {
        kFn(w, dt, b.at<void>(0, i), n, b.at<Codes>(1, i), b.at<Side>(2, i), attrs...);
      });
    }
  };

  // (x, seed) -> (codes, side)
  template <auto kCheck, auto kFn, typename... A>
  struct Encode<kCheck, kFn, void (*)(Work, DType, const void*, int64_t, const uint32_t*, Codes*, Side*, A...)> {
    static ffi::Error impl(Context ctx, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> seed, ffi::ResultBuffer<kCodes> codes,
                           ffi::ResultBuffer<kSide> side, A... attrs) {
      const Batch<4> b(x, seed, *codes, *side);
      const DType dt = dtype_of(x.element_type());
      const int64_t n = b.count(0);
      Platform::hint(codes->untyped_data(), codes->size_bytes());
      const char* error = kCheck(dt, n, b.count(1), b.count(2), b.count(3), attrs...);
      return Platform::run(ctx, b, error, n, [&](int64_t i, Work w) {
        kFn(w, dt, b.at<void>(0, i), n, b.at<const uint32_t>(1, i), b.at<Codes>(2, i), b.at<Side>(3, i), attrs...);
      });
    }
  };

  // (codes, side) -> out
  template <auto kCheck, auto kFn, typename... A>
  struct Decode<kCheck, kFn, void (*)(Work, DType, const Codes*, const Side*, int64_t, void*, A...)> {
    static ffi::Error impl(Context ctx, ffi::Buffer<kCodes> codes, ffi::Buffer<kSide> side,
                           ffi::Result<ffi::AnyBuffer> out, A... attrs) {
      const Batch<3> b(codes, side, *out);
      const DType dt = dtype_of(out->element_type());
      const int64_t n = b.count(2);
      Platform::hint(out->untyped_data(), out->size_bytes());
      return Platform::run(ctx, b, kCheck(dt, n, b.count(0), b.count(1), attrs...), n, [&](int64_t i, Work w) {
        kFn(w, dt, b.at<const Codes>(0, i), b.at<const Side>(1, i), n, b.at<void>(2, i), attrs...);
      });
    }
  };

  template <auto kCheck, auto kFn, typename Fn = decltype(kFn)>
  struct Feedback {
    static_assert(sizeof(Fn) == 0,
                  "a fused error-feedback encoder is fn(work, dtype, x, residual, n, codes, side, new_residual, "
                  "attributes...)");
  };

  // (x, residual) -> (codes, side, new residual): error feedback in one pass,
  // the payload of acc = float32(x) + residual and acc - decode(payload).
  template <auto kCheck, auto kFn, typename... A>
  struct Feedback<kCheck, kFn, void (*)(Work, DType, const void*, const float*, int64_t, Codes*, Side*, float*, A...)> {
    static ffi::Error impl(Context ctx, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> residual,
                           ffi::ResultBuffer<kCodes> codes, ffi::ResultBuffer<kSide> side,
                           ffi::ResultBuffer<ffi::F32> out, A... attrs) {
      const Batch<5> b(x, residual, *codes, *side, *out);
      const DType dt = dtype_of(x.element_type());
      const int64_t n = b.count(0);
      Platform::hint(out->untyped_data(), out->size_bytes());
      const char* error = b.count(1) != n || b.count(4) != n
                              ? "the residual and the new residual must have the gradient's size"
                              : kCheck(dt, n, b.count(2), b.count(3), attrs...);
      return Platform::run(ctx, b, error, n, [&](int64_t i, Work w) {
        kFn(w, dt, b.at<void>(0, i), b.at<const float>(1, i), n, b.at<Codes>(2, i), b.at<Side>(3, i),
            b.at<float>(4, i), attrs...);
      });
    }
  };

  // (x, residual, seed) -> (codes, side, new residual)
  template <auto kCheck, auto kFn, typename... A>
  struct Feedback<kCheck, kFn,
                  void (*)(Work, DType, const void*, const float*, int64_t, const uint32_t*, Codes*, Side*, float*,
                           A...)> {
    static ffi::Error impl(Context ctx, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> residual, ffi::Buffer<ffi::U32> seed,
                           ffi::ResultBuffer<kCodes> codes, ffi::ResultBuffer<kSide> side,
                           ffi::ResultBuffer<ffi::F32> out, A... attrs) {
      const Batch<6> b(x, residual, seed, *codes, *side, *out);
      const DType dt = dtype_of(x.element_type());
      const int64_t n = b.count(0);
      Platform::hint(out->untyped_data(), out->size_bytes());
      const char* error = b.count(1) != n || b.count(5) != n
                              ? "the residual and the new residual must have the gradient's size"
                              : kCheck(dt, n, b.count(2), b.count(3), b.count(4), attrs...);
      return Platform::run(ctx, b, error, n, [&](int64_t i, Work w) {
        kFn(w, dt, b.at<void>(0, i), b.at<const float>(1, i), n, b.at<const uint32_t>(2, i), b.at<Codes>(3, i),
            b.at<Side>(4, i), b.at<float>(5, i), attrs...);
      });
    }
  };

  // The implementations, for JAXCOMP_REGISTER.
  template <auto kCheck, auto kFn>
  static constexpr auto encode = &Encode<kCheck, kFn>::impl;
  template <auto kCheck, auto kFn>
  static constexpr auto decode = &Decode<kCheck, kFn>::impl;
  template <auto kCheck, auto kFn>
  static constexpr auto feedback = &Feedback<kCheck, kFn>::impl;
};

}  // namespace jaxcomp
