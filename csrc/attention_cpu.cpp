// Driver of the CPU attention kernels: ISA selection, tile-table validation, work lists, dynamic
// scheduling on top of at::parallel_for, and the log-sum-exp merge. No torch tensor types here.
#include "attention_cpu.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "dtype_convert.h"

namespace dcp {
namespace {

bool avx2_supported() {
#if defined(DCP_HAVE_AVX2_KERNELS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

const KernelTable* table_for(const std::string& name) {
  if (name == "generic") return &generic::kernel_table();
#if defined(DCP_HAVE_AVX2_KERNELS)
  if (name == "avx2") return avx2_supported() ? &avx2::kernel_table() : nullptr;
#endif
  if (name == "auto" || name.empty()) {
#if defined(DCP_HAVE_AVX2_KERNELS)
    if (avx2_supported()) return &avx2::kernel_table();
#endif
    return &generic::kernel_table();
  }
  return nullptr;
}

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable& table() {
  const KernelTable* t = g_table.load();
  if (t == nullptr) {
    const char* env = std::getenv("DCP_CPU_ISA");  // "generic" forces the baseline build
    t = table_for(env ? std::string(env) : std::string("auto"));
    if (t == nullptr) t = table_for("auto");
    g_table.store(t);
  }
  return *t;
}

// Run worker(next) on up to get_num_threads() threads; workers pull items from the shared counter.
template <typename F>
void run_parallel(int64_t n_items, const F& worker) {
  if (n_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n_items);
  if (nt <= 1) {
    worker(&next);
    return;
  }
  at::parallel_for(0, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) worker(&next);
  });
}

// q-block x head items, most expensive first (longest-processing-time order for the dynamic queue).
std::vector<QItem> make_q_items(const TileTableView& tt, int64_t hq) {
  std::vector<std::pair<int64_t, QItem>> work;
  for (int64_t s = 0; s < tt.n_seg; ++s) {
    const int64_t q0 = tt.seg_cu[s], q1 = tt.seg_cu[s + 1];
    int64_t keys = 0;
    for (int64_t t = tt.seg_tile_ptr[s]; t < tt.seg_tile_ptr[s + 1]; ++t) keys += tt.tile_k_len[t];
    for (int64_t r = q0; r < q1; r += kBlockQ) {
      const int64_t nq = std::min(kBlockQ, q1 - r);
      for (int64_t h = 0; h < hq; ++h)
        work.push_back({nq * (keys + 8),
                        QItem{static_cast<int32_t>(s), static_cast<int32_t>(r), static_cast<int32_t>(nq),
                              static_cast<int32_t>(h)}});
    }
  }
  std::stable_sort(work.begin(), work.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<QItem> items;
  items.reserve(work.size());
  for (const auto& w : work) items.push_back(w.second);
  return items;
}

struct ChunkIndexData {
  std::vector<int64_t> ptr;
  std::vector<int32_t> tile, tile_seg;
  ChunkIndex view() const {
    return ChunkIndex{ptr.data(), tile.data(), tile_seg.data(), static_cast<int64_t>(ptr.size()) - 1};
  }
};

ChunkIndexData make_chunk_index(const TileTableView& tt, int64_t tk) {
  ChunkIndexData ci;
  const int64_t n_chunks = (tk + kBlockK - 1) / kBlockK;
  ci.tile_seg.assign(static_cast<size_t>(tt.n_tiles), 0);
  for (int64_t s = 0; s < tt.n_seg; ++s)
    for (int64_t t = tt.seg_tile_ptr[s]; t < tt.seg_tile_ptr[s + 1]; ++t) ci.tile_seg[t] = static_cast<int32_t>(s);
  ci.ptr.assign(static_cast<size_t>(n_chunks + 1), 0);
  auto for_chunks = [&](auto&& fn) {
    for (int64_t t = 0; t < tt.n_tiles; ++t) {
      const int64_t s = ci.tile_seg[t];
      if (tt.tile_k_len[t] <= 0 || tt.seg_cu[s + 1] <= tt.seg_cu[s]) continue;
      const int64_t c_lo = tt.tile_k_start[t] / kBlockK;
      const int64_t c_hi = (tt.tile_k_start[t] + tt.tile_k_len[t] - 1) / kBlockK;
      for (int64_t c = c_lo; c <= c_hi; ++c) fn(c, t);
    }
  };
  for_chunks([&](int64_t c, int64_t) { ++ci.ptr[c + 1]; });
  for (int64_t c = 0; c < n_chunks; ++c) ci.ptr[c + 1] += ci.ptr[c];
  ci.tile.assign(static_cast<size_t>(ci.ptr[n_chunks]), 0);
  std::vector<int64_t> fill(ci.ptr.begin(), ci.ptr.end() - 1);
  for_chunks([&](int64_t c, int64_t t) { ci.tile[fill[c]++] = static_cast<int32_t>(t); });
  return ci;
}

std::vector<KvItem> make_kv_items(const TileTableView& tt, const ChunkIndexData& ci, int64_t tk,
                                  int64_t hkv) {
  std::vector<std::pair<int64_t, KvItem>> work;
  const int64_t n_chunks = static_cast<int64_t>(ci.ptr.size()) - 1;
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t c0 = c * kBlockK, c1 = std::min(tk, c0 + kBlockK);
    int64_t cost = 8;
    for (int64_t e = ci.ptr[c]; e < ci.ptr[c + 1]; ++e) {
      const int64_t t = ci.tile[e], s = ci.tile_seg[t];
      const int64_t a = std::max<int64_t>(c0, tt.tile_k_start[t]);
      const int64_t b = std::min<int64_t>(c1, tt.tile_k_start[t] + tt.tile_k_len[t]);
      cost += (b - a) * (tt.seg_cu[s + 1] - tt.seg_cu[s]);
    }
    for (int64_t h = 0; h < hkv; ++h)
      work.push_back({cost, KvItem{static_cast<int32_t>(c), static_cast<int32_t>(h)}});
  }
  std::stable_sort(work.begin(), work.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<KvItem> items;
  items.reserve(work.size());
  for (const auto& w : work) items.push_back(w.second);
  return items;
}

// ---- merge ----
template <typename S, typename TC>
void acc_row(const S* src, TC c, TC* acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += c * load_as<TC>(src[i]);
}

template <typename TC>
void acc_operand(const MergeOperand& op, int64_t t, int64_t h, TC c, TC* acc, int64_t d) {
  const int64_t off = t * op.o_st + h * op.o_sh;
  switch (op.dtype) {
    case DType::kF64: return acc_row(static_cast<const double*>(op.o) + off, c, acc, d);
    case DType::kF32: return acc_row(static_cast<const float*>(op.o) + off, c, acc, d);
    case DType::kBF16: return acc_row(static_cast<const bf16_t*>(op.o) + off, c, acc, d);
    case DType::kF16: return acc_row(static_cast<const fp16_t*>(op.o) + off, c, acc, d);
  }
}

template <typename S, typename TC>
void put_row(S* dst, const TC* acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = StoreAs<S>::cvt(acc[i]);
}

template <typename TC>
void store_operand(const MergeOperand& op, int64_t t, int64_t h, const TC* acc, int64_t d) {
  const int64_t off = t * op.o_st + h * op.o_sh;
  switch (op.dtype) {
    case DType::kF64: return put_row(static_cast<double*>(op.o) + off, acc, d);
    case DType::kF32: return put_row(static_cast<float*>(op.o) + off, acc, d);
    case DType::kBF16: return put_row(static_cast<bf16_t*>(op.o) + off, acc, d);
    case DType::kF16: return put_row(static_cast<fp16_t*>(op.o) + off, acc, d);
  }
}

template <typename TC>
void merge_impl(const MergeParams& p) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, p.h * p.d * p.n));
  at::parallel_for(0, p.t, grain, [&](int64_t t0, int64_t t1) {
    std::vector<TC> acc(static_cast<size_t>(p.d)), w(static_cast<size_t>(p.n));
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < p.h; ++h) {
        float m = ninf;
        for (int64_t i = 0; i < p.n; ++i) {  // NaN-propagating max: a NaN partial poisons the row
          const MergeOperand& in = p.inputs[i];
          const float l = in.lse[h * in.lse_sh + t * in.lse_st];
          m = (l != l || l > m) ? l : m;
          if (m != m) break;
        }
        float* lse_out = p.out.lse + h * p.out.lse_sh + t * p.out.lse_st;
        std::fill(acc.begin(), acc.end(), m != m ? std::numeric_limits<TC>::quiet_NaN() : TC(0));
        if (m == ninf || m != m) {  // every partial is empty (o = 0, lse = -inf), or one is NaN (both NaN)
          store_operand(p.out, t, h, acc.data(), p.d);
          *lse_out = m;
          continue;
        }
        TC sum = 0;
        for (int64_t i = 0; i < p.n; ++i) {
          const MergeOperand& in = p.inputs[i];
          w[i] = std::exp(static_cast<TC>(in.lse[h * in.lse_sh + t * in.lse_st]) - static_cast<TC>(m));
          sum += w[i];
        }
        for (int64_t i = 0; i < p.n; ++i) {  // an empty partial adds nothing; any other adds w * o (NaN too)
          const MergeOperand& in = p.inputs[i];
          if (in.lse[h * in.lse_sh + t * in.lse_st] != ninf) acc_operand(in, t, h, w[i] / sum, acc.data(), p.d);
        }
        store_operand(p.out, t, h, acc.data(), p.d);
        *lse_out = static_cast<float>(static_cast<TC>(m) + std::log(sum));
      }
    }
  });
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
std::string validate_tile_table(const TileTableView& tt, int64_t tq, int64_t tk) {
  std::ostringstream err;
  if (tt.n_seg < 0 || tt.n_tiles < 0 || tt.n_mask_rows < 0 || tt.n_ranges < 0) return "negative tile table sizes";
  if (tt.seg_cu[0] < 0) {
    err << "seg_cu[0] = " << tt.seg_cu[0] << " is negative";
    return err.str();
  }
  if (tt.seg_tile_ptr[0] != 0) {
    err << "seg_tile_ptr[0] must be 0, got " << tt.seg_tile_ptr[0];
    return err.str();
  }
  for (int64_t s = 0; s < tt.n_seg; ++s) {
    if (tt.seg_cu[s + 1] < tt.seg_cu[s]) {
      err << "seg_cu must be non-decreasing: seg_cu[" << s + 1 << "] = " << tt.seg_cu[s + 1] << " < seg_cu[" << s
          << "] = " << tt.seg_cu[s];
      return err.str();
    }
    if (tt.seg_tile_ptr[s + 1] < tt.seg_tile_ptr[s]) {
      err << "seg_tile_ptr must be non-decreasing at segment " << s;
      return err.str();
    }
  }
  if (tt.seg_cu[tt.n_seg] > tq) {
    err << "segments end at q row " << tt.seg_cu[tt.n_seg] << " but q has only Tq = " << tq << " rows";
    return err.str();
  }
  if (tt.seg_tile_ptr[tt.n_seg] != tt.n_tiles) {
    err << "seg_tile_ptr[-1] = " << tt.seg_tile_ptr[tt.n_seg] << " must equal the number of tiles " << tt.n_tiles;
    return err.str();
  }
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (int64_t s = 0; s < tt.n_seg; ++s) {
    const int64_t q_len = tt.seg_cu[s + 1] - tt.seg_cu[s];
    spans.clear();
    for (int64_t t = tt.seg_tile_ptr[s]; t < tt.seg_tile_ptr[s + 1]; ++t) {
      const int64_t k0 = tt.tile_k_start[t], kl = tt.tile_k_len[t], mr = tt.tile_mask_row[t];
      if (k0 < 0 || kl < 0 || k0 + kl > tk) {
        err << "tile " << t << " (segment " << s << "): key range [" << k0 << ", " << k0 + kl
            << ") is not inside [0, Tk = " << tk << ")";
        return err.str();
      }
      if (mr < -1 || (mr >= 0 && mr + q_len > tt.n_mask_rows)) {
        err << "tile " << t << " (segment " << s << "): mask rows [" << mr << ", " << mr + q_len
            << ") are not inside mask_ranges (" << tt.n_mask_rows << " rows); use -1 for a full tile";
        return err.str();
      }
      if (mr >= 0) {
        const int32_t* rg = tt.mask_ranges + mr * tt.n_ranges * 2;
        for (int64_t i = 0; i < q_len * tt.n_ranges; ++i) {
          const int64_t a = rg[2 * i], b = rg[2 * i + 1];
          if (a < 0 || b < a || b > kl) {
            err << "tile " << t << " (segment " << s << "), q row " << i / tt.n_ranges << ": key range (" << a
                << ", " << b << ") must satisfy 0 <= start <= end <= k_len = " << kl;
            return err.str();
          }
        }
      }
      if (kl > 0) spans.push_back({k0, k0 + kl});
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i)
      if (spans[i].first < spans[i - 1].second) {
        err << "segment " << s << ": tiles overlap on keys [" << spans[i].first << ", "
            << std::min(spans[i].second, spans[i - 1].second) << ") (tiles of a segment must be disjoint)";
        return err.str();
      }
  }
  return std::string();
}

