// Python entry points of dcp._C for the planner and the simulator: the input-round greedy, the makespan
// estimate, tile staging, box and grouped-layout pair counts and the simulator's event loop. Every array is
// checked here; the loops (rounds, estimate, stages, box_counts, pieces, sim .cpp) only see plain structs.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "box_counts.h"
#include "checks.h"
#include "estimate.h"
#include "magi_place.h"
#include "pieces.h"
#include "rounds.h"
#include "sim.h"
#include "stages.h"

namespace {

using at::Tensor;
using dcp::check_cpu;
using dcp::check_mat;
using dcp::check_vec;
using dcp::to_tensor;

std::tuple<Tensor, Tensor> input_rounds(const Tensor& order, const Tensor& dev, const Tensor& key, const Tensor& home,
                                        const Tensor& nbytes, const Tensor& budget_first, const Tensor& budget,
                                        int64_t gpus_per_node, int64_t n_nodes, int64_t max_rounds, bool relay,
                                        double port, double nic) {
  const char* fn = "dcp._C.input_rounds";
  const int64_t n = dev.numel(), n_dev = budget.numel();
  check_vec(order, fn, "order", n, at::kLong);
  check_vec(dev, fn, "dev", n, at::kLong);
  check_vec(key, fn, "key", n, at::kLong);
  check_vec(home, fn, "home", n, at::kLong);
  check_vec(nbytes, fn, "nbytes", n, at::kDouble);
  check_vec(budget_first, fn, "budget_first", n_dev, at::kDouble);
  check_vec(budget, fn, "budget", n_dev, at::kDouble);
  TORCH_CHECK(gpus_per_node > 0 && n_nodes > 0 && n_dev == gpus_per_node * n_nodes, fn, ": ", n_dev,
              " devices must be gpus_per_node (", gpus_per_node, ") x n_nodes (", n_nodes, ")");
  TORCH_CHECK(max_rounds >= 1, fn, ": max_rounds must be >= 1, got ", max_rounds);
  int64_t n_keys = 0;
  if (n) {
    const auto in_range = [](const Tensor& t, int64_t hi) {
      return t.min().item<int64_t>() >= 0 && t.max().item<int64_t>() < hi;
    };
    TORCH_CHECK(in_range(order, n) && at::equal(std::get<0>(order.sort()), at::arange(n, order.options())), fn,
                ": order must be a permutation of 0..", n - 1);
    TORCH_CHECK(in_range(dev, n_dev) && in_range(home, n_dev), fn, ": dev and home must be devices 0..", n_dev - 1);
    TORCH_CHECK(key.min().item<int64_t>() >= 0, fn, ": keys must be >= 0");
    n_keys = key.max().item<int64_t>() + 1;
  }
  Tensor arrival = at::empty({n}, dev.options()), source = at::empty({n}, dev.options());
  dcp::RoundsParams p;
  p.n = n;
  p.order = order.data_ptr<int64_t>();
  p.dev = dev.data_ptr<int64_t>();
  p.key = key.data_ptr<int64_t>();
  p.home = home.data_ptr<int64_t>();
  p.nbytes = nbytes.data_ptr<double>();
  p.budget_first = budget_first.data_ptr<double>();
  p.budget = budget.data_ptr<double>();
  p.n_dev = n_dev;
  p.gpus_per_node = gpus_per_node;
  p.n_nodes = n_nodes;
  p.max_rounds = max_rounds;
  p.n_keys = n_keys;
  p.relay = relay;
  p.port = port;
  p.nic = nic;
  p.arrival = arrival.data_ptr<int64_t>();
  p.source = source.data_ptr<int64_t>();
  {
    pybind11::gil_scoped_release no_gil;
    dcp::input_rounds(p);
  }
  return {arrival, source};
}

Tensor estimate_rounds(const Tensor& round, const Tensor& src, const Tensor& dst, const Tensor& nbytes,
                       const Tensor& comp, const Tensor& red, const Tensor& n_merges, const Tensor& t0,
                       const Tensor& host0, const std::vector<double>& host, double round_over, double latency,
                       double port, double nic, int64_t gpus_per_node, int64_t per_nic) {
  const char* fn = "dcp._C.estimate_rounds";
  const int64_t m = round.numel(), n = t0.numel();
  check_vec(round, fn, "round", m, at::kLong);
  check_vec(src, fn, "src", m, at::kLong);
  check_vec(dst, fn, "dst", m, at::kLong);
  check_vec(nbytes, fn, "nbytes", m, at::kDouble);
  check_vec(t0, fn, "t0", n, at::kDouble);
  check_vec(host0, fn, "host0", n, at::kDouble);
  for (const auto& [t, name] : {std::pair{&comp, "comp"}, std::pair{&red, "red"}, std::pair{&n_merges, "n_merges"}}) {
    check_cpu(*t, fn, name);
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->scalar_type() == at::kDouble && t->is_contiguous(), fn, ": ",
                name, " must be a contiguous float64 [", n, ", k] tensor, got ", t->sizes());
  }
  const int64_t n_rounds = red.size(1) - 1;
  TORCH_CHECK(n_rounds >= 0 && n_merges.size(1) == n_rounds + 1, fn, ": red and n_merges must both be [n, n_rounds + 1]");
  TORCH_CHECK(host.size() == 5, fn, ": host must be (launch, message, wait, compute, reduce) seconds");
  TORCH_CHECK(gpus_per_node > 0 && per_nic > 0 && n % gpus_per_node == 0 && gpus_per_node % per_nic == 0, fn,
              ": ", n, " devices must be whole nodes of gpus_per_node (", gpus_per_node, "), a multiple of per_nic (",
              per_nic, ")");
  Tensor out = at::empty({n}, t0.options());
  dcp::EstimateParams p;
  p.n_dev = n;
  p.n_transfers = m;
  p.n_rounds = n_rounds;
  p.n_stages = comp.size(1);
  p.round = round.data_ptr<int64_t>();
  p.src = src.data_ptr<int64_t>();
  p.dst = dst.data_ptr<int64_t>();
  p.nbytes = nbytes.data_ptr<double>();
  p.comp = comp.data_ptr<double>();
  p.red = red.data_ptr<double>();
  p.n_merges = n_merges.data_ptr<double>();
  p.t0 = t0.data_ptr<double>();
  p.host0 = host0.data_ptr<double>();
  p.launch = host[0];
  p.message = host[1];
  p.wait = host[2];
  p.compute = host[3];
  p.reduce = host[4];
  p.round_over = round_over;
  p.latency = latency;
  p.port = port;
  p.nic = nic;
  p.gpus_per_node = gpus_per_node;
  p.per_nic = per_nic;
  p.n_nics = n / per_nic;
  p.t = out.data_ptr<double>();
  std::string err;
  TORCH_CHECK(dcp::estimate_rounds(p, err), fn, ": ", err);
  return out;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> grouped_pair_counts(
    const Tensor& seq_piece_ptr, const Tensor& piece_start, const Tensor& piece_len, const Tensor& piece_block,
    int64_t n_blocks, const Tensor& ranges, const Tensor& range_ptr, const Tensor& seq_r) {
  const char* fn = "dcp._C.grouped_pair_counts";
  const int64_t n_seqs = seq_r.numel(), n_pieces = piece_len.numel();
  check_vec(seq_piece_ptr, fn, "seq_piece_ptr", n_seqs + 1, at::kLong);
  check_vec(piece_start, fn, "piece_start", n_pieces, at::kLong);
  check_vec(piece_len, fn, "piece_len", n_pieces, at::kLong);
  check_vec(piece_block, fn, "piece_block", n_pieces, at::kLong);
  check_vec(range_ptr, fn, "range_ptr", n_seqs + 1, at::kLong);
  check_vec(seq_r, fn, "seq_r", n_seqs, at::kLong);
  check_cpu(ranges, fn, "ranges");
  TORCH_CHECK(ranges.scalar_type() == at::kInt, fn, ": ranges must have dtype int32, got ", ranges.scalar_type());
  TORCH_CHECK(ranges.dim() == 2 && ranges.size(1) == 2, fn, ": ranges must have shape [rows, 2], got ",
              ranges.sizes());
  TORCH_CHECK(ranges.is_contiguous(), fn, ": ranges must be contiguous");
  TORCH_CHECK(n_blocks >= 0, fn, ": n_blocks must be >= 0, got ", n_blocks);
  const auto non_decreasing = [](const Tensor& t) {
    return t.numel() < 2 || (t.slice(0, 1) >= t.slice(0, 0, t.numel() - 1)).all().item<bool>();
  };
  const int64_t* sp = seq_piece_ptr.data_ptr<int64_t>();
  const int64_t* rp = range_ptr.data_ptr<int64_t>();
  TORCH_CHECK(sp[0] >= 0 && sp[n_seqs] <= n_pieces && non_decreasing(seq_piece_ptr), fn,
              ": seq_piece_ptr must be non-decreasing within [0, ", n_pieces, "]");
  TORCH_CHECK(rp[0] >= 0 && rp[n_seqs] <= ranges.size(0) && non_decreasing(range_ptr), fn,
              ": range_ptr must be non-decreasing within [0, ", ranges.size(0), "]");
  if (n_pieces) {
    TORCH_CHECK(piece_block.min().item<int64_t>() >= 0 && piece_block.max().item<int64_t>() < n_blocks, fn,
                ": piece_block must name blocks 0..", n_blocks - 1);
  }
  dcp::GroupedCountsParams p;
  p.n_seqs = n_seqs;
  p.n_pieces = n_pieces;
  p.n_blocks = n_blocks;
  p.seq_piece_ptr = sp;
  p.piece_start = piece_start.data_ptr<int64_t>();
  p.piece_len = piece_len.data_ptr<int64_t>();
  p.piece_block = piece_block.data_ptr<int64_t>();
  p.ranges = ranges.data_ptr<int32_t>();
  p.range_ptr = rp;
  p.seq_r = seq_r.data_ptr<int64_t>();
  dcp::GroupedCountsResult r;
  std::string err;
  bool ok;
  {
    pybind11::gil_scoped_release no_gil;
    ok = dcp::grouped_pair_counts(p, r, err);
  }
  TORCH_CHECK(ok, fn, ": ", err);
  return {to_tensor(r.q_block), to_tensor(r.kv_block), to_tensor(r.unmasked), to_tensor(r.area),
          to_tensor(r.sub_n), to_tensor(r.sub_wq), to_tensor(r.sub_wk), to_tensor(r.sub_wqk)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t> simulate_streams(
    const Tensor& ptr, const Tensor& step_dev, const Tensor& flow_ptr, const Tensor& step_flows,
    const Tensor& pending, const Tensor& comp, const Tensor& red, const Tensor& f_step, const Tensor& f_res,
    const Tensor& f_bytes, const Tensor& cap, const Tensor& clock0, const Tensor& reduce0, const Tensor& host,
    const Tensor& host0, double latency, double round_over) {
  const char* fn = "dcp._C.simulate_streams";
  const int64_t n_dev = clock0.numel(), n_steps = step_dev.numel(), n_flows = f_bytes.numel(),
                n_res = cap.numel();
  check_vec(ptr, fn, "ptr", n_dev + 1, at::kLong);
  check_vec(step_dev, fn, "step_dev", n_steps, at::kLong);
  check_vec(flow_ptr, fn, "flow_ptr", n_steps + 1, at::kLong);
  check_vec(step_flows, fn, "step_flows", step_flows.numel(), at::kLong);
  check_vec(pending, fn, "pending", n_steps, at::kLong);
  check_vec(comp, fn, "comp", n_steps, at::kDouble);
  check_vec(red, fn, "red", n_steps, at::kDouble);
  check_mat(f_step, fn, "f_step", n_flows);
  TORCH_CHECK(f_step.size(1) == 2, fn, ": f_step must have shape [n_flows, 2], got ", f_step.sizes());
  check_mat(f_res, fn, "f_res", n_flows);
  check_vec(f_bytes, fn, "f_bytes", n_flows, at::kDouble);
  check_vec(cap, fn, "cap", n_res, at::kDouble);
  check_vec(clock0, fn, "clock0", n_dev, at::kDouble);
  check_vec(reduce0, fn, "reduce0", n_dev, at::kDouble);
  TORCH_CHECK(host.dim() == 2 && host.size(0) == n_steps && host.size(1) == 4 && host.scalar_type() == at::kDouble &&
                  host.is_contiguous(),
              fn, ": host must be a contiguous float64 [n_steps, 4] tensor, got ", host.sizes());
  check_vec(host0, fn, "host0", n_dev, at::kDouble);
  check_cpu(host, fn, "host");
  TORCH_CHECK(flow_ptr[n_steps].item<int64_t>() == step_flows.numel(), fn, ": flow_ptr must end at the ",
              step_flows.numel(), " entries of step_flows");
  const auto dopt = at::TensorOptions().dtype(at::kDouble);
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  Tensor clock = at::empty({n_dev}, dopt), compute_s = at::empty({n_dev}, dopt), reduce_s = at::empty({n_dev}, dopt),
         wait_s = at::empty({n_dev}, dopt), f_start = at::empty({n_flows}, dopt), f_end = at::empty({n_flows}, dopt),
         blocked = at::empty({n_dev}, lopt), pos = at::empty({n_dev}, lopt);
  dcp::SimParams p;
  p.n_dev = n_dev;
  p.n_steps = n_steps;
  p.n_flows = n_flows;
  p.n_res = n_res;
  p.ptr = ptr.data_ptr<int64_t>();
  p.step_dev = step_dev.data_ptr<int64_t>();
  p.flow_ptr = flow_ptr.data_ptr<int64_t>();
  p.step_flows = step_flows.data_ptr<int64_t>();
  p.pending = pending.data_ptr<int64_t>();
  p.comp = comp.data_ptr<double>();
  p.red = red.data_ptr<double>();
  p.f_step = f_step.data_ptr<int64_t>();
  p.f_res = f_res.data_ptr<int64_t>();
  p.res_width = f_res.size(1);
  p.f_bytes = f_bytes.data_ptr<double>();
  p.cap = cap.data_ptr<double>();
  p.clock0 = clock0.data_ptr<double>();
  p.reduce0 = reduce0.data_ptr<double>();
  p.host = host.data_ptr<double>();
  p.host0 = host0.data_ptr<double>();
  p.latency = latency;
  p.round_over = round_over;
  p.clock = clock.data_ptr<double>();
  p.compute_s = compute_s.data_ptr<double>();
  p.reduce_s = reduce_s.data_ptr<double>();
  p.wait_s = wait_s.data_ptr<double>();
  p.f_start = f_start.data_ptr<double>();
  p.f_end = f_end.data_ptr<double>();
  p.blocked = blocked.data_ptr<int64_t>();
  p.pos = pos.data_ptr<int64_t>();
  std::string err;
  bool ok;
  {
    pybind11::gil_scoped_release no_gil;
    ok = dcp::simulate_streams(p, err);
  }
  TORCH_CHECK(ok, fn, ": ", err);
  return {clock, compute_s, reduce_s, wait_s, f_start, f_end, blocked, pos, p.n_rate_updates};
}

Tensor max_min_fill(const Tensor& res, const Tensor& cap, bool small) {
  const char* fn = "dcp._C.max_min_fill";
  check_mat(res, fn, "res", res.size(0));
  check_vec(cap, fn, "cap", cap.numel(), at::kDouble);
  const int64_t n = res.size(0), w = res.size(1), n_res = cap.numel();
  if (n) {
    TORCH_CHECK(res.max().item<int64_t>() < n_res && res.min().item<int64_t>() >= -1, fn,
                ": res must name resources 0..", n_res - 1, " (-1: padding)");
    TORCH_CHECK(w >= 1 && (res.select(1, 0) >= 0).all().item<bool>(), fn,
                ": every row must cross a resource in its first column");
  }
  Tensor rate = at::empty({n}, at::TensorOptions().dtype(at::kDouble));
  dcp::max_min_fill(n, w, res.data_ptr<int64_t>(), cap.data_ptr<double>(), n_res, small, rate.data_ptr<double>());
  return rate;
}

Tensor tile_stages(const Tensor& tile_device, const Tensor& release, const Tensor& out_unit, const Tensor& tile_time,
                   const Tensor& staged, int64_t n_stages, const std::optional<Tensor>& round_s) {
  const char* fn = "dcp._C.tile_stages";
  const int64_t n = tile_device.numel(), n_dev = staged.numel();
  check_vec(tile_device, fn, "tile_device", n, at::kLong);
  check_vec(release, fn, "release", n, at::kLong);
  check_vec(out_unit, fn, "out_unit", n, at::kLong);
  check_vec(tile_time, fn, "tile_time", n, at::kDouble);
  check_vec(staged, fn, "staged", n_dev, at::kBool);
  TORCH_CHECK(n_stages >= 1, fn, ": n_stages must be >= 1, got ", n_stages);
  if (n) {
    TORCH_CHECK(tile_device.min().item<int64_t>() >= 0 && tile_device.max().item<int64_t>() < n_dev, fn,
                ": tile_device must be devices 0..", n_dev - 1, " (staged has one flag per device)");
    TORCH_CHECK(release.min().item<int64_t>() >= 0, fn, ": release rounds must be >= 0");
    TORCH_CHECK(out_unit.min().item<int64_t>() >= -1, fn, ": out_unit must be >= -1 (-1: none)");
    TORCH_CHECK((tile_time >= 0).all().item<bool>(), fn, ": tile_time must be >= 0");
  }
  if (round_s) {
    check_cpu(*round_s, fn, "round_s");
    TORCH_CHECK(round_s->dim() == 2 && round_s->size(0) == n_dev && round_s->size(1) >= 1 &&
                    round_s->scalar_type() == at::kDouble && round_s->is_contiguous(),
                fn, ": round_s must be a contiguous float64 [", n_dev, ", width >= 1] tensor, got ", round_s->sizes());
  }
  Tensor stage = at::empty({n}, tile_device.options());
  dcp::StagesParams p;
  p.n_tiles = n;
  p.n_dev = n_dev;
  p.n_stages = n_stages;
  p.tile_device = tile_device.data_ptr<int64_t>();
  p.release = release.data_ptr<int64_t>();
  p.out_unit = out_unit.data_ptr<int64_t>();
  p.tile_time = tile_time.data_ptr<double>();
  p.staged = reinterpret_cast<const uint8_t*>(staged.data_ptr<bool>());
  p.round_s = round_s ? round_s->data_ptr<double>() : nullptr;
  p.round_width = round_s ? round_s->size(1) : 0;
  p.stage = stage.data_ptr<int64_t>();
  dcp::tile_stages(p);
  return stage;
}

Tensor box_counts_direct(const Tensor& ranges, const Tensor& q_bounds, const Tensor& kv_bounds) {
  const char* fn = "dcp._C.box_counts_direct";
  check_cpu(ranges, fn, "ranges");
  TORCH_CHECK(ranges.dim() == 3 && ranges.size(2) == 2 && ranges.scalar_type() == at::kInt && ranges.is_contiguous(),
              fn, ": ranges must be a contiguous int32 [T, R, 2] tensor, got ", ranges.scalar_type(), " ",
              ranges.sizes());
  const int64_t T = ranges.size(0);
  for (const auto& [b, name] : {std::pair{&q_bounds, "q_bounds"}, std::pair{&kv_bounds, "kv_bounds"}}) {
    check_vec(*b, fn, name, b->numel(), at::kLong);
    const int64_t* v = b->data_ptr<int64_t>();
    bool ok = b->numel() >= 2 && v[0] == 0 && v[b->numel() - 1] == T;
    for (int64_t i = 1; ok && i < b->numel(); ++i) ok = v[i] > v[i - 1];
    TORCH_CHECK(ok, fn, ": ", name, " must increase strictly from 0 to ", T);
  }
  Tensor counts = at::empty({q_bounds.numel() - 1, kv_bounds.numel() - 1}, q_bounds.options());
  dcp::BoxCountsParams p;
  p.n_tok = T;
  p.n_slots = ranges.size(1);
  p.n_q = q_bounds.numel() - 1;
  p.n_kv = kv_bounds.numel() - 1;
  p.ranges = ranges.data_ptr<int32_t>();
  p.q_bounds = q_bounds.data_ptr<int64_t>();
  p.kv_bounds = kv_bounds.data_ptr<int64_t>();
  p.counts = counts.data_ptr<int64_t>();
  std::string err;
  TORCH_CHECK(dcp::box_counts_direct(p, err), fn, ": ", err);
  return counts;
}

std::tuple<bool, Tensor, Tensor> magi_place(const Tensor& mask, const Tensor& degree, const Tensor& home,
                                            const Tensor& area, const Tensor& free_order, const Tensor& movable_order,
                                            const Tensor& rank, const Tensor& load, double avg, double cap,
                                            int64_t refine_passes) {
  const char* fn = "dcp._C.magi_place";
  const int64_t n = mask.numel(), p = load.numel();
  check_vec(mask, fn, "mask", n, at::kLong);  // uint64 bits, passed as int64
  check_vec(degree, fn, "degree", n, at::kLong);
  check_vec(home, fn, "home", n, at::kLong);
  check_vec(area, fn, "area", n, at::kDouble);
  check_vec(free_order, fn, "free_order", free_order.numel(), at::kLong);
  check_vec(movable_order, fn, "movable_order", movable_order.numel(), at::kLong);
  check_vec(rank, fn, "rank", n, at::kLong);
  check_vec(load, fn, "load", p, at::kDouble);
  TORCH_CHECK(p >= 1 && p <= 64, fn, ": 1..64 ranks (one 64-bit mask per tile), got ", p);
  TORCH_CHECK(refine_passes >= 0, fn, ": refine_passes must be >= 0, got ", refine_passes);
  if (n) {
    const uint64_t outside = p == 64 ? 0ULL : ~((1ULL << p) - 1ULL);
    const auto* m = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
    const int64_t* deg = degree.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK((m[t] & outside) == 0 && m[t] != 0, fn, ": tile ", t, "'s mask must name 1..", p,
                  " ranks 0..", p - 1);
      TORCH_CHECK(deg[t] == __builtin_popcountll(m[t]), fn, ": degree[", t, "] must count its mask's ranks");
    }
    TORCH_CHECK(home.min().item<int64_t>() >= 0 && home.max().item<int64_t>() < p, fn, ": home must be ranks 0..",
                p - 1);
    TORCH_CHECK(rank.min().item<int64_t>() >= -1 && rank.max().item<int64_t>() < p, fn,
                ": rank must be -1 (unplaced) or ranks 0..", p - 1);
  }
  for (const auto& [o, name] : {std::pair{&free_order, "free_order"}, std::pair{&movable_order, "movable_order"}}) {
    TORCH_CHECK(!o->numel() || (o->min().item<int64_t>() >= 0 && o->max().item<int64_t>() < n), fn, ": ", name,
                " must hold tiles 0..", n - 1);
  }
  Tensor rank_out = rank.clone(), load_out = load.clone();
  const int64_t* fo = free_order.data_ptr<int64_t>();
  const int64_t* r0 = rank.data_ptr<int64_t>();
  std::vector<char> placed(n);  // every tile the refinement may move has a rank by then
  for (int64_t t = 0; t < n; ++t) placed[t] = r0[t] >= 0;
  for (int64_t i = 0; i < free_order.numel(); ++i) {
    TORCH_CHECK(!placed[fo[i]], fn, ": free tile ", fo[i], " is already placed (rank ", r0[fo[i]], ") or listed twice");
    placed[fo[i]] = 1;
  }
  const int64_t* mo = movable_order.data_ptr<int64_t>();
  for (int64_t i = 0; i < movable_order.numel(); ++i) {
    TORCH_CHECK(placed[mo[i]], fn, ": movable tile ", mo[i], " is neither placed nor free");
  }
  dcp::MagiPlaceParams prm;
  prm.n_tiles = n;
  prm.n_ranks = p;
  prm.n_free = free_order.numel();
  prm.n_movable = movable_order.numel();
  prm.refine_passes = refine_passes;
  prm.mask = reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  prm.degree = degree.data_ptr<int64_t>();
  prm.home = home.data_ptr<int64_t>();
  prm.area = area.data_ptr<double>();
  prm.free_order = fo;
  prm.movable_order = mo;
  prm.avg = avg;
  prm.cap = cap;
  prm.rank = rank_out.data_ptr<int64_t>();
  prm.load = load_out.data_ptr<double>();
  const bool ok = dcp::magi_place(prm);
  return {ok, rank_out, load_out};
}

}  // namespace

namespace dcp {

// The wrappers above live outside namespace dcp (`::name`): the loops they call share their names.
void register_planner(pybind11::module_& m) {
  m.def("input_rounds", &::input_rounds, "(order, dev, key, home, nbytes, budget_first, budget, gpus_per_node, "
        "n_nodes, max_rounds, relay, port, nic) -> (arrival, source): the planner's input-round greedy");
  m.def("estimate_rounds", &::estimate_rounds, "(round, src, dst, nbytes, comp, red, n_merges, t0, host0, host, "
        "round_over, latency, port, nic, gpus_per_node, per_nic) -> t: the planner's makespan estimate "
        "(dcp.cost.estimate)");
  m.def("tile_stages", &::tile_stages, "(tile_device, release, out_unit, tile_time, staged, n_stages, round_s) -> "
        "stage: the planner's tile staging (dcp.schedule.stages)");
  m.def("box_counts_direct", &::box_counts_direct, "(ranges [T, R, 2] int32, q_bounds, kv_bounds) -> counts "
        "[nq, nkv]: attended pairs per (query box, key box) in one pass (dcp.masks.box_counts)");
  m.def("grouped_pair_counts", &::grouped_pair_counts, "(seq_piece_ptr, piece_start, piece_len, piece_block, "
        "n_blocks, ranges, range_ptr, seq_r) -> (q_block, kv_block, unmasked, area, sub_n, sub_wq, "
        "sub_wk, sub_wqk): pair counts and moments of a grouped layout (dcp.layout.pieces)");
  m.def("simulate_streams", &::simulate_streams, "(ptr, step_dev, flow_ptr, step_flows, pending, comp, red, "
        "f_step, f_res, f_bytes, cap, clock0, reduce0, host, host0, latency, round_over) -> (clock, compute_s, reduce_s, "
        "wait_s, f_start, f_end, blocked, pos, n_rate_updates): the simulator's event loop (dcp.sim.streams)");
  m.def("magi_place", &::magi_place, "(mask, degree, home, area, free_order, movable_order, rank, load, avg, cap, "
        "refine_passes) -> (ok, rank, load): the greedy placement of Magi's dynamic solver "
        "(dcp.baselines.magi_dynamic.solve)");
  m.def("max_min_fill", &::max_min_fill, "(res [n, width] int64 (-1 padding), cap, small) -> rate: max-min fair "
        "rates by the simulator's progressive filling (small: dcp.sim.flows._max_min_small)");
}

}  // namespace dcp
