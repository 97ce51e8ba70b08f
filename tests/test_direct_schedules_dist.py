"""dcp placements run under their direct schedules (``dcp.planner.polish.direct_schedule``: inputs straight
from home, partials straight home, token-ordered or ring-shifted overlap groups, hierarchical or not) on
gloo ranks, against dense fp64 attention: the schedules ``polish`` may choose execute exactly, and the
batch provably moves data between ranks and nodes."""
from __future__ import annotations

import time

import numpy as np
from _dense import assert_matches_dense, dense_case

import dcp
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask
from dcp.partition import GreedyPartitioner
from dcp.planner.dcp_planner import DCPPlanner
from dcp.planner.polish import DIRECT_ORDERS, direct_schedule
from dcp.schedule.assemble import assemble
from dcp.schedule.stages import Schedule

#: (order, forward degree / hierarchical, backward degree / hierarchical) of the plans run
SETTINGS = (("direct", (1, False), (2, True)), ("shifted", (2, True), (3, False)))


def _direct_plans():
    """Deterministic: the 4-device (2 x 2) plans of one batch, the search's packing (its longest sequence, more
    than a node can hold within the memory budget, split over devices of both nodes) under each setting of
    ``SETTINGS``."""
    spec = dcp.BatchSpec([60, 9, 10, 6], [CausalMask(), LambdaMask(sink=2, window=6), SharedQuestionMask(0.25, 2),
                                          CausalMask()], 4, 2, 8, dtype="float64")
    cluster = dcp.Cluster(2, 2)
    cfg = dcp.PlannerConfig(block_size=4, partitioner=GreedyPartitioner(), time_budget_s=None)
    search = DCPPlanner(cfg).search(spec, cluster)
    cand = next(c for c in search.cands if c.label.startswith("pack(")
                and len(np.unique(c.home[c.layout.tb_seq == 0])) > 2)
    plans = []
    for order, fwd, bwd in SETTINGS:
        (fs, fr), (bs, br) = (direct_schedule(cand, cluster, d, h, order) for d, h in (fwd, bwd))
        plans.append(assemble(spec, cluster, cand.layout, cand.tiles, cand.home, cand.tile_device, fs, fr,
                              f"dcp:{order}", time.perf_counter(), backward=Schedule("backward", bs, br)))
    return plans


def test_direct_schedules_match_dense_attention():
    plans = _direct_plans()
    assert {p.planner for p in plans} == {f"dcp:{o}" for o in DIRECT_ORDERS}
    for plan in plans:
        assert plan.meta["valid"]
        assert_matches_dense(plan, seed=3)


def _rank_errors(rank, world):
    """Each rank plans (deterministically), runs dcp.attention on its slice, compares with dense fp64."""
    out = {}
    for plan in _direct_plans():
        q, k, v, do, o_ref, g_ref = dense_case(plan.spec, seed=0)
        ql, kl, vl = (dcp.dispatch(plan, rank, x).requires_grad_() for x in (q, k, v))
        o = dcp.attention(ql, kl, vl, plan, timeout=30)
        o.backward(dcp.dispatch(plan, rank, do))

        def err(a, b):
            return float((a.detach() - dcp.dispatch(plan, rank, b)).abs().max()) if a.numel() else 0.0

        out[plan.planner] = {"o": err(o, o_ref), "dq": err(ql.grad, g_ref[0]), "dk": err(kl.grad, g_ref[1]),
                             "dv": err(vl.grad, g_ref[2]), "n": int(ql.shape[0])}
    return out


def test_four_gloo_ranks_on_two_nodes(tmp_path):
    from _spawn import run_ranks

    for plan in _direct_plans():  # the batch provably moves data between ranks, across the two nodes too
        stats = plan.stats()
        assert stats.comm_bytes_total > 0 and stats.comm_bytes_inter_node > 0
        assert len(set(plan.home[plan.layout.tb_seq == 0].tolist())) > 2
    results = run_ranks(_rank_errors, 4, tmp_path, deadline_s=180.0)
    for res in results:
        assert set(res) == {f"dcp:{o}" for o in DIRECT_ORDERS}
        for errs in res.values():
            assert max(errs["o"], errs["dq"], errs["dk"], errs["dv"]) < 1e-10, errs
    assert sum(r["dcp:direct"]["n"] for r in results) == 85
