// The simulator's event loop in C++ (see sim.h). Mirrors dcp/sim/streams.py (Streams.run, _advance,
// _post, _finish, _merge) and dcp/sim/flows.py (ComponentNetwork, _max_min_small) together with
// dcp/sim/network.py (max_min_rates, for components of more than _SMALL flows), one operation for one
// operation. Heaps order their entries by the whole tuple, as Python's heapq does, so events pop in the
// same order; components are recomputed over the same flow sets (the union-find partition does not depend
// on the order of its unions) with large ones in ascending flow order, as the Python path sorts them.
// The progressive filling itself is in fill.cpp. Two changes keep the results and only save time: the
// finish heap drops its stale entries once they outnumber the live ones and takes a large refresh's entries
// in one make_heap (live keys are distinct, so they pop in the same order); a refresh's flows are ordered
// through a bit set unless their ids are sparse.
#include "sim.h"

#include "fill.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "sim_fp.h"

namespace dcp {
namespace {

using simfp::kInf;
using simfp::pymax0;
constexpr double kRel = 1e-12;   // dcp.sim.network._REL: finishes this close are simultaneous
constexpr int64_t kSmall = 24;   // dcp.sim.flows._SMALL

using Fin = std::tuple<double, int64_t, int64_t>;  // (finish time, version, flow)
using Start = std::pair<double, int64_t>;         // (start time, flow)

class Sim {
 public:
  explicit Sim(SimParams& p)
      : p_(p), w_(p.res_width), fill_(p.cap, p.n_res), parent_(p.n_res), members_(p.n_res), mpos_(p.n_flows, -1),
        rem_(p.n_flows, 0.0), t_ref_(p.n_flows, 0.0), rate_(p.n_flows, 0.0), version_(p.n_flows, 0),
        load_(p.n_res, 0), solo_on_(p.n_res, -1), solo_(p.n_flows, 0), pending_(p.pending, p.pending + p.n_steps),
        f_posted_(p.n_flows, 0), f_post_(p.n_flows, 0.0) {
    for (int64_t r = 0; r < p.n_res; ++r) parent_[r] = r;
  }

  void run() {
    SimParams& p = p_;
    for (int64_t d = 0; d < p.n_dev; ++d) {
      p.clock[d] = p.clock0[d];
      p.reduce_s[d] = p.reduce0[d];
      p.compute_s[d] = p.wait_s[d] = 0.0;
      p.blocked[d] = -1;
      p.pos[d] = p.ptr[d];
    }
    since_.assign(p.n_dev, 0.0);
    host_.assign(p.host0, p.host0 + p.n_dev);
    std::fill(p.f_start, p.f_start + p.n_flows, std::nan(""));
    std::fill(p.f_end, p.f_end + p.n_flows, std::nan(""));
    for (int64_t d = 0; d < p.n_dev; ++d) advance(d);
    std::vector<int64_t> batch, remote;
    std::vector<std::pair<int64_t, double>> done;
    while (true) {
      const double t_start = starts_.empty() ? kInf : starts_.front().first;
      const double t_done = next_finish();
      if (t_start == kInf && t_done == kInf) break;
      if (t_done <= t_start) {
        pop_finished(done);
        for (const auto& ft : done) finish(ft.first, ft.second);
        continue;
      }
      batch.clear();
      while (!starts_.empty() && starts_.front().first <= t_start) {
        std::pop_heap(starts_.begin(), starts_.end(), std::greater<Start>());
        batch.push_back(starts_.back().second);
        starts_.pop_back();
      }
      remote.clear();
      for (int64_t f : batch)
        if (need(f) == 2) remote.push_back(f);
      if (!remote.empty()) add(remote, t_start);
      for (int64_t f : batch)
        if (need(f) == 1) finish(f, t_start);
    }
    p.n_rate_updates = n_rate_updates_;
  }

 private:
  int64_t need(int64_t f) const { return p_.f_step[2 * f + 1] >= 0 ? 2 : 1; }
  const int64_t* row(int64_t f) const { return p_.f_res + f * w_; }

  // -- device streams (Streams._advance, _merge, _post, _finish)
  void advance(int64_t d) {
    SimParams& p = p_;
    int64_t k = p.pos[d];
    const int64_t end = p.ptr[d + 1];
    double t = p.clock[d], h = host_[d];
    while (k < end) {
      const int64_t a = p.flow_ptr[k], b = p.flow_ptr[k + 1];
      const double* hs = p.host + 4 * k;
      if (b > a) {
        t += p.round_over;
        h += hs[0];
        post(a, b, h > t ? h : t);
      }
      const double c = p.comp[k];
      if (c > 0) {
        h += hs[1];
        if (h > t) t = h;
        p.compute_s[d] += c;
        t += c;
      }
      if (b > a) {
        h += hs[2];
        if (h > t) t = h;
      }
      host_[d] = h;
      if (pending_[k] > 0) {
        p.blocked[d] = k;
        since_[d] = t;
        p.pos[d] = k;
        p.clock[d] = t;
        return;
      }
      t = merge(d, k, t);
      h = host_[d];
      ++k;
    }
    p.pos[d] = k;
    p.clock[d] = t;
  }

