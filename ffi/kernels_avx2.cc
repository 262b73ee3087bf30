// Kernels compiled with -mavx2 (CMake sets the flag on this file only); used
// when the CPU reports AVX2 at run time.
#define JC_ISA isa_avx2
#include "cpu_kernels.inc"
