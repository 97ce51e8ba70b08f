"""Small dense pure-PyTorch tile kernels with the ``dcp.kernels`` interface: the executors' fp64 path
(kernels whose row statistics are fp32 cap an fp64 run near 1e-7) and a cross-check.

A stage's whole ``[Tq, Tk]`` mask is materialized, so rows of different sequences share one block: the
products with masked weights go through ``dcp.kernels.masked``, so that a NaN or inf reaches exactly the
rows and keys that attend it, never another sequence.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from dcp.kernels.masked import keys_to_rows, masked, rows_to_keys, softmax_rows
from dcp.kernels.reference import compute_dtype


def _dense_mask(tiles, tq: int, tk: int) -> np.ndarray:
    """Boolean ``[tq, tk]`` matrix of the (q row, key) pairs a tile table attends (vectorized)."""
    seg_cu = np.asarray(tiles.seg_cu, dtype=np.int64)
    ptr = np.asarray(tiles.seg_tile_ptr, dtype=np.int64)
    ks = np.asarray(tiles.tile_k_start, dtype=np.int64)
    kl = np.asarray(tiles.tile_k_len, dtype=np.int64)
    mrow = np.asarray(tiles.tile_mask_row, dtype=np.int64)
    mr = np.asarray(tiles.mask_ranges, dtype=np.int64)
    if mr.ndim != 3 or mr.shape[0] == 0:
        mr = np.zeros((0, 1, 2), dtype=np.int64)
    n_tiles = ks.size
    diff = np.zeros((tq, tk + 1), dtype=np.int64)
    if n_tiles == 0:
        return np.zeros((tq, tk), dtype=bool)
    tile_seg = np.repeat(np.arange(ptr.size - 1), np.diff(ptr))
    seg_len = np.diff(seg_cu)
    rows_per_tile = seg_len[tile_seg]
    t_of_row = np.repeat(np.arange(n_tiles), rows_per_tile)
    i_in_tile = np.arange(t_of_row.size) - np.repeat(np.cumsum(rows_per_tile) - rows_per_tile, rows_per_tile)
    row = seg_cu[tile_seg][t_of_row] + i_in_tile
    full = mrow[t_of_row] < 0
    # full tiles: one range per row
    s_full = ks[t_of_row][full]
    e_full = s_full + kl[t_of_row][full]
    r_full = row[full]
    # partial tiles: all slots of their mask rows, shifted to the key buffer
    pr = ~full
    mr_rows = mrow[t_of_row][pr] + i_in_tile[pr]
    slots = mr[mr_rows] if mr_rows.size else np.zeros((0, mr.shape[1], 2), dtype=np.int64)
    s_part = (slots[:, :, 0] + ks[t_of_row][pr][:, None]).reshape(-1)
    e_part = (slots[:, :, 1] + ks[t_of_row][pr][:, None]).reshape(-1)
    r_part = np.repeat(row[pr], mr.shape[1])
    used = slots[:, :, 1].reshape(-1) > slots[:, :, 0].reshape(-1)
    r_all = np.concatenate([r_full, r_part[used]])
    s_all = np.concatenate([s_full, s_part[used]])
    e_all = np.concatenate([e_full, e_part[used]])
    np.add.at(diff, (r_all, s_all), 1)
    np.add.at(diff, (r_all, e_all), -1)
    return np.cumsum(diff, axis=1)[:, :tk] > 0


class FallbackKernels:
    """Dense tile kernels over a stage's whole mask, in fp32 (fp64 for fp64 inputs).

    Layouts as ``dcp.kernels.reference``: ``q/o/do [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]``, ``lse/delta [Hq, Tq]``.
    """

    name = "execute-fallback"

    @staticmethod
    def _scores(q_thd, k_thd, tiles, scale):
        """(masked scores ``s_hgqk [Hkv, G, Tq, Tk]``, ``allowed [Tq, Tk]``, compute dtype, scale)."""
        tq, hq, d = q_thd.shape
        tk, hkv = k_thd.shape[0], k_thd.shape[1]
        cdt = compute_dtype(q_thd.dtype)
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        allowed = torch.from_numpy(_dense_mask(tiles, tq, tk)).to(q_thd.device)
        q = q_thd.to(cdt).reshape(tq, hkv, hq // hkv, d)
        s = torch.einsum("qhgd,khd->hgqk", q, k_thd.to(cdt)) * scale
        return s.masked_fill(~allowed, float("-inf")), allowed, cdt, scale

    def forward(self, q_thd, k_thd, v_thd, tiles, scale=None):
        tq, hq, d = q_thd.shape
        s, allowed, cdt, _ = self._scores(q_thd, k_thd, tiles, scale)
        p, lse = softmax_rows(s)  # a row without keys: o = 0, lse = -inf; NaN stays NaN
        o = keys_to_rows(p, allowed, v_thd.to(cdt)).reshape(tq, hq, d)
        lse = lse.reshape(hq, tq)
        return o.to(q_thd.dtype), lse.to(cdt)

    def backward(self, do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles, scale=None, out_dtype=None):
        tq, hq, d = q_thd.shape
        hkv = k_thd.shape[1]
        g = hq // hkv
        s, allowed, cdt, scale = self._scores(q_thd, k_thd, tiles, scale)
        lse = lse_ht.to(cdt).reshape(hkv, g, tq, 1)
        dead = torch.isneginf(lse)  # rows without keys; a NaN lse poisons its row, as in dense attention
        p = masked(torch.exp(s - torch.where(dead, torch.full_like(lse, float("inf")), lse)), allowed)
        q, do = (x.to(cdt).reshape(tq, hkv, g, d) for x in (q_thd, do_thd))
        k, v = k_thd.to(cdt), v_thd.to(cdt)
        dv = rows_to_keys(p, allowed, do)
        dp = torch.einsum("qhgd,khd->hgqk", do, v)
        ds = masked(p * (dp - delta_ht.to(cdt).reshape(hkv, g, tq, 1)), allowed)
        dq = keys_to_rows(ds, allowed, k).reshape(tq, hq, d) * scale
        dk = rows_to_keys(ds, allowed, q) * scale
        out = out_dtype or q_thd.dtype
        return dq.to(out), dk.to(out), dv.to(out)

    @staticmethod
    def merge_into(o_acc, lse_acc, o_new, lse_new):
        """In place: (o_acc, lse_acc) <- LSE merge of both partials. o [T, H, D], lse [H, T]. An empty
        partial (lse = -inf) adds nothing; a NaN lse or o poisons the row."""
        lse_new = lse_new.to(lse_acc.dtype)
        mx = torch.maximum(lse_acc, lse_new)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        wa, wb = torch.exp(lse_acc - mx), torch.exp(lse_new - mx)
        tot = wa + wb
        inv = torch.where(tot == 0, torch.zeros_like(tot), 1.0 / tot)
        parts = []
        for w, lse, o in ((wa, lse_acc, o_acc), (wb, lse_new, o_new)):
            c = (w * inv).t()[..., None].to(o_acc.dtype)
            parts.append(torch.where(torch.isneginf(lse).t()[..., None], 0.0, c * o.to(o_acc.dtype)))
        o_acc.copy_(parts[0] + parts[1])
        lse_acc.copy_(torch.log(tot) + mx)
        return o_acc, lse_acc

    def merge_partials(self, o_list, lse_list):
        o, lse = o_list[0].clone(), lse_list[0].clone()
        for o_new, lse_new in zip(o_list[1:], lse_list[1:]):
            self.merge_into(o, lse, o_new, lse_new)
        return o, lse


__all__ = ["FallbackKernels"]
