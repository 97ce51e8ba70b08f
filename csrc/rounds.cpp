// The input-round greedy (see rounds.h and dcp/schedule/rounds.py, whose reference loop this mirrors line by line).
#include "rounds.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace dcp {

void input_rounds(const RoundsParams& p) {
  const int64_t gpn = p.gpus_per_node;
  std::vector<std::vector<int64_t>> holders(static_cast<size_t>(p.n_keys));  // home first, then receivers
  // the same holders per (unit, node), in the same order: the in-node search looks at these only
  std::unordered_map<int64_t, std::vector<int64_t>> in_node;
  std::vector<int64_t> pending(p.order, p.order + p.n), waiting;
  std::vector<double> used_in(p.n_dev), used_out(p.n_dev), nic_in(p.n_nodes), nic_out(p.n_nodes);
  std::unordered_set<int64_t> crossing;  // (unit, node) entering that node this round
  std::vector<std::pair<int64_t, int64_t>> fresh;
  for (int64_t i = 0; i < p.n; ++i) {
    p.arrival[i] = 0;
    p.source[i] = -1;
  }
  for (int64_t rnd = 1; rnd <= p.max_rounds && !pending.empty(); ++rnd) {
    const bool last = rnd == p.max_rounds;
    const double* bud = rnd == 1 ? p.budget_first : p.budget;
    std::fill(used_in.begin(), used_in.end(), 0.0);
    std::fill(used_out.begin(), used_out.end(), 0.0);
    std::fill(nic_in.begin(), nic_in.end(), 0.0);
    std::fill(nic_out.begin(), nic_out.end(), 0.0);
    crossing.clear();
    fresh.clear();
    waiting.clear();
    for (const int64_t i : pending) {
      const int64_t d = p.dev[i], key = p.key[i];
      const double b = p.nbytes[i];
      const double cap_port = bud[d] * p.port, cap_nic = bud[d] * p.nic;
      if (!last && used_in[d] > 0 && used_in[d] + b > cap_port) {
        waiting.push_back(i);
        continue;
      }
      const int64_t nd = d / gpn;
      std::vector<int64_t>& hs = holders[static_cast<size_t>(key)];
      if (hs.empty()) {
        hs.push_back(p.home[i]);
        in_node[key * p.n_nodes + p.home[i] / gpn].push_back(p.home[i]);
      }
      int64_t best = -1;
      double best_load = 0.0;
      const auto local = in_node.find(key * p.n_nodes + nd);
      if (local != in_node.end()) {
        for (const int64_t s : local->second) {  // the least busy holder in the consumer's node
          if (best < 0 || used_out[s] < best_load) {
            best = s;
            best_load = used_out[s];
            if (best_load == 0.0) break;  // loads are >= 0: no later holder beats the first idle one
          }
        }
      }
      const bool cross = best < 0;
      if (cross) {
        if (p.relay && !last && crossing.count(key * p.n_nodes + nd)) {
          waiting.push_back(i);  // it enters this node this round: relayed from there next round
          continue;
        }
        double best_nic = 0.0, best_port = 0.0;
        for (const int64_t s : hs) {  // the holder whose node's NIC, then port, is least busy
          const double a = nic_out[s / gpn], c = used_out[s];
          if (best < 0 || a < best_nic || (a == best_nic && c < best_port)) {
            best = s;
            best_nic = a;
            best_port = c;
            if (a == 0.0 && c == 0.0) break;  // (0, 0) is the least possible: the first one wins
          }
        }
        const int64_t ns = best / gpn;
        if (!last && ((nic_out[ns] > 0 && nic_out[ns] + b > cap_nic) || (nic_in[nd] > 0 && nic_in[nd] + b > cap_nic))) {
          waiting.push_back(i);
          continue;
        }
      }
      if (!last && used_out[best] > 0 && used_out[best] + b > cap_port) {
        waiting.push_back(i);
        continue;
      }
      p.arrival[i] = rnd;
      p.source[i] = best;
      used_in[d] += b;
      used_out[best] += b;
      if (cross) {
        nic_out[best / gpn] += b;
        nic_in[nd] += b;
        crossing.insert(key * p.n_nodes + nd);
      }
      fresh.emplace_back(key, d);
    }
    if (p.relay) {
      for (const auto& kd : fresh) {
        holders[static_cast<size_t>(kd.first)].push_back(kd.second);
        in_node[kd.first * p.n_nodes + kd.second / gpn].push_back(kd.second);
      }
    }
    pending.swap(waiting);
  }
}

}  // namespace dcp
