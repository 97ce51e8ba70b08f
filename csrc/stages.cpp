#include "stages.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace dcp {

namespace {

// Stages of one staged device's tiles `t` (ascending tile ids).
void device_stages(const StagesParams& p, const std::vector<int64_t>& t, int64_t dev) {
  const int64_t m = static_cast<int64_t>(t.size());
  std::vector<int64_t> rel(m), unit(m), ready(m, 0), st(m, -1);
  std::vector<double> tt(m);
  int64_t last = p.n_stages;
  double total = 0.0;
  bool any_out = false;
  std::unordered_map<int64_t, int64_t> unit_ready;
  for (int64_t i = 0; i < m; ++i) {
    rel[i] = p.release[t[i]];
    unit[i] = p.out_unit[t[i]];
    tt[i] = p.tile_time[t[i]];
    last = std::max(last, rel[i]);
    total += tt[i];
    if (unit[i] >= 0) {
      any_out = true;
      auto [it, fresh] = unit_ready.try_emplace(unit[i], rel[i]);
      if (!fresh) it->second = std::max(it->second, rel[i]);
    }
  }
  for (int64_t i = 0; i < m; ++i)
    if (unit[i] >= 0) ready[i] = unit_ready[unit[i]];
  std::vector<double> target(last + 1, total / static_cast<double>(last + 1));
  if (p.round_s) {
    const int64_t k = std::min(last, p.round_width - 1);
    for (int64_t s = 0; s < k; ++s) target[s] = std::max(target[s], p.round_s[dev * p.round_width + s + 1]);
  }
  // stage 0 hides round 1: local tiles in order while their exclusive prefix is under the target
  double cum = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    if (rel[i] != 0) continue;
    cum += tt[i];
    if (cum - tt[i] < target[0]) st[i] = 0;
  }
  if (any_out) {  // local work kept for the last stage, latest tiles first
    cum = 0.0;
    for (int64_t i = m - 1; i >= 0; --i) {
      if (rel[i] != 0 || st[i] >= 0) continue;
      cum += tt[i];
      if (cum <= target[last]) st[i] = last;
    }
  }
  std::vector<int64_t> cand;
  for (int64_t s = 1; s < last; ++s) {
    cand.clear();
    for (int64_t i = 0; i < m; ++i)
      if (st[i] < 0 && rel[i] <= s) cand.push_back(i);
    if (cand.empty()) continue;
    // partials leave early: remote-output tiles first, a unit's tiles together, ready units first
    std::sort(cand.begin(), cand.end(), [&](int64_t a, int64_t b) {
      return std::make_tuple(unit[a] < 0, ready[a], unit[a], rel[a], a) <
             std::make_tuple(unit[b] < 0, ready[b], unit[b], rel[b], b);
    });
    cum = 0.0;
    for (int64_t i : cand) {
      cum += tt[i];
      if (cum - tt[i] < target[s]) st[i] = s;
    }
  }
  for (int64_t i = 0; i < m; ++i) p.stage[t[i]] = st[i] < 0 ? last : st[i];
}

}  // namespace

void tile_stages(const StagesParams& p) {
  std::vector<std::vector<int64_t>> by_dev(p.n_dev);
  for (int64_t i = 0; i < p.n_tiles; ++i) {
    p.stage[i] = p.release[i];
    if (p.staged[p.tile_device[i]]) by_dev[p.tile_device[i]].push_back(i);
  }
  for (int64_t d = 0; d < p.n_dev; ++d)
    if (!by_dev[d].empty()) device_stages(p, by_dev[d], d);
}

}  // namespace dcp
