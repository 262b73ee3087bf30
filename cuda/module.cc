// The nanobind module _jaxcomp_cuda: hands the CUDA handlers that the family
// files registered (jaxcomp/registry.h) to jaxcomp/_ffi.py, which registers
// them for platform "CUDA".
//
// It is a separate, host-compiled file so that nanobind is built by the
// compiler it targets rather than by nvcc's front end.
#include "jaxcomp/registry.h"
#include <string>

#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

NB_MODULE(_jaxcomp_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const jaxcomp::HandlerEntry& e : jaxcomp::unique_handlers()) d[e.name] = nb::capsule(e.handler);
    return d;
  });
  m.def("source_hash", []() { return std::string(JAXCOMP_SOURCE_HASH); }, "Hash of the kernel sources built.");
}
