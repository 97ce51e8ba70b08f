"""dcp's own layered plan on gloo ranks: rank 0 plans a model with full and sliding-window layers
(``dcp.plan`` -> ``LayeredPlan``), ``dcp.broadcast_plan`` ships it, and every kind runs exactly (forward,
gradients, with and without sinks) against dense fp64 attention. The batch's longest sequence exceeds the
memory budget of one rank, so the plans cut it over the ranks and move data."""
from __future__ import annotations

import pytest
import torch
from _dense import TOL, dense_attention_with_sinks
from _spawn import run_ranks

import dcp

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SEQLENS = (150, 30, 20)


def _spec():
    return dcp.BatchSpec(list(SEQLENS), {"full": "causal", "sliding": dcp.masks.SlidingWindowMask(12)}, 4, 2, 8,
                         "float64", layers={"full": 1, "sliding": 3})


def _dist(rank: int, world: int) -> dict:
    spec = _spec()
    plan = None
    if rank == 0:
        plan = dcp.plan(spec, dcp.Cluster(1, world), dcp.PlannerConfig(block_size=16), progress=False)
    plan = dcp.broadcast_plan(plan)
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(spec.total_tokens, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    idx = torch.from_numpy(plan.local_token_index(rank))
    out = {"type": type(plan).__name__}
    for kind in spec.kinds:
        for s in (None, sinks):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            if s is None:
                want = dcp.reference_attention(*leaves, spec.for_kind(kind))
            else:
                want = dense_attention_with_sinks(*leaves, spec.for_kind(kind), s)[0]
            grads = torch.autograd.grad(want, leaves, do)
            local = [x.index_select(0, idx).clone().requires_grad_() for x in (q, k, v)]
            o = dcp.attention(*local, plan, kind=kind, sinks=s, timeout=30)
            o.backward(do.index_select(0, idx))
            errs = [float((o.detach() - want.detach().index_select(0, idx)).abs().max())]
            errs += [float((a.grad - b.index_select(0, idx)).abs().max()) for a, b in zip(local, grads)]
            out[kind, s is None] = max(errs)
        st = plan.kind(kind).stats()
        out[kind, "crossing"] = (st.split_sequences, st.comm_bytes_total)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_dcps_layered_plan_is_exact_on_gloo_ranks(tmp_path, world):
    outs = run_ranks(_dist, world, tmp_path, deadline_s=90.0)
    assert all(o["type"] == "LayeredPlan" for o in outs)
    full, sliding = outs[0]["full", "crossing"], outs[0]["sliding", "crossing"]
    assert min(full) > 0 and min(sliding) > 0, (full, sliding)  # sequences cut over ranks, data moved
    assert sliding[1] < full[1]  # the windowed layers move less
    for rank, out in enumerate(outs):
        for kind in ("full", "sliding"):
            for plain in (True, False):
                assert out[kind, plain] < TOL, (rank, kind, plain, out[kind, plain])