  double merge(int64_t d, int64_t k, double t) {
    const double r = p_.red[k];
    if (r <= 0) return t;
    const double h = host_[d] + p_.host[4 * k + 3];
    host_[d] = h;
    if (h > t) t = h;
    p_.reduce_s[d] += r;
    return t + r;
  }

  void post(int64_t a, int64_t b, double t) {
    for (int64_t i = a; i < b; ++i) {
      const int64_t f = p_.step_flows[i];
      f_posted_[f] += 1;
      if (t > f_post_[f]) f_post_[f] = t;
      if (f_posted_[f] == need(f)) {
        const double s = f_post_[f];
        p_.f_start[f] = s;
        starts_.emplace_back(s + (need(f) == 2 ? p_.latency : 0.0), f);
        std::push_heap(starts_.begin(), starts_.end(), std::greater<Start>());
      }
    }
  }

  void finish(int64_t f, double t) {
    SimParams& p = p_;
    p.f_end[f] = t;
    for (int e = 0; e < 2; ++e) {
      const int64_t k = p.f_step[2 * f + e];
      if (k < 0) continue;
      pending_[k] -= 1;
      const int64_t d = p.step_dev[k];
      if (pending_[k] == 0 && p.blocked[d] == k) {
        const double since = since_[d];
        const double resume = std::max(t, since);
        if (resume > since) p.wait_s[d] += resume - since;
        p.blocked[d] = -1;
        p.clock[d] = merge(d, k, resume);
        p.pos[d] = k + 1;
        advance(d);
      }
    }
  }

  // -- union-find over resources (ComponentNetwork._find, _join, _rebuild)
  int64_t find(int64_t r) {
    int64_t root = r;
    while (parent_[root] != root) root = parent_[root];
    while (parent_[r] != root) {
      const int64_t nxt = parent_[r];
      parent_[r] = root;
      r = nxt;
    }
    return root;
  }

  int64_t join(int64_t f) {
    const int64_t* rs = row(f);
    int64_t root = find(rs[0]);
    for (int64_t j = 1; j < w_ && rs[j] >= 0; ++j) {
      int64_t other = find(rs[j]);
      if (other == root) continue;
      if (members_[root].size() < members_[other].size()) std::swap(root, other);
      parent_[other] = root;
      auto& a = members_[root];
      for (int64_t g : members_[other]) {
        mpos_[g] = static_cast<int64_t>(a.size());
        a.push_back(g);
      }
      members_[other].clear();
      members_[other].shrink_to_fit();
    }
    return root;
  }

  int64_t add_member(int64_t f) {
    const int64_t root = join(f);
    mpos_[f] = static_cast<int64_t>(members_[root].size());
    members_[root].push_back(f);
    return root;
  }

  void remove_member(int64_t root, int64_t f) {
    auto& m = members_[root];
    const int64_t i = mpos_[f];
    m[i] = m.back();
    mpos_[m[i]] = i;
    m.pop_back();
    mpos_[f] = -1;
  }

  void rebuild() {
    std::vector<int64_t> active;
    for (auto& m : members_) {
      active.insert(active.end(), m.begin(), m.end());
      m.clear();
    }
    for (int64_t r = 0; r < p_.n_res; ++r) parent_[r] = r;
    for (int64_t f : active) add_member(f);
    ended_since_rebuild_ = 0;
    active_at_rebuild_ = static_cast<int64_t>(active.size());
  }

  // distinct resources of flow f, in row order
  int distinct(int64_t f, int64_t* out) const {
    const int64_t* rs = row(f);
    int n = 0;
    for (int64_t j = 0; j < w_ && rs[j] >= 0; ++j) {
      bool seen = false;
      for (int q = 0; q < n; ++q) seen = seen || out[q] == rs[j];
      if (!seen) out[n++] = rs[j];
    }
    return n;
  }

