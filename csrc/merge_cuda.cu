// CUDA kernels for the log-sum-exp merge of partial attention outputs and for summing partial
// dQ / dK / dV. Plain parameter structs (merge_cuda.h); no torch headers here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "merge_cuda.h"

namespace dcp {
namespace cuda {
namespace {

template <typename TC>
__device__ __forceinline__ TC load_elem(const void* base, CuDType dt, int64_t idx) {
  switch (dt) {
    case CuDType::kF32: return static_cast<TC>(static_cast<const float*>(base)[idx]);
    case CuDType::kBF16: return static_cast<TC>(__bfloat162float(static_cast<const __nv_bfloat16*>(base)[idx]));
    case CuDType::kF16: return static_cast<TC>(__half2float(static_cast<const __half*>(base)[idx]));
    case CuDType::kF64: return static_cast<TC>(static_cast<const double*>(base)[idx]);
  }
  return TC(0);
}

template <typename TC>
__device__ __forceinline__ void store_elem(void* base, CuDType dt, int64_t idx, TC x) {
  switch (dt) {
    case CuDType::kF32: static_cast<float*>(base)[idx] = static_cast<float>(x); break;
    case CuDType::kBF16:
      static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(static_cast<float>(x));
      break;
    case CuDType::kF16: static_cast<__half*>(base)[idx] = __float2half_rn(static_cast<float>(x)); break;
    case CuDType::kF64: static_cast<double*>(base)[idx] = static_cast<double>(x); break;
  }
}

constexpr int kWarpsPerBlock = 4;

// One warp per (t, h) row: every lane computes the (few) weights, lanes split the D dimension.
// All reads of a row happen before its writes, so the output may alias input 0 (in-place merge).
template <typename TC>
__global__ void merge_kernel(const MergeCudaParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.t * p.h) return;
  const int64_t t = row / p.h, h = row % p.h;
  float m = -INFINITY;  // NaN-propagating max (fmaxf drops NaN): a NaN partial poisons the row
  for (int i = 0; i < p.n; ++i) {
    const float l = p.lse[i][h * p.t + t];
    m = (l != l || l > m) ? l : m;
  }
  TC w[kMaxMergeInputs];
  TC sum = 0;
  const bool empty = m == -INFINITY;
  for (int i = 0; i < p.n; ++i) {
    w[i] = empty ? TC(0) : exp(static_cast<TC>(p.lse[i][h * p.t + t]) - static_cast<TC>(m));
    sum += w[i];
  }
  const TC inv = empty ? TC(0) : TC(1) / sum;
  for (int64_t c = lane; c < p.d; c += 32) {
    TC acc = 0;
    for (int i = 0; i < p.n; ++i)  // an empty partial adds nothing; any other adds w * o (NaN included)
      if (p.lse[i][h * p.t + t] != -INFINITY)
        acc += w[i] * inv * load_elem<TC>(p.o[i], p.o_dtype[i], t * p.o_st[i] + h * p.o_sh[i] + c);
    store_elem<TC>(p.out, p.out_dtype, t * p.out_st + h * p.out_sh + c, acc);
  }
  __syncwarp();  // every lane has read lse of this row before lane 0 overwrites it
  if (lane == 0)
    p.out_lse[h * p.t + t] = empty ? -INFINITY : static_cast<float>(static_cast<TC>(m) + log(sum));
}

template <typename TC>
__global__ void sum_kernel(const SumCudaParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.numel; i += stride) {
    TC acc = p.accumulate ? load_elem<TC>(p.dst, p.dst_dtype, i) : TC(0);
    for (int j = 0; j < p.n; ++j) acc += load_elem<TC>(p.src[j], p.src_dtype, i);
    store_elem<TC>(p.dst, p.dst_dtype, i, acc);
  }
}

}  // namespace

cudaError_t launch_merge(const MergeCudaParams& p, cudaStream_t stream) {
  if (p.n < 1 || p.n > kMaxMergeInputs) return cudaErrorInvalidValue;
  const int64_t rows = p.t * p.h;
  if (rows == 0) return cudaSuccess;
  bool f64 = p.out_dtype == CuDType::kF64;
  for (int i = 0; i < p.n; ++i) f64 = f64 || p.o_dtype[i] == CuDType::kF64;
  const dim3 grid(static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(32 * kWarpsPerBlock);
  if (f64)
    merge_kernel<double><<<grid, block, 0, stream>>>(p);
  else
    merge_kernel<float><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_sum(const SumCudaParams& p, cudaStream_t stream) {
  if (p.n < 0 || p.n > kMaxMergeInputs) return cudaErrorInvalidValue;
  if (p.numel == 0) return cudaSuccess;
  const int threads = 256;
  const int64_t blocks64 = (p.numel + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(blocks64 < 65535 ? blocks64 : 65535);
  if (p.dst_dtype == CuDType::kF64 || p.src_dtype == CuDType::kF64)
    sum_kernel<double><<<blocks, threads, 0, stream>>>(p);
  else
    sum_kernel<float><<<blocks, threads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace dcp
