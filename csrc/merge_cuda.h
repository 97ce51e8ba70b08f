// Plain (torch-free) parameter structs of the CUDA merge kernels in merge_cuda.cu.
//
// Layouts: o [T, H, D] with unit stride along D (strides along T and H given), lse [H, T] float32
// contiguous. All pointers are device pointers on the current device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dcp {
namespace cuda {

constexpr int kMaxMergeInputs = 16;

enum class CuDType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

// n-way log-sum-exp merge: lse = m + log(sum_i exp(lse_i - m)), o = sum_i exp(lse_i - lse) o_i.
// Rows where every lse_i is -inf get o = 0, lse = -inf. `out` / `out_lse` may alias input 0.
struct MergeCudaParams {
  int32_t n = 0;
  const void* o[kMaxMergeInputs] = {};
  CuDType o_dtype[kMaxMergeInputs] = {};
  int64_t o_st[kMaxMergeInputs] = {};
  int64_t o_sh[kMaxMergeInputs] = {};
  const float* lse[kMaxMergeInputs] = {};
  void* out = nullptr;
  CuDType out_dtype = CuDType::kF32;
  int64_t out_st = 0, out_sh = 0;
  float* out_lse = nullptr;
  int64_t t = 0, h = 0, d = 0;
};

// dst[i] = (accumulate ? dst[i] : 0) + sum_j src_j[i] for i < numel (contiguous buffers), summed in
// fp32 (fp64 when dst is fp64): used to add partial dQ / dK / dV from several devices.
struct SumCudaParams {
  int32_t n = 0;
  const void* src[kMaxMergeInputs] = {};
  CuDType src_dtype = CuDType::kF32;
  void* dst = nullptr;
  CuDType dst_dtype = CuDType::kF32;
  int64_t numel = 0;
  bool accumulate = false;
};

cudaError_t launch_merge(const MergeCudaParams& p, cudaStream_t stream);
cudaError_t launch_sum(const SumCudaParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace dcp
