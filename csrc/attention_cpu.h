// Plain (torch-free) parameter structs and entry points of the blockwise CPU attention kernels.
//
// Layouts: q/k/v/o/do/dq/dk/dv are [T, H, D] with unit stride along D (strides along T and H are free);
// lse/delta are [H, T] float32 (free strides). The tile table is described in dcp/kernels/tiles.py.
// Everything below bindings.cpp sees only these structs: no torch types.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DCP_HAVE_AVX2_KERNELS 1
#endif

namespace dcp {

enum class DType : int32_t { kF64 = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

// Blocking constants shared by every ISA variant.
constexpr int64_t kBlockQ = 96;   // q rows per block (multiple of kMR and of every NR)
constexpr int64_t kBlockK = 96;   // keys per block; also the key-chunk size of the dK/dV pass
constexpr int64_t kMR = 6;        // micro-kernel rows

struct TileTableView {
  const int32_t* seg_cu = nullptr;        // [n_seg + 1] q segment boundaries (non-decreasing)
  const int32_t* seg_tile_ptr = nullptr;  // [n_seg + 1] CSR into the tile arrays
  const int32_t* tile_k_start = nullptr;  // [n_tiles]
  const int32_t* tile_k_len = nullptr;    // [n_tiles]
  const int32_t* tile_mask_row = nullptr; // [n_tiles] -1 = full tile, else first row in mask_ranges
  const int32_t* mask_ranges = nullptr;   // [n_mask_rows, n_ranges, 2] key ranges relative to k_start
  int64_t n_seg = 0, n_tiles = 0, n_mask_rows = 0, n_ranges = 0;
};

struct Tensor3View {  // [T, H, D], stride 1 along D
  void* data = nullptr;
  int64_t stride_t = 0, stride_h = 0;
};

struct Tensor2View {  // [H, T] float32
  float* data = nullptr;
  int64_t stride_h = 0, stride_t = 0;
};

struct AttnShape {
  int64_t tq = 0, tk = 0, hq = 0, hkv = 0, d = 0;
};

struct FwdParams {
  DType dtype = DType::kF32;  // of q, k, v and o
  AttnShape shape;
  Tensor3View q, k, v, o;
  Tensor2View lse;  // output
  double scale = 1.0;
  TileTableView tiles;
};

struct BwdParams {
  DType dtype = DType::kF32;       // of do, q, k, v
  DType grad_dtype = DType::kF32;  // of dq, dk, dv (== dtype or kF32)
  AttnShape shape;
  Tensor3View dout, q, k, v, dq, dk, dv;
  Tensor2View lse, delta;  // inputs: final lse and rowsum(dO * O) per head
  double scale = 1.0;
  TileTableView tiles;
};

// One unit of the forward / dQ passes: q rows [row0, row0 + nrows) of segment seg, query head head.
struct QItem {
  int32_t seg, row0, nrows, head;
};
// One unit of the dK/dV pass: keys [chunk * kBlockK, ...) of kv head kv_head.
struct KvItem {
  int32_t chunk, kv_head;
};
// Tiles overlapping each key chunk (CSR, tiles in increasing order).
struct ChunkIndex {
  const int64_t* ptr = nullptr;  // [n_chunks + 1]
  const int32_t* tile = nullptr;
  const int32_t* tile_seg = nullptr;  // [n_tiles] segment owning each tile
  int64_t n_chunks = 0;
};

// Workers pull item indices from `next` until exhausted (dynamic scheduling; results do not depend on
// which thread ran what).
struct KernelTable {
  const char* name;
  void (*forward)(const FwdParams&, const QItem*, int64_t, std::atomic<int64_t>*);
  void (*backward_dq)(const BwdParams&, const QItem*, int64_t, std::atomic<int64_t>*);
  void (*backward_dkv)(const BwdParams&, const ChunkIndex&, const KvItem*, int64_t,
                       std::atomic<int64_t>*);
};

namespace generic { const KernelTable& kernel_table(); }
#if defined(DCP_HAVE_AVX2_KERNELS)
namespace avx2 { const KernelTable& kernel_table(); }
#endif

struct MergeOperand {  // one partial result: o [T, H, D] of dtype, lse [H, T]
  DType dtype = DType::kF32;
  void* o = nullptr;
  int64_t o_st = 0, o_sh = 0;
  float* lse = nullptr;
  int64_t lse_sh = 0, lse_st = 0;
};

struct MergeParams {
  int64_t t = 0, h = 0, d = 0;
  int64_t n = 0;
  const MergeOperand* inputs = nullptr;  // [n]
  MergeOperand out;                      // may alias inputs[0] (in-place merge)
};

// ---- entry points (attention_cpu.cpp); inputs must already be validated ----
std::string validate_tile_table(const TileTableView& tiles, int64_t tq, int64_t tk);
void attention_forward_cpu(const FwdParams& p);
void attention_backward_cpu(const BwdParams& p);
void merge_cpu(const MergeParams& p);

const char* cpu_isa();
bool set_cpu_isa(const std::string& name);  // "generic", "avx2" or "auto"; false if unavailable
std::string available_cpu_isas();            // comma separated

}  // namespace dcp
