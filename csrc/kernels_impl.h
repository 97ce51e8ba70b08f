// Blockwise attention kernels, compiled once per ISA (kernels_generic.cpp, kernels_avx2.cpp).
//
// The including file defines DCP_ISA_NS (namespace) and DCP_VEC_BYTES (16 or 32), includes every
// standard header this file needs *before* any `#pragma GCC target`, and then includes this file, so
// that nothing with external linkage is compiled for the wider ISA: all code below sits in an anonymous
// namespace except DCP_ISA_NS::kernel_table().
//
// Scheme (per q block of kBlockQ rows x key block of kBlockK keys), all in fp32 (fp64 for fp64 inputs):
//   forward  : S^T = K Q^T (Q pre-scaled), mask, online softmax over columns, O += P V.
//   dQ pass  : S^T, P^T = exp(S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta), dQ += dS K.
//   dKV pass : per key chunk (kBlockK keys) and kv head, over every (segment, tile) touching the chunk:
//              S = Q K^T, P = exp(S - lse), dP = dO V^T, dS = P (dP - delta), dV += P^T dO, dK += dS^T Q.
//              Each chunk owns its dK/dV rows: no races, no atomics, deterministic results.
// The GEMMs use one register-blocked micro-kernel (kMR x NR, NR = two vectors) written with GCC vector
// extensions; the compiler maps it to SSE2 or AVX2+FMA.
#ifndef DCP_ISA_NS
#error "define DCP_ISA_NS and DCP_VEC_BYTES before including kernels_impl.h"
#endif

