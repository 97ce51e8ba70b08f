// Plain (torch-free) parameters of the simulator's event loop (dcp.sim.streams.Streams.run together with
// dcp.sim.flows.ComponentNetwork): device streams advancing step by step, flows posted by both ends,
// started after the link latency and drained through a max-min fair fluid network recomputed per
// union-find component. The Python classes define the semantics; this is the same loop, operation for
// operation (the same event order, tolerances and floating-point operations), so both give the same
// times. Streams.__init__ (Python) builds every table below.
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

struct SimParams {
  int64_t n_dev = 0, n_steps = 0, n_flows = 0, n_res = 0;
  const int64_t* ptr = nullptr;         // [n_dev + 1] steps of device d: ptr[d]..ptr[d+1]
  const int64_t* step_dev = nullptr;    // [n_steps]
  const int64_t* flow_ptr = nullptr;    // [n_steps + 1] flows a step posts: step_flows[flow_ptr[k]..]
  const int64_t* step_flows = nullptr;  // [flow_ptr[n_steps]]
  const int64_t* pending = nullptr;     // [n_steps] flow endpoints a step waits for
  const double* comp = nullptr;         // [n_steps] compute seconds
  const double* red = nullptr;          // [n_steps] merge seconds
  const int64_t* f_step = nullptr;      // [n_flows, 2] the steps a flow's ends wait in (-1: none, local flow)
  const int64_t* f_res = nullptr;       // [n_flows, res_width] resources a flow crosses (-1: padding)
  int64_t res_width = 0;
  const double* f_bytes = nullptr;      // [n_flows]
  const double* cap = nullptr;          // [n_res] bytes/s of each resource (inf: unlimited)
  const double* clock0 = nullptr;       // [n_dev] when each stream starts (program overhead + delta)
  const double* reduce0 = nullptr;      // [n_dev] reduce time already spent (the delta)
  const double* host = nullptr;         // [n_steps, 4] host seconds per step: post, compute, wait, merges
  const double* host0 = nullptr;        // [n_dev] host seconds before a device's first step
  double latency = 0.0, round_over = 0.0;
  // outputs
  double* clock = nullptr;              // [n_dev] when each stream ended
  double* compute_s = nullptr;          // [n_dev]
  double* reduce_s = nullptr;           // [n_dev]
  double* wait_s = nullptr;             // [n_dev]
  double* f_start = nullptr;            // [n_flows] (NaN: never started)
  double* f_end = nullptr;              // [n_flows] (NaN: never finished)
  int64_t* blocked = nullptr;           // [n_dev] the step a device waits in at the end (-1: none)
  int64_t* pos = nullptr;               // [n_dev] the step a device stopped at (ptr[d + 1]: finished)
  int64_t n_rate_updates = 0;           // out: component recomputations
};

// Runs the event loop; fills the outputs. Returns false (and `err`) on malformed tables.
bool simulate_streams(SimParams& p, std::string& err);

// Max-min fair rates of `n` flows crossing rows of `res` ([n, width], -1 padding) over `cap`, by the
// progressive filling of dcp.sim.network.max_min_rates (large) or dcp.sim.flows._max_min_small (small).
void max_min_fill(int64_t n, int64_t width, const int64_t* res, const double* cap, int64_t n_res, bool small,
                  double* rate);

}  // namespace dcp
