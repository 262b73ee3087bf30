// The nanobind module _jaxcomp_cpu: hands the CPU handlers that the family
// files registered (jaxcomp/registry.h) to jaxcomp/_ffi.py, which registers
// them for platform "cpu", and reports which build of the loops runs.
#include <string>

#include "cpu_runtime.h"
#include "jaxcomp/registry.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

namespace {

// Resolved by the loader exactly as the loops' versions are (cpu_runtime.h),
// so it names the version that runs.
#if JC_CPU_AVX2
__attribute__((target("avx2"))) const char* isa() { return "avx2"; }
__attribute__((target("default"))) const char* isa() { return "base"; }
#else
const char* isa() { return "base"; }
#endif

}  // namespace

NB_MODULE(_jaxcomp_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const jaxcomp::HandlerEntry& e : jaxcomp::unique_handlers()) d[e.name] = nb::capsule(e.handler);
    return d;
  });
  m.def("isa", []() { return std::string(isa()); }, "Instruction set the CPU kernels use.");
  m.def("source_hash", []() { return std::string(JAXCOMP_SOURCE_HASH); }, "Hash of the kernel sources built.");
}
