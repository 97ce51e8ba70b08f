#include "box_counts.h"

#include <algorithm>
#include <vector>

namespace dcp {

bool box_counts_direct(const BoxCountsParams& p, std::string& err) {
  const int64_t nq = p.n_q, nk = p.n_kv, T = p.n_tok;
  // key box of every key position 0..T-1 (the bounds cover 0..T), so each range end costs O(1)
  std::vector<int64_t> box_of(T > 0 ? T : 1);
  for (int64_t k = 0; k < nk; ++k)
    for (int64_t x = p.kv_bounds[k]; x < p.kv_bounds[k + 1]; ++x) box_of[x] = k;
  std::fill(p.counts, p.counts + nq * nk, int64_t{0});
  std::vector<int64_t> spans(nk + 1);  // interior key boxes a query box covers whole, as differences
  for (int64_t g = 0; g < nq; ++g) {
    std::fill(spans.begin(), spans.end(), int64_t{0});
    int64_t* row = p.counts + g * nk;
    for (int64_t t = p.q_bounds[g]; t < p.q_bounds[g + 1]; ++t) {
      const int32_t* r = p.ranges + t * p.n_slots * 2;
      for (int64_t j = 0; j < p.n_slots; ++j) {
        const int64_t s = r[2 * j], e = r[2 * j + 1];
        if (e <= s) continue;
        if (s < 0 || e > T) {
          err = "query " + std::to_string(t) + " has KV range [" + std::to_string(s) + ", " + std::to_string(e) +
                ") outside 0.." + std::to_string(T);
          return false;
        }
        const int64_t js = box_of[s], je = box_of[e - 1];
        if (js == je) {
          row[js] += e - s;
        } else {
          row[js] += p.kv_bounds[js + 1] - s;
          row[je] += e - p.kv_bounds[je];
          if (je > js + 1) {
            spans[js + 1] += 1;
            spans[je] -= 1;
          }
        }
      }
    }
    int64_t covered = 0;
    for (int64_t k = 0; k < nk; ++k) {
      covered += spans[k];
      row[k] += covered * (p.kv_bounds[k + 1] - p.kv_bounds[k]);
    }
  }
  return true;
}

}  // namespace dcp
