"""``dcp.integration``: batches, positions/labels, rejection, plan cache, planner failures, and the same plan on
every rank (4 gloo processes, plan hashes compared), plus ``DCPAttention`` against dense attention.

Planner-worker tests use module-level plan functions of this file (``WorkerConfig.plan_fn``): the spawned
worker imports this module by name, as the parent's ``sys.path`` is handed to it.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _spawn import run_ranks

import dcp
from dcp.integration import (DCPAttention, DCPLoader, InlinePlanner, PlanCache, PlanMismatchError,
                             PlannerWorkerDiedError, PlanningError, PlanningTimeoutError, Sample, SampleRejectedError,
                             WorkerConfig, pack_positions_labels)
from dcp.integration.cache import CachedPlan, plan_key
from dcp.masks import CausalMask, DocumentMask, LambdaMask

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32")
FAST = dcp.PlannerConfig(block_size=16, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
SPAWN_DEADLINE_S = 75.0


def _samples(lengths, seed=0, mask=CausalMask()):
    rng = np.random.default_rng(seed)
    return [Sample(rng.integers(0, 100, n), mask, f"s{i}") for i, n in enumerate(lengths)]


def _loader(samples, cluster=dcp.Cluster(1, 1), budget=256, mode="inline", **kw):
    return DCPLoader(samples, cluster, kw.pop("config", FAST), budget, **HEADS, worker=WorkerConfig(mode=mode, **{
        k: kw.pop(k) for k in list(kw) if k in ("plan_fn", "timeout_s")}), **kw)


# ----------------------------------------------------------------------- plan functions run in the worker
def _failing_plan(description, cluster, config):
    raise RuntimeError("injected planner failure")


def _dying_plan(description, cluster, config):
    os._exit(3)


def _slow_plan(description, cluster, config):
    time.sleep(60)


class _FailingPartitioner(dcp.partition.Partitioner):
    name = "failing"

    def partition(self, hg, k, max_block_weight, fixed, seed):
        raise ValueError("partitioner exploded")


# ------------------------------------------------------------------------------------------ single process
def test_positions_and_labels_tiny():
    tokens, positions, labels = pack_positions_labels([np.array([5, 6, 7]), np.array([8]), np.array([9, 10])])
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10]
    assert positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert labels.tolist() == [6, 7, -100, -100, 10, -100]
    samples = [Sample(np.array([1, 2, 3]), CausalMask(), "a"), Sample(np.array([4, 5]), CausalMask(), "b"),
               Sample(np.array([6, 7, 8, 9]), CausalMask(), "c")]
    batches = list(_loader(samples, budget=5))  # greedy in arrival order: [a, b] (5 tokens), [c]
    assert [b.sample_ids for b in batches] == [("a", "b"), ("c",)]
    b0 = batches[0]
    assert b0.tokens.tolist() == [1, 2, 3, 4, 5] and b0.positions.tolist() == [0, 1, 2, 0, 1]
    assert b0.labels.tolist() == [2, 3, -100, 5, -100]
    assert b0.num_tokens == 5 and b0.num_label_tokens == 3 and b0.plan.spec.seqlens == (3, 2)
    assert batches[1].labels.tolist() == [7, 8, 9, -100]


def test_over_long_sample_is_rejected_and_nothing_else_is_lost():
    lengths = [50, 30, 400, 60, 90, 20, 10, 70]
    samples = _samples(lengths)
    loader = _loader(samples, budget=128)
    seen = [sid for b in loader for sid in b.sample_ids]
    assert seen == [s.sample_id for s in samples if s.sample_id != "s2"]
    assert len(loader.rejected) == 1
    err = loader.rejected[0]
    assert isinstance(err, SampleRejectedError) and isinstance(err, dcp.DcpError)
    assert err.sample_id == "s2" and err.length == 400 and "token budget" in str(err)
    with pytest.raises(SampleRejectedError, match="s2"):
        list(_loader(_samples(lengths), budget=128, on_reject="raise"))


def test_bad_masks_and_tokens_are_rejected():
    good = Sample(np.arange(20), CausalMask(), "ok")
    bad_doc = Sample(np.arange(20), DocumentMask((5, 5)), "doc")  # documents sum to 10, not 20
    not_mask = Sample(np.arange(20), "causal", "str")
    floats = Sample(np.linspace(0, 1, 20), CausalMask(), "float")
    empty = Sample(np.zeros(0, dtype=np.int64), CausalMask(), "empty")
    loader = _loader([good, bad_doc, not_mask, floats, empty, Sample(np.arange(7), LambdaMask(2, 4), "lam")])
    assert [sid for b in loader for sid in b.sample_ids] == ["ok", "lam"]
    assert sorted(e.sample_id for e in loader.rejected) == ["doc", "empty", "float", "str"]


def test_plan_cache_lru():
    cache = PlanCache(2)
    spec = dcp.BatchSpec([32, 16], CausalMask(), **HEADS)
    entry = CachedPlan.from_bytes(dcp.plan(spec, dcp.Cluster(1, 1), FAST).to_bytes())
    k1 = plan_key(spec, dcp.Cluster(1, 1), FAST)
    assert k1 == plan_key(dcp.BatchSpec([32, 16], [CausalMask(), CausalMask()], **HEADS), dcp.Cluster(1, 1), FAST)
    assert k1 != plan_key(spec, dcp.Cluster(1, 2), FAST)
    assert k1 != plan_key(dcp.BatchSpec([32, 16], LambdaMask(4, 8), **HEADS), dcp.Cluster(1, 1), FAST)
    assert k1 != plan_key(spec, dcp.Cluster(1, 1), dcp.PlannerConfig(block_size=8, partitioner=dcp.GreedyPartitioner()))
    assert cache.get(k1) is None
    cache.put(k1, entry)
    cache.put(b"k2", entry)
    assert cache.get(k1) is entry  # k1 most recent now
    cache.put(b"k3", entry)  # evicts k2
    assert b"k2" not in cache and k1 in cache and len(cache) == 2
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1


def test_cache_hits_on_repeated_batches_with_background_worker():
    samples = _samples([100, 60, 90] * 4 + [50])  # four identical batches of 250 tokens, then one of 50
    with _loader(samples, budget=250, mode="process") as loader:
        batches = list(loader)
    assert [b.plan.spec.seqlens for b in batches] == [(100, 60, 90)] * 4 + [(50,)]
    assert [b.cache_hit for b in batches] == [False, True, True, True, False]
    assert len({b.plan_digest for b in batches[:4]}) == 1
    assert loader.stats()["planned"] == 2
    assert [sid for b in batches for sid in b.sample_ids] == [s.sample_id for s in samples]


@pytest.mark.parametrize("plan_fn,error,match", [
    (_failing_plan, PlanningError, "injected planner failure"),
    (_dying_plan, PlannerWorkerDiedError, "died"),
    (_slow_plan, PlanningTimeoutError, "within 1.5 s"),
])
def test_planner_failure_surfaces_as_dcp_error(plan_fn, error, match):
    loader = _loader(_samples([30, 40]), mode="process", plan_fn=plan_fn, timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(error, match=match) as info:
        list(loader)
    assert isinstance(info.value, dcp.DcpError)
    assert time.monotonic() - started < 30
    assert loader._planner is None  # the worker was shut down


def test_failing_partitioner_keeps_its_error_type():
    """The real planner path: a partitioner that raises (no time budget, so no greedy fallback) gives a
    ``PlanningError`` carrying the original type and traceback (inline here; the worker runs the same job)."""
    # a loose memory budget, so that the search runs the hypergraph candidate (and its partitioner)
    config = dcp.PlannerConfig(block_size=16, partitioner=_FailingPartitioner(), time_budget_s=None, epsilon_memory=1.0)
    planner = InlinePlanner(dcp.Cluster(1, 2), config)
    job = planner.submit(dcp.BatchSpec([30, 40], CausalMask(), **HEADS))
    with pytest.raises(PlanningError, match="partitioner exploded") as info:
        planner.result(job)
    assert info.value.remote_type == "ValueError" and "Traceback" in info.value.remote_traceback


def test_dcp_attention_single_process_matches_dense():
    """A 3-device plan run in one process (reference executor) and a 1-device plan, forward and backward."""
    torch.manual_seed(0)
    spec = dcp.BatchSpec([40, 25, 60], LambdaMask(4, 16), 4, 2, 8, "float64")
    q = torch.randn(125, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(125, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(125, 2, 8, dtype=torch.float64, requires_grad=True)
    want = dcp.reference_attention(q, k, v, spec)
    gw = torch.autograd.grad(want.square().sum(), (q, k, v))
    attn = DCPAttention()
    assert attn.resolved_mode() == "single_process"
    for cluster in (dcp.Cluster(1, 3), dcp.Cluster(1, 1)):
        plan = dcp.plan(spec, cluster, FAST)
        o = attn(q, k, v, plan)
        torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-10)
        for g, w in zip(torch.autograd.grad(o.square().sum(), (q, k, v)), gw):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    with pytest.raises(dcp.ExecutionError, match="heads"):
        attn(q[:, :2].contiguous(), k, v, plan)


# ------------------------------------------------------------------------------------------ 4 processes
def _dist_worker(rank: int, world: int) -> dict:
    out = {}
    torch.set_num_threads(1)
    cluster = dcp.Cluster(1, world)
    lengths = [70, 33, 400, 120, 64, 70, 33, 120, 64, 90, 15]  # 400 > budget: rejected on every rank
    samples = _samples(lengths, seed=1)
    loader = _loader(samples, cluster=cluster, budget=287, mode="process")
    rows = []
    for b in loader:
        gathered = [None] * world
        dist.all_gather_object(gathered, b.plan_digest)
        assert len(set(gathered)) == 1, f"ranks ran different plans: {gathered}"
        g = pack_positions_labels([np.asarray(samples[int(s[1:])].tokens) for s in b.sample_ids])
        idx = b.plan.local_token_index(rank)
        for mine, glob in zip((b.tokens, b.positions, b.labels), g):
            assert np.array_equal(mine.numpy(), glob[idx])
        rows.append((b.sample_ids, b.plan_digest, b.cache_hit, b.waited_s))
    out["rows"] = rows
    out["history"] = loader.history
    out["rejected"] = [e.sample_id for e in loader.rejected]
    # DCPAttention over gloo with a loader plan: this rank's rows of dense attention
    plan = CachedPlan.from_bytes(dcp.plan(dcp.BatchSpec([50, 77], CausalMask(), 4, 2, 8, "float64"), cluster,
                                          FAST).to_bytes()).plan
    gen = torch.Generator().manual_seed(3)
    qg, kg, vg = (torch.randn(127, h, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
    idx = torch.from_numpy(plan.local_token_index(rank))
    q, k, v = (x[idx].clone().requires_grad_() for x in (qg, kg, vg))
    o = DCPAttention(timeout=20)(q, k, v, plan)
    torch.testing.assert_close(o, dcp.reference_attention(qg, kg, vg, plan.spec)[idx], rtol=1e-10, atol=1e-10)
    o.sum().backward()
    out["attention"] = "ok"
    out["crossing"] = (plan.stats().split_sequences, plan.stats().comm_bytes_total)  # the test crosses ranks
    # a planner failure on rank 0 becomes a PlanningError on every rank
    try:
        list(_loader(_samples([30, 40]), cluster=cluster, mode="process", plan_fn=_failing_plan))
        out["failure"] = "no error"
    except PlanningError as err:
        out["failure"] = str(err)
    # ranks that read different data: PlanMismatchError on every rank
    try:
        list(_loader(_samples([30, 40 + (rank == 2)]), cluster=cluster, mode="inline"))
        out["mismatch"] = "no error"
    except PlanMismatchError as err:
        out["mismatch"] = str(err)
    return out


def test_four_ranks_share_one_plan(tmp_path):
    world = 4
    outs = run_ranks(_dist_worker, world, tmp_path, deadline_s=SPAWN_DEADLINE_S, group_timeout_s=40.0)
    ids = [[row[0] for row in out["rows"]] for out in outs]
    assert all(x == ids[0] for x in ids)
    assert [s for batch in ids[0] for s in batch] == [f"s{i}" for i in range(11) if i != 2]
    assert all(out["rejected"] == ["s2"] for out in outs)
    digests = [[row[1] for row in out["rows"]] for out in outs]
    assert all(d == digests[0] for d in digests)
    # batches 0 and 1 are identical (70, 33, 120, 64): the repeat is a cache hit on every rank
    hits = [[row[2] for row in out["rows"]] for out in outs]
    assert all(h == hits[0] for h in hits) and any(hits[0]), hits
    for out in outs:
        for h, row in zip(out["history"], out["rows"]):
            if row[2]:  # a cache hit moves no plan bytes
                assert not h["transferred"]
    # every rank reports the source's planning time (plan bytes do not carry it), 0 for a cache hit
    times = [[h["planning_time_s"] for h in out["history"]] for out in outs]
    for step, t0 in enumerate(times[0]):
        assert all(abs(t[step] - t0) < 1e-8 for t in times), times
        assert (t0 == 0) == bool(hits[0][step]), (times[0], hits[0])
        assert out["attention"] == "ok"
        assert min(out["crossing"]) > 0, out["crossing"]  # its plan cuts a sequence over ranks and moves data
        assert "injected planner failure" in out["failure"]
        assert "different batches" in out["mismatch"]
