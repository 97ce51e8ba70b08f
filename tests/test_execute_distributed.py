"""``dcp.attention`` over gloo: 2, 3 and 4 processes against dense attention, bad inputs, failed peers.

Every child builds the same plan deterministically (greedy partitioner, no time budget), computes the
dense fp64 truth of the whole batch once and compares its own slice (``plan.local_token_index(rank)``)
of outputs and q/k/v gradients. Children report through files; the parent enforces a deadline.
"""
from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from _spawn import run_ranks

SPAWN_DEADLINE_S = 90.0
PEER_TIMEOUT_S = 4.0


# ------------------------------------------------------------------------------------------ helpers
def _spawn(world: int, scenario, tmp_path) -> list:
    """Run ``scenario(rank, world)`` in ``world`` gloo processes; each rank's result dict."""
    return run_ranks(scenario, world, tmp_path, deadline_s=SPAWN_DEADLINE_S, check=False)


def _build(world: int, family: str, nodes: int = 1, dtype: str = "float64", seqlens=(23, 6, 17, 1)):
    from dcp.cluster import Cluster
    from dcp.config import PlannerConfig, SearchConfig
    from dcp.masks import CausalMask, DocumentMask, FullMask, LambdaMask, SharedQuestionMask
    from dcp.partition import GreedyPartitioner
    from dcp.planner import plan
    from dcp.spec import BatchSpec

    masks = {
        "causal": [CausalMask()] * len(seqlens),
        "mixed": [LambdaMask(sink=2, window=5), FullMask(), SharedQuestionMask(0.3, 2), CausalMask()][:len(seqlens)],
        "document": [DocumentMask(doc_lengths=(n // 2, n - n // 2)) if n > 1 else CausalMask() for n in seqlens],
    }[family]
    spec = BatchSpec(list(seqlens), masks, 4, 2, 8, dtype=dtype)
    # the hypergraph candidate alone: it moves data on these small batches (a packing would not)
    cfg = PlannerConfig(block_size=3, head_block_size=2, partitioner=GreedyPartitioner(), time_budget_s=None,
                        search=SearchConfig(pack_epsilons=(), aligned_groups=False, warm_starts=()))
    return plan(spec, Cluster(nodes, world // nodes), cfg)


def _digest(plan) -> str:
    h = hashlib.sha1()
    for a in (plan.home, plan.tile_device, plan.tile_stage):
        h.update(np.ascontiguousarray(a).tobytes())
    h.update(repr([str(p) for p in plan.program("forward") + plan.program("backward")]).encode())
    return h.hexdigest()


def _truth(plan, seed=0):
    from dcp.execute import reference_attention

    spec = plan.spec
    g = torch.Generator().manual_seed(seed)
    t = spec.total_tokens
    q = torch.randn(t, spec.num_heads, spec.head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(t, spec.num_kv_heads, spec.head_dim, generator=g, dtype=torch.float64)
    do = torch.randn(t, spec.num_heads, spec.head_dim, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = reference_attention(*leaves, spec, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do)
    return (q, k, v, do), o.detach(), lse.detach(), grads


def _local_errors(plan, rank, dtype, seed=0, kernels=None) -> dict:
    import dcp

    (q, k, v, do), o_ref, lse_ref, g_ref = _truth(plan, seed)
    ql, kl, vl = (dcp.dispatch(plan, rank, x).to(dtype).requires_grad_() for x in (q, k, v))
    o, lse = dcp.attention(ql, kl, vl, plan, timeout=20, return_lse=True, kernels=kernels)
    o.backward(dcp.dispatch(plan, rank, do).to(dtype))
    sl = lambda x, dim=0: dcp.dispatch(plan, rank, x, dim)  # noqa: E731
    err = lambda a, b: float((a.double() - b).abs().max()) if a.numel() else 0.0  # noqa: E731
    fin = torch.isfinite(sl(lse_ref, 1))
    return {"o": err(o.detach(), sl(o_ref)), "lse": err(lse[fin], sl(lse_ref, 1)[fin]),
            "dq": err(ql.grad, sl(g_ref[0])), "dk": err(kl.grad, sl(g_ref[1])), "dv": err(vl.grad, sl(g_ref[2])),
            "o_dtype": str(o.dtype), "n_local": int(ql.shape[0]),
            "moved": plan.stats().comm_bytes_total, "split": plan.stats().split_sequences}


# ---------------------------------------------------------------------------------------- scenarios
def _scenario_correct(rank, world):
    out = {}
    configs = [("causal", 1, "float64"), ("mixed", 1, "float32"), ("document", 1, "float64")]
    if world % 2 == 0:
        configs.append(("mixed", 2, "float64"))
    for family, nodes, dtype in configs:
        plan = _build(world, family, nodes, dtype)
        out[family, nodes, dtype] = {"digest": _digest(plan), **_local_errors(plan, rank, getattr(torch, dtype))}
    # grouped static baselines (each device's chunks of every sequence one token block, dcp.pieces): the
    # executor runs their expansion over pieces
    from dcp.baselines import TEA2AP2PPlanner, ZigzagPlanner
    from dcp.cluster import Cluster

    nodes = 2 if world % 2 == 0 else 1
    for planner in (ZigzagPlanner(shards=True), TEA2AP2PPlanner(shards=True)):
        plan = planner.plan(_build(world, "mixed", nodes).spec, Cluster(nodes, world // nodes))
        assert plan.layout.grouped
        out["mixed", nodes, "float64", planner.name] = {"digest": _digest(plan),
                                                       **_local_errors(plan, rank, torch.float64)}
    # the fused varlen tile path (its CPU emulation) under the distributed executor
    plan = _build(world, "mixed", 1, "float32")
    out["mixed", 1, "float32", "varlen"] = {"digest": _digest(plan),
                                            **_local_errors(plan, rank, torch.float32, kernels="varlen")}
    return out, True


def _count_transfers() -> list:
    """Make ``dist.batch_isend_irecv`` record the size of every group it posts (in this process)."""
    calls = []
    real = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return real(ops)

    dist.batch_isend_irecv = counting
    return calls


def _scenario_bad_inputs(rank, world):
    import dcp
    from dcp.errors import ExecutionError

    calls = _count_transfers()
    plan = _build(world, "causal")
    n = len(plan.local_token_index(rank))
    q = torch.randn(n, 4, 8, dtype=torch.float64)
    k = torch.randn(n, 2, 8, dtype=torch.float64)
    v = torch.randn(n, 2, 8, dtype=torch.float64)
    other = _build(world + 1, "causal")
    cases = {
        "short_q": lambda: dcp.attention(q[:-1], k, v, plan),
        "heads": lambda: dcp.attention(q, q, v, plan),
        "dtype": lambda: dcp.attention(q, k.float(), v, plan),
        "world": lambda: dcp.attention(q, k, v, other),
        "not_a_plan": lambda: dcp.attention(q, k, v, "plan"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ExecutionError as err:
            out[name] = "ExecutionError: " + str(err)
        except Exception as err:  # noqa: BLE001
            out[name] = f"{type(err).__name__}: {err}"
    out["transfers_before"] = list(calls)
    # the group still works: good calls afterwards match the dense truth
    out["correct"], _ = _scenario_correct(rank, world)
    out["transfers_after"] = len(calls)
    return out, True


def _scenario_agreement(rank, world):
    """Ranks holding different plans raise PlanMismatchError naming rank 1, before any transfer; then the
    same group runs a plan that rank 0 made and broadcast_plan shipped."""
    import dcp

    calls = _count_transfers()
    out = {}
    mine = _build(world, "causal", seqlens=(23, 6, 17, 2 if rank == 1 else 1))
    try:
        _local_errors(mine, rank, torch.float64)
        out["mismatch"] = "no error"
    except dcp.PlanMismatchError as err:
        out["mismatch"] = str(err)
    out["transfers_before"] = list(calls)
    shared = dcp.broadcast_plan(_build(world, "mixed", dtype="float32") if rank == 0 else None, src=0)
    out["shared"] = {"digest": _digest(shared), **_local_errors(shared, rank, torch.float32)}
    out["planning_time_s"] = shared.planning_time_s  # not in the bytes: shipped beside them
    try:
        dcp.broadcast_plan("not a plan" if rank == 0 else None)
        out["bad_source"] = "no error"
    except dcp.DcpError as err:
        out["bad_source"] = f"{type(err).__name__}: {err}"
    return out, True


def _peer_failure(rank, world, how, outdir):
    import dcp

    plan = _build(world, "causal")
    (q, k, v, _), *_ = _truth(plan)
    ql, kl, vl = (dcp.dispatch(plan, rank, x) for x in (q, k, v))
    if how != "exit_first":  # fail mid-run of a plan the ranks already agreed on
        dcp.attention(ql, kl, vl, plan, timeout=PEER_TIMEOUT_S)
    dist.barrier()
    if rank == world - 1:
        if how.startswith("exit"):
            os._exit(0)
        # stall (alive, silent) until the others have given up, then leave
        give_up = time.monotonic() + PEER_TIMEOUT_S + 20
        while time.monotonic() < give_up and not all(
                os.path.exists(os.path.join(outdir, f"_peer_failure-{r}.pkl")) for r in range(world - 1)):
            time.sleep(0.2)
        return {"stalled": True}, False
    start = time.monotonic()
    try:
        dcp.attention(ql, kl, vl, plan, timeout=PEER_TIMEOUT_S)
        res = {"error": None}
    except Exception as err:  # noqa: BLE001
        res = {"error": type(err).__name__, "message": str(err)}
    res["elapsed"] = time.monotonic() - start
    return res, False


# -------------------------------------------------------------------------------------------- tests
pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is required")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-process run: bad inputs first (before any transfer), then the correctness configs."""
    return _spawn(2, _scenario_bad_inputs, tmp_path_factory.mktemp("two_ranks"))


def _check_correct(results):
    for rank, res in enumerate(results):
        assert "crash" not in res, res.get("crash")
    for key in results[0]:
        family, nodes, dtype, *_ = key
        assert len({r[key]["digest"] for r in results}) == 1, "ranks built different plans"
        assert sum(r[key]["n_local"] for r in results) == 47
        tol = 1e-10 if dtype == "float64" else 2e-5
        for rank, r in enumerate(results):
            errs = {n: r[key][n] for n in ("o", "lse", "dq", "dk", "dv")}
            assert max(errs.values()) < tol, (key, rank, errs)
            assert r[key]["o_dtype"] == f"torch.{dtype}"
        # the test crosses ranks: every plan moves data, and some plan of each world cuts a sequence over ranks
        assert results[0][key]["moved"] > 0, key
    assert any(results[0][key]["split"] > 0 for key in results[0]), {k: v["split"] for k, v in results[0].items()}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_distributed_matches_dense(world, tmp_path, request):
    if world == 2:
        results = request.getfixturevalue("two_ranks")
        for res in results:
            assert "crash" not in res, res.get("crash")
        _check_correct([res["correct"] for res in results])
    else:
        _check_correct(_spawn(world, _scenario_correct, tmp_path))


def test_bad_inputs_raise_before_any_transfer(two_ranks):
    for rank, res in enumerate(two_ranks):
        assert "crash" not in res, res.get("crash")
        assert res["transfers_before"] == [], "a transfer was posted before the inputs were checked"
        assert "shape" in res["short_q"] and res["short_q"].startswith("ExecutionError"), res["short_q"]
        assert res["heads"].startswith("ExecutionError") and "shape" in res["heads"]
        assert res["dtype"].startswith("ExecutionError") and "dtype" in res["dtype"]
        assert res["world"].startswith("ExecutionError") and "3 devices" in res["world"]
        assert res["not_a_plan"].startswith("ExecutionError")
        assert res["transfers_after"] > 0  # the same group then ran the good calls


def test_ranks_with_different_plans_raise_plan_mismatch_and_broadcast_plan_shares_one(tmp_path):
    results = _spawn(3, _scenario_agreement, tmp_path)
    for rank, res in enumerate(results):
        assert "crash" not in res, res.get("crash")
        assert res["mismatch"].startswith("the ranks hold different plans (ranks [1] differ"), res["mismatch"]
        assert res["transfers_before"] == [], "a transfer was posted before the ranks agreed on the plan"
        assert "PlanningError" in res["bad_source"] and "not a dcp.Plan" in res["bad_source"], res["bad_source"]
    times = [res["planning_time_s"] for res in results]
    assert times[0] > 0 and all(abs(t - times[0]) < 1e-8 for t in times), times
    _check_correct([{("shared", 1, "float32"): res["shared"]} for res in results])


@pytest.mark.parametrize("how", ["exit", "stall", "exit_first"])
def test_failed_peer_raises_within_timeout(how, tmp_path):
    world = 3
    results = run_ranks(_peer_failure, world, tmp_path, how, str(tmp_path), deadline_s=SPAWN_DEADLINE_S,
                        allow_missing=True, check=False)
    if how.startswith("exit"):
        assert results[-1] is None and all(r is not None for r in results[:-1]), results
    survivors = [r for r in results if r is not None and "stalled" not in r]
    assert survivors, results
    for res in survivors:
        assert "crash" not in res, res.get("crash")
        assert res["error"] == "ExecutionError", res
        want = "agreeing on the plan" if how == "exit_first" else "round"
        assert want in res["message"] and "devices" in res["message"], res["message"]
        assert res["elapsed"] < PEER_TIMEOUT_S + 6, res