  // -- events (ComponentNetwork.add, _unsolo, _set_rate, next_finish, pop_finished, _refresh)
  void add(const std::vector<int64_t>& flows, double t) {
    roots_.clear();
    int64_t dist[64];
    for (int64_t f : flows) {
      rem_[f] = p_.f_bytes[f];
      t_ref_[f] = t;
      rate_[f] = 0.0;
      const int nd = distinct(f, dist);
      bool busy = false;
      for (int q = 0; q < nd; ++q) busy = busy || load_[dist[q]] != 0;
      if (!busy) {
        solo_[f] = 1;
        for (int q = 0; q < nd; ++q) {
          load_[dist[q]] += 1;
          solo_on_[dist[q]] = f;
        }
        rows_.assign(1, row(f));
        double r_f;
        fill_.small(rows_, w_, &r_f);
        set_rate(f, r_f, t);
        continue;
      }
      for (int q = 0; q < nd; ++q) {
        const int64_t g = solo_on_[dist[q]];
        if (g >= 0) {
          unsolo(g);
          roots_.push_back(add_member(g));
        }
        load_[dist[q]] += 1;
      }
      roots_.push_back(add_member(f));
    }
    if (!roots_.empty()) {
      for (auto& r : roots_) r = find(r);
      refresh(t);
    }
  }

  void unsolo(int64_t f) {
    solo_[f] = 0;
    int64_t dist[64];
    const int nd = distinct(f, dist);
    for (int q = 0; q < nd; ++q) solo_on_[dist[q]] = -1;
  }

  void set_rate(int64_t f, double r, double t) {
    const size_t before = heap_.size();
    append_rate(f, r, t);
    heap_appended(before);
  }

  // set_rate's state changes, its finish entry appended to heap_ but not yet heaped (heap_appended)
  void append_rate(int64_t f, double r, double t) {
    rate_[f] = r;
    const double left = rem_[f];
    const double fin = (left <= 0 || r == kInf) ? t : (r > 0 ? t + left / r : kInf);
    version_[f] += 1;
    if (fin != kInf) heap_.emplace_back(fin, version_[f], f);
  }

  // Heaps the entries appended from index `before` on: one at a time when few, all at once (the stale ones
  // dropped, compact) when many, as after a large refresh; the live entries' keys are distinct, so the
  // order they pop in is the same either way
  void heap_appended(size_t before) {
    if ((heap_.size() - before) * 8 > before) {
      compact();
      return;
    }
    for (size_t i = before + 1; i <= heap_.size(); ++i)
      std::push_heap(heap_.begin(), heap_.begin() + static_cast<std::ptrdiff_t>(i), std::greater<Fin>());
    if (heap_.size() > compact_at_) compact();
  }

  // Drops stale entries (a flow's rate changed since they were pushed) once they outnumber the live ones:
  // every refresh of a large component pushes one entry per flow, and a heap grown by millions of dead
  // entries made each push and pop several times slower. Keys are distinct (one live entry per flow), so
  // the live entries pop in the same order as before.
  void compact() {
    heap_.erase(std::remove_if(heap_.begin(), heap_.end(),
                               [&](const Fin& e) { return std::get<1>(e) != version_[std::get<2>(e)]; }),
                heap_.end());
    std::make_heap(heap_.begin(), heap_.end(), std::greater<Fin>());
    compact_at_ = std::max<size_t>(1024, 2 * heap_.size());
  }

  double next_finish() {
    while (!heap_.empty() && std::get<1>(heap_.front()) != version_[std::get<2>(heap_.front())]) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<Fin>());
      heap_.pop_back();
    }
    return heap_.empty() ? kInf : std::get<0>(heap_.front());
  }

  void pop_finished(std::vector<std::pair<int64_t, double>>& done) {
    done.clear();
    const double t = next_finish();
    if (t == kInf) return;
    const double tol = kRel * std::max(1.0, std::abs(t)) + 1e-18;
    roots_.clear();
    int64_t dist[64];
    while (!heap_.empty() && std::get<0>(heap_.front()) <= t + tol) {
      std::pop_heap(heap_.begin(), heap_.end(), std::greater<Fin>());
      const Fin e = heap_.back();
      heap_.pop_back();
      const int64_t f = std::get<2>(e);
      if (std::get<1>(e) != version_[f]) continue;
      version_[f] += 1;
      const int nd = distinct(f, dist);
      for (int q = 0; q < nd; ++q) load_[dist[q]] -= 1;
      done.emplace_back(f, t);
      if (solo_[f]) {
        unsolo(f);
        continue;
      }
      const int64_t root = find(row(f)[0]);
      remove_member(root, f);
      roots_.push_back(root);
      ended_since_rebuild_ += 1;
    }
    refresh(t);
    if (ended_since_rebuild_ > std::max<int64_t>(64, active_at_rebuild_)) rebuild();
  }