void attention_forward_cpu(const FwdParams& p) {
  const KernelTable& kt = table();
  const std::vector<QItem> items = make_q_items(p.tiles, p.shape.hq);
  const int64_t n = static_cast<int64_t>(items.size());
  run_parallel(n, [&](std::atomic<int64_t>* next) { kt.forward(p, items.data(), n, next); });
}

void attention_backward_cpu(const BwdParams& p) {
  const KernelTable& kt = table();
  const std::vector<QItem> q_items = make_q_items(p.tiles, p.shape.hq);
  const int64_t nq = static_cast<int64_t>(q_items.size());
  run_parallel(nq, [&](std::atomic<int64_t>* next) { kt.backward_dq(p, q_items.data(), nq, next); });

  const ChunkIndexData ci = make_chunk_index(p.tiles, p.shape.tk);
  const ChunkIndex civ = ci.view();
  const std::vector<KvItem> kv_items = make_kv_items(p.tiles, ci, p.shape.tk, p.shape.hkv);
  const int64_t nkv = static_cast<int64_t>(kv_items.size());
  run_parallel(nkv, [&](std::atomic<int64_t>* next) { kt.backward_dkv(p, civ, kv_items.data(), nkv, next); });
}

void merge_cpu(const MergeParams& p) {
  if (p.t <= 0 || p.h <= 0) return;
  bool f64 = p.out.dtype == DType::kF64;
  for (int64_t i = 0; i < p.n; ++i) f64 |= p.inputs[i].dtype == DType::kF64;
  if (f64)
    merge_impl<double>(p);
  else
    merge_impl<float>(p);
}

const char* cpu_isa() { return table().name; }

bool set_cpu_isa(const std::string& name) {
  const KernelTable* t = table_for(name);
  if (t == nullptr) return false;
  g_table.store(t);
  return true;
}

std::string available_cpu_isas() {
  std::string out = "generic";
  if (avx2_supported()) out += ",avx2";
  return out;
}

}  // namespace dcp
