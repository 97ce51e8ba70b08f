// Baseline-ISA build of the blockwise kernels (SSE2 on x86-64; whatever the compiler targets elsewhere).
#include "kernels_common.h"

#define DCP_ISA_NS generic
#define DCP_ISA_NAME "generic"
#define DCP_VEC_BYTES 16
#include "kernels_impl.h"
