#include "estimate.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

namespace dcp {

bool estimate_rounds(const EstimateParams& p, std::string& err) {
  const int64_t n = p.n_dev, m = p.n_transfers;
  for (int64_t i = 0; i < m; ++i) {
    if (p.round[i] < 0 || p.round[i] > p.n_rounds || p.src[i] < 0 || p.src[i] >= n || p.dst[i] < 0 ||
        p.dst[i] >= n) {
      err = "transfer " + std::to_string(i) + " (round " + std::to_string(p.round[i]) + ", " +
            std::to_string(p.src[i]) + " -> " + std::to_string(p.dst[i]) + ") is outside rounds 0.." +
            std::to_string(p.n_rounds) + " and devices 0.." + std::to_string(n - 1);
      return false;
    }
  }
  // coalesce transfers into flows, one per (round, src, dst) in ascending key order (numpy's unique), each
  // flow's bytes added in input order (numpy's bincount): densely when the key space is small, else by a sort
  std::vector<int64_t> f_round, f_src, f_dst;
  std::vector<double> f_bytes;
  const int64_t n_keys = (p.n_rounds + 1) * n * n;
  const auto add_flow = [&](int64_t key) {
    f_round.push_back(key / (n * n));
    f_src.push_back(key / n % n);
    f_dst.push_back(key % n);
  };
  if (n_keys <= std::max<int64_t>(4 * m, 1 << 16)) {
    std::vector<double> sum(n_keys, 0.0);
    std::vector<uint8_t> seen(n_keys, 0);
    for (int64_t i = 0; i < m; ++i) {
      const int64_t key = (p.round[i] * n + p.src[i]) * n + p.dst[i];
      sum[key] += p.nbytes[i];
      seen[key] = 1;
    }
    for (int64_t key = 0; key < n_keys; ++key)
      if (seen[key]) {
        add_flow(key);
        f_bytes.push_back(sum[key]);
      }
  } else {
    std::vector<int64_t> key(m), idx(m);
    for (int64_t i = 0; i < m; ++i) key[i] = (p.round[i] * n + p.src[i]) * n + p.dst[i];
    std::iota(idx.begin(), idx.end(), int64_t{0});
    std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
    for (int64_t j = 0; j < m; ++j) {
      const int64_t i = idx[j];
      if (j == 0 || key[i] != key[idx[j - 1]]) {
        add_flow(key[i]);
        f_bytes.push_back(0.0);
      }
      f_bytes.back() += p.nbytes[i];
    }
  }
  const int64_t n_flows = static_cast<int64_t>(f_bytes.size());
  std::vector<double> t(p.t0, p.t0 + n), host(p.host0, p.host0 + n), post(n), msgs(n), out_dev(n), in_dev(n),
      done(n), out_nic(p.n_nics), in_nic(p.n_nics);
  const int64_t gpn = p.gpus_per_node, last = std::max(p.n_rounds, p.n_stages);
  int64_t f = 0;  // first flow of round r
  for (int64_t r = 1; r <= last; ++r) {
    while (f < n_flows && f_round[f] < r) ++f;  // flows of round 0 (none in a schedule) are never looked at
    int64_t f_end = f;
    while (f_end < n_flows && f_round[f_end] == r) ++f_end;
    std::fill(msgs.begin(), msgs.end(), 0.0);
    for (int64_t k = f; k < f_end; ++k) {
      msgs[f_src[k]] += 1.0;
      if (f_src[k] != f_dst[k]) msgs[f_dst[k]] += 1.0;
    }
    for (int64_t d = 0; d < n; ++d) {
      const bool busy = msgs[d] > 0;
      if (p.round_over != 0.0) t[d] = t[d] + p.round_over * (busy ? 1.0 : 0.0);
      if (busy) host[d] = host[d] + (p.launch + p.message * msgs[d]);
      post[d] = std::max(t[d], host[d]);
      if (r - 1 < p.n_stages) {
        const double c = p.comp[d * p.n_stages + r - 1];
        if (c > 0) {
          host[d] = host[d] + p.compute;
          t[d] = std::max(t[d], host[d]) + c;
        }
      }
      if (busy) {
        host[d] = host[d] + p.wait;
        t[d] = std::max(t[d], host[d]);
      }
    }
    if (r > p.n_rounds) continue;
    if (f_end > f) {
      std::fill(out_dev.begin(), out_dev.end(), 0.0);
      std::fill(in_dev.begin(), in_dev.end(), 0.0);
      std::fill(out_nic.begin(), out_nic.end(), 0.0);
      std::fill(in_nic.begin(), in_nic.end(), 0.0);
      std::fill(done.begin(), done.end(), 0.0);
      for (int64_t k = f; k < f_end; ++k) {
        out_dev[f_src[k]] += f_bytes[k];
        in_dev[f_dst[k]] += f_bytes[k];
        if (f_src[k] / gpn != f_dst[k] / gpn) {
          out_nic[f_src[k] / p.per_nic] += f_bytes[k];
          in_nic[f_dst[k] / p.per_nic] += f_bytes[k];
        }
      }
      for (int64_t k = f; k < f_end; ++k) {
        const int64_t s = f_src[k], d = f_dst[k];
        const bool local = s == d;
        const double start = std::max(post[s], post[d]) + (local ? 0.0 : p.latency);
        double drain = std::max(out_dev[s], in_dev[d]) / p.port;
        if (s / gpn != d / gpn) drain = std::max(drain, std::max(out_nic[s / p.per_nic], in_nic[d / p.per_nic]) / p.nic);
        const double fin = start + (local ? 0.0 : drain);
        done[s] = std::max(done[s], fin);
        done[d] = std::max(done[d], fin);
      }
      for (int64_t d = 0; d < n; ++d) t[d] = std::max(t[d], done[d]);
    }
    for (int64_t d = 0; d < n; ++d) {
      const double merges = p.n_merges[d * (p.n_rounds + 1) + r];
      host[d] = host[d] + p.reduce * merges;
      if (merges > 0) t[d] = std::max(t[d], host[d]);
      t[d] = t[d] + p.red[d * (p.n_rounds + 1) + r];
    }
    f = f_end;
  }
  std::copy(t.begin(), t.end(), p.t);
  return true;
}

}  // namespace dcp
