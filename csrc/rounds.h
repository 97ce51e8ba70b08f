// Plain (torch-free) parameters of the input-round greedy of dcp/schedule/stages.py (dcp.schedule.rounds), the planner's
// inner loop: it fills rounds with demands (device, remote unit) under per-round port and NIC capacities.
// The Python reference dcp.schedule.rounds.input_rounds_reference defines the semantics; this is the same loop,
// operation for operation (the same floating-point comparisons), so both give identical results.
#pragma once

#include <cstdint>

namespace dcp {

struct RoundsParams {
  int64_t n = 0;                        // demands
  const int64_t* order = nullptr;       // [n] demand ids in priority order
  const int64_t* dev = nullptr;         // [n] consumer device of each demand
  const int64_t* key = nullptr;         // [n] unit id (side, token block, head block) of each demand
  const int64_t* home = nullptr;        // [n] home device of the demand's unit
  const double* nbytes = nullptr;       // [n] bytes
  const double* budget_first = nullptr; // [n_dev] seconds a device's round 1 may take
  const double* budget = nullptr;       // [n_dev] seconds of its later rounds
  int64_t n_dev = 0, gpus_per_node = 1, n_nodes = 1, max_rounds = 1, n_keys = 0;
  bool relay = true;
  double port = 0.0, nic = 0.0;         // bytes per second of a GPU port and of a node's NIC
  int64_t* arrival = nullptr;           // [n] out: round of each demand (0: none)
  int64_t* source = nullptr;            // [n] out: serving device (-1: none)
};

void input_rounds(const RoundsParams& p);

}  // namespace dcp
