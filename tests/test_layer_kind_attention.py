"""Picking a layer kind: ``dcp.attention(..., kind=)`` and ``DCPAttention(...)(..., kind=)`` on a ``LayeredPlan``.

A layered batch (full causal and sliding-window layers) gets one plan per kind over one placement. Until
dcp's own planner is the one under test here, the ``LayeredPlan`` is built from a static baseline (zigzag),
which places tokens independently of the mask, so the kinds' homes agree. Each kind runs in one process (one
device and three) and on 2 gloo ranks (plans that cut sequences over the ranks and move data), forward and
backward against dense fp64 attention under that kind's masks; with sinks too on the ranks. A missing or
unknown kind, or a kind with a plain ``Plan``, raises ``InvalidPlanError`` before any transfer.
"""
from __future__ import annotations

import pytest
import torch
from _dense import TOL, dense_attention_with_sinks
from _spawn import run_ranks

import dcp
from dcp.baselines import ZigzagPlanner
from dcp.integration import DCPAttention
from dcp.ir.layered import LayeredPlan

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SEQLENS = (40, 23, 61)
SPAWN_DEADLINE_S = 90.0


def _spec(masks=None, layers=None):
    masks = {"full": "causal", "sliding": dcp.masks.SlidingWindowMask(16)} if masks is None else masks
    layers = {"full": 1, "sliding": 2} if layers is None else layers
    return dcp.BatchSpec(list(SEQLENS), masks=masks, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float64",
                         layers=layers)


def _layered(n_devices: int, spec=None) -> LayeredPlan:
    """One zigzag plan per kind (mask-independent placement: the kinds' homes agree)."""
    spec = _spec() if spec is None else spec
    cluster = dcp.Cluster(1, n_devices)
    return LayeredPlan(spec, tuple(ZigzagPlanner().plan(spec.for_kind(k), cluster) for k in spec.kinds))


def _inputs(spec, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t, d = spec.total_tokens, spec.head_dim
    return tuple(torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))


