// The greedy placement of Magi's dynamic solver (magi_place.h), a line-by-line port of the Python loop in
// dcp.baselines.magi_dynamic.solve.
#include "magi_place.h"

#include <algorithm>

namespace dcp {

namespace {

// The set bit c of m with the least load[c] (first such c in increasing order: ties to the lowest rank,
// as the Python loop's strict comparison and its (load, rank)-sorted list both give).
inline int64_t least_loaded(uint64_t m, const double* load) {
  int64_t r = -1;
  double best = 0.0;
  while (m) {
    const int c = __builtin_ctzll(m);
    if (r < 0 || load[c] < best) {
      r = c;
      best = load[c];
    }
    m &= m - 1;
  }
  return r;
}

inline double max_load(const double* load, int64_t n) { return *std::max_element(load, load + n); }

}  // namespace

bool magi_place(const MagiPlaceParams& p) {
  double* load = p.load;
  for (int64_t i = 0; i < p.n_free; ++i) {
    const int64_t t = p.free_order[i];
    const uint64_t m = p.mask[t];
    const int64_t h = p.home[t];
    const int64_t r = ((m >> h) & 1ULL) && load[h] < p.avg ? h : least_loaded(m, load);
    load[r] += p.area[t];
    p.rank[t] = r;
  }
  if (p.n_ranks == 0) return true;
  for (int64_t pass = 0; pass < p.refine_passes; ++pass) {
    if (max_load(load, p.n_ranks) <= p.cap) break;
    bool changed = false;
    for (int64_t i = 0; i < p.n_movable; ++i) {
      const int64_t t = p.movable_order[i];
      const int64_t cur = p.rank[t];
      if (load[cur] <= p.cap) continue;
      const double a = p.area[t];
      double best = load[cur];
      int64_t target = -1;
      for (uint64_t mm = p.mask[t] & ~(1ULL << cur); mm; mm &= mm - 1) {
        const int c = __builtin_ctzll(mm);
        if (load[c] + a < best) {
          target = c;
          best = load[c] + a;
        }
      }
      if (target >= 0) {
        load[cur] -= a;
        load[target] += a;
        p.rank[t] = target;
        changed = true;
      }
    }
    if (!changed) break;
  }
  return max_load(load, p.n_ranks) <= p.cap;
}

}  // namespace dcp
