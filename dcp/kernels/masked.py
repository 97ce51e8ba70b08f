"""Masked attention products that stay exact when inputs hold NaN or inf.

Attention defines row ``i``'s output from ``q_i`` and the keys/values row ``i`` attends, nothing else. Dense
kernels compute ``P @ V`` (and the backward's ``dS @ K``, ``P^T @ dO``, ``dS^T @ Q``) over a block in which
masked pairs merely carry weight 0, and IEEE arithmetic makes ``0 * NaN`` and ``0 * inf`` NaN: one
non-finite value would poison every row (or key) of the block, even those that never meet it, and other
sequences packed into the same block. These products zero the weights of masked pairs explicitly and
add the contributions of non-finite operand entries only through allowed pairs, so

    keys_to_rows(w, allowed, x)[i] == sum over keys j that row i attends of w[i, j] * x[j]
    rows_to_keys(w, allowed, x)[j] == sum over rows i that attend key j of w[i, j] * x[i]

exactly as the restricted sums define them (finite inputs take the plain einsum and nothing else), and
``softmax_rows`` gives every dense path one convention for rows with NaN or +inf scores.

Layouts (GQA: query head ``h * G + g`` reads kv head ``h``): weights ``w_hgqk [Hkv, G, Tq, Tk]``,
``allowed_qk [Tq, Tk]`` bool, key-side ``x_khd [Tk, Hkv, D]``, row-side ``x_qhgd [Tq, Hkv, G, D]``.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

#: bound on the elements of one correction product (the [.., rows or keys, chunk, D] tensor)
CHUNK_ELEMENTS = 1 << 24

_BRANCH_FREE: contextvars.ContextVar = contextvars.ContextVar("dcp_masked_branch_free", default=False)


@contextlib.contextmanager
def branch_free():
    """Inside: the products never read data on the host (no "are all inputs finite?" branch), so a CUDA graph
    (or ``dcp.execute.graphs``' tape) can capture them; same results, a few more matmuls (on indicators)."""
    token = _BRANCH_FREE.set(True)
    try:
        yield
    finally:
        _BRANCH_FREE.reset(token)


def _exact_branch_free(w, allowed_qk, x, plain):
    """``_exact`` without a host branch: the non-finite entries' contributions through allowed pairs follow
    from counts (matmuls of 0/1 indicators): NaN if an allowed pair meets a NaN, an inf with weight 0, or
    infs of both signs; else +-inf if one sign of inf meets a non-zero weight; the finite part as usual."""
    allowed = allowed_qk.expand_as(w)
    fin = torch.isfinite(x)
    one = lambda m: m.to(w.dtype)  # noqa: E731
    pos, neg, zero = one(allowed & (w > 0)), one(allowed & (w < 0)), one(allowed & (w == 0))
    x_pinf, x_minf = one(torch.isposinf(x)), one(torch.isneginf(x))
    nan = (plain(one(allowed), one(torch.isnan(x))) + plain(zero, x_pinf + x_minf)) > 0
    up = (plain(pos, x_pinf) + plain(neg, x_minf)) > 0
    down = (plain(pos, x_minf) + plain(neg, x_pinf)) > 0
    inf = torch.full((), float("inf"), dtype=w.dtype, device=w.device)
    nf = torch.where(nan | (up & down), inf - inf, torch.where(up, inf, torch.where(down, -inf, 0.0)))
    return plain(masked(w, allowed_qk), torch.where(fin, x, 0.0)) + nf


def masked(w_hgqk: torch.Tensor, allowed_qk: torch.Tensor) -> torch.Tensor:
    """``w`` with masked pairs set to exactly 0 (whatever NaN they held)."""
    return torch.where(allowed_qk, w_hgqk, torch.zeros((), dtype=w_hgqk.dtype, device=w_hgqk.device))


def softmax_rows(s_hgqk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, lse)`` of masked scores along the last dim: ``p = exp(s - lse)``, ``lse = log sum exp s``.

    A row without keys (all -inf) gets p = 0 and lse = -inf. A NaN score, or a +inf one (softmax's
    inf - inf), makes the row's p and lse NaN: unlike ``torch.logsumexp``, which returns +inf there, so
    that every kernel, merge and the dense oracle agree on it.
    """
    m = s_hgqk.amax(-1, keepdim=True) if s_hgqk.shape[-1] else \
        torch.full(s_hgqk.shape[:-1] + (1,), float("-inf"), dtype=s_hgqk.dtype, device=s_hgqk.device)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()
    e = torch.exp(s_hgqk - m)
    denom = e.sum(-1, keepdim=True)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    return p, (torch.log(denom) + m).squeeze(-1)


def _exact(w_hgqk, allowed_qk, x, plain, nonfinite_part, per_index: int):
    """``plain(w, x)`` with masked weights zeroed; when ``x`` has non-finite entries, ``plain`` runs on the
    finite part and ``nonfinite_part(w, x_nf, idx)`` adds, through allowed pairs only, the non-finite part
    of the dim-0 entries ``idx`` of ``x`` that hold one (in chunks of about ``CHUNK_ELEMENTS``)."""
    if _BRANCH_FREE.get():
        return _exact_branch_free(w_hgqk, allowed_qk, x, plain)
    w = masked(w_hgqk, allowed_qk)
    fin = torch.isfinite(x)
    if bool(fin.all()):
        return plain(w, x)
    bad = torch.nonzero(~fin.flatten(1).all(dim=1)).flatten()
    out = plain(w, torch.where(fin, x, 0.0))
    step = max(1, CHUNK_ELEMENTS // max(1, per_index))
    for c in range(0, bad.numel(), step):
        idx = bad[c:c + step]
        out = out + nonfinite_part(w, torch.where(fin[idx], 0.0, x[idx]), idx)
    return out


def keys_to_rows(w_hgqk: torch.Tensor, allowed_qk: torch.Tensor, x_khd: torch.Tensor) -> torch.Tensor:
    """``[Tq, Hkv, G, D]``: per row, the ``w``-weighted sum of ``x`` over the keys it attends."""
    def nonfinite_part(w, x_nf, j):                                          # x_nf [J, Hkv, D]
        prod = w[..., j, None] * x_nf.permute(1, 0, 2)[:, None, None]        # [Hkv, G, Tq, J, D]
        prod = torch.where(allowed_qk[:, j][None, None, :, :, None], prod, 0.0)
        return prod.sum(dim=3).permute(2, 0, 1, 3)

    hkv, g, tq, _ = w_hgqk.shape
    return _exact(w_hgqk, allowed_qk, x_khd, lambda w, x: torch.einsum("hgqk,khd->qhgd", w, x), nonfinite_part,
                  hkv * g * tq * x_khd.shape[-1])


def rows_to_keys(w_hgqk: torch.Tensor, allowed_qk: torch.Tensor, x_qhgd: torch.Tensor) -> torch.Tensor:
    """``[Tk, Hkv, D]``: per key, the ``w``-weighted sum of ``x`` over the rows (and group heads) that
    attend it."""
    def nonfinite_part(w, x_nf, i):                                          # x_nf [I, Hkv, G, D]
        prod = w[:, :, i, :, None] * x_nf.permute(1, 2, 0, 3)[:, :, :, None]  # [Hkv, G, I, Tk, D]
        prod = torch.where(allowed_qk[i][None, None, :, :, None], prod, 0.0)
        return prod.sum(dim=(1, 2)).permute(1, 0, 2)

    hkv, g, _, tk = w_hgqk.shape
    return _exact(w_hgqk, allowed_qk, x_qhgd, lambda w, x: torch.einsum("hgqk,qhgd->khd", w, x), nonfinite_part,
                  hkv * g * tk * x_qhgd.shape[-1])


__all__ = ["keys_to_rows", "rows_to_keys", "masked", "softmax_rows", "branch_free"]
