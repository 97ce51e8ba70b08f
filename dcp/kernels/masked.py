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

import torch

#: bound on the elements of one correction product (the [.., rows or keys, chunk, D] tensor)
CHUNK_ELEMENTS = 1 << 24


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


def _nonfinite(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(finite mask of ``x``, indices along dim 0 holding a non-finite entry), or None if all finite."""
    fin = torch.isfinite(x)
    if bool(fin.all()):
        return None
    return fin, torch.nonzero(~fin.flatten(1).all(dim=1)).flatten()


def keys_to_rows(w_hgqk: torch.Tensor, allowed_qk: torch.Tensor, x_khd: torch.Tensor) -> torch.Tensor:
    """``[Tq, Hkv, G, D]``: per row, the ``w``-weighted sum of ``x`` over the keys it attends."""
    w = masked(w_hgqk, allowed_qk)
    nf = _nonfinite(x_khd)
    if nf is None:
        return torch.einsum("hgqk,khd->qhgd", w, x_khd)
    fin, bad = nf
    out = torch.einsum("hgqk,khd->qhgd", w, torch.where(fin, x_khd, 0.0))
    hkv, g, tq, _ = w.shape
    step = max(1, CHUNK_ELEMENTS // max(1, hkv * g * tq * x_khd.shape[-1]))
    for c in range(0, bad.numel(), step):
        j = bad[c:c + step]
        x_nf = torch.where(fin[j], 0.0, x_khd[j])                            # [J, Hkv, D]: only the non-finite parts
        prod = w[..., j, None] * x_nf.permute(1, 0, 2)[:, None, None]        # [Hkv, G, Tq, J, D]
        prod = torch.where(allowed_qk[:, j][None, None, :, :, None], prod, 0.0)
        out = out + prod.sum(dim=3).permute(2, 0, 1, 3)
    return out


def rows_to_keys(w_hgqk: torch.Tensor, allowed_qk: torch.Tensor, x_qhgd: torch.Tensor) -> torch.Tensor:
    """``[Tk, Hkv, D]``: per key, the ``w``-weighted sum of ``x`` over the rows (and group heads) that
    attend it."""
    w = masked(w_hgqk, allowed_qk)
    nf = _nonfinite(x_qhgd)
    if nf is None:
        return torch.einsum("hgqk,qhgd->khd", w, x_qhgd)
    fin, bad = nf
    out = torch.einsum("hgqk,qhgd->khd", w, torch.where(fin, x_qhgd, 0.0))
    hkv, g, _, tk = w.shape
    step = max(1, CHUNK_ELEMENTS // max(1, hkv * g * tk * x_qhgd.shape[-1]))
    for c in range(0, bad.numel(), step):
        i = bad[c:c + step]
        x_nf = torch.where(fin[i], 0.0, x_qhgd[i])                           # [I, Hkv, G, D]
        prod = w[:, :, i, :, None] * x_nf.permute(1, 2, 0, 3)[:, :, :, None]  # [Hkv, G, I, Tk, D]
        prod = torch.where(allowed_qk[i][None, None, :, :, None], prod, 0.0)
        out = out + prod.sum(dim=(1, 2)).permute(1, 0, 2)
    return out


__all__ = ["keys_to_rows", "rows_to_keys", "masked", "softmax_rows"]
