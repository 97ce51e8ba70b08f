// Argument checks shared by the Python entry points of dcp._C: one clear message per condition.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <vector>

namespace dcp {

inline void check_cpu(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.defined(), fn, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor, got device ", t.device());
}

// 1-D contiguous CPU tensor of `n` elements and dtype `dt`.
inline void check_vec(const at::Tensor& t, const char* fn, const char* name, int64_t n, at::ScalarType dt) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == dt, fn, ": ", name, " must have dtype ", dt, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, fn, ": ", name, " must have shape [", n, "], got ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous");
}

// [rows, width] int64 contiguous CPU tensor.
inline void check_mat(const at::Tensor& t, const char* fn, const char* name, int64_t rows) {
  check_cpu(t, fn, name);
  TORCH_CHECK(t.scalar_type() == at::kLong, fn, ": ", name, " must have dtype int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, fn, ": ", name, " must have shape [", rows, ", width], got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous");
}

// A copy of `v` as a 1-D int64 tensor.
inline at::Tensor to_tensor(const std::vector<int64_t>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(v.begin(), v.end(), t.data_ptr<int64_t>());
  return t;
}

// A copy of `v` as a 1-D float64 tensor.
inline at::Tensor to_tensor(const std::vector<double>& v) {
  at::Tensor t = at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(v.begin(), v.end(), t.data_ptr<double>());
  return t;
}

void register_planner(pybind11::module_& m);  // bindings_planner.cpp

}  // namespace dcp