def _truth(spec, kind: str, q, k, v, do, sinks=None):
    """Dense fp64 ``(o, lse, dq, dk, dv)`` of the whole batch under ``kind``'s masks (sinked with ``sinks``)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    one = spec.for_kind(kind)
    if sinks is None:
        o, lse = dcp.reference_attention(*leaves, one, return_lse=True)
    else:
        o, lse = dense_attention_with_sinks(*leaves, one, sinks)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, leaves, do))


def _err(got, want) -> float:
    return max(float((g - w).abs().max()) for g, w in zip(got, want))


# ------------------------------------------------------------------------------------------ one process
def test_each_kind_runs_its_own_masks_in_one_process():
    spec = _spec()
    q, k, v, do = _inputs(spec)
    truths = {kind: _truth(spec, kind, q, k, v, do) for kind in spec.kinds}
    # the kinds differ, so running the wrong kind's plan could not pass
    assert float((truths["full"][0] - truths["sliding"][0]).abs().max()) > 0.1
    attn = DCPAttention(mode="single_process")
    for n_devices in (1, 3):
        plan = _layered(n_devices)
        for kind in spec.kinds:
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o = attn(*leaves, plan, kind=kind)
            o.backward(do)
            want = truths[kind]
            err = _err((o.detach(), *(x.grad for x in leaves)), (want[0], *want[2:]))
            assert err < TOL, (n_devices, kind, err)
    plan = _layered(1)  # dcp.attention's one-device run, with the lse
    for kind in spec.kinds:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = dcp.attention(*leaves, plan, kind=kind, return_lse=True)
        o.backward(do)
        assert _err((o.detach(), lse, *(x.grad for x in leaves)), truths[kind]) < TOL, kind


def test_a_one_kind_layered_plan_needs_no_kind():
    spec = _spec(masks={"only": dcp.masks.SlidingWindowMask(16)}, layers={"only": 4})
    plan = _layered(2, spec)
    q, k, v, do = _inputs(spec)
    want = dcp.reference_attention(q, k, v, spec.for_kind("only"))
    o = DCPAttention(mode="single_process")(q, k, v, plan)
    assert float((o - want).abs().max()) < TOL


def test_missing_unknown_or_unwanted_kind_raises_invalid_plan_error():
    spec = _spec()
    q, k, v, _ = _inputs(spec)
    layered1, layered3 = _layered(1), _layered(3)
    plain = ZigzagPlanner().plan(spec.for_kind("full"), dcp.Cluster(1, 1))
    attn = DCPAttention(mode="single_process")
    for run in (lambda p, **kw: dcp.attention(q, k, v, p, **kw), lambda p, **kw: attn(q, k, v, p, **kw)):
        for layered in (layered1, layered3):  # the kind is picked before anything runs
            with pytest.raises(dcp.InvalidPlanError, match=r"kind=\.\.\."):
                run(layered)
            with pytest.raises(dcp.InvalidPlanError, match="no layer kind 'global'"):
                run(layered, kind="global")
        with pytest.raises(dcp.InvalidPlanError, match="kind='sliding' given, but the plan has one layer kind"):
            run(plain, kind="sliding")
    # the module still checks the tensors against the layered batch
    with pytest.raises(dcp.ExecutionError, match="heads"):
        attn(q[:, :2].contiguous(), k, v, layered3, kind="full")
    with pytest.raises(dcp.ExecutionError, match="dcp.Plan or dcp.LayeredPlan"):
        attn(q, k, v, "plan", kind="full")


# ------------------------------------------------------------------------------------------ gloo ranks
def _dist_kinds(rank: int, world: int) -> dict:
    out = {}
    spec = _spec()
    plan = _layered(world)
    q, k, v, do = _inputs(spec, seed=5)
    sinks = torch.tensor([1.5, -0.5, 2.0, 0.0], dtype=torch.float64)
    idx = torch.from_numpy(plan.local_token_index(rank))
    mine = lambda x, dim=0: x.index_select(dim, idx)  # noqa: E731
    for kind in spec.kinds:
        for with_sinks in (False, True):
            want = _truth(spec, kind, q, k, v, do, sinks if with_sinks else None)
            ql, kl, vl = (mine(x).clone().requires_grad_() for x in (q, k, v))
            if with_sinks:
                o, lse = dcp.attention(ql, kl, vl, plan, kind=kind, sinks=sinks, timeout=20, return_lse=True)
                got, ref = (o, lse), (mine(want[0]), mine(want[1], 1))
            else:
                o = DCPAttention(timeout=20)(ql, kl, vl, plan, kind=kind)
                got, ref = (o,), (mine(want[0]),)
            o.backward(mine(do))
            out[kind, with_sinks] = _err((*(x.detach() for x in got), ql.grad, kl.grad, vl.grad),
                                         (*ref, *(mine(w) for w in want[2:])))
        out[kind, "crossing"] = (plan.kind(kind).stats().split_sequences, plan.kind(kind).stats().comm_bytes_total)
    try:  # every rank raises before any transfer: no rank is left waiting
        DCPAttention(timeout=20)(mine(q), mine(k), mine(v), plan)
        out["no_kind"] = "no error"
    except dcp.InvalidPlanError as err:
        out["no_kind"] = str(err)
    return out


def test_each_kind_on_two_gloo_ranks(tmp_path):
    outs = run_ranks(_dist_kinds, 2, tmp_path, deadline_s=SPAWN_DEADLINE_S)
    for kind in _spec().kinds:
        assert min(outs[0][kind, "crossing"]) > 0, (kind, outs[0][kind, "crossing"])  # cut sequences, moved data
        for rank, out in enumerate(outs):
            for with_sinks in (False, True):
                assert out[kind, with_sinks] < TOL, (kind, with_sinks, rank, out[kind, with_sinks])
    assert all("say which one the layer is" in out["no_kind"] for out in outs), [o["no_kind"] for o in outs]
