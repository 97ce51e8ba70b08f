// Pair counts of a grouped layout (see pieces.h and dcp/layout/pieces.py, whose reference this reproduces exactly).
//
// The q blocks are taken one at a time (so one row of n accumulators is live, in cache, and the rows come
// out sorted), and within a q block Q its pieces sequence by sequence. For the pieces of sequence s in Q,
// every KV range [a, e) of every query token adds its overlap with the pieces of s it spans: the pieces
// holding a and e-1 partially, the pieces in between fully through a difference array over the pieces of
// s. One sweep over the touched pieces j then gives the attended pairs between (s, Q) and j as
// run x len(j) + partials, added to the accumulator of j's block K. The first non-zero value of (s, Q, K)
// (a stamp per accumulator) also adds s to the pair: sub_n += 1 and the product of its tokens in Q and K;
// once the group is swept, its summed pairs p_s add the moments p_s / q_s, p_s / k_s, p_s / (q_s k_s).
// Counts are >= 0, so "some piece pair of s attends" is "their sum is > 0", as the reference's np.nonzero.
#include "pieces.h"

#include <algorithm>

namespace dcp {

namespace {

struct Cell {  // accumulators of (Q, K) for the current q block Q
  int64_t unmasked, area, sub_n;
  double wq, wk, wqk;  // the moments, sequence by sequence (the reference's order of additions)
  int64_t stamp;       // the last (sequence, q block) group that added its sequence here
  int64_t cur, tk;     // that group's pairs here, and its sequence's tokens in K
};
constexpr Cell kEmpty{0, 0, 0, 0.0, 0.0, 0.0, -1, 0, 0};

std::string seq_error(int64_t s, const std::string& what) { return "sequence " + std::to_string(s) + ": " + what; }

std::string range_text(int64_t a, int64_t e) { return "range [" + std::to_string(a) + ", " + std::to_string(e) + ")"; }

}  // namespace

bool grouped_pair_counts(const GroupedCountsParams& p, GroupedCountsResult& out, std::string& error) {
  const int64_t n = p.n_blocks, np_all = p.n_pieces;
  const int64_t* pb = p.piece_block;
  // pass 1, sequence by sequence: checks, token -> local piece, each piece's sequence and the tokens of
  // its sequence in its block
  std::vector<int64_t> piece_seq(static_cast<size_t>(np_all), -1), seq_tokens_in_block(static_cast<size_t>(np_all));
  std::vector<int64_t> tok_off(static_cast<size_t>(p.n_seqs + 1), 0);
  int64_t max_pieces = 0;
  for (int64_t s = 0; s < p.n_seqs; ++s) {
    const int64_t lo = p.seq_piece_ptr[s], hi = p.seq_piece_ptr[s + 1];
    max_pieces = std::max(max_pieces, hi - lo);
    for (int64_t j = lo; j < hi; ++j) {
      if (p.piece_len[j] < 0) {
        error = seq_error(s, "piece " + std::to_string(j) + " has a negative length");
        return false;
      }
      if (j + 1 < hi && p.piece_start[j + 1] != p.piece_start[j] + p.piece_len[j]) {
        error = seq_error(s, "pieces " + std::to_string(j) + " and " + std::to_string(j + 1) +
                                 " are not contiguous (start + len != next start)");
        return false;
      }
    }
    const int64_t seqlen = hi > lo ? p.piece_start[hi - 1] + p.piece_len[hi - 1] - p.piece_start[lo] : 0;
    const int64_t rows = p.range_ptr[s + 1] - p.range_ptr[s], nr = p.seq_r[s];
    if (nr < 1 || rows != seqlen * nr) {
      error = seq_error(s, std::to_string(rows) + " rows of ranges are not seqlen " + std::to_string(seqlen) +
                               " x R " + std::to_string(nr) + " (R >= 1)");
      return false;
    }
    tok_off[static_cast<size_t>(s + 1)] = tok_off[static_cast<size_t>(s)] + seqlen;
  }
  std::vector<int32_t> tok_piece(static_cast<size_t>(tok_off[static_cast<size_t>(p.n_seqs)]));
  {
    std::vector<int64_t> tokens(static_cast<size_t>(n), 0);  // tokens of one sequence per block
    for (int64_t s = 0; s < p.n_seqs; ++s) {
      const int64_t lo = p.seq_piece_ptr[s], hi = p.seq_piece_ptr[s + 1];
      int32_t* tp = tok_piece.data() + tok_off[static_cast<size_t>(s)];
      for (int64_t j = lo; j < hi; ++j) {
        std::fill(tp + (p.piece_start[j] - p.piece_start[lo]), tp + (p.piece_start[j] - p.piece_start[lo]) +
                  p.piece_len[j], static_cast<int32_t>(j - lo));
        tokens[static_cast<size_t>(pb[j])] += p.piece_len[j];
        piece_seq[static_cast<size_t>(j)] = s;
      }
      for (int64_t j = lo; j < hi; ++j) seq_tokens_in_block[static_cast<size_t>(j)] = tokens[static_cast<size_t>(pb[j])];
      for (int64_t j = lo; j < hi; ++j) tokens[static_cast<size_t>(pb[j])] = 0;
    }
  }
  // the pieces of each block, in piece order (so by sequence, then token order): a counting sort
  std::vector<int64_t> block_ptr(static_cast<size_t>(n + 1), 0), by_block;
  for (int64_t j = 0; j < np_all; ++j)
    if (piece_seq[static_cast<size_t>(j)] >= 0) ++block_ptr[static_cast<size_t>(pb[j] + 1)];
  for (int64_t b = 0; b < n; ++b) block_ptr[static_cast<size_t>(b + 1)] += block_ptr[static_cast<size_t>(b)];
  by_block.resize(static_cast<size_t>(block_ptr[static_cast<size_t>(n)]));
  {
    std::vector<int64_t> fill(block_ptr.begin(), block_ptr.end() - 1);
    for (int64_t j = 0; j < np_all; ++j)
      if (piece_seq[static_cast<size_t>(j)] >= 0) by_block[static_cast<size_t>(fill[static_cast<size_t>(pb[j])]++)] = j;
  }

  // pass 2, q block by q block
  std::vector<int64_t> diff(static_cast<size_t>(max_pieces + 1), 0), partial(static_cast<size_t>(max_pieces + 1), 0);
  std::vector<Cell> row(static_cast<size_t>(n), kEmpty);
  std::vector<int64_t> touched, in_group;
  int64_t group = 0;
  for (int64_t q = 0; q < n; ++q) {
    const int64_t q_end = block_ptr[static_cast<size_t>(q + 1)];
    for (int64_t g = block_ptr[static_cast<size_t>(q)]; g < q_end; ++group) {  // the pieces of one sequence
      const int64_t s = piece_seq[static_cast<size_t>(by_block[static_cast<size_t>(g)])];
      const int64_t lo_p = p.seq_piece_ptr[s], first = p.piece_start[lo_p], nr = p.seq_r[s];
      const int64_t seqlen = tok_off[static_cast<size_t>(s + 1)] - tok_off[static_cast<size_t>(s)];
      const int64_t tq = seq_tokens_in_block[static_cast<size_t>(by_block[static_cast<size_t>(g)])];
      const int32_t* tp = tok_piece.data() + tok_off[static_cast<size_t>(s)];
      const int32_t* rng = p.ranges + 2 * p.range_ptr[s];
      const int64_t* start = p.piece_start + lo_p;  // local piece j: tokens [start[j] - first, + len)
      const int64_t* len = p.piece_len + lo_p;
      int64_t lo = max_pieces, hi = -1;  // touched local pieces
      for (; g < q_end && piece_seq[static_cast<size_t>(by_block[static_cast<size_t>(g)])] == s; ++g) {
        const int64_t i = by_block[static_cast<size_t>(g)] - lo_p;
        const int32_t* r = rng + 2 * nr * (start[i] - first);
        const int32_t* r_end = r + 2 * nr * len[i];
        for (; r < r_end; r += 2) {
          const int64_t a = r[0], e = r[1];
          if (a >= e) {
            if (a == e) continue;
            error = seq_error(s, range_text(a, e) + " is reversed");
            return false;
          }
          if (a < 0 || e > seqlen) {
            error = seq_error(s, range_text(a, e) + " lies outside [0, " + std::to_string(seqlen) + "]");
            return false;
          }
          const int64_t ja = tp[a], je = tp[e - 1];
          if (ja == je) {
            partial[static_cast<size_t>(ja)] += e - a;
          } else {
            partial[static_cast<size_t>(ja)] += start[ja] + len[ja] - first - a;
            partial[static_cast<size_t>(je)] += e - (start[je] - first);
            if (je > ja + 1) {
              ++diff[static_cast<size_t>(ja + 1)];
              --diff[static_cast<size_t>(je)];
            }
          }
          lo = std::min(lo, ja);
          hi = std::max(hi, je);
        }
      }
      int64_t run = 0;
      for (int64_t j = lo; j <= hi; ++j) {
        run += diff[static_cast<size_t>(j)];
        const int64_t v = run * len[j] + partial[static_cast<size_t>(j)];
        diff[static_cast<size_t>(j)] = 0;
        partial[static_cast<size_t>(j)] = 0;
        if (v == 0) continue;
        const int64_t k = pb[lo_p + j];
        Cell& c = row[static_cast<size_t>(k)];
        c.unmasked += v;
        if (c.stamp != group) {  // sequence s meets (Q, K) for the first time
          c.stamp = group;
          if (c.sub_n++ == 0) touched.push_back(k);
          in_group.push_back(k);
          c.tk = seq_tokens_in_block[static_cast<size_t>(lo_p + j)];
          c.area += tq * c.tk;
          c.cur = 0;
        }
        c.cur += v;
      }
      // the sequence's moments, once its pairs with every K are summed (p_s / q_s etc., as the reference)
      for (const int64_t k : in_group) {
        Cell& c = row[static_cast<size_t>(k)];
        const double p_s = static_cast<double>(c.cur), q_s = static_cast<double>(tq), k_s = static_cast<double>(c.tk);
        c.wq += p_s / q_s;
        c.wk += p_s / k_s;
        c.wqk += p_s / static_cast<double>(tq * c.tk);
      }
      in_group.clear();
    }
    // emit row Q sorted by K and clear it
    if (touched.size() * 16 > static_cast<size_t>(n)) {
      touched.clear();
      for (int64_t k = 0; k < n; ++k)
        if (row[static_cast<size_t>(k)].sub_n) touched.push_back(k);
    } else {
      std::sort(touched.begin(), touched.end());
    }
    for (const int64_t k : touched) {
      Cell& c = row[static_cast<size_t>(k)];
      out.q_block.push_back(q);
      out.kv_block.push_back(k);
      out.unmasked.push_back(c.unmasked);
      out.area.push_back(c.area);
      out.sub_n.push_back(c.sub_n);
      out.sub_wq.push_back(c.wq);
      out.sub_wk.push_back(c.wk);
      out.sub_wqk.push_back(c.wqk);
      c = kEmpty;
    }
    touched.clear();
  }
  return true;
}

}  // namespace dcp
