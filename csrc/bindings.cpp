// Python entry points of dcp._C. Every tensor is checked here (device, dtype, shape, strides) with one
// clear message per condition; the kernels below only see the plain structs of attention_cpu.h.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cpu.h"
#include "pieces.h"
#include "rounds.h"
#include "sim.h"

namespace {

using at::Tensor;

dcp::DType kernel_dtype(const Tensor& t, const char* fn, const char* name) {
  switch (t.scalar_type()) {
    case at::kDouble: return dcp::DType::kF64;
    case at::kFloat: return dcp::DType::kF32;
    case at::kBFloat16: return dcp::DType::kBF16;
    case at::kHalf: return dcp::DType::kF16;
    default:
      TORCH_CHECK(false, fn, ": ", name, " must be float64, float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return dcp::DType::kF32;
}

void check_cpu(const Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got device ", t.device());
}

// [T, H, D] tensor of dtype `dt`, unit stride along D.
void check_thd(const Tensor& t, const char* fn, const char* name, int64_t T, int64_t H, int64_t D,
               at::ScalarType dt) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.dim() == 3, fn, ": ", name, " must have 3 dims [T, H, D], got shape ", t.sizes());
  TORCH_CHECK(t.size(0) == T && t.size(1) == H && t.size(2) == D, fn, ": ", name, " must have shape [", T,
              ", ", H, ", ", D, "], got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == dt, fn, ": ", name, " must have dtype ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.stride(2) == 1 || D <= 1, fn, ": ", name,
              " must be contiguous along its last dim (stride 1), got strides ", t.strides());
}

// [H, T] float32 tensor.
void check_ht(const Tensor& t, const char* fn, const char* name, int64_t H, int64_t T) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == H && t.size(1) == T, fn, ": ", name, " must have shape [", H, ", ",
              T, "], got ", t.sizes());
}

dcp::Tensor3View view3(const Tensor& t) {
  return dcp::Tensor3View{t.data_ptr(), t.stride(0), t.stride(1)};
}
dcp::Tensor2View view2(const Tensor& t) {
  return dcp::Tensor2View{t.data_ptr<float>(), t.stride(0), t.stride(1)};
}

void check_index(const Tensor& t, const char* fn, const char* name, int64_t dim) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == at::kInt, fn, ": tile table field ", name, " must be int32, got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, fn, ": tile table field ", name, " must have ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": tile table field ", name, " must be contiguous");
}

dcp::TileTableView tile_view(const char* fn, const Tensor& seg_cu, const Tensor& seg_tile_ptr,
                             const Tensor& tile_k_start, const Tensor& tile_k_len, const Tensor& tile_mask_row,
                             const Tensor& mask_ranges, int64_t tq, int64_t tk) {
  check_index(seg_cu, fn, "seg_cu", 1);
  check_index(seg_tile_ptr, fn, "seg_tile_ptr", 1);
  check_index(tile_k_start, fn, "tile_k_start", 1);
  check_index(tile_k_len, fn, "tile_k_len", 1);
  check_index(tile_mask_row, fn, "tile_mask_row", 1);
  check_index(mask_ranges, fn, "mask_ranges", 3);
  TORCH_CHECK(seg_cu.numel() >= 1, fn, ": seg_cu must have n_seg + 1 >= 1 entries");
  TORCH_CHECK(seg_tile_ptr.numel() == seg_cu.numel(), fn, ": seg_tile_ptr must have ", seg_cu.numel(),
              " entries like seg_cu, got ", seg_tile_ptr.numel());
  const int64_t n_tiles = tile_k_start.numel();
  TORCH_CHECK(tile_k_len.numel() == n_tiles && tile_mask_row.numel() == n_tiles, fn,
              ": tile_k_start, tile_k_len and tile_mask_row must have the same length, got ", n_tiles, ", ",
              tile_k_len.numel(), ", ", tile_mask_row.numel());
  TORCH_CHECK(mask_ranges.size(2) == 2, fn, ": mask_ranges must have shape [n_rows, R, 2], got ",
              mask_ranges.sizes());
  dcp::TileTableView tt;
  tt.seg_cu = seg_cu.data_ptr<int32_t>();
  tt.seg_tile_ptr = seg_tile_ptr.data_ptr<int32_t>();
  tt.tile_k_start = tile_k_start.data_ptr<int32_t>();
  tt.tile_k_len = tile_k_len.data_ptr<int32_t>();
  tt.tile_mask_row = tile_mask_row.data_ptr<int32_t>();
  tt.mask_ranges = mask_ranges.data_ptr<int32_t>();
  tt.n_seg = seg_cu.numel() - 1;
  tt.n_tiles = n_tiles;
  tt.n_mask_rows = mask_ranges.size(0);
  tt.n_ranges = mask_ranges.size(1);
  const std::string err = dcp::validate_tile_table(tt, tq, tk);
  TORCH_CHECK(err.empty(), fn, ": invalid tile table: ", err);
  return tt;
}

