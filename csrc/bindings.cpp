// Python entry points of dcp._C. Every tensor is checked here (device, dtype, shape, strides) with one
// clear message per condition; the kernels below only see the plain structs of attention_cpu.h.
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "attention_cpu.h"
#include "checks.h"

namespace {

using at::Tensor;
using dcp::check_cpu;

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

void set_cpu_isa(const std::string& name) {
  TORCH_CHECK(dcp::set_cpu_isa(name), "dcp._C.set_cpu_isa: ISA '", name, "' is not available here (available: ",
              dcp::available_cpu_isas(), ")");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dcp native CPU kernels: block-table attention forward/backward, log-sum-exp merges, and the "
            "planner's loops (bindings_planner.cpp)";
  m.def("attention_forward", &attention_forward, "(q, k, v, seg_cu, seg_tile_ptr, tile_k_start, tile_k_len, "
        "tile_mask_row, mask_ranges, scale) -> (o_thd, lse_ht)");
  m.def("attention_backward", &attention_backward, "(do, q, k, v, lse, delta, <6 tile arrays>, scale, "
        "fp32_grads) -> (dq, dk, dv)");
  m.def("merge_partials", &merge_partials, "(o_list, lse_list) -> (o_thd, lse_ht)");
  m.def("merge_into", &merge_into, "(o_acc, lse_acc, o_new, lse_new): in-place two-way merge into o_acc/lse_acc");
  dcp::register_planner(m);
  m.def("cpu_isa", []() { return std::string(dcp::cpu_isa()); }, "ISA variant of the kernels in use");
  m.def("set_cpu_isa", &set_cpu_isa, "select 'generic', 'avx2' or 'auto'");
  m.def("available_cpu_isas", []() { return dcp::available_cpu_isas(); });
}
