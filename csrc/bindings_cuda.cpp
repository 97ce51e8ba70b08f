// Python entry points of dcp._C_cuda: LSE merges and partial-gradient sums on CUDA tensors.
// Every tensor is checked here; the kernels (merge_cuda.cu) only see the plain structs of merge_cuda.h.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "merge_cuda.h"

namespace {

using at::Tensor;
using dcp::cuda::CuDType;

CuDType cu_dtype(const Tensor& t, const char* fn, const std::string& name) {
  switch (t.scalar_type()) {
    case at::kFloat: return CuDType::kF32;
    case at::kBFloat16: return CuDType::kBF16;
    case at::kHalf: return CuDType::kF16;
    case at::kDouble: return CuDType::kF64;
    default:
      TORCH_CHECK(false, fn, ": ", name, " must be float32, bfloat16, float16 or float64, got ", t.scalar_type());
  }
  return CuDType::kF32;
}

void check_o(const Tensor& o, const char* fn, const std::string& name, const Tensor& like) {
  TORCH_CHECK(o.is_cuda(), fn, ": ", name, " must be a CUDA tensor, got device ", o.device());
  TORCH_CHECK(o.device() == like.device(), fn, ": ", name, " is on ", o.device(), " but expected ", like.device());
  TORCH_CHECK(o.dim() == 3 && o.sizes() == like.sizes(), fn, ": ", name, " must have shape ", like.sizes(),
              ", got ", o.sizes());
  TORCH_CHECK(o.stride(2) == 1 || o.size(2) <= 1, fn, ": ", name, " must be contiguous along its last dim");
  cu_dtype(o, fn, name);
}

void check_lse(const Tensor& lse, const char* fn, const std::string& name, const Tensor& o) {
  TORCH_CHECK(lse.device() == o.device(), fn, ": ", name, " is on ", lse.device(), " but expected ", o.device());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ", lse.scalar_type());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == o.size(1) && lse.size(1) == o.size(0), fn, ": ", name,
              " must have shape [", o.size(1), ", ", o.size(0), "], got ", lse.sizes());
  TORCH_CHECK(lse.is_contiguous(), fn, ": ", name, " must be contiguous");
}

