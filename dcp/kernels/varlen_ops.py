"""Fused varlen attention calls: flash-attn, PyTorch's bundled flash kernel, and a pure-PyTorch emulation.

Every implementation meets one interface (``VarlenOps``) over packed tensors:

    o_thd, lse_ht = ops.forward(q_thd, k_thd, v_thd, call, scale)
    dq, dk, dv    = ops.backward(do_thd, q_thd, k_thd, v_thd, o_thd, lse_ht, call, scale)

``q/o/do [Nq, Hq, D]``, ``k/v [Nk, Hkv, D]`` (GQA by head ratio), ``lse_ht [Hq, Nq]`` float32 (float64
from the emulation of float64 inputs), natural log; ``call`` is a ``VarlenCall`` (cu_seqlens, max
lengths, one bottom-right window). The backward takes the *final* output and lse of each row, as flash
kernels do: they use ``o`` only for ``D = rowsum(dO * O)``. Outputs come back in the input dtype, as from the flash kernels.

``EmulatedOps`` is the same arithmetic in plain PyTorch (fp32 accumulation, fp64 for fp64 inputs, NaN and
inf reaching exactly the rows and keys that attend them: ``dcp.kernels.masked``) on any device: the oracle the GPU implementations are checked against, and what lets CPU tests drive the
whole varlen path.
"""
from __future__ import annotations

import functools
import inspect

import torch

from dcp.errors import ExecutionError
from dcp.kernels.masked import keys_to_rows, masked, rows_to_keys, softmax_rows
from dcp.kernels.reference import compute_dtype
from dcp.kernels.varlen_schedule import VarlenCall

HALF_DTYPES = (torch.bfloat16, torch.float16)


