// The nanobind module _jaxcomp_cuda: hands the CUDA handlers of cuda_ops.cu
// to jaxcomp/_ffi.py, which registers them for platform "CUDA".
//
// It is a separate, host-compiled file so that nanobind is built by the
// compiler it targets rather than by nvcc's front end.
#include "nanobind/nanobind.h"
#include "jaxcomp/handlers.h"
#include "xla/ffi/api/api.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaQsgdEncode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaQsgdDecode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaInt8Encode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaInt8Decode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaOnebitEncode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaOnebitDecode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaCast);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaTerngradEncode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaTerngradDecode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaNaturalEncode);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxcompCudaNaturalDecode);

namespace {
template <typename T>
nb::capsule capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxcomp_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxcomp_qsgd_encode"] = capsule(JaxcompCudaQsgdEncode);
    d["jaxcomp_qsgd_decode"] = capsule(JaxcompCudaQsgdDecode);
    d["jaxcomp_int8_encode"] = capsule(JaxcompCudaInt8Encode);
    d["jaxcomp_int8_decode"] = capsule(JaxcompCudaInt8Decode);
    d["jaxcomp_onebit_encode"] = capsule(JaxcompCudaOnebitEncode);
    d["jaxcomp_onebit_decode"] = capsule(JaxcompCudaOnebitDecode);
    d["jaxcomp_cast"] = capsule(JaxcompCudaCast);
    d["jaxcomp_terngrad_encode"] = capsule(JaxcompCudaTerngradEncode);
    d["jaxcomp_terngrad_decode"] = capsule(JaxcompCudaTerngradDecode);
    d["jaxcomp_natural_encode"] = capsule(JaxcompCudaNaturalEncode);
    d["jaxcomp_natural_decode"] = capsule(JaxcompCudaNaturalDecode);
    for (auto list : {jaxcomp::threelc_cuda_handlers(), jaxcomp::topk_cuda_handlers()}) {
      for (const jaxcomp::HandlerEntry& e : list) d[e.name] = nb::capsule(e.handler);
    }
    return d;
  });
}
