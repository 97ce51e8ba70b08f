// AVX2 + FMA build of the blockwise kernels, selected at run time only on CPUs that have both
// (see attention_cpu.cpp). Only this file is compiled for AVX2: every library header comes first,
// every function below has internal linkage except avx2::kernel_table().
#include "kernels_common.h"

#if defined(DCP_HAVE_AVX2_KERNELS)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#define DCP_ISA_NS avx2
#define DCP_ISA_NAME "avx2"
#define DCP_VEC_BYTES 32
#include "kernels_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // DCP_HAVE_AVX2_KERNELS