struct Dims {
  int64_t tq, tk, hq, hkv, d;
};

Dims check_qkv(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v) {
  check_cpu(q, fn, "q_thd");
  TORCH_CHECK(q.dim() == 3, fn, ": q_thd must have 3 dims [Tq, Hq, D], got shape ", q.sizes());
  check_cpu(k, fn, "k_thd");
  TORCH_CHECK(k.dim() == 3, fn, ": k_thd must have 3 dims [Tk, Hkv, D], got shape ", k.sizes());
  kernel_dtype(q, fn, "q_thd");
  Dims d{q.size(0), k.size(0), q.size(1), k.size(1), q.size(2)};
  TORCH_CHECK(d.hkv >= 1 && d.hq % d.hkv == 0, fn, ": the number of query heads (", d.hq,
              ") must be a multiple of the number of kv heads (", d.hkv, ")");
  TORCH_CHECK(d.d >= 1, fn, ": head dim must be >= 1");
  check_thd(q, fn, "q_thd", d.tq, d.hq, d.d, q.scalar_type());
  check_thd(k, fn, "k_thd", d.tk, d.hkv, d.d, q.scalar_type());
  check_thd(v, fn, "v_thd", d.tk, d.hkv, d.d, q.scalar_type());
  return d;
}

// Rows outside [seg_cu[0], seg_cu[-1]) get o = 0 (and lse = -inf when given).
void clear_uncovered(const Tensor& seg_cu, const Tensor& o, const Tensor* lse) {
  const int64_t first = seg_cu.data_ptr<int32_t>()[0];
  const int64_t last = seg_cu.data_ptr<int32_t>()[seg_cu.numel() - 1];
  const int64_t T = o.size(0);
  if (first > 0) {
    o.narrow(0, 0, first).zero_();
    if (lse) lse->narrow(1, 0, first).fill_(-std::numeric_limits<float>::infinity());
  }
  if (last < T) {
    o.narrow(0, last, T - last).zero_();
    if (lse) lse->narrow(1, last, T - last).fill_(-std::numeric_limits<float>::infinity());
  }
}

