// Attended pairs in each (query box, key box) of a sequence from its KV ranges, in one pass
// (dcp.masks.box_counts, method "direct"): the Python reference dcp.masks.box_counts._direct_counts_reference
// defines the counts; this loop gives the same integers.
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

struct BoxCountsParams {
  int64_t n_tok = 0, n_slots = 0, n_q = 0, n_kv = 0;
  const int32_t* ranges = nullptr;  // [n_tok, n_slots, 2] (start, end) of each query's KV ranges; end <= start: unused
  const int64_t* q_bounds = nullptr;   // [n_q + 1] strictly increasing from 0 to n_tok
  const int64_t* kv_bounds = nullptr;  // [n_kv + 1] strictly increasing from 0 to n_tok
  int64_t* counts = nullptr;           // [n_q, n_kv] out
};

// Fills p.counts. Returns false (and `err`) when a used range leaves 0..n_tok.
bool box_counts_direct(const BoxCountsParams& p, std::string& err);

}  // namespace dcp
