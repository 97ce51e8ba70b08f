// Floating-point rules of the simulator's C++ files (sim.cpp, fill.cpp), which repeat the Python
// reference's operations one for one: a*b+c must round twice (no fused multiply-add), and max(a, 0.0)
// must answer as Python's does. Include it after the standard headers: the pragma covers what follows.
#pragma once

#include <limits>

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dcp {
namespace simfp {

constexpr double kInf = std::numeric_limits<double>::infinity();

inline double pymax0(double a) { return 0.0 > a ? 0.0 : a; }  // Python's max(a, 0.0)

}  // namespace simfp
}  // namespace dcp
