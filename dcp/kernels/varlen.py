"""Tile-table attention through fused varlen calls (the GPU tile path).

Same signatures and semantics as ``dcp.kernels.reference``: a device's tile table is rewritten once as a
few varlen calls (``varlen_schedule``), each call is one flash-attention launch over packed sequences
(``varlen_ops``: flash-attn when installed, else PyTorch's bundled flash kernel, else — on the CPU or
for dtypes the flash kernels lack — a plain-PyTorch emulation), and rows that several pieces cover are
merged by log-sum-exp.

Backward: flash kernels form ``D = rowsum(dO * O)`` from the output, while a dcp plan ships ``D``
itself (``delta_ht``: one float per row and head instead of ``D`` values). ``_delta_carrier`` builds an
output stand-in with two non-zeros per row whose products with ``dO`` are exact in fp32 and sum to
``delta`` to about 2^-16 relative (bf16), so the kernels see the plan's ``D``.
"""
from __future__ import annotations

import torch

from dcp.kernels import native
from dcp.kernels import reference as ref
from dcp.kernels.tiles import TileTable
from dcp.kernels.varlen_ops import for_call, select_ops
from dcp.kernels.varlen_schedule import schedule_for


def attention_forward(q_thd, k_thd, v_thd, tiles: TileTable, scale=None, ops: str = "auto"):
    """Block-table attention through varlen calls: ``(o_thd [Tq, Hq, D] in q's dtype, lse_ht [Hq, Tq] fp32)``.

    ``ops``: 'auto', 'flash_attn', 'torch_flash' or 'emulated' (see ``varlen_ops.select_ops``).
    """
    tq, hq, d, tk, _, scale = ref.check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale,
                                                         "varlen attention_forward")
    sched = schedule_for(tiles, tq, tk, q_thd.device)
    impl = select_ops(q_thd.dtype, q_thd.device, d, ops)
    if not sched.calls:
        return (torch.zeros_like(q_thd),
                torch.full((hq, tq), float("-inf"), dtype=torch.float32, device=q_thd.device))
    outs, lses = [], []
    for call in sched.calls:
        o_c, lse_c = for_call(impl, call).forward(q_thd.index_select(0, call.q_index),
                                                  k_thd.index_select(0, call.k_index),
                                                  v_thd.index_select(0, call.k_index), call, scale)
        outs.append(o_c)
        lses.append(lse_c)
    o_all = outs[0] if len(outs) == 1 else torch.cat(outs)
    lse_all = lses[0] if len(lses) == 1 else torch.cat(lses, dim=1)
    return _merge_rows(o_all, lse_all, sched.row_index, sched.rows_unique, tq, q_thd.dtype)


def _merge_rows(o_all, lse_all, rows, unique: bool, tq: int, dtype):
    """Scatter packed outputs ``o_all [N, H, D]`` / ``lse_all [H, N]`` to q rows ``rows [N]``, merging
    rows that occur several times by log-sum-exp. Rows that never occur get ``o = 0, lse = -inf``."""
    h = lse_all.shape[0]
    dev = o_all.device
    lse = torch.full((h, tq), float("-inf"), dtype=torch.float32, device=dev)
    if unique:
        o = torch.zeros((tq,) + tuple(o_all.shape[1:]), dtype=dtype, device=dev)
        o.index_copy_(0, rows, o_all.to(dtype))
        lse.index_copy_(1, rows, lse_all.float())
        return o, lse
    cd = ref.compute_dtype(dtype)
    lse_c = lse_all.to(cd)
    m = torch.full((h, tq), float("-inf"), dtype=cd, device=dev)
    m.scatter_reduce_(1, rows.expand(h, -1), lse_c, reduce="amax")
    w = torch.exp(lse_c - m.index_select(1, rows))              # every packed row has a key: m finite
    w_sum = torch.zeros((h, tq), dtype=cd, device=dev).index_add_(1, rows, w)
    coef = w / w_sum.index_select(1, rows)                       # [H, N]
    o = torch.zeros((tq,) + tuple(o_all.shape[1:]), dtype=cd, device=dev)
    o.index_add_(0, rows, o_all.to(cd) * coef.t()[..., None])
    lse.copy_(m + torch.log(w_sum))                              # -inf where no piece: log 0 + -inf
    return o.to(dtype), lse