  void refresh(double t) {
    std::sort(roots_.begin(), roots_.end());
    roots_.erase(std::unique(roots_.begin(), roots_.end()), roots_.end());
    flows_.clear();
    for (int64_t root : roots_) flows_.insert(flows_.end(), members_[root].begin(), members_[root].end());
    if (flows_.empty()) return;
    n_rate_updates_ += 1;
    for (int64_t f : flows_) {
      const double r = rate_[f];
      if (r > 0) rem_[f] = r == kInf ? 0.0 : pymax0(rem_[f] - r * (t - t_ref_[f]));
      t_ref_[f] = t;
    }
    const bool small = static_cast<int64_t>(flows_.size()) <= kSmall;
    if (!small) sort_flows();
    rows_.clear();
    for (int64_t f : flows_) rows_.push_back(row(f));
    new_.resize(flows_.size());
    if (small)
      fill_.small(rows_, w_, new_.data());
    else
      fill_.large(rows_, w_, new_.data());
    const size_t before = heap_.size();
    for (size_t i = 0; i < flows_.size(); ++i) append_rate(flows_[i], new_[i], t);
    heap_appended(before);
  }

  // flows_ in ascending order (its ids are distinct): through a bit set over their range unless it is
  // far sparser than a sort would cost (a component's flows were posted around the same rounds)
  void sort_flows() {
    const auto mm = std::minmax_element(flows_.begin(), flows_.end());
    const int64_t lo = *mm.first, span = *mm.second - lo + 1;
    if (span > 64 * static_cast<int64_t>(flows_.size())) {
      std::sort(flows_.begin(), flows_.end());
      return;
    }
    bits_.assign((span + 63) / 64, 0);
    for (int64_t f : flows_) bits_[(f - lo) >> 6] |= uint64_t{1} << ((f - lo) & 63);
    size_t i = 0;
    for (size_t k = 0; k < bits_.size(); ++k)
      for (uint64_t b = bits_[k]; b != 0; b &= b - 1)
        flows_[i++] = lo + static_cast<int64_t>(64 * k) + __builtin_ctzll(b);
  }

  SimParams& p_;
  int64_t w_;
  Filler fill_;
  std::vector<int64_t> parent_;
  std::vector<std::vector<int64_t>> members_;
  std::vector<int64_t> mpos_;
  std::vector<double> rem_, t_ref_, rate_;
  std::vector<int64_t> version_, load_, solo_on_;
  std::vector<char> solo_;
  std::vector<uint64_t> bits_;
  std::vector<Fin> heap_;
  std::vector<Start> starts_;
  std::vector<int64_t> pending_, f_posted_;
  std::vector<double> f_post_, since_, host_;
  std::vector<int64_t> roots_, flows_;
  std::vector<const int64_t*> rows_;
  std::vector<double> new_;
  int64_t ended_since_rebuild_ = 0, active_at_rebuild_ = 0, n_rate_updates_ = 0;
  size_t compact_at_ = 1024;
};

}  // namespace

bool simulate_streams(SimParams& p, std::string& err) {
  if (p.res_width < 1 || p.res_width > 64) {
    err = "res_width must be in 1..64";
    return false;
  }
  for (int64_t d = 0; d < p.n_dev; ++d)
    if (p.ptr[d] > p.ptr[d + 1]) {
      err = "ptr must be non-decreasing";
      return false;
    }
  if (p.ptr[0] != 0 || p.ptr[p.n_dev] != p.n_steps) {
    err = "ptr must run from 0 to n_steps";
    return false;
  }
  const int64_t n_ends = p.flow_ptr[p.n_steps];
  for (int64_t k = 0; k < p.n_steps; ++k) {
    if (p.flow_ptr[k] > p.flow_ptr[k + 1] || p.flow_ptr[k] < 0) {
      err = "flow_ptr must be non-decreasing from 0";
      return false;
    }
    if (p.step_dev[k] < 0 || p.step_dev[k] >= p.n_dev) {
      err = "step_dev must name devices";
      return false;
    }
  }
  for (int64_t i = 0; i < n_ends; ++i)
    if (p.step_flows[i] < 0 || p.step_flows[i] >= p.n_flows) {
      err = "step_flows must name flows";
      return false;
    }
  for (int64_t f = 0; f < p.n_flows; ++f) {
    if (p.f_step[2 * f] < 0 || p.f_step[2 * f] >= p.n_steps || p.f_step[2 * f + 1] >= p.n_steps) {
      err = "f_step must name steps (the second may be -1)";
      return false;
    }
    const int64_t* rs = p.f_res + f * p.res_width;
    if (rs[0] < 0) {
      err = "every flow must cross at least one resource";
      return false;
    }
    for (int64_t j = 0; j < p.res_width; ++j)
      if (rs[j] >= p.n_res || (j > 0 && rs[j] >= 0 && rs[j - 1] < 0)) {
        err = "f_res rows must name resources, padded with -1 at the end";
        return false;
      }
  }
  Sim sim(p);
  sim.run();
  return true;
}

}  // namespace dcp