std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& seg_cu, const Tensor& seg_tile_ptr,
                                             const Tensor& tile_k_start, const Tensor& tile_k_len,
                                             const Tensor& tile_mask_row, const Tensor& mask_ranges,
                                             double scale) {
  const char* fn = "dcp._C.attention_forward";
  const Dims d = check_qkv(fn, q, k, v);
  dcp::FwdParams p;
  p.tiles = tile_view(fn, seg_cu, seg_tile_ptr, tile_k_start, tile_k_len, tile_mask_row, mask_ranges, d.tq, d.tk);
  Tensor o = at::empty({d.tq, d.hq, d.d}, q.options());
  Tensor lse = at::empty({d.hq, d.tq}, q.options().dtype(at::kFloat));
  clear_uncovered(seg_cu, o, &lse);
  p.dtype = kernel_dtype(q, fn, "q_thd");
  p.shape = dcp::AttnShape{d.tq, d.tk, d.hq, d.hkv, d.d};
  p.q = view3(q);
  p.k = view3(k);
  p.v = view3(v);
  p.o = view3(o);
  p.lse = view2(lse);
  p.scale = scale;
  {
    pybind11::gil_scoped_release no_gil;
    dcp::attention_forward_cpu(p);
  }
  return {o, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_backward(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& delta,
    const Tensor& seg_cu, const Tensor& seg_tile_ptr, const Tensor& tile_k_start, const Tensor& tile_k_len,
    const Tensor& tile_mask_row, const Tensor& mask_ranges, double scale, bool fp32_grads) {
  const char* fn = "dcp._C.attention_backward";
  const Dims d = check_qkv(fn, q, k, v);
  check_thd(dout, fn, "do_thd", d.tq, d.hq, d.d, q.scalar_type());
  check_ht(lse, fn, "lse_ht", d.hq, d.tq);
  check_ht(delta, fn, "delta_ht", d.hq, d.tq);
  dcp::BwdParams p;
  p.tiles = tile_view(fn, seg_cu, seg_tile_ptr, tile_k_start, tile_k_len, tile_mask_row, mask_ranges, d.tq, d.tk);
  const auto gopt = q.options().dtype(fp32_grads ? at::kFloat : q.scalar_type());
  Tensor dq = at::empty({d.tq, d.hq, d.d}, gopt);
  Tensor dk = at::empty({d.tk, d.hkv, d.d}, gopt);
  Tensor dv = at::empty({d.tk, d.hkv, d.d}, gopt);
  clear_uncovered(seg_cu, dq, nullptr);
  p.dtype = kernel_dtype(q, fn, "q_thd");
  p.grad_dtype = kernel_dtype(dq, fn, "dq");
  p.shape = dcp::AttnShape{d.tq, d.tk, d.hq, d.hkv, d.d};
  p.dout = view3(dout);
  p.q = view3(q);
  p.k = view3(k);
  p.v = view3(v);
  p.dq = view3(dq);
  p.dk = view3(dk);
  p.dv = view3(dv);
  p.lse = view2(lse);
  p.delta = view2(delta);
  p.scale = scale;
  {
    pybind11::gil_scoped_release no_gil;
    dcp::attention_backward_cpu(p);
  }
  return {dq, dk, dv};
}

dcp::MergeOperand operand(const Tensor& o, const Tensor& lse) {
  dcp::MergeOperand m;
  m.dtype = kernel_dtype(o, "dcp._C.merge", "o");
  m.o = o.data_ptr();
  m.o_st = o.stride(0);
  m.o_sh = o.stride(1);
  m.lse = lse.data_ptr<float>();
  m.lse_sh = lse.stride(0);
  m.lse_st = lse.stride(1);
  return m;
}

std::tuple<Tensor, Tensor> merge_partials(const std::vector<Tensor>& o_list, const std::vector<Tensor>& lse_list) {
  const char* fn = "dcp._C.merge_partials";
  TORCH_CHECK(!o_list.empty(), fn, ": needs at least one partial output");
  TORCH_CHECK(o_list.size() == lse_list.size(), fn, ": got ", o_list.size(), " outputs but ", lse_list.size(),
              " lse tensors");
  const Tensor& o0 = o_list[0];
  check_cpu(o0, fn, "o_list[0]");
  TORCH_CHECK(o0.dim() == 3, fn, ": o_list[0] must have 3 dims [T, H, D], got shape ", o0.sizes());
  kernel_dtype(o0, fn, "o_list[0]");
  const int64_t T = o0.size(0), H = o0.size(1), D = o0.size(2);
  std::vector<dcp::MergeOperand> ops;
  for (size_t i = 0; i < o_list.size(); ++i) {
    const std::string on = "o_list[" + std::to_string(i) + "]", ln = "lse_list[" + std::to_string(i) + "]";
    check_thd(o_list[i], fn, on.c_str(), T, H, D, o0.scalar_type());
    check_ht(lse_list[i], fn, ln.c_str(), H, T);
    ops.push_back(operand(o_list[i], lse_list[i]));
  }
  Tensor o = at::empty({T, H, D}, o0.options());
  Tensor lse = at::empty({H, T}, o0.options().dtype(at::kFloat));
  dcp::MergeParams p;
  p.t = T;
  p.h = H;
  p.d = D;
  p.n = static_cast<int64_t>(ops.size());
  p.inputs = ops.data();
  p.out = operand(o, lse);
  {
    pybind11::gil_scoped_release no_gil;
    dcp::merge_cpu(p);
  }
  return {o, lse};
}

void merge_into(const Tensor& o_acc, const Tensor& lse_acc, const Tensor& o_new, const Tensor& lse_new) {
  const char* fn = "dcp._C.merge_into";
  check_cpu(o_acc, fn, "o_acc");
  TORCH_CHECK(o_acc.dim() == 3, fn, ": o_acc must have 3 dims [T, H, D], got shape ", o_acc.sizes());
  kernel_dtype(o_acc, fn, "o_acc");
  kernel_dtype(o_new, fn, "o_new");
  const int64_t T = o_acc.size(0), H = o_acc.size(1), D = o_acc.size(2);
  check_thd(o_acc, fn, "o_acc", T, H, D, o_acc.scalar_type());
  check_thd(o_new, fn, "o_new", T, H, D, o_new.scalar_type());
  check_ht(lse_acc, fn, "lse_acc", H, T);
  check_ht(lse_new, fn, "lse_new", H, T);
  std::vector<dcp::MergeOperand> ops{operand(o_acc, lse_acc), operand(o_new, lse_new)};
  dcp::MergeParams p;
  p.t = T;
  p.h = H;
  p.d = D;
  p.n = 2;
  p.inputs = ops.data();
  p.out = ops[0];
  {
    pybind11::gil_scoped_release no_gil;
    dcp::merge_cpu(p);
  }
}

// 1-D contiguous CPU tensor of `n` elements and dtype `dt`.
void check_vec(const Tensor& t, const char* fn, const char* name, int64_t n, at::ScalarType dt) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == dt, fn, ": ", name, " must have dtype ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, fn, ": ", name, " must have shape [", n, "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous");
}

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

// A copy of `v` as a 1-D int64 tensor.
Tensor to_tensor(const std::vector<int64_t>& v) {
  Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

// A copy of `v` as a 1-D float64 tensor.
Tensor to_tensor(const std::vector<double>& v) {
  Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(v.begin(), v.end(), t.data_ptr<double>());
  return t;
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

// [rows, width] int64 contiguous CPU tensor.
void check_mat(const Tensor& t, const char* fn, const char* name, int64_t rows) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, fn, ": ", name, " must have dtype int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, fn, ": ", name, " must have shape [", rows, ", width], got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous");
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

void set_cpu_isa(const std::string& name) {
  TORCH_CHECK(dcp::set_cpu_isa(name), "dcp._C.set_cpu_isa: ISA '", name, "' is not available here (available: ",
              dcp::available_cpu_isas(), ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dcp native CPU kernels: block-table attention forward/backward, log-sum-exp merges, and the "
            "planner's input-round greedy, grouped-layout pair counts and the simulator's event loop";
  m.def("attention_forward", &attention_forward, "(q, k, v, seg_cu, seg_tile_ptr, tile_k_start, tile_k_len, "
        "tile_mask_row, mask_ranges, scale) -> (o_thd, lse_ht)");
  m.def("attention_backward", &attention_backward, "(do, q, k, v, lse, delta, <6 tile arrays>, scale, "
        "fp32_grads) -> (dq, dk, dv)");
  m.def("merge_partials", &merge_partials, "(o_list, lse_list) -> (o_thd, lse_ht)");
  m.def("merge_into", &merge_into, "(o_acc, lse_acc, o_new, lse_new): in-place two-way merge into o_acc/lse_acc");
  m.def("input_rounds", &input_rounds, "(order, dev, key, home, nbytes, budget_first, budget, gpus_per_node, "
        "n_nodes, max_rounds, relay, port, nic) -> (arrival, source): the planner's input-round greedy");
  m.def("grouped_pair_counts", &grouped_pair_counts, "(seq_piece_ptr, piece_start, piece_len, piece_block, "
        "n_blocks, ranges, range_ptr, seq_r) -> (q_block, kv_block, unmasked, area, sub_n, sub_wq, "
        "sub_wk, sub_wqk): pair counts and moments of a grouped layout (dcp.layout.pieces)");
  m.def("simulate_streams", &simulate_streams, "(ptr, step_dev, flow_ptr, step_flows, pending, comp, red, "
        "f_step, f_res, f_bytes, cap, clock0, reduce0, host, host0, latency, round_over) -> (clock, compute_s, reduce_s, "
        "wait_s, f_start, f_end, blocked, pos, n_rate_updates): the simulator's event loop (dcp.sim.streams)");
  m.def("max_min_fill", &max_min_fill, "(res [n, width] int64 (-1 padding), cap, small) -> rate: max-min fair "
        "rates by the simulator's progressive filling (small: dcp.sim.flows._max_min_small)");
  m.def("cpu_isa", []() { return std::string(dcp::cpu_isa()); }, "ISA variant of the kernels in use");
  m.def("set_cpu_isa", &set_cpu_isa, "select 'generic', 'avx2' or 'auto'");
  m.def("available_cpu_isas", []() { return dcp::available_cpu_isas(); });
}