void run_merge(const std::vector<Tensor>& o, const std::vector<Tensor>& lse, const Tensor& out,
               const Tensor& out_lse) {
  dcp::cuda::MergeCudaParams p;
  p.n = static_cast<int32_t>(o.size());
  for (size_t i = 0; i < o.size(); ++i) {
    p.o[i] = o[i].data_ptr();
    p.o_dtype[i] = cu_dtype(o[i], "dcp._C_cuda.merge", "o");
    p.o_st[i] = o[i].stride(0);
    p.o_sh[i] = o[i].stride(1);
    p.lse[i] = lse[i].data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.out_dtype = cu_dtype(out, "dcp._C_cuda.merge", "out");
  p.out_st = out.stride(0);
  p.out_sh = out.stride(1);
  p.out_lse = out_lse.data_ptr<float>();
  p.t = out.size(0);
  p.h = out.size(1);
  p.d = out.size(2);
  const cudaError_t err = dcp::cuda::launch_merge(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "dcp._C_cuda.merge: kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<Tensor, Tensor> merge_partials(const std::vector<Tensor>& o_list, const std::vector<Tensor>& lse_list) {
  const char* fn = "dcp._C_cuda.merge_partials";
  TORCH_CHECK(!o_list.empty(), fn, ": needs at least one partial output");
  TORCH_CHECK(o_list.size() == lse_list.size(), fn, ": got ", o_list.size(), " outputs but ", lse_list.size(),
              " lse tensors");
  const Tensor& o0 = o_list[0];
  TORCH_CHECK(o0.dim() == 3, fn, ": o_list[0] must have 3 dims [T, H, D], got ", o0.sizes());
  for (size_t i = 0; i < o_list.size(); ++i) {
    check_o(o_list[i], fn, "o_list[" + std::to_string(i) + "]", o0);
    TORCH_CHECK(o_list[i].scalar_type() == o0.scalar_type(), fn, ": all partial outputs must share one dtype");
    check_lse(lse_list[i], fn, "lse_list[" + std::to_string(i) + "]", o0);
  }
  const c10::cuda::CUDAGuard guard(o0.device());
  Tensor out = at::empty(o0.sizes(), o0.options());
  Tensor out_lse = at::empty({o0.size(1), o0.size(0)}, o0.options().dtype(at::kFloat));
  // more than kMaxMergeInputs partials: merge in rounds, carrying the running result as input 0
  std::vector<Tensor> os, ls;
  size_t next = 0;
  while (next < o_list.size()) {
    os.clear();
    ls.clear();
    if (next > 0) {
      os.push_back(out);
      ls.push_back(out_lse);
    }
    while (next < o_list.size() && os.size() < static_cast<size_t>(dcp::cuda::kMaxMergeInputs)) {
      os.push_back(o_list[next]);
      ls.push_back(lse_list[next]);
      ++next;
    }
    run_merge(os, ls, out, out_lse);
  }
  return {out, out_lse};
}

void merge_into(const Tensor& o_acc, const Tensor& lse_acc, const Tensor& o_new, const Tensor& lse_new) {
  const char* fn = "dcp._C_cuda.merge_into";
  TORCH_CHECK(o_acc.dim() == 3, fn, ": o_acc must have 3 dims [T, H, D], got ", o_acc.sizes());
  check_o(o_acc, fn, "o_acc", o_acc);
  check_o(o_new, fn, "o_new", o_acc);
  check_lse(lse_acc, fn, "lse_acc", o_acc);
  check_lse(lse_new, fn, "lse_new", o_acc);
  const c10::cuda::CUDAGuard guard(o_acc.device());
  run_merge({o_acc, o_new}, {lse_acc, lse_new}, o_acc, lse_acc);
}

// dst (+)= sum(srcs): partial dQ / dK / dV of several devices into one (fp32 accumulation).
void sum_partials(const Tensor& dst, const std::vector<Tensor>& srcs, bool accumulate) {
  const char* fn = "dcp._C_cuda.sum_partials";
  TORCH_CHECK(dst.is_cuda() && dst.is_contiguous(), fn, ": dst must be a contiguous CUDA tensor");
  const CuDType dst_dt = cu_dtype(dst, fn, "dst");
  const c10::cuda::CUDAGuard guard(dst.device());
  size_t next = 0;
  bool acc = accumulate;
  do {
    dcp::cuda::SumCudaParams p;
    p.dst = dst.data_ptr();
    p.dst_dtype = dst_dt;
    p.numel = dst.numel();
    p.accumulate = acc;
    while (next < srcs.size() && p.n < dcp::cuda::kMaxMergeInputs) {
      const Tensor& s = srcs[next];
      TORCH_CHECK(s.device() == dst.device() && s.is_contiguous() && s.numel() == dst.numel(), fn, ": srcs[", next,
                  "] must be a contiguous tensor on ", dst.device(), " with ", dst.numel(), " elements");
      const CuDType dt = cu_dtype(s, fn, "srcs[" + std::to_string(next) + "]");
      TORCH_CHECK(p.n == 0 || dt == p.src_dtype, fn, ": all srcs must share one dtype");
      p.src_dtype = dt;
      p.src[p.n++] = s.data_ptr();
      ++next;
    }
    const cudaError_t err = dcp::cuda::launch_sum(p, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, fn, ": kernel launch failed: ", cudaGetErrorString(err));
    acc = true;
  } while (next < srcs.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dcp CUDA kernels: log-sum-exp merges and partial-gradient sums";
  m.def("merge_partials", &merge_partials, "(o_list, lse_list) -> (o_thd, lse_ht)");
  m.def("merge_into", &merge_into, "(o_acc, lse_acc, o_new, lse_new): in-place two-way merge");
  m.def("sum_partials", &sum_partials, "(dst, srcs, accumulate): dst = (dst if accumulate else 0) + sum(srcs)");
}