namespace dcp {
namespace DCP_ISA_NS {
namespace {

typedef float vf_t __attribute__((vector_size(DCP_VEC_BYTES)));
typedef double vd_t __attribute__((vector_size(DCP_VEC_BYTES)));
typedef int32_t vi_t __attribute__((vector_size(DCP_VEC_BYTES)));

template <typename T>
struct VT;
template <>
struct VT<float> {
  typedef vf_t V;
  static constexpr int64_t W = DCP_VEC_BYTES / 4;
};
template <>
struct VT<double> {
  typedef vd_t V;
  static constexpr int64_t W = DCP_VEC_BYTES / 8;
};

constexpr int64_t BQ = kBlockQ;
constexpr int64_t BK = kBlockK;
constexpr int64_t MR = kMR;
static_assert(BQ % MR == 0 && BK % MR == 0, "blocks must be multiples of the micro-kernel rows");
static_assert(BQ % (2 * (DCP_VEC_BYTES / 4)) == 0, "BQ must be a multiple of the float NR");

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
constexpr int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

template <typename V, typename T>
inline V ldu(const T* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V, typename T>
inline void stu(T* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}
template <typename V, typename T>
inline V splat(T x) {
  return V{} + x;
}

// exp for a float vector: Cephes-style range reduction + degree-6 polynomial (~1 ulp), exactly 0 for
// x < -87.33 (including -inf), NaN propagates.
inline vf_t vexp(vf_t x) {
  const vf_t lo = splat<vf_t>(-87.3365447f);
  const vf_t hi = splat<vf_t>(88.0f);
  const vi_t under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf_t n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf_t r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const vf_t r2 = r * r;
  vf_t p = splat<vf_t>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r2 + r + 1.0f;
  const vi_t ni = __builtin_convertvector(n, vi_t);
  const vf_t pow2n = (vf_t)((ni + 127) << 23);
  const vf_t res = p * pow2n;
  return under ? vf_t{} : res;
}

inline vd_t vexp(vd_t x) {
  vd_t r;
  for (int64_t l = 0; l < VT<double>::W; ++l) r[l] = std::exp(x[l]);
  return r;
}

template <typename V>
inline V vmax(V a, V b) {
  return a > b ? a : b;
}

// ---------------------------------------------------------------------------------------------------
// GEMM: C[M][N] (+)= A[M][K] * B[K][N], M % MR == 0, N % NR == 0. A(i, k) is A[i*lda + k], or
// A[k*lda + i] when A_T. B rows are NR-contiguous (ldb stride). C row-major (ldc).
// ---------------------------------------------------------------------------------------------------
template <typename T, bool A_T, bool ACC>
inline __attribute__((always_inline)) void micro_kernel(int64_t K, const T* __restrict A, int64_t lda,
                                                        const T* __restrict B, int64_t ldb,
                                                        T* __restrict C, int64_t ldc) {
  typedef typename VT<T>::V V;
  constexpr int64_t W = VT<T>::W;
  V c[MR][2];
#pragma GCC unroll 8
  for (int64_t i = 0; i < MR; ++i) {
    c[i][0] = V{};
    c[i][1] = V{};
  }
  for (int64_t k = 0; k < K; ++k) {
    const V b0 = ldu<V>(B + k * ldb);
    const V b1 = ldu<V>(B + k * ldb + W);
#pragma GCC unroll 8
    for (int64_t i = 0; i < MR; ++i) {
      const T a = A_T ? A[k * lda + i] : A[i * lda + k];
      c[i][0] += a * b0;
      c[i][1] += a * b1;
    }
  }
#pragma GCC unroll 8
  for (int64_t i = 0; i < MR; ++i) {
    T* crow = C + i * ldc;
    if (ACC) {
      stu(crow, ldu<V>(crow) + c[i][0]);
      stu(crow + W, ldu<V>(crow + W) + c[i][1]);
    } else {
      stu(crow, c[i][0]);
      stu(crow + W, c[i][1]);
    }
  }
}

template <typename T, bool A_T, bool ACC>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
          int64_t ldc) {
  constexpr int64_t NR = 2 * VT<T>::W;
  for (int64_t j0 = 0; j0 < N; j0 += NR) {
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const T* a = A_T ? A + i0 : A + i0 * lda;
      micro_kernel<T, A_T, ACC>(K, a, lda, B + j0, ldb, C + i0 * ldc + j0, ldc);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// packing (storage type S -> compute type T)
// ---------------------------------------------------------------------------------------------------
// dst[r][c] = mult * src(row r)[c] for r < nrows, c < D; zero in columns [D, ldd) and rows [nrows, rows_pad).
template <typename S, typename T>
void pack_rows(const S* src, int64_t row_stride, int64_t nrows, int64_t D, T mult, T* dst, int64_t ldd,
               int64_t rows_pad) {
  for (int64_t r = 0; r < nrows; ++r) {
    const S* s = src + r * row_stride;
    T* d = dst + r * ldd;
    for (int64_t c = 0; c < D; ++c) d[c] = load_as<T>(s[c]) * mult;
    for (int64_t c = D; c < ldd; ++c) d[c] = T(0);
  }
  for (int64_t r = nrows; r < rows_pad; ++r)
    for (int64_t c = 0; c < ldd; ++c) dst[r * ldd + c] = T(0);
}

// dst[c][r] = mult * src(row r)[c] (transpose) for r < nrows; zero in columns [nrows, ldd).
template <typename S, typename T>
void pack_cols(const S* src, int64_t row_stride, int64_t nrows, int64_t D, T mult, T* dst, int64_t ldd) {
  for (int64_t r = 0; r < nrows; ++r) {
    const S* s = src + r * row_stride;
    for (int64_t c = 0; c < D; ++c) dst[c * ldd + r] = load_as<T>(s[c]) * mult;
  }
  for (int64_t c = 0; c < D; ++c)
    for (int64_t r = nrows; r < ldd; ++r) dst[c * ldd + r] = T(0);
}

template <typename S, typename T>
void store_row(S* dst, const T* src, int64_t D, T mult) {
  for (int64_t c = 0; c < D; ++c) dst[c] = StoreAs<S>::cvt(src[c] * mult);
}

template <typename T>
struct Scratch {  // one aligned arena per worker thread
  T* base = nullptr;
  int64_t used = 0;
  explicit Scratch(int64_t n) {
    const size_t bytes = static_cast<size_t>(round_up(n * static_cast<int64_t>(sizeof(T)) + 64 * 16, 64));
    base = static_cast<T*>(std::aligned_alloc(64, bytes));
    if (base == nullptr) throw std::bad_alloc();
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* take(int64_t n) {
    T* p = base + used;
    used += round_up(n, static_cast<int64_t>(64 / sizeof(T)));
    return p;
  }
};
template <typename T>
constexpr int64_t slot(int64_t n) {
  return round_up(n, static_cast<int64_t>(64 / sizeof(T)));
}

#include "kernels_mask.h"  // block_mask, apply_mask, the non-finite side path

// P^T = exp(S^T - lse) in place for rows [j0, j1) (lse per column, +inf for dead columns).
template <typename T>
void exp_minus_lse(T* st, const T* lse, int64_t j0, int64_t j1) {
  typedef typename VT<T>::V V;
  constexpr int64_t W = VT<T>::W, NV = BQ / W;
  V l[NV];
  for (int64_t v = 0; v < NV; ++v) l[v] = ldu<V>(lse + v * W);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t v = 0; v < NV; ++v) {
      T* p = st + j * BQ + v * W;
      stu(p, vexp(ldu<V>(p) - l[v]));
    }
}

// dS^T = P^T * (dP^T - delta) into dpt, rows [j0, j1).
template <typename T>
void ds_from_p(const T* pt, T* dpt, const T* delta, int64_t j0, int64_t j1) {
  typedef typename VT<T>::V V;
  constexpr int64_t W = VT<T>::W, NV = BQ / W;
  V dl[NV];
  for (int64_t v = 0; v < NV; ++v) dl[v] = ldu<V>(delta + v * W);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t v = 0; v < NV; ++v) {
      T* d = dpt + j * BQ + v * W;
      stu(d, ldu<V>(pt + j * BQ + v * W) * (ldu<V>(d) - dl[v]));
    }
}

// Load lse/delta of rows [row0, row0 + nq) of head h; dead rows (lse = -inf) and padding get
// lse = +inf (so P = 0) and delta = 0.
template <typename T>
void load_row_stats(const BwdParams& p, int64_t h, int64_t row0, int64_t nq, T* lse, T* delta) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < BQ; ++i) {
    lse[i] = inf;
    delta[i] = T(0);
  }
  for (int64_t i = 0; i < nq; ++i) {
    const float l = p.lse.data[h * p.lse.stride_h + (row0 + i) * p.lse.stride_t];
    if (l == -std::numeric_limits<float>::infinity()) continue;
    lse[i] = static_cast<T>(l);
    delta[i] = static_cast<T>(p.delta.data[h * p.delta.stride_h + (row0 + i) * p.delta.stride_t]);
  }
}

// ---------------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------------
template <typename S, typename T>
void forward_worker(const FwdParams& p, const QItem* items, int64_t n_items, std::atomic<int64_t>* next) {
  typedef typename VT<T>::V V;
  constexpr int64_t W = VT<T>::W, NV = BQ / W, NR = 2 * W;
  const TileTableView& tt = p.tiles;
  const int64_t D = p.shape.d, Dp = round_up(D, NR), G = p.shape.hq / p.shape.hkv;
  const T scale = static_cast<T>(p.scale);
  const T ninf = -std::numeric_limits<T>::infinity();
  Scratch<T> arena(slot<T>(D * BQ) + 3 * slot<T>(BK * Dp) + 2 * slot<T>(BK * BQ) + slot<T>(BQ * Dp) +
                   4 * slot<T>(BQ));
  T* qt = arena.take(D * BQ);
  T* kb = arena.take(BK * Dp);
  T* vb = arena.take(BK * Dp);
  T* saved = arena.take(BK * Dp);  // value rows with a non-finite entry (kernels_mask.h)
  int64_t bad[BK];
  T* st = arena.take(BK * BQ);
  T* bias = arena.take(BK * BQ);
  T* acc = arena.take(BQ * Dp);
  T* m = arena.take(BQ);
  T* l = arena.take(BQ);
  T* alpha = arena.take(BQ);
  const S* q = static_cast<const S*>(p.q.data);
  const S* k = static_cast<const S*>(p.k.data);
  const S* v = static_cast<const S*>(p.v.data);
  S* o = static_cast<S*>(p.o.data);

  for (;;) {
    const int64_t it = next->fetch_add(1, std::memory_order_relaxed);
    if (it >= n_items) break;
    const QItem item = items[it];
    const int64_t seg = item.seg, row0 = item.row0, nq = item.nrows, h = item.head, hk = h / G;
    const int64_t srow0 = row0 - tt.seg_cu[seg];
    pack_cols(q + row0 * p.q.stride_t + h * p.q.stride_h, p.q.stride_t, nq, D, scale, qt, BQ);
    for (int64_t i = 0; i < BQ; ++i) {
      m[i] = ninf;
      l[i] = T(0);
    }
    for (int64_t i = 0; i < BQ * Dp; ++i) acc[i] = T(0);

    for (int64_t t = tt.seg_tile_ptr[seg]; t < tt.seg_tile_ptr[seg + 1]; ++t) {
      const int64_t k_start = tt.tile_k_start[t], k_len = tt.tile_k_len[t];
      for (int64_t kb0 = 0; kb0 < k_len; kb0 += BK) {
        const int64_t bk = imin(BK, k_len - kb0), bkp = round_up(bk, MR);
        const int mk = block_mask(tt, t, srow0, nq, kb0, bk, bias, 0);
        if (mk == kEmpty) continue;
        const int64_t key0 = k_start + kb0;
        pack_rows(k + key0 * p.k.stride_t + hk * p.k.stride_h, p.k.stride_t, bk, D, T(1), kb, Dp, bkp);
        pack_rows(v + key0 * p.v.stride_t + hk * p.v.stride_h, p.v.stride_t, bk, D, T(1), vb, Dp, bk);
        gemm<T, false, false>(bkp, BQ, D, kb, Dp, qt, BQ, st, BQ);  // S^T [bkp][BQ]
        if (mk == kPartial) apply_mask<false>(st, bias, 0, bk);

        // online softmax over the columns of S^T
        V mb[NV], mu[NV], ls[NV];
        for (int64_t u = 0; u < NV; ++u) mb[u] = splat<V>(ninf);
        for (int64_t j = 0; j < bk; ++j)
          for (int64_t u = 0; u < NV; ++u) mb[u] = vmax(mb[u], ldu<V>(st + j * BQ + u * W));
        for (int64_t u = 0; u < NV; ++u) {
          const V mo = ldu<V>(m + u * W);
          const V mn = vmax(mo, mb[u]);
          mu[u] = mn == splat<V>(ninf) ? V{} : mn;
          stu(alpha + u * W, vexp(mo - mu[u]));
          stu(m + u * W, mn);
          ls[u] = V{};
        }
        for (int64_t j = 0; j < bk; ++j)
          for (int64_t u = 0; u < NV; ++u) {
            T* s = st + j * BQ + u * W;
            const V e = vexp(ldu<V>(s) - mu[u]);
            stu(s, e);
            ls[u] += e;
          }
        for (int64_t u = 0; u < NV; ++u)
          stu(l + u * W, ldu<V>(l + u * W) * ldu<V>(alpha + u * W) + ls[u]);
        for (int64_t i = 0; i < nq; ++i) {
          const T a = alpha[i];
          if (a == T(1)) continue;
          T* row = acc + i * Dp;
          for (int64_t c = 0; c < Dp; ++c) row[c] *= a;
        }
        const int64_t nbad = mk == kPartial ? take_nonfinite_rows(vb, Dp, bk, D, saved, bad) : 0;
        gemm<T, true, true>(BQ, Dp, bk, st, BQ, vb, Dp, acc, Dp);  // O += P V
        if (nbad) add_saved_keys(acc, Dp, st, bias, saved, bad, nbad, nq, D);
      }
    }
    for (int64_t i = 0; i < nq; ++i) {
      S* orow = o + (row0 + i) * p.o.stride_t + h * p.o.stride_h;
      float* lse = p.lse.data + h * p.lse.stride_h + (row0 + i) * p.lse.stride_t;
      if (l[i] != T(0)) {  // a key was attended (l is NaN when a NaN reached the row: o and lse stay NaN)
        store_row(orow, acc + i * Dp, D, T(1) / l[i]);
        *lse = static_cast<float>(m[i] + std::log(l[i]));
      } else {
        for (int64_t c = 0; c < D; ++c) orow[c] = StoreAs<S>::cvt(T(0));
        *lse = -std::numeric_limits<float>::infinity();
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// backward, pass 1: dQ (one worker item = q block x query head)
// ---------------------------------------------------------------------------------------------------
template <typename S, typename G_, typename T>
void backward_dq_worker(const BwdParams& p, const QItem* items, int64_t n_items, std::atomic<int64_t>* next) {
  constexpr int64_t NR = 2 * VT<T>::W;
  const TileTableView& tt = p.tiles;
  const int64_t D = p.shape.d, Dp = round_up(D, NR), G = p.shape.hq / p.shape.hkv;
  const T scale = static_cast<T>(p.scale);
  Scratch<T> arena(2 * slot<T>(D * BQ) + 3 * slot<T>(BK * Dp) + 3 * slot<T>(BK * BQ) + slot<T>(BQ * Dp) +
                   2 * slot<T>(BQ));
  T* qt = arena.take(D * BQ);
  T* dot = arena.take(D * BQ);
  T* kb = arena.take(BK * Dp);
  T* vb = arena.take(BK * Dp);
  T* saved = arena.take(BK * Dp);  // key rows with a non-finite entry (kernels_mask.h)
  int64_t bad[BK];
  T* st = arena.take(BK * BQ);
  T* dpt = arena.take(BK * BQ);
  T* bias = arena.take(BK * BQ);
  T* dq = arena.take(BQ * Dp);
  T* lse = arena.take(BQ);
  T* delta = arena.take(BQ);
  const S* q = static_cast<const S*>(p.q.data);
  const S* k = static_cast<const S*>(p.k.data);
  const S* v = static_cast<const S*>(p.v.data);
  const S* dout = static_cast<const S*>(p.dout.data);
  G_* dq_out = static_cast<G_*>(p.dq.data);

  for (;;) {
    const int64_t it = next->fetch_add(1, std::memory_order_relaxed);
    if (it >= n_items) break;
    const QItem item = items[it];
    const int64_t seg = item.seg, row0 = item.row0, nq = item.nrows, h = item.head, hk = h / G;
    const int64_t srow0 = row0 - tt.seg_cu[seg];
    pack_cols(q + row0 * p.q.stride_t + h * p.q.stride_h, p.q.stride_t, nq, D, scale, qt, BQ);
    pack_cols(dout + row0 * p.dout.stride_t + h * p.dout.stride_h, p.dout.stride_t, nq, D, T(1), dot, BQ);
    load_row_stats(p, h, row0, nq, lse, delta);
    for (int64_t i = 0; i < BQ * Dp; ++i) dq[i] = T(0);

    for (int64_t t = tt.seg_tile_ptr[seg]; t < tt.seg_tile_ptr[seg + 1]; ++t) {
      const int64_t k_start = tt.tile_k_start[t], k_len = tt.tile_k_len[t];
      for (int64_t kb0 = 0; kb0 < k_len; kb0 += BK) {
        const int64_t bk = imin(BK, k_len - kb0), bkp = round_up(bk, MR);
        const int mk = block_mask(tt, t, srow0, nq, kb0, bk, bias, 0);
        if (mk == kEmpty) continue;
        const int64_t key0 = k_start + kb0;
        pack_rows(k + key0 * p.k.stride_t + hk * p.k.stride_h, p.k.stride_t, bk, D, T(1), kb, Dp, bkp);
        pack_rows(v + key0 * p.v.stride_t + hk * p.v.stride_h, p.v.stride_t, bk, D, T(1), vb, Dp, bkp);
        gemm<T, false, false>(bkp, BQ, D, kb, Dp, qt, BQ, st, BQ);
        if (mk == kPartial) apply_mask<false>(st, bias, 0, bk);
        exp_minus_lse(st, lse, 0, bk);
        gemm<T, false, false>(bkp, BQ, D, vb, Dp, dot, BQ, dpt, BQ);  // dP^T = V dO^T
        ds_from_p(st, dpt, delta, 0, bk);
        int64_t nbad = 0;
        if (mk == kPartial) {
          apply_mask<true>(dpt, bias, 0, bk);
          nbad = take_nonfinite_rows(kb, Dp, bk, D, saved, bad);
        }
        gemm<T, true, true>(BQ, Dp, bk, dpt, BQ, kb, Dp, dq, Dp);  // dQ += dS K
        if (nbad) add_saved_keys(dq, Dp, dpt, bias, saved, bad, nbad, nq, D);
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      store_row(dq_out + (row0 + i) * p.dq.stride_t + h * p.dq.stride_h, dq + i * Dp, D, scale);
  }
}

// ---------------------------------------------------------------------------------------------------
// backward, pass 2: dK, dV (one worker item = key chunk x kv head). Works on S = Q K^T (rows = q, columns
// = keys of the chunk) so that K^T / V^T of the chunk are packed once per item and Q / dO only need
// row-major copies; Q is pre-scaled so that dK = dS^T (scale Q) needs no final scaling.
// ---------------------------------------------------------------------------------------------------
template <typename S, typename G_, typename T>
void backward_dkv_worker(const BwdParams& p, const ChunkIndex& ci, const KvItem* items, int64_t n_items,
                         std::atomic<int64_t>* next) {
  typedef typename VT<T>::V V;
  constexpr int64_t W = VT<T>::W, NR = 2 * W;
  constexpr int64_t LD = BK + NR;  // key columns of S / dP / K^T / V^T (room for NR-aligned spans)
  const TileTableView& tt = p.tiles;
  const int64_t D = p.shape.d, Dp = round_up(D, NR), G = p.shape.hq / p.shape.hkv;
  const T scale = static_cast<T>(p.scale);
  Scratch<T> arena(2 * slot<T>(D * LD) + 4 * slot<T>(BQ * Dp) + 2 * slot<T>(BK * Dp) + 3 * slot<T>(BQ * LD) +
                   2 * slot<T>(BQ));
  T* kt = arena.take(D * LD);
  T* vt = arena.take(D * LD);
  T* qr = arena.take(BQ * Dp);
  T* dor = arena.take(BQ * Dp);
  T* saved_q = arena.take(BQ * Dp);  // q / dO rows with a non-finite entry (kernels_mask.h)
  T* saved_do = arena.take(BQ * Dp);
  int64_t bad_q[BQ], bad_do[BQ];
  T* dk = arena.take(BK * Dp);
  T* dv = arena.take(BK * Dp);
  T* sm = arena.take(BQ * LD);
  T* dp = arena.take(BQ * LD);
  T* bias = arena.take(BQ * LD);
  T* lse = arena.take(BQ);
  T* delta = arena.take(BQ);
  const S* q = static_cast<const S*>(p.q.data);
  const S* k = static_cast<const S*>(p.k.data);
  const S* v = static_cast<const S*>(p.v.data);
  const S* dout = static_cast<const S*>(p.dout.data);
  G_* dk_out = static_cast<G_*>(p.dk.data);
  G_* dv_out = static_cast<G_*>(p.dv.data);

  for (;;) {
    const int64_t it = next->fetch_add(1, std::memory_order_relaxed);
    if (it >= n_items) break;
    const KvItem item = items[it];
    const int64_t c0 = static_cast<int64_t>(item.chunk) * BK, hk = item.kv_head;
    const int64_t cl = imin(BK, p.shape.tk - c0);
    for (int64_t i = 0; i < BK * Dp; ++i) dk[i] = dv[i] = T(0);
    const int64_t e0 = ci.ptr[item.chunk], e1 = ci.ptr[item.chunk + 1];
    if (e1 > e0) {
      pack_cols(k + c0 * p.k.stride_t + hk * p.k.stride_h, p.k.stride_t, cl, D, T(1), kt, LD);
      pack_cols(v + c0 * p.v.stride_t + hk * p.v.stride_h, p.v.stride_t, cl, D, T(1), vt, LD);
    }
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t t = ci.tile[e], seg = ci.tile_seg[t];
      const int64_t k_start = tt.tile_k_start[t], k_end = k_start + tt.tile_k_len[t];
      const int64_t a = imax(k_start, c0), b = imin(k_end, c0 + cl);
      if (b <= a) continue;
      // keys [ja, jb) of the chunk belong to this tile; GEMM rows of dK/dV [jlo, jhi) (MR-aligned), GEMM
      // columns of S [jlo, chi) (a multiple of NR wide); P and dS are zero outside [ja, jb).
      const int64_t ja = a - c0, jb = b - c0, jlo = ja / MR * MR, jhi = round_up(jb, MR);
      const int64_t chi = jlo + round_up(jhi - jlo, NR);
      const int64_t kb0 = a - k_start, bk = b - a;
      const int64_t q0 = tt.seg_cu[seg], qlen = tt.seg_cu[seg + 1] - q0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        for (int64_t qi0 = 0; qi0 < qlen; qi0 += BQ) {
          const int64_t nq = imin(BQ, qlen - qi0), row0 = q0 + qi0;
          const int mk = block_mask(tt, t, qi0, nq, kb0, bk, bias, ja, 1, LD);
          if (mk == kEmpty) continue;
          pack_rows(q + row0 * p.q.stride_t + h * p.q.stride_h, p.q.stride_t, nq, D, scale, qr, Dp, BQ);
          pack_rows(dout + row0 * p.dout.stride_t + h * p.dout.stride_h, p.dout.stride_t, nq, D, T(1), dor, Dp,
                    BQ);
          load_row_stats(p, h, row0, nq, lse, delta);
          gemm<T, false, false>(BQ, chi - jlo, D, qr, Dp, kt + jlo, LD, sm + jlo, LD);   // S
          gemm<T, false, false>(BQ, chi - jlo, D, dor, Dp, vt + jlo, LD, dp + jlo, LD);  // dP = dO V^T
          for (int64_t i = 0; i < BQ; ++i) {
            T* srow = sm + i * LD;
            T* drow = dp + i * LD;
            const T* brow = bias + i * LD;
            if (mk == kPartial)  // overwrite, so that a masked pair's NaN score does not survive
              for (int64_t j = ja; j < jb; ++j) srow[j] = brow[j] < T(0) ? brow[j] : srow[j];
            const V lv = splat<V>(lse[i]), dl = splat<V>(delta[i]);
            for (int64_t j = jlo; j < chi; j += W) {
              const V pv = vexp(ldu<V>(srow + j) - lv);
              stu(srow + j, pv);
              stu(drow + j, pv * (ldu<V>(drow + j) - dl));
            }
            if (mk == kPartial)  // masked pairs weigh 0, whatever NaN the row statistics brought
              for (int64_t j = ja; j < jb; ++j)
                if (brow[j] < T(0)) srow[j] = drow[j] = T(0);
            for (int64_t j = jlo; j < ja; ++j) srow[j] = drow[j] = T(0);  // keys outside this tile
            for (int64_t j = jb; j < chi; ++j) srow[j] = drow[j] = T(0);
          }
          // rows whose weights are zero for some key of the GEMM span (masked, or another tile's) must
          // not bring a non-finite q / dO value to that key
          const bool zeros = mk == kPartial || jlo < ja || jhi > jb;
          const int64_t nq_bad = zeros ? take_nonfinite_rows(qr, Dp, nq, D, saved_q, bad_q) : 0;
          const int64_t ndo_bad = zeros ? take_nonfinite_rows(dor, Dp, nq, D, saved_do, bad_do) : 0;
          gemm<T, true, true>(jhi - jlo, Dp, nq, sm + jlo, LD, dor, Dp, dv + jlo * Dp, Dp);  // dV += P^T dO
          gemm<T, true, true>(jhi - jlo, Dp, nq, dp + jlo, LD, qr, Dp, dk + jlo * Dp, Dp);   // dK += dS^T Q
          const T* mbias = mk == kPartial ? bias : nullptr;
          if (ndo_bad) add_saved_rows(dv, Dp, sm, LD, mbias, saved_do, bad_do, ndo_bad, ja, jb, D);
          if (nq_bad) add_saved_rows(dk, Dp, dp, LD, mbias, saved_q, bad_q, nq_bad, ja, jb, D);
        }
      }
    }
    for (int64_t j = 0; j < cl; ++j) {
      store_row(dk_out + (c0 + j) * p.dk.stride_t + hk * p.dk.stride_h, dk + j * Dp, D, T(1));
      store_row(dv_out + (c0 + j) * p.dv.stride_t + hk * p.dv.stride_h, dv + j * Dp, D, T(1));
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// dtype dispatch
// ---------------------------------------------------------------------------------------------------
void forward_entry(const FwdParams& p, const QItem* items, int64_t n, std::atomic<int64_t>* next) {
  switch (p.dtype) {
    case DType::kF64: return forward_worker<double, double>(p, items, n, next);
    case DType::kF32: return forward_worker<float, float>(p, items, n, next);
    case DType::kBF16: return forward_worker<bf16_t, float>(p, items, n, next);
    case DType::kF16: return forward_worker<fp16_t, float>(p, items, n, next);
  }
}

#define DCP_BWD_DISPATCH(FN, ...)                                                                 \
  do {                                                                                            \
    const bool f32_grads = p.grad_dtype == DType::kF32;                                           \
    switch (p.dtype) {                                                                            \
      case DType::kF64:                                                                           \
        return f32_grads ? FN<double, float, double>(__VA_ARGS__) : FN<double, double, double>(__VA_ARGS__); \
      case DType::kF32: return FN<float, float, float>(__VA_ARGS__);                              \
      case DType::kBF16:                                                                          \
        return f32_grads ? FN<bf16_t, float, float>(__VA_ARGS__) : FN<bf16_t, bf16_t, float>(__VA_ARGS__); \
      case DType::kF16:                                                                           \
        return f32_grads ? FN<fp16_t, float, float>(__VA_ARGS__) : FN<fp16_t, fp16_t, float>(__VA_ARGS__); \
    }                                                                                             \
  } while (0)

void backward_dq_entry(const BwdParams& p, const QItem* items, int64_t n, std::atomic<int64_t>* next) {
  DCP_BWD_DISPATCH(backward_dq_worker, p, items, n, next);
}

void backward_dkv_entry(const BwdParams& p, const ChunkIndex& ci, const KvItem* items, int64_t n,
                        std::atomic<int64_t>* next) {
  DCP_BWD_DISPATCH(backward_dkv_worker, p, ci, items, n, next);
}
#undef DCP_BWD_DISPATCH

}  // namespace

const KernelTable& kernel_table() {
  static const KernelTable table{DCP_ISA_NAME, &forward_entry, &backward_dq_entry, &backward_dkv_entry};
  return table;
}

}  // namespace DCP_ISA_NS
}  // namespace dcp
