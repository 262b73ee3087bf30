// Kernels for the baseline instruction set of the target.
#define JC_ISA isa_base
#include "cpu_kernels.inc"
