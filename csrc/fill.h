// Max-min fair rates by progressive filling (dcp/sim/flows.py _max_min_small and dcp/sim/network.py
// max_min_rates, operation for operation), for the simulator's event loop (sim.cpp) and for
// dcp._C.max_min_fill.
#pragma once

#include <cstdint>
#include <vector>

namespace dcp {

// Progressive filling over flows given by their resource rows (row(i) -> pointer, width, -1 padding).
class Filler {
 public:
  Filler(const double* cap, int64_t n_res) : cap_(cap), lid_(n_res, -1) {}

  // dcp.sim.flows._max_min_small
  void small(const std::vector<const int64_t*>& rows, int64_t w, double* rate);
  // dcp.sim.network.max_min_rates (padding dropped: an unlimited resource never binds)
  void large(const std::vector<const int64_t*>& rows, int64_t w, double* rate);

 private:
  const double* cap_;
  std::vector<int64_t> lid_, res_, loc_, cnt_, idx_, keep_, hit_;
  std::vector<double> left_, share_, sub_, fmin_;
  std::vector<std::vector<int64_t>> users_;
  std::vector<char> frozen_, held_;
};

}  // namespace dcp
