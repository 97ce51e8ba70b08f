// Progressive filling (see fill.h). One change keeps the results and only saves time: the large fill keeps
// its per-resource counts of unfrozen flows as flows freeze, where the reference recounts them each level
// (integers, so the same counts).
#include "fill.h"

#include <algorithm>
#include <cmath>

#include "sim_fp.h"

namespace dcp {
namespace {

using simfp::kInf;
using simfp::pymax0;
constexpr double kTie = 1e-9;  // dcp.sim.flows._TIE: shares within this relative distance are one level

}  // namespace

// dcp.sim.flows._max_min_small
void Filler::small(const std::vector<const int64_t*>& rows, int64_t w, double* rate) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (n == 1) {
    double best = kInf;
    bool any = false;
    const int64_t* rs = rows[0];
    for (int64_t j = 0; j < w && rs[j] >= 0; ++j) {
      int64_t c = 0;
      for (int64_t q = 0; q < w && rs[q] >= 0; ++q) c += rs[q] == rs[j];
      const double v = cap_[rs[j]] / static_cast<double>(c);
      if (!any || v < best) best = v;  // min(): the first of equal values, the smallest
      any = true;
    }
    rate[0] = any ? best : kInf;
    return;
  }
  std::fill(rate, rate + n, kInf);
  res_.clear();
  left_.clear();
  users_.clear();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < w && rows[i][j] >= 0; ++j) {
      const int64_t r = rows[i][j];
      if (cap_[r] == kInf) continue;
      if (lid_[r] < 0) {
        lid_[r] = static_cast<int64_t>(res_.size());
        res_.push_back(r);
        left_.push_back(cap_[r]);
        users_.emplace_back();
      }
      users_[lid_[r]].push_back(i);
    }
  }
  frozen_.assign(n, 0);
  const int64_t n_l = static_cast<int64_t>(res_.size());
  int64_t live = n_l;
  while (live > 0) {
    double level = kInf;
    bool first = true;
    for (int64_t l = 0; l < n_l; ++l) {
      if (users_[l].empty()) continue;
      const double s = pymax0(left_[l]) / static_cast<double>(users_[l].size());
      if (first || s < level) level = s;
      first = false;
    }
    const double thr = level * (1 + kTie);
    hit_.clear();
    for (int64_t l = 0; l < n_l; ++l) {
      if (users_[l].empty()) continue;
      if (pymax0(left_[l]) / static_cast<double>(users_[l].size()) <= thr)
        hit_.insert(hit_.end(), users_[l].begin(), users_[l].end());
    }
    for (int64_t i : hit_) {
      if (frozen_[i]) continue;
      frozen_[i] = 1;
      rate[i] = level;
      for (int64_t j = 0; j < w && rows[i][j] >= 0; ++j) {
        const int64_t r = rows[i][j];
        if (cap_[r] != kInf) left_[lid_[r]] -= level;
      }
    }
    for (int64_t l = 0; l < n_l; ++l) {
      auto& u = users_[l];
      if (u.empty()) continue;
      u.erase(std::remove_if(u.begin(), u.end(), [&](int64_t i) { return frozen_[i] != 0; }), u.end());
      if (u.empty()) --live;
    }
  }
  for (int64_t r : res_) lid_[r] = -1;
}

// dcp.sim.network.max_min_rates (padding dropped: an unlimited resource never binds)
void Filler::large(const std::vector<const int64_t*>& rows, int64_t w, double* rate) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::fill(rate, rate + n, kInf);
  res_.clear();
  left_.clear();
  loc_.assign(n * w, -1);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < w && rows[i][j] >= 0; ++j) {
      const int64_t r = rows[i][j];
      if (lid_[r] < 0) {
        lid_[r] = static_cast<int64_t>(res_.size());
        res_.push_back(r);
        left_.push_back(cap_[r]);
      }
      loc_[i * w + j] = lid_[r];
    }
  }
  for (int64_t r : res_) lid_[r] = -1;
  const int64_t n_l = static_cast<int64_t>(res_.size());
  cnt_.resize(n_l);
  share_.resize(n_l);
  held_.resize(n_l);
  sub_.resize(n_l);
  fmin_.resize(n);
  idx_.resize(n);
  for (int64_t i = 0; i < n; ++i) idx_[i] = i;
  // cnt_: the unfrozen flows on each resource, kept as flows freeze (the reference recounts it)
  std::fill(cnt_.begin(), cnt_.end(), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < w && loc_[i * w + j] >= 0; ++j) ++cnt_[loc_[i * w + j]];
  while (!idx_.empty()) {
    for (int64_t l = 0; l < n_l; ++l)
      share_[l] = cnt_[l] > 0 ? std::max(left_[l], 0.0) / static_cast<double>(std::max<int64_t>(cnt_[l], 1))
                              : kInf;
    // each flow's tightest share, and (same pass: it needs only that flow's) the resources it holds below
    // their share
    bool any_finite = false;
    std::fill(held_.begin(), held_.end(), 0);
    for (int64_t i : idx_) {
      const int64_t* li = &loc_[i * w];
      double m = kInf;
      for (int64_t j = 0; j < w && li[j] >= 0; ++j) m = std::min(m, share_[li[j]]);
      fmin_[i] = m;
      any_finite = any_finite || std::isfinite(m);
      for (int64_t j = 0; j < w && li[j] >= 0; ++j)
        if (m < share_[li[j]] * (1 - kTie)) held_[li[j]] = 1;
    }
    if (!any_finite) break;
    std::fill(sub_.begin(), sub_.end(), 0.0);
    keep_.clear();
    for (int64_t i : idx_) {
      bool hit = false;
      if (std::isfinite(fmin_[i])) {
        for (int64_t j = 0; j < w && loc_[i * w + j] >= 0; ++j) {
          const int64_t l = loc_[i * w + j];
          if (!held_[l] && std::isfinite(share_[l])) hit = true;
        }
      }
      if (!hit) {
        keep_.push_back(i);
        continue;
      }
      rate[i] = fmin_[i];
      for (int64_t j = 0; j < w && loc_[i * w + j] >= 0; ++j) {
        sub_[loc_[i * w + j]] += fmin_[i];
        --cnt_[loc_[i * w + j]];
      }
    }
    for (int64_t l = 0; l < n_l; ++l) left_[l] -= sub_[l];
    idx_.swap(keep_);
  }
}

void max_min_fill(int64_t n, int64_t width, const int64_t* res, const double* cap, int64_t n_res, bool small,
                  double* rate) {
  if (n == 0) return;
  Filler fill(cap, n_res);
  std::vector<const int64_t*> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = res + i * width;
  if (small)
    fill.small(rows, width, rate);
  else
    fill.large(rows, width, rate);
}

}  // namespace dcp
