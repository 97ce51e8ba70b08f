"""Dense masked attention of a whole packed batch: the ground truth the executors are tested against."""
from __future__ import annotations

import math

import numpy as np
import torch

from dcp.kernels.masked import softmax_rows
from dcp.masks import ranges_to_dense
from dcp.spec import BatchSpec


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec,
                        scale: float | None = None, return_lse: bool = False):
    """Attention of the packed batch ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` under ``spec``'s masks.

    Per sequence: a boolean ``[L, L]`` mask from ``spec.kv_ranges`` and a dense softmax in the inputs'
    dtype (autograd-capable; use fp64 for a tight reference). A query with no key gets o = 0 and
    lse = -inf. Returns ``o [T, Hq, D]`` (and ``lse [Hq, T]`` when ``return_lse``).

    NaN and inf propagate as attention defines them: row i's output depends on ``q_i`` and on the keys and
    values row i attends, nothing else. A NaN in ``q_i`` makes row i's ``o`` and ``lse`` NaN; one in an
    attended key ``k_j`` the rows that attend j; one in ``v_j`` the ``o`` of the rows that attend j; never
    a row that does not attend it, nor another sequence (the gradients, by autograd, likewise). A +inf
    score makes its row NaN (softmax's inf - inf; ``dcp.kernels.masked.softmax_rows``). A sequence with a
    non-finite input is computed row by row over gathered keys for that.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t != spec.total_tokens or k.shape != (t, hkv, d) or v.shape != k.shape or hq != spec.num_heads \
            or hkv != spec.num_kv_heads:
        raise ValueError(f"reference_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do "
                         f"not fit the batch ({spec.total_tokens} tokens, {spec.num_heads}/{spec.num_kv_heads} "
                         f"heads)")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g = hq // hkv
    cu = spec.cu_seqlens
    outs, lses = [], []
    for s in range(spec.num_seqs):
        a, b = int(cu[s]), int(cu[s + 1])
        n = b - a
        mask = torch.from_numpy(np.ascontiguousarray(ranges_to_dense(spec.kv_ranges(s), n))).to(q.device)
        qs = q[a:b].reshape(n, hkv, g, d)
        finite = all(bool(torch.isfinite(x[a:b]).all()) for x in (q, k, v))
        attend = _dense_rows if finite else _gathered_rows
        o, lse = attend(qs, k[a:b], v[a:b], mask, scale)
        outs.append(o.reshape(n, hq, d))
        lses.append(lse.reshape(hq, n))
    o = torch.cat(outs, 0)
    if return_lse:
        return o, torch.cat(lses, 1)
    return o


def _dense_rows(q_qhgd, k_khd, v_khd, mask_qk, scale):
    """One sequence as dense matmuls (exact for finite inputs)."""
    scores = torch.einsum("qhgd,khd->hgqk", q_qhgd, k_khd) * scale
    p, lse = softmax_rows(scores.masked_fill(~mask_qk, float("-inf")))
    return torch.einsum("hgqk,khd->qhgd", p, v_khd), lse


def _gathered_rows(q_qhgd, k_khd, v_khd, mask_qk, scale, chunk_elements: int = 1 << 24):
    """One sequence row by row over the keys each row attends: every row gathers its keys (padded with a
    zero key whose score is masked), so a NaN or inf meets only the rows that attend it, forward and
    backward, as attention defines it. O(L * keys per row) memory, in row chunks."""
    n, hkv, g, d = q_qhgd.shape
    counts = mask_qk.sum(1)
    width = max(int(counts.max()) if n else 0, 1)
    order = torch.argsort((~mask_qk).to(torch.int8), dim=1, stable=True)[:, :width]  # attended keys first
    valid = torch.arange(width, device=q_qhgd.device)[None, :] < counts[:, None]    # [n, width]
    idx = torch.where(valid, order, n)                                               # pads -> the zero key
    zero = torch.zeros((1, hkv, d), dtype=k_khd.dtype, device=k_khd.device)
    k_ext, v_ext = torch.cat([k_khd, zero]), torch.cat([v_khd, zero])
    rows = max(1, chunk_elements // (width * hkv * d))
    outs, lses = [], []
    for r0 in range(0, n, rows):
        sl = slice(r0, r0 + rows)
        kg, vg = k_ext[idx[sl]], v_ext[idx[sl]]                                      # [rows, width, Hkv, D]
        scores = torch.einsum("qhgd,qmhd->hgqm", q_qhgd[sl], kg) * scale
        p, lse = softmax_rows(scores.masked_fill(~valid[sl], float("-inf")))
        outs.append(torch.einsum("hgqm,qmhd->qhgd", p, vg))
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 2)
