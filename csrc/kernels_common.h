// Standard headers needed by kernels_impl.h. Included by each ISA translation unit *before* its
// `#pragma GCC target`, so that no library code is compiled for a wider ISA than the baseline.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>

#include "attention_cpu.h"
#include "dtype_convert.h"
