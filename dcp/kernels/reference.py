"""Pure-PyTorch reference of the block-table attention kernels (the test oracle).

Layouts: ``q_thd / o_thd / do_thd [Tq, Hq, D]``, ``k_thd / v_thd [Tk, Hkv, D]`` (GQA: query head h uses
kv head ``h // (Hq // Hkv)``), ``lse_ht / delta_ht [Hq, Tq]`` float32. The tile table is described in
``dcp.kernels.tiles``. Per segment the allowed keys become a dense boolean mask and everything is
computed with dense matmuls in float32 (float64 for float64 inputs), the products with masked weights
through ``dcp.kernels.masked`` so that NaN and inf reach exactly the rows and keys that attend them.
Runs on any device.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from dcp.errors import ExecutionError
from dcp.kernels.masked import keys_to_rows, masked, rows_to_keys, softmax_rows
from dcp.kernels.tiles import TileTable

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_NEG_INF = float("-inf")
_POS_INF = float("inf")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------ checks
def _check_tensor(t, name: str, fn: str, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ExecutionError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ExecutionError(f"{fn}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")


def check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale, fn: str, cpu_only: bool = False):
    """Validate q/k/v and the tile table; return ``(tq, hq, d, tk, hkv, scale)``.

    Raises ``ExecutionError`` on a wrong type, shape, dtype, device, head ratio, scale or tile table.
    """
    for t, name in ((q_thd, "q_thd"), (k_thd, "k_thd"), (v_thd, "v_thd")):
        _check_tensor(t, name, fn, 3)
    tq, hq, d = q_thd.shape
    tk, hkv, dk = k_thd.shape
    if q_thd.dtype not in SUPPORTED_DTYPES:
        raise ExecutionError(f"{fn}: q_thd must be float64, float32, bfloat16 or float16, got {q_thd.dtype}")
    for t, name in ((k_thd, "k_thd"), (v_thd, "v_thd")):
        if t.dtype != q_thd.dtype:
            raise ExecutionError(f"{fn}: {name} has dtype {t.dtype} but q_thd has {q_thd.dtype}")
        if t.device != q_thd.device:
            raise ExecutionError(f"{fn}: {name} is on {t.device} but q_thd is on {q_thd.device}")
    if cpu_only and q_thd.device.type != "cpu":
        raise ExecutionError(f"{fn}: the native kernels take CPU tensors, got {q_thd.device}")
    if tuple(v_thd.shape) != tuple(k_thd.shape):
        raise ExecutionError(f"{fn}: v_thd shape {tuple(v_thd.shape)} differs from k_thd {tuple(k_thd.shape)}")
    if dk != d or d < 1:
        raise ExecutionError(f"{fn}: head dims differ or are empty: q_thd has D={d}, k_thd has D={dk}")
    if hkv < 1 or hq % hkv != 0:
        raise ExecutionError(f"{fn}: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if not isinstance(tiles, TileTable):
        raise ExecutionError(f"{fn}: tiles must be a TileTable, got {type(tiles).__name__}")
    tiles.validate(tq, tk)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ExecutionError(f"{fn}: scale must be a finite number, got {scale!r}")
    return tq, hq, d, tk, hkv, float(scale)


def check_row_stats(t, name: str, fn: str, hq: int, tq: int, device) -> None:
    """``t`` must be a float32 ``[hq, tq]`` tensor on ``device``."""
    _check_tensor(t, name, fn, 2)
    if t.dtype != torch.float32:
        raise ExecutionError(f"{fn}: {name} must be float32, got {t.dtype}")
    if tuple(t.shape) != (hq, tq):
        raise ExecutionError(f"{fn}: {name} must have shape [{hq}, {tq}], got {tuple(t.shape)}")
    if t.device != device:
        raise ExecutionError(f"{fn}: {name} is on {t.device}, expected {device}")


def check_backward_inputs(do_thd, q_thd, lse_ht, delta_ht, out_dtype, hq, tq, fn: str):
    _check_tensor(do_thd, "do_thd", fn, 3)
    if tuple(do_thd.shape) != tuple(q_thd.shape) or do_thd.dtype != q_thd.dtype:
        raise ExecutionError(f"{fn}: do_thd must match q_thd ({tuple(q_thd.shape)}, {q_thd.dtype}), got "
                             f"{tuple(do_thd.shape)}, {do_thd.dtype}")
    if do_thd.device != q_thd.device:
        raise ExecutionError(f"{fn}: do_thd is on {do_thd.device} but q_thd is on {q_thd.device}")
    check_row_stats(lse_ht, "lse_ht", fn, hq, tq, q_thd.device)
    check_row_stats(delta_ht, "delta_ht", fn, hq, tq, q_thd.device)
    if out_dtype not in (None, torch.float32, q_thd.dtype):
        raise ExecutionError(f"{fn}: out_dtype must be None or torch.float32, got {out_dtype}")


def check_merge_inputs(o_list: Sequence, lse_list: Sequence, fn: str):
    """Validate partial outputs ``o [T, H, D]`` and lse ``[H, T]`` float32; return (T, H, D)."""
    if len(o_list) == 0:
        raise ExecutionError(f"{fn}: needs at least one partial output")
    if len(o_list) != len(lse_list):
        raise ExecutionError(f"{fn}: got {len(o_list)} outputs but {len(lse_list)} lse tensors")
    _check_tensor(o_list[0], "o_list[0]", fn, 3)
    t, h, d = o_list[0].shape
    for i, (o, lse) in enumerate(zip(o_list, lse_list)):
        _check_tensor(o, f"o_list[{i}]", fn, 3)
        if tuple(o.shape) != (t, h, d):
            raise ExecutionError(f"{fn}: o_list[{i}] has shape {tuple(o.shape)}, expected {(t, h, d)}")
        if o.dtype not in SUPPORTED_DTYPES:
            raise ExecutionError(f"{fn}: o_list[{i}] must be a floating tensor, got {o.dtype}")
        if o.device != o_list[0].device:
            raise ExecutionError(f"{fn}: o_list[{i}] is on {o.device}, o_list[0] on {o_list[0].device}")
        check_row_stats(lse, f"lse_list[{i}]", fn, h, t, o_list[0].device)
    return t, h, d


# ------------------------------------------------------------------------------------------ kernels
def _segment_blocks(tiles: TileTable, q_thd, k_thd, v_thd, cd, group: int):
    """Per non-empty segment yield ``(q0, q1, spans, allowed [n, m], q_seg [n, Hkv, G, D],
    k_seg / v_seg [m, Hkv, D])`` where ``spans`` lists ``(k_start, k_len, offset)`` of its tiles inside
    the m concatenated keys."""
    dev = q_thd.device
    for s in range(tiles.n_segments):
        q0, q1 = int(tiles.seg_cu[s]), int(tiles.seg_cu[s + 1])
        keys, allowed = tiles.segment_keys(s)
        if q1 == q0 or keys.numel() == 0:
            continue
        spans, off = [], 0
        for i in range(int(tiles.seg_tile_ptr[s]), int(tiles.seg_tile_ptr[s + 1])):
            k0, kl = int(tiles.tile_k_start[i]), int(tiles.tile_k_len[i])
            spans.append((k0, kl, off))
            off += kl
        ks = torch.cat([k_thd[k0:k0 + kl] for k0, kl, _ in spans]).to(cd)
        vs = torch.cat([v_thd[k0:k0 + kl] for k0, kl, _ in spans]).to(cd)
        qs = q_thd[q0:q1].to(cd)
        yield q0, q1, spans, allowed.to(dev), qs.reshape(q1 - q0, ks.shape[1], group, -1), ks, vs


def attention_forward(q_thd, k_thd, v_thd, tiles: TileTable, scale=None):
    """Block-table attention. Returns ``(o_thd [Tq, Hq, D] in q's dtype, lse_ht [Hq, Tq] float32)``.

    Rows outside every segment, or with no allowed key, get ``o = 0`` and ``lse = -inf``.
    """
    tq, hq, d, tk, hkv, scale = check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale,
                                                       "reference attention_forward")
    cd = compute_dtype(q_thd.dtype)
    o = torch.zeros(tq, hq, d, dtype=cd, device=q_thd.device)
    lse = torch.full((hq, tq), _NEG_INF, dtype=torch.float32, device=q_thd.device)
    for q0, q1, _, allowed, qs, ks, vs in _segment_blocks(tiles, q_thd, k_thd, v_thd, cd, hq // hkv):
        s = torch.einsum("qhgd,khd->hgqk", qs, ks) * scale  # [Hkv, G, n, m]
        p, lse_s = softmax_rows(s.masked_fill(~allowed, _NEG_INF))  # lse -inf for rows without keys
        o[q0:q1] = keys_to_rows(p, allowed, vs).reshape(q1 - q0, hq, d)
        lse[:, q0:q1] = lse_s.reshape(hq, q1 - q0).float()
    return o.to(q_thd.dtype), lse


def attention_backward(do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles: TileTable, scale=None,
                       out_dtype=None):
    """Gradient contributions of these tiles: ``(dq [Tq,Hq,D], dk [Tk,Hkv,D], dv [Tk,Hkv,D])``.

    ``lse_ht`` is the final log-sum-exp of each row (possibly merged from several devices), ``delta_ht``
    is ``rowsum(dO * O_final)`` per head, both ``[Hq, Tq]`` float32. Rows with ``lse = -inf`` contribute
    nothing. Gradients come back in q's dtype, or float32 with ``out_dtype=torch.float32``.
    """
    fn = "reference attention_backward"
    tq, hq, d, tk, hkv, scale = check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale, fn)
    check_backward_inputs(do_thd, q_thd, lse_ht, delta_ht, out_dtype, hq, tq, fn)
    g = hq // hkv
    cd = compute_dtype(q_thd.dtype)
    dev = q_thd.device
    dq = torch.zeros(tq, hq, d, dtype=cd, device=dev)
    dk = torch.zeros(tk, hkv, d, dtype=cd, device=dev)
    dv = torch.zeros(tk, hkv, d, dtype=cd, device=dev)
    lse = lse_ht.to(cd)
    lse = torch.where(torch.isneginf(lse), _POS_INF, lse).reshape(hkv, g, tq)  # dead rows: P = 0
    delta = delta_ht.to(cd).reshape(hkv, g, tq)
    for q0, q1, spans, allowed, qs, ks, vs in _segment_blocks(tiles, q_thd, k_thd, v_thd, cd, g):
        dos = do_thd[q0:q1].to(cd).reshape(qs.shape)
        s = torch.einsum("qhgd,khd->hgqk", qs, ks) * scale
        p = masked(torch.exp(s.masked_fill(~allowed, _NEG_INF) - lse[:, :, q0:q1, None]), allowed)
        dp = torch.einsum("qhgd,khd->hgqk", dos, vs)
        ds = masked(p * (dp - delta[:, :, q0:q1, None]), allowed)
        dq[q0:q1] += (keys_to_rows(ds, allowed, ks) * scale).reshape(q1 - q0, hq, d)
        dv_s = rows_to_keys(p, allowed, dos)
        dk_s = rows_to_keys(ds, allowed, qs) * scale
        for k0, kl, off in spans:
            dv[k0:k0 + kl] += dv_s[off:off + kl]
            dk[k0:k0 + kl] += dk_s[off:off + kl]
    od = out_dtype or q_thd.dtype
    return dq.to(od), dk.to(od), dv.to(od)


def merge_partials(o_list: Sequence[torch.Tensor], lse_list: Sequence[torch.Tensor]):
    """Log-sum-exp merge of partial results ``o_i [T, H, D]``, ``lse_i [H, T]`` float32.

    ``lse = m + log(sum_i exp(lse_i - m))``, ``o = sum_i exp(lse_i - lse) * o_i``; rows where every
    ``lse_i`` is -inf get ``o = 0, lse = -inf``. Returns ``(o [T, H, D] in o_list[0]'s dtype, lse [H, T])``.
    """
    check_merge_inputs(o_list, lse_list, "reference merge_partials")
    cd = torch.float64 if any(o.dtype == torch.float64 for o in o_list) else torch.float32
    lse = torch.stack([x.to(cd) for x in lse_list])  # [n, H, T]
    m = lse.amax(dim=0)  # NaN if any partial's lse is NaN: it poisons the row, as it does in dense attention
    m = torch.where(torch.isneginf(m), 0.0, m)
    w = torch.exp(lse - m)
    w_sum = w.sum(dim=0)
    out_lse = m + torch.log(w_sum)  # -inf where w_sum == 0
    coef = torch.where(w_sum == 0, 0.0, w / torch.where(w_sum == 0, 1.0, w_sum))  # [n, H, T]
    o = torch.zeros(o_list[0].shape, dtype=cd, device=o_list[0].device)
    for c, li, oi in zip(coef, lse, o_list):
        # an empty partial (lse = -inf) adds nothing; any other adds c * o, NaN or inf included
        o += torch.where(torch.isneginf(li).t()[..., None], 0.0, c.t()[..., None] * oi.to(cd))
    return o.to(o_list[0].dtype), out_lse.float()


def merge_into(o_acc, lse_acc, o_new, lse_new):
    """In-place two-way merge: ``(o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_new, lse_new))``.

    ``o_acc`` may be of a wider dtype than ``o_new`` (e.g. a float32 accumulator). Returns
    ``(o_acc, lse_acc)``.
    """
    check_merge_inputs([o_acc, o_new], [lse_acc, lse_new], "reference merge_into")
    cd = torch.float64 if torch.float64 in (o_acc.dtype, o_new.dtype) else torch.float32
    o, lse = merge_partials([o_acc.to(cd), o_new.to(cd)], [lse_acc, lse_new])
    o_acc.copy_(o)
    lse_acc.copy_(lse)
    return o_acc, lse_acc


def dense_attention(q_thd, k_thd, v_thd, allowed_tk, scale=None):
    """Plain masked attention from a boolean ``allowed_tk [Tq, Tk]``; differentiable.

    Computes in the inputs' dtype (pass float64 tensors for an oracle). Returns ``(o_thd [Tq, Hq, D],
    lse_ht [Hq, Tq])``; rows without allowed keys get ``o = 0`` and ``lse = -inf`` (and zero gradients).
    """
    hq, hkv, d = q_thd.shape[1], k_thd.shape[1], q_thd.shape[2]
    if hkv < 1 or hq % hkv:
        raise ExecutionError(f"dense_attention: query heads ({hq}) must be a multiple of kv heads ({hkv})")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tq = q_thd.shape[0]
    qg = q_thd.reshape(tq, hkv, hq // hkv, d)
    allowed = allowed_tk.to(device=q_thd.device, dtype=torch.bool)  # [Tq, Tk]
    empty = ~allowed.any(dim=-1)  # [Tq]
    s = torch.einsum("qhgd,khd->hgqk", qg, k_thd) * scale  # [Hkv, G, Tq, Tk]
    s = s.masked_fill(~allowed, _NEG_INF).masked_fill(empty[:, None], 0.0)
    p = torch.softmax(s, dim=-1) * (~empty)[:, None]
    o = torch.einsum("hgqk,khd->qhgd", p, v_thd).reshape(tq, hq, d)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty, _NEG_INF).reshape(hq, tq)
    return o, lse
