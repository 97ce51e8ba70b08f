// Masks of the blockwise kernels, and exact handling of non-finite inputs under them.
//
// Included by kernels_impl.h only, inside its anonymous namespace (it uses VT, ldu/stu, BQ, imin/imax).
//
// Attention defines row i's output from q_i and the keys/values it attends, nothing else. A blocked GEMM
// over a partial block gives masked (or padded, or other tiles') pairs weight 0, and 0 * NaN = NaN: one
// non-finite value in a key, value, query or dO row would reach rows or keys that never meet it. So
// masking overwrites scores (apply_mask<false>; never adds -inf to a NaN), weights of masked pairs are
// zeroed after the row statistics (apply_mask<true>; a NaN lse must not leak through exp(-inf - NaN)),
// and before a GEMM with masked weights the operand rows holding a non-finite value are moved aside
// (take_nonfinite_rows) and added back through allowed pairs only (add_saved_keys / add_saved_rows).
// Finite inputs only pay the scan of each packed operand (O(1/BQ) of the GEMM).
#ifndef DCP_ISA_NS
#error "kernels_mask.h is part of kernels_impl.h"
#endif

enum : int { kEmpty = 0, kFull = 1, kPartial = 2 };

// Classify tile `tile` for segment rows [srow0, srow0 + nq) and tile-relative keys [kb0, kb0 + bk).
// For kPartial, fills bias[(joff + key - kb0) * sj + i * si] for keys of the block and q rows i < BQ with
// 0 where allowed, -inf elsewhere ((sj, si) = (BQ, 1) for the S^T layout, (1, ld) for S).
template <typename T>
int block_mask(const TileTableView& tt, int64_t tile, int64_t srow0, int64_t nq, int64_t kb0, int64_t bk,
               T* bias, int64_t joff, int64_t sj = BQ, int64_t si = 1) {
  const int64_t mrow = tt.tile_mask_row[tile];
  if (mrow < 0) return kFull;
  const int64_t R = tt.n_ranges;
  const int32_t* rg = tt.mask_ranges + (mrow + srow0) * R * 2;
  const int64_t kb1 = kb0 + bk;
  bool any = false, all = true;
  for (int64_t i = 0; i < nq; ++i) {
    const int32_t* rr = rg + i * R * 2;
    bool row_any = false, row_full = false;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = rr[2 * r], e = rr[2 * r + 1];
      row_any |= imin(e, kb1) > imax(s, kb0);
      row_full |= (s <= kb0) & (e >= kb1);
    }
    any |= row_any;
    all &= row_full;
  }
  if (!any) return kEmpty;
  if (all) return kFull;
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t j = joff; j < joff + bk; ++j)
    for (int64_t i = 0; i < BQ; ++i) bias[j * sj + i * si] = ninf;
  for (int64_t i = 0; i < nq; ++i) {
    const int32_t* rr = rg + i * R * 2;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t s = imax(rr[2 * r], kb0), e = imin(rr[2 * r + 1], kb1);
      for (int64_t key = s; key < e; ++key) bias[(joff + key - kb0) * sj + i * si] = T(0);
    }
  }
  return kPartial;
}

// Rows [j0, j1) of an S^T block where the bias is -inf (masked): x = -inf for scores (kZero false;
// overwriting, not adding, so that a masked pair's NaN score does not survive the mask), or x = 0 for
// weights P^T / dS^T (kZero true, whatever NaN the row statistics put there).
template <bool kZero, typename T>
void apply_mask(T* x, const T* bias, int64_t j0, int64_t j1) {
  typedef typename VT<T>::V V;
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t i = 0; i < BQ; i += VT<T>::W) {
      const V b = ldu<V>(bias + j * BQ + i);
      stu(x + j * BQ + i, b < V{} ? (kZero ? V{} : b) : ldu<V>(x + j * BQ + i));
    }
}

// Rows r < nrows of a packed operand (row stride ld) with a non-finite value among their first D columns:
// copied to saved[n * ld ...], their indices to idx[n], and zeroed in place. Returns n.
template <typename T>
int64_t take_nonfinite_rows(T* rows, int64_t ld, int64_t nrows, int64_t D, T* saved, int64_t* idx) {
  typedef typename VT<T>::V V;
  V z = V{};  // one vector pass first (ld is a multiple of the vector width): x * 0 is 0 unless x is inf/NaN
  for (int64_t i = 0; i < nrows * ld; i += VT<T>::W) z += ldu<V>(rows + i) * V{};
  bool finite = true;
  for (int64_t l = 0; l < VT<T>::W; ++l) finite &= z[l] == T(0);
  if (finite) return 0;
  int64_t n = 0;
  for (int64_t r = 0; r < nrows; ++r) {
    T* row = rows + r * ld;
    bool bad = false;
    for (int64_t c = 0; c < D; ++c) bad |= !std::isfinite(row[c]);
    if (!bad) continue;
    for (int64_t c = 0; c < ld; ++c) {
      saved[n * ld + c] = row[c];
      row[c] = T(0);
    }
    idx[n++] = r;
  }
  return n;
}

// S^T layout (weights w[j * BQ + i], key j, row i): acc[i][:D] += w[j][i] * saved key row, for every saved
// key j and every row i < nq that attends it (bias 0).
template <typename T>
void add_saved_keys(T* acc, int64_t ld, const T* w, const T* bias, const T* saved, const int64_t* idx,
                    int64_t n, int64_t nq, int64_t D) {
  for (int64_t b = 0; b < n; ++b) {
    const int64_t j = idx[b];
    for (int64_t i = 0; i < nq; ++i) {
      if (bias[j * BQ + i] < T(0)) continue;
      const T wv = w[j * BQ + i];
      for (int64_t c = 0; c < D; ++c) acc[i * ld + c] += wv * saved[b * ld + c];
    }
  }
}

// S layout (weights w[i * lw + j], row i, key column j): dst[j][:D] += w[i][j] * saved row, for every saved
// q row i and every key j in [ja, jb) it attends (bias 0, or every key when bias is null: a full block).
template <typename T>
void add_saved_rows(T* dst, int64_t ld, const T* w, int64_t lw, const T* bias, const T* saved,
                    const int64_t* idx, int64_t n, int64_t ja, int64_t jb, int64_t D) {
  for (int64_t b = 0; b < n; ++b) {
    const int64_t i = idx[b];
    for (int64_t j = ja; j < jb; ++j) {
      if (bias != nullptr && bias[i * lw + j] < T(0)) continue;
      const T wv = w[i * lw + j];
      for (int64_t c = 0; c < D; ++c) dst[j * ld + c] += wv * saved[b * ld + c];
    }
  }
}