def _window_mask(n: int, s: int, window: tuple[int, int], device) -> torch.Tensor:
    """Boolean ``[n, s]``: row t sees key j under flash's bottom-right window convention."""
    left, right = window
    t = torch.arange(n, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    d = s - n
    ok = torch.ones(n, s, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= t + d - left
    if right >= 0:
        ok &= j <= t + d + right
    return ok


class EmulatedOps:
    """Varlen attention in plain PyTorch, one dense block per packed sequence."""

    name = "emulated"

    def supports_window(self, window: tuple[int, int]) -> bool:
        return True

    def _seqs(self, call: VarlenCall):
        cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
        for i in range(call.n_seq):
            yield cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]

    def forward(self, q_thd, k_thd, v_thd, call: VarlenCall, scale: float):
        cd = compute_dtype(q_thd.dtype)
        hq, hkv = q_thd.shape[1], k_thd.shape[1]
        g = hq // hkv
        o = torch.zeros(q_thd.shape, dtype=cd, device=q_thd.device)
        lse = torch.full((hq, q_thd.shape[0]), float("-inf"), dtype=cd, device=q_thd.device)
        for a, b, c, d in self._seqs(call):
            qs = q_thd[a:b].to(cd).reshape(b - a, hkv, g, -1)
            ks, vs = k_thd[c:d].to(cd), v_thd[c:d].to(cd)
            allowed = _window_mask(b - a, d - c, call.window, q_thd.device)
            s = torch.einsum("qhgd,khd->hgqk", qs, ks) * scale
            p, lse_s = softmax_rows(s.masked_fill(~allowed, float("-inf")))
            o[a:b] = keys_to_rows(p, allowed, vs).reshape(b - a, hq, -1)
            lse[:, a:b] = lse_s.reshape(hq, b - a)
        return o.to(q_thd.dtype), lse

    def backward(self, do_thd, q_thd, k_thd, v_thd, o_thd, lse_ht, call: VarlenCall, scale: float):
        cd = compute_dtype(q_thd.dtype)
        hq, hkv = q_thd.shape[1], k_thd.shape[1]
        g = hq // hkv
        dq = torch.zeros(q_thd.shape, dtype=cd, device=q_thd.device)
        dk = torch.zeros(k_thd.shape, dtype=cd, device=q_thd.device)
        dv = torch.zeros(k_thd.shape, dtype=cd, device=q_thd.device)
        delta = (do_thd.to(cd) * o_thd.to(cd)).sum(-1).t()  # [Hq, Nq], as the flash kernels form it
        for a, b, c, d in self._seqs(call):
            n = b - a
            qs = q_thd[a:b].to(cd).reshape(n, hkv, g, -1)
            dos = do_thd[a:b].to(cd).reshape(n, hkv, g, -1)
            ks, vs = k_thd[c:d].to(cd), v_thd[c:d].to(cd)
            allowed = _window_mask(n, d - c, call.window, q_thd.device)
            s = torch.einsum("qhgd,khd->hgqk", qs, ks) * scale
            s = s.masked_fill(~allowed, float("-inf"))
            p = masked(torch.exp(s - lse_ht[:, a:b].to(cd).reshape(hkv, g, n)[..., None]), allowed)
            dp = torch.einsum("qhgd,khd->hgqk", dos, vs)
            ds = masked(p * (dp - delta[:, a:b].reshape(hkv, g, n)[..., None]), allowed)
            dq[a:b] = (keys_to_rows(ds, allowed, ks) * scale).reshape(n, hq, -1)
            dv[c:d] = rows_to_keys(p, allowed, dos)
            dk[c:d] = rows_to_keys(ds, allowed, qs) * scale
        return dq.to(q_thd.dtype), dk.to(q_thd.dtype), dv.to(q_thd.dtype)


def _window_args(call: VarlenCall):
    """(is_causal, left or None, right or None) in PyTorch's flash op convention."""
    if call.causal:
        return True, None, None
    left, right = call.window
    return False, (left if left >= 0 else None), (right if right >= 0 else None)


def _lse_packed(lse: torch.Tensor, call: VarlenCall) -> torch.Tensor:
    """Flash builds differ in the varlen lse layout: ``[H, Nq]`` (current) or ``[B, H, max_q]`` (old)."""
    nq = int(call.q_index.numel())
    if lse.dim() == 2 and lse.shape[1] == nq:
        return lse.float()
    if lse.dim() == 3 and lse.shape[0] == call.n_seq:
        cu = call.cu_q.tolist()
        return torch.cat([lse[i, :, :cu[i + 1] - cu[i]] for i in range(call.n_seq)], dim=1).float()
    raise ExecutionError(f"unexpected varlen softmax_lse shape {tuple(lse.shape)} for {nq} packed rows")


def _lse_for_backward(lse_ht: torch.Tensor, call: VarlenCall, layout_3d: bool) -> torch.Tensor:
    if not layout_3d:
        return lse_ht.contiguous()
    cu = call.cu_q.tolist()
    out = lse_ht.new_zeros(call.n_seq, lse_ht.shape[0], call.max_q)
    for i in range(call.n_seq):
        out[i, :, :cu[i + 1] - cu[i]] = lse_ht[:, cu[i]:cu[i + 1]]
    return out


class TorchFlashOps:
    """PyTorch's bundled flash kernel (``aten::_flash_attention_forward/_backward``, CUDA, fp16/bf16)."""

    name = "torch_flash"

    def __init__(self):
        self._lse_3d = False
        args = {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
        self._windows = "window_size_left" in args  # older PyTorch: full and causal only

    def supports_window(self, window: tuple[int, int]) -> bool:
        return self._windows or window in ((-1, -1), (-1, 0))

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        if device.type != "cuda" or dtype not in HALF_DTYPES or head_dim > 256 or head_dim % 8:
            return False
        if not getattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)():
            return False
        return torch.cuda.get_device_capability(device) >= (8, 0)

    def forward(self, q_thd, k_thd, v_thd, call: VarlenCall, scale: float):
        causal, left, right = _window_args(call)
        kw = dict(window_size_left=left, window_size_right=right) if self._windows else {}
        o, lse, *_ = torch.ops.aten._flash_attention_forward(
            q_thd, k_thd, v_thd, call.cu_q, call.cu_k, call.max_q, call.max_k, 0.0, causal, False,
            scale=scale, **kw)
        self._lse_3d = lse.dim() == 3
        return o, _lse_packed(lse, call)

    def backward(self, do_thd, q_thd, k_thd, v_thd, o_thd, lse_ht, call: VarlenCall, scale: float):
        causal, left, right = _window_args(call)
        unused = torch.empty((), dtype=torch.int64, device=q_thd.device)  # RNG state: no dropout
        kw = dict(window_size_left=left, window_size_right=right) if self._windows else {}
        return torch.ops.aten._flash_attention_backward(
            do_thd, q_thd, k_thd, v_thd, o_thd, _lse_for_backward(lse_ht, call, self._lse_3d), call.cu_q,
            call.cu_k, call.max_q, call.max_k, 0.0, causal, unused, unused, scale=scale, **kw)


class FlashAttnOps:
    """The ``flash_attn`` package's varlen kernels (flash-attention 2), when installed."""

    name = "flash_attn"

    def __init__(self):
        from flash_attn import flash_attn_interface as fai  # noqa: F401 - raises ImportError if absent

        self._fai = fai
        self._bwd_params = set(inspect.signature(fai._flash_attn_varlen_backward).parameters)
        self._lse_3d = False

    def supports_window(self, window: tuple[int, int]) -> bool:
        return True

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        return device.type == "cuda" and dtype in HALF_DTYPES and head_dim <= 256

    def forward(self, q_thd, k_thd, v_thd, call: VarlenCall, scale: float):
        o, lse, _ = self._fai.flash_attn_varlen_func(
            q_thd, k_thd, v_thd, call.cu_q, call.cu_k, call.max_q, call.max_k, dropout_p=0.0,
            softmax_scale=scale, causal=call.causal, window_size=call.window, return_attn_probs=True)
        self._lse_3d = lse.dim() == 3
        return o, _lse_packed(lse, call)

    def backward(self, do_thd, q_thd, k_thd, v_thd, o_thd, lse_ht, call: VarlenCall, scale: float):
        dq, dk, dv = torch.empty_like(q_thd), torch.empty_like(k_thd), torch.empty_like(v_thd)
        # the private backward's keyword set changed across flash-attn 2 releases: pass what it takes
        kw = dict(dout=do_thd, q=q_thd, k=k_thd, v=v_thd, out=o_thd,
                  softmax_lse=_lse_for_backward(lse_ht, call, self._lse_3d), dq=dq, dk=dk, dv=dv,
                  cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q,
                  max_seqlen_k=call.max_k, dropout_p=0.0, softmax_scale=scale, causal=call.causal,
                  window_size=call.window, window_size_left=call.window[0], window_size_right=call.window[1],
                  softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None)
        self._fai._flash_attn_varlen_backward(**{k: v for k, v in kw.items() if k in self._bwd_params})
        return dq, dk, dv


_EMULATED = EmulatedOps()
_GPU_OPS: list = []


def _gpu_ops() -> list:
    if not _GPU_OPS:
        try:
            _GPU_OPS.append(FlashAttnOps())
        except Exception:  # noqa: BLE001 - not installed or an incompatible build
            pass
        _GPU_OPS.append(TorchFlashOps())
    return _GPU_OPS


def select_ops(dtype: torch.dtype, device: torch.device, head_dim: int, prefer: str = "auto"):
    """The varlen implementation for these inputs: ``prefer`` 'auto' (flash_attn, else torch_flash,
    else emulated), or one of 'flash_attn', 'torch_flash', 'emulated' (``ExecutionError`` if unusable).
    Cached per argument tuple: it runs on every kernel call."""
    return _select_ops(dtype, device, int(head_dim), prefer)


@functools.lru_cache(maxsize=64)
def _select_ops(dtype: torch.dtype, device: torch.device, head_dim: int, prefer: str):
    if prefer == "emulated":
        return _EMULATED
    for ops in _gpu_ops() if device.type == "cuda" else []:
        if prefer in ("auto", ops.name) and ops.supports(dtype, device, head_dim):
            return ops
    if prefer == "auto":
        return _EMULATED
    raise ExecutionError(f"varlen ops {prefer!r} cannot run {dtype} inputs of head dim {head_dim} on {device} "
                         f"(flash kernels need a CUDA device of compute capability >= 8.0, fp16/bf16, "
                         f"head dim <= 256)")


def for_call(ops, call: VarlenCall):
    """``ops``, or the emulation for a window ``ops`` cannot express (old PyTorch flash op)."""
    return ops if ops.supports_window(call.window) else _EMULATED


def gpu_varlen_available(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a real flash varlen kernel (not the emulation) can run these inputs."""
    return device.type == "cuda" and select_ops(dtype, device, head_dim) is not _EMULATED
