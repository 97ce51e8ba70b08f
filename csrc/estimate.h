// Plain (torch-free) parameters of the planner's makespan estimate, round by round
// (dcp.cost.estimate.estimate_device_ends_s): per round r, launch r, compute stage r-1, wait r, merge what
// arrived; a round's flows coalesced per (sender, receiver), each finishing when the busiest resource it
// crosses (ports, and across nodes the NICs) has drained that round's bytes. The Python reference
// dcp.cost.estimate.rounds_end_s_reference defines the semantics; this is the same loop, operation for
// operation (the same sums in the same order), so both give the same times.
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

struct EstimateParams {
  int64_t n_dev = 0, n_transfers = 0, n_rounds = 0, n_stages = 0;
  const int64_t* round = nullptr;   // [n_transfers] round of each transfer, 1..n_rounds
  const int64_t* src = nullptr;     // [n_transfers] sending device
  const int64_t* dst = nullptr;     // [n_transfers] receiving device
  const double* nbytes = nullptr;   // [n_transfers]
  const double* comp = nullptr;     // [n_dev, n_stages] fused compute seconds per (device, stage)
  const double* red = nullptr;      // [n_dev, n_rounds + 1] merge seconds per (device, round)
  const double* n_merges = nullptr; // [n_dev, n_rounds + 1] merges per (device, round)
  const double* t0 = nullptr;       // [n_dev] when each stream starts its first round
  const double* host0 = nullptr;    // [n_dev] when each host starts its first round
  double launch = 0, message = 0, wait = 0, compute = 0, reduce = 0;  // host seconds (GPUProfile.host_*)
  double round_over = 0, latency = 0, port = 0, nic = 0;  // seconds; bytes/s of a port and of a NIC
  int64_t gpus_per_node = 1, per_nic = 1, n_nics = 1;
  double* t = nullptr;              // [n_dev] out: when each device's stream ends
};

// Fills p.t. Transfers may come in any order; within a (round, sender, receiver) their bytes add in input order.
// Returns false (and `err`) when a transfer names a round or device out of range.
bool estimate_rounds(const EstimateParams& p, std::string& err);

}  // namespace dcp
