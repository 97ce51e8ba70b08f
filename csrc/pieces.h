// Pair counts of a grouped layout (dcp/layout/pieces.py): token blocks made of contiguous per-sequence *pieces*.
// The Python reference dcp.layout.pieces.grouped_pair_counts_reference defines the semantics; this computes the
// same integers (exactly) in one pass per sequence instead of a dense pieces x pieces matrix per sequence.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dcp {

struct GroupedCountsParams {
  int64_t n_seqs = 0;
  int64_t n_pieces = 0;
  int64_t n_blocks = 0;                   // grouped blocks; every piece_block lies in [0, n_blocks)
  const int64_t* seq_piece_ptr = nullptr; // [n_seqs + 1] pieces of sequence s: ptr[s]..ptr[s+1], token order
  const int64_t* piece_start = nullptr;   // [n_pieces] first token (packed row); a sequence's pieces touch
  const int64_t* piece_len = nullptr;     // [n_pieces] tokens (>= 0)
  const int64_t* piece_block = nullptr;   // [n_pieces] grouped block of each piece
  const int32_t* ranges = nullptr;        // [rows, 2] half-open KV ranges, sequence-local; start == end: empty
  const int64_t* range_ptr = nullptr;     // [n_seqs + 1] rows of sequence s: range_ptr[s]..range_ptr[s+1]
  const int64_t* seq_r = nullptr;         // [n_seqs] ranges per query token (rows of s = seqlen x seq_r[s])
};

// One row per (q block, kv block) pair with at least one attended pair, sorted by (q, kv); the moments
// sum, over the sequences taking part, p_s / q_s, p_s / k_s and p_s / (q_s k_s) (dcp/layout/pieces.py).
struct GroupedCountsResult {
  std::vector<int64_t> q_block, kv_block, unmasked, area, sub_n;
  std::vector<double> sub_wq, sub_wk, sub_wqk;
};

// Fills `out`; on bad input returns false and sets `error` (the message names the sequence).
bool grouped_pair_counts(const GroupedCountsParams& p, GroupedCountsResult& out, std::string& error);

}  // namespace dcp
