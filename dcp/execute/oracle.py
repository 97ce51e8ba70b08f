"""Dense masked attention of a whole packed batch: the ground truth the executors are tested against."""
from __future__ import annotations

import math

import numpy as np
import torch

from dcp.masks import ranges_to_dense
from dcp.spec import BatchSpec


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: BatchSpec,
                        scale: float | None = None, return_lse: bool = False):
    """Attention of the packed batch ``q [T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` under ``spec``'s masks.

    Per sequence: a boolean ``[L, L]`` mask from ``spec.kv_ranges`` and a dense softmax in the inputs'
    dtype (autograd-capable; use fp64 for a tight reference). A query with no key gets o = 0 and
    lse = -inf. Returns ``o [T, Hq, D]`` (and ``lse [Hq, T]`` when ``return_lse``).
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
        scores = torch.einsum("qhgd,khd->hgqk", qs, k[a:b]) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        m = scores.amax(-1, keepdim=True).detach()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(scores - m)
        denom = p.sum(-1, keepdim=True)
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = torch.einsum("hgqk,khd->qhgd", p / safe, v[a:b])
        outs.append(o.reshape(n, hq, d))
        if return_lse:
            lses.append((torch.log(denom) + m).reshape(hq, n))
    o = torch.cat(outs, 0)
    if return_lse:
        return o, torch.cat(lses, 1)
    return o