def _delta_carrier(do_thd: torch.Tensor, delta_ht: torch.Tensor) -> torch.Tensor:
    """An ``[Tq, Hq, D]`` tensor ``c`` in ``do``'s dtype with ``sum_d do * c == delta`` (see module doc).

    ``c = a e_i + b e_j`` where ``i, j`` are the two largest ``|dO|`` entries of the row: ``a`` carries
    ``delta / dO_i`` rounded to the dtype, ``b`` the rounding remainder; products of two half values
    are exact in fp32, so only ``b``'s rounding remains. Rows with ``dO = 0`` have ``delta = 0``.
    """
    dt = do_thd.dtype
    cd = ref.compute_dtype(dt)
    do_c = do_thd.to(cd)
    delta = delta_ht.to(cd).t()                                    # [Tq, Hq]
    top = min(2, do_thd.shape[-1])
    _, idx = do_c.abs().topk(top, dim=-1)                          # [Tq, Hq, top]
    vals = do_c.gather(-1, idx)
    carrier = torch.zeros_like(do_c)
    v1 = vals[..., 0]
    a = torch.where(v1 != 0, delta / torch.where(v1 != 0, v1, 1.0), 0.0).to(dt).to(cd)
    carrier.scatter_(-1, idx[..., :1], a[..., None])
    if top == 2:
        v2 = vals[..., 1]
        rest = delta - a * v1
        b = torch.where(v2 != 0, rest / torch.where(v2 != 0, v2, 1.0), 0.0).to(dt).to(cd)
        b = torch.where(torch.isfinite(b), b, 0.0)                 # fp16 range: drop the refinement
        carrier.scatter_(-1, idx[..., 1:], b[..., None])
    return carrier.to(dt)


def attention_backward(do_thd, q_thd, k_thd, v_thd, lse_ht, delta_ht, tiles: TileTable, scale=None,
                       out_dtype=None, ops: str = "auto"):
    """Gradient contributions ``(dq [Tq,Hq,D], dk [Tk,Hkv,D], dv [Tk,Hkv,D])`` through varlen calls.

    ``lse_ht`` / ``delta_ht`` are the rows' final log-sum-exp and ``rowsum(dO * O)`` (``[Hq, Tq]`` fp32),
    as in ``reference.attention_backward``. Gradients are accumulated in fp32 and returned in q's dtype,
    or fp32 with ``out_dtype=torch.float32``.
    """
    fn = "varlen attention_backward"
    tq, hq, d, tk, hkv, scale = ref.check_attention_inputs(q_thd, k_thd, v_thd, tiles, scale, fn)
    ref.check_backward_inputs(do_thd, q_thd, lse_ht, delta_ht, out_dtype, hq, tq, fn)
    sched = schedule_for(tiles, tq, tk, q_thd.device)
    impl = select_ops(q_thd.dtype, q_thd.device, d, ops)
    cd = ref.compute_dtype(q_thd.dtype)
    dev = q_thd.device
    dq = torch.zeros((tq, hq, d), dtype=cd, device=dev)
    dk = torch.zeros((tk, hkv, d), dtype=cd, device=dev)
    dv = torch.zeros((tk, hkv, d), dtype=cd, device=dev)
    if sched.calls:
        carrier = _delta_carrier(do_thd, delta_ht)
        for call in sched.calls:
            qi, ki = call.q_index, call.k_index
            dq_c, dk_c, dv_c = for_call(impl, call).backward(
                do_thd.index_select(0, qi), q_thd.index_select(0, qi), k_thd.index_select(0, ki),
                v_thd.index_select(0, ki), carrier.index_select(0, qi), lse_ht.index_select(1, qi), call, scale)
            dq.index_add_(0, qi, dq_c.to(cd))
            dk.index_add_(0, ki, dk_c.to(cd))
            dv.index_add_(0, ki, dv_c.to(cd))
    od = out_dtype or q_thd.dtype
    return dq.to(od), dk.to(od), dv.to(od)


def merge_partials(o_list, lse_list):
    """LSE merge: the native kernels where they take these tensors (one non-fp64 dtype), else the
    reference, whose checks also name bad inputs."""
    dtypes = {getattr(o, "dtype", None) for o in o_list}
    use_native = len(dtypes) == 1 and torch.float64 not in dtypes and _native_merges(o_list[0])
    return (native if use_native else ref).merge_partials(o_list, lse_list)


def merge_into(o_acc, lse_acc, o_new, lse_new):
    """In-place two-way LSE merge (``reference.merge_into``); native where it takes these tensors (the
    accumulator may be wider than ``o_new``, neither fp64)."""
    use_native = _native_merges(o_acc) and torch.float64 not in (o_acc.dtype, getattr(o_new, "dtype", None))
    return (native if use_native else ref).merge_into(o_acc, lse_acc, o_new, lse_new)


def _native_merges(t) -> bool:
    """Whether the native merges take a tensor on ``t``'s device (CPU: dcp._C; CUDA: dcp._C_cuda)."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.device.type == "cpu":
        return native.is_available()
    return t.device.type == "cuda" and native.cuda_merge_available()
