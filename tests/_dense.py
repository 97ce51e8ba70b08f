"""Dense fp64 attention as the oracle of a plan: random inputs, reference outputs and gradients, and the
check that a plan run by the reference executor reproduces them (shared by the baselines' tests)."""
from __future__ import annotations

import torch

from dcp.execute import ReferenceExecutor, reference_attention

TOL = 1e-10  # fp64 plans against fp64 dense attention: only summation order differs


def dense_case(spec, seed: int):
    """(q, k, v, do, o_ref, (dq, dk, dv)_ref): fp64 ``[tokens, heads, head_dim]`` inputs drawn from ``seed``
    and dense attention's output and gradients under ``spec``'s masks."""
    g = torch.Generator().manual_seed(seed)
    t, d = spec.total_tokens, spec.head_dim
    q, k, v, do = (torch.randn(t, h, d, generator=g, dtype=torch.float64)
                   for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = reference_attention(*leaves, spec)
    grads_ref = torch.autograd.grad(o_ref, leaves, do)
    return q, k, v, do, o_ref.detach(), grads_ref


def assert_matches_dense(plan, seed: int = 7, tol: float = TOL) -> None:
    """The plan's forward output and backward gradients (reference executor) equal dense attention's."""
    q, k, v, do, o_ref, grads_ref = dense_case(plan.spec, seed)
    ex = ReferenceExecutor()
    o, lse = ex.run_forward(plan, q, k, v)
    grads = ex.run_backward(plan, q, k, v, o, lse, do)
    for name, got, want in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        err = float((got - want).abs().max())
        assert err < tol, f"{plan.planner}: {name} differs from dense attention by {err:.3g}"


def dense_attention_with_sinks(q, k, v, spec, sinks, scale: float | None = None):
    """``(o [T, Hq, D], lse [Hq, T])`` of dense attention with attention sinks, autograd-capable (use fp64).

    Per sequence and query head h: the scores of the keys each row attends, with one more column, the sink
    logit ``sinks[h]`` (a virtual key of zero value); softmax over both; the sink column dropped before the
    values. Every row gathers only the keys it attends (padded with a masked zero key), so a NaN or inf meets
    only the rows that attend it, forward and backward, as ``reference_attention`` defines it. A row without
    keys and with a -inf sink is NaN (softmax over nothing): avoid it."""
    import math

    import numpy as np

    from dcp.masks import ranges_to_dense

    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    cu = spec.cu_seqlens
    outs, lses = [], []
    for s in range(spec.num_seqs):
        a, b = int(cu[s]), int(cu[s + 1])
        n = b - a
        mask_qk = torch.from_numpy(np.ascontiguousarray(ranges_to_dense(spec.kv_ranges(s), n)))
        counts = mask_qk.sum(1)
        width = max(int(counts.max()), 1)
        order = torch.argsort((~mask_qk).to(torch.int8), dim=1, stable=True)[:, :width]  # attended keys first
        valid_qm = torch.arange(width)[None, :] < counts[:, None]
        idx_qm = torch.where(valid_qm, order, n)                                       # pads -> the zero key
        zero = torch.zeros((1, hkv, d), dtype=k.dtype)
        k_qmhd, v_qmhd = torch.cat([k[a:b], zero])[idx_qm], torch.cat([v[a:b], zero])[idx_qm]
        scores = torch.einsum("qhgd,qmhd->hgqm", q[a:b].reshape(n, hkv, g, d), k_qmhd) * scale
        scores = scores.masked_fill(~valid_qm, float("-inf"))
        sink = sinks.to(q.dtype).reshape(hkv, g, 1, 1).expand(hkv, g, n, 1)
        full = torch.cat([scores, sink], -1)                                           # [Hkv, g, n, width + 1]
        p = torch.softmax(full, -1)[..., :width]                                       # the sink column dropped
        outs.append(torch.einsum("hgqm,qmhd->qhgd", p, v_qmhd).reshape(n, hq, d))
        lses.append(torch.logsumexp(full, -1).reshape(hq, n))
    return torch.cat(outs, 0), torch.cat(lses, 1)
