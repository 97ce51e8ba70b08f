"""``dcp.varlen_attention`` / ``dcp.varlen_plan``: flash-attn's varlen call run as a dcp plan.

Against dense fp64 attention written from flash-attn's own convention (query ``i`` attends keys
``i - left <= j <= i + right``, ``right = 0`` with ``causal``), not from dcp's masks: on one process, and on
2 and 4 gloo ranks with a batch whose long sequence the plan splits over ranks (asserted: its rows have
several home ranks and the plan moves bytes), forward, lse and q/k/v gradients; the plan is made once
per batch (planner calls counted); bad input raises the named errors; experiments/varlen_example.py runs.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _dense import dense_case
from _spawn import run_ranks

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-10  # fp64 plans against fp64 dense attention: only summation order differs
LENS = (1024, 200, 0, 150, 50)  # one long sequence the plan must split, short ones kept whole, an empty one
HEADS = dict(num_heads=2, num_kv_heads=1, head_dim=8)


def _cu(lens=LENS) -> list[int]:
    return [0, *itertools.accumulate(lens)]


def _config():
    """Small token blocks and a cheap deterministic search: the long sequence is split, planning is fast."""
    import dcp

    return dcp.PlannerConfig(block_size=128, partitioner=dcp.GreedyPartitioner(), time_budget_s=None,
                             search=dcp.SearchConfig(hypergraph=False, warm_starts=(), simulate_top=0,
                                                     refine_evaluations=0, block_size_factors=()))


def _flash_allowed(n: int, causal: bool, window) -> torch.Tensor:
    """bool ``[n, n]``: flash-attn's mask of one sequence (``window_size=(left, right)``, -1 unbounded)."""
    left, right = window
    right = 0 if causal else right
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = torch.ones(n, n, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def _flash_dense(q, k, v, cu, causal=False, window=(-1, -1), scale=None):
    """Dense ``(o [T, Hq, D], lse [Hq, T])`` of a packed batch under flash-attn's mask convention."""
    d, g = q.shape[2], q.shape[1] // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    outs, lses = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        kk, vv = (x[a:b].repeat_interleave(g, dim=1) for x in (k, v))
        s = torch.einsum("qhd,khd->hqk", q[a:b], kk) * scale
        s = s.masked_fill(~_flash_allowed(b - a, causal, window), float("-inf"))
        lses.append(torch.logsumexp(s, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv))
    return torch.cat(outs), torch.cat(lses, 1)


def _inputs(total: int, seed: int, hq: int = 2, hkv: int = 1, d: int = 8):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(total, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq))


def _errs(got: dict, want: dict) -> dict:
    return {name: float((got[name] - want[name]).abs().max()) if got[name].numel() else 0.0 for name in got}


# ------------------------------------------------------------------------------------------ masks
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (-1, 0)), (True, (5, 0)),
                                           (True, (0, 0)), (False, (3, 0)), (True, (4, 7)), (True, (40, -1))])
def test_mask_from_flash_follows_flash_attn_window_convention(causal, window):
    from dcp.integration.varlen import mask_from_flash

    for n in (1, 9, 17):
        dense = torch.from_numpy(mask_from_flash(causal, window).dense(n))
        assert torch.equal(dense, _flash_allowed(n, causal, window)), (causal, window, n)


@pytest.mark.parametrize("causal,window", [(False, (3, 2)), (False, (-1, 4)), (False, (6, -1))])
def test_windows_reaching_past_the_query_are_refused(causal, window):
    import dcp
    from dcp.integration.varlen import mask_from_flash

    with pytest.raises(dcp.InvalidMaskError, match="masks="):
        mask_from_flash(causal, window)


# ----------------------------------------------------------------------------------- one process
def test_one_process_is_flash_varlen_forward_backward_lse_and_plans_once():
    import dcp
    from dcp.integration import PlanCache
    from dcp.integration import varlen as V

    lens = (90, 0, 33, 7)
    cu = torch.tensor(_cu(lens), dtype=torch.int32)
    cache = PlanCache(4)
    for causal, window, scale in ((True, (-1, -1), None), (True, (12, 0), 0.3), (False, (-1, -1), None)):
        q, k, v, do = _inputs(int(cu[-1]), 3, hq=4, hkv=2)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = dcp.varlen_attention(*leaves, cu, causal=causal, window_size=window, softmax_scale=scale,
                                      return_lse=True, config=_config(), cache=cache)
        o.backward(do)
        ref = [x.clone().requires_grad_() for x in (q, k, v)]
        o_ref, lse_ref = _flash_dense(*ref, cu.tolist(), causal, window, scale)
        o_ref.backward(do)
        errs = _errs({"o": o.detach(), "lse": lse, **{n: x.grad for n, x in zip("qkv", leaves)}},
                     {"o": o_ref.detach(), "lse": lse_ref.detach(), **{n: x.grad for n, x in zip("qkv", ref)}})
        assert max(errs.values()) < TOL, (causal, window, errs)
    # the same shapes again (cu_seqlens now a list): found in the cache, not planned
    before = dict(cache.stats())
    dcp.varlen_attention(q, k, v, _cu(lens), causal=True, window_size=(12, 0), config=_config(), cache=cache)
    after = cache.stats()
    assert (after["misses"], after["hits"]) == (before["misses"], before["hits"] + 1) and after["misses"] == 3
    # varlen_plan for bf16 finds the plan varlen_attention made for fp64 inputs: dtype is no part of the key
    plan = V.varlen_plan(cu, **{**HEADS, "num_heads": 4, "num_kv_heads": 2}, causal=True, dtype="bfloat16",
                         config=_config(), cache=cache)
    assert plan.spec.seqlens == (90, 33, 7) and cache.stats()["hits"] == after["hits"] + 1


def test_sinks_are_gpt_oss_attention_sinks_with_their_gradient():
    import dcp
    from _dense import dense_attention_with_sinks

    lens = (90, 33, 7)
    cu = torch.tensor(_cu(lens), dtype=torch.int32)
    q, k, v, do = _inputs(int(cu[-1]), 3, hq=4, hkv=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    o, lse = dcp.varlen_attention(*leaves[:3], cu, causal=True, window_size=(12, 0), return_lse=True,
                                  config=_config(), sinks=leaves[3])
    o.backward(do)
    ref = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    spec = dcp.BatchSpec(list(lens), dcp.masks.SlidingWindowMask(13), 4, 2, q.shape[2], "float64")
    o_ref, lse_ref = dense_attention_with_sinks(*ref[:3], spec, ref[3])
    o_ref.backward(do)
    errs = _errs({"o": o.detach(), "lse": lse, **{n: x.grad for n, x in zip(("q", "k", "v", "sinks"), leaves)}},
                 {"o": o_ref.detach(), "lse": lse_ref.detach(),
                  **{n: x.grad for n, x in zip(("q", "k", "v", "sinks"), ref)}})
    assert max(errs.values()) < TOL and float(leaves[3].grad.abs().min()) > 0, errs
    with pytest.raises(dcp.ExecutionError, match="sinks must have shape"):
        dcp.varlen_attention(q, k, v, cu, causal=True, config=_config(), sinks=torch.zeros(3, dtype=torch.float64))


def test_plan_once_per_shape_counts_planner_calls(monkeypatch):
    import dcp
    from dcp.integration import varlen as V

    calls = []
    real = V._plan_batch
    monkeypatch.setattr(V, "_plan_batch", lambda *a: calls.append(a[0].seqlens) or real(*a))
    cache = dcp.integration.PlanCache(8)
    for lens in ((40, 20), (40, 20), (30, 30), (40, 20), (30, 30)):
        q, k, v, _ = _inputs(60, 0)
        dcp.varlen_attention(q, k, v, _cu(lens), causal=True, config=_config(), cache=cache)
    assert calls == [(40, 20), (30, 30)]


@pytest.mark.filterwarnings("ignore:memory budget")  # 64 tokens on 4 devices
def test_a_plan_passed_in_must_fit_the_call():
    import dcp

    cu = _cu((50, 14))
    plan = dcp.varlen_plan(cu, **HEADS, causal=True, config=_config(), cache=dcp.integration.PlanCache(2))
    q, k, v, _ = _inputs(64, 1)
    o = dcp.varlen_attention(q, k, v, cu, causal=True, plan=plan)
    assert torch.allclose(o, _flash_dense(q, k, v, cu, True)[0], atol=TOL, rtol=0)
    with pytest.raises(dcp.InvalidMaskError, match="planned with"):
        dcp.varlen_attention(q, k, v, cu, causal=False, plan=plan)
    with pytest.raises(dcp.InvalidBatchError, match="sequence lengths"):
        dcp.varlen_attention(q, k, v, _cu((40, 24)), causal=True, plan=plan)
    with pytest.raises(dcp.InvalidBatchError, match="heads"):
        dcp.varlen_attention(q.repeat(1, 2, 1), k, v, cu, causal=True, plan=plan)
    with pytest.raises(dcp.InvalidConfigError, match="dcp.Plan"):
        dcp.varlen_attention(q, k, v, cu, causal=True, plan="plan")
    four = dcp.varlen_plan(cu, **HEADS, causal=True, world_size=4, config=_config(), share=False)
    assert four.n_devices == 4
    with pytest.raises(dcp.InvalidClusterError, match="4 devices"):
        dcp.varlen_attention(q, k, v, cu, causal=True, plan=four)


def test_a_batch_planned_with_another_config_is_not_planned_anew():
    """The home rows follow varlen_plan's plan: a later call with another config must not silently run a
    different plan over them."""
    import dcp

    cache = dcp.integration.PlanCache(4)
    cu = _cu((64, 32))
    dcp.varlen_plan(cu, **HEADS, causal=True, config=_config(), cache=cache)
    q, k, v, _ = _inputs(96, 2)
    with pytest.raises(dcp.InvalidConfigError, match="config="):
        dcp.varlen_attention(q, k, v, cu, causal=True, cache=cache)  # the default config: another key
    dcp.varlen_attention(q, k, v, cu, causal=True, config=_config(), cache=cache)


def _bad_calls():
    """(id, kwargs changes, expected error) for ``varlen_attention(q, k, v, cu_seqlens, ...)``."""
    import dcp

    q, k, v, _ = _inputs(30, 0)
    ok = dict(q=q, k=k, v=v, cu_seqlens=torch.tensor([0, 10, 30], dtype=torch.int32))
    t = lambda *x, dtype=torch.int32: torch.tensor(x, dtype=dtype)  # noqa: E731
    return [
        ("cu-not-at-0", dict(cu_seqlens=t(1, 10, 30)), dcp.InvalidBatchError, "start at 0"),
        ("cu-decreasing", dict(cu_seqlens=t(0, 20, 10, 30)), dcp.InvalidBatchError, "decreases"),
        ("cu-float", dict(cu_seqlens=t(0, 10, 30, dtype=torch.float32)), dcp.InvalidBatchError, "int32 or int64"),
        ("cu-float-list", dict(cu_seqlens=[0, 10.5, 30]), dcp.InvalidBatchError, "integers"),
        ("cu-2d", dict(cu_seqlens=t(0, 10, 30)[None]), dcp.InvalidBatchError, "1-D"),
        ("cu-one-entry", dict(cu_seqlens=[0]), dcp.InvalidBatchError, "at least 2"),
        ("cu-empty-batch", dict(cu_seqlens=[0, 0]), dcp.InvalidBatchError, "empty batch"),
        ("cu-not-a-sequence", dict(cu_seqlens="0,10,30"), dcp.InvalidBatchError, "cu_seqlens"),
        ("total-mismatch", dict(cu_seqlens=t(0, 10, 31)), dcp.InvalidBatchError, "30 rows"),
        ("q-2d", dict(q=q[:, 0]), dcp.InvalidBatchError, "tokens, heads, head_dim"),
        ("kv-shapes", dict(v=v[:, :, :4]), dcp.InvalidBatchError, "one shape"),
        ("q-k-tokens", dict(k=k[:20], v=v[:20]), dcp.InvalidBatchError, "same tokens"),
        ("gqa", dict(q=q.repeat(1, 3, 1), k=k.repeat(1, 4, 1), v=v.repeat(1, 4, 1)), dcp.InvalidBatchError, "GQA"),
        ("dtypes", dict(k=k.float(), v=v.float()), dcp.InvalidBatchError, "one dtype"),
        ("int-q", dict(q=q.long(), k=k.long(), v=v.long()), dcp.InvalidBatchError, "float64"),
        ("not-tensor", dict(q=q.numpy()), dcp.InvalidBatchError, "torch.Tensor"),
        ("causal-and-masks", dict(masks=dcp.masks.FullMask(), causal=True), dcp.InvalidMaskError, "not both"),
        ("window-and-masks", dict(masks="causal", window_size=(4, 0)), dcp.InvalidMaskError, "not both"),
        ("masks-count", dict(masks=[dcp.masks.CausalMask()] * 3), dcp.InvalidMaskError, "3 masks for 2"),
        ("masks-max-seqlen", dict(masks=20), dcp.InvalidMaskError, "max_seqlen="),
        ("masks-type", dict(masks=[1.5, 2.5]), dcp.InvalidBatchError, "not a dcp.masks.Mask"),
        ("window-shape", dict(window_size=(4,)), dcp.InvalidMaskError, "pair"),
        ("window-below-minus-1", dict(window_size=(-2, 0)), dcp.InvalidMaskError, "pair"),
        ("bidirectional-window", dict(window_size=(3, 3)), dcp.InvalidMaskError, "masks="),
        ("max-seqlen-short", dict(max_seqlen=10), dcp.InvalidBatchError, "longest"),
        ("dropout", dict(dropout_p=0.1), dcp.InvalidConfigError, "dropout"),
        ("softcap", dict(softcap=30.0), dcp.InvalidConfigError, "softcap"),
        ("alibi", dict(alibi_slopes=torch.ones(2)), dcp.InvalidConfigError, "ALiBi"),
        ("scale", dict(softmax_scale=float("nan")), dcp.InvalidConfigError, "softmax_scale"),
        ("config", dict(config={"block_size": 8}), dcp.InvalidConfigError, "PlannerConfig"),
        ("cluster", dict(cluster=dcp.Cluster(1, 2)), dcp.InvalidClusterError, "one process per device"),
    ], ok


def test_bad_input_raises_named_errors():
    import dcp

    cases, ok = _bad_calls()
    for name, change, error, match in cases:
        args = {**ok, **change}
        with pytest.raises(error, match=match) as info:
            dcp.varlen_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens"),
                                 **{"config": _config(), **args})
        assert isinstance(info.value, dcp.DcpError), name
    with pytest.raises(dcp.InvalidBatchError, match="positive int"):
        dcp.varlen_plan([0, 8], num_heads=0, head_dim=8)
    with pytest.raises(dcp.InvalidClusterError, match="world_size"):
        dcp.varlen_plan([0, 8], num_heads=1, head_dim=8, world_size=0)
    with pytest.raises(dcp.InvalidClusterError, match="world_size=3"):
        dcp.varlen_plan([0, 8], num_heads=1, head_dim=8, world_size=3, cluster=dcp.Cluster(1, 2))


# ---------------------------------------------------------------------------------------- ranks
def _ranks_match_dense(rank: int, world: int) -> dict:
    import dcp
    from dcp.integration import varlen as V

    calls = []
    real = V._plan_batch
    V._plan_batch = lambda *a: calls.append(a[0].seqlens) or real(*a)
    cfg, cu = _config(), torch.tensor(_cu(), dtype=torch.int64)
    out = {}
    # causal: varlen_plan, then varlen_attention finds the plan in the cache; checked with tests/_dense.py
    plan = dcp.varlen_plan(cu, **HEADS, causal=True, dtype=torch.float64, config=cfg)
    q, k, v, do, o_ref, g_ref = dense_case(plan.spec, seed=5)
    _, lse_ref = _flash_dense(q, k, v, cu.tolist(), causal=True)
    local = lambda x, dim=0: dcp.dispatch(plan, rank, x, dim)  # noqa: E731
    leaves = [local(x).requires_grad_() for x in (q, k, v)]
    o, lse = dcp.varlen_attention(*leaves, cu, causal=True, return_lse=True, config=cfg)
    o.backward(local(do))
    out["causal"] = _errs({"o": o.detach(), "lse": lse, **{n: x.grad for n, x in zip("qkv", leaves)}},
                          {"o": local(o_ref), "lse": local(lse_ref, 1), **{n: local(x) for n, x in zip("qkv", g_ref)}})
    stats = plan.stats()
    home = plan.token_device()
    out["long_seq_homes"] = sorted(set(home[:LENS[0]].tolist()))
    out["comm_bytes"], out["n_local"] = stats.comm_bytes_total, int(leaves[0].shape[0])
    # again, new values: no planning, same plan object
    q2 = local(torch.randn(cu[-1].item(), 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9)))
    dcp.varlen_attention(q2, *(x.detach() for x in leaves[1:]), cu, causal=True, config=cfg)
    # a causal sliding window (flash's window_size=(w, 0)), plan= given; dense oracle from flash's convention
    window = (100, 0)
    wplan = dcp.varlen_plan(cu.int(), **HEADS, causal=True, window_size=window, config=cfg)
    q, k, v, do = _inputs(int(cu[-1]), 6)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = _flash_dense(*ref, cu.tolist(), True, window, 0.25)
    o_ref.backward(do)
    wl = lambda x, dim=0: dcp.dispatch(wplan, rank, x, dim)  # noqa: E731
    leaves = [wl(x).requires_grad_() for x in (q, k, v)]
    o, lse = dcp.varlen_attention(*leaves, cu, causal=True, window_size=window, softmax_scale=0.25,
                                  return_lse=True, plan=wplan)
    o.backward(wl(do))
    out["window"] = _errs({"o": o.detach(), "lse": lse, **{n: x.grad for n, x in zip("qkv", leaves)}},
                          {"o": wl(o_ref.detach()), "lse": wl(lse_ref.detach(), 1),
                           **{n: wl(x.grad) for n, x in zip("qkv", ref)}})
    out["window_homes"] = sorted(set(wplan.token_device()[:LENS[0]].tolist()))
    out["window_comm_bytes"] = wplan.stats().comm_bytes_total
    out["planner_calls"], out["cache"] = list(calls), V.PLAN_CACHE.stats()
    # a rank whose batch differs: every rank raises PlanMismatchError (none hangs)
    lens = (512, 512) if rank == 0 else (256, 768)
    try:
        dcp.varlen_plan(_cu(lens), **HEADS, causal=True, config=cfg)
        out["mismatch"] = "no error"
    except dcp.PlanMismatchError as err:
        out["mismatch"] = str(err)
    # a mask that does not fit its sequence: refused on every rank before any planning (BatchSpec checks it)
    from dcp.masks import RangesMask

    try:
        dcp.varlen_plan(_cu((20, 10)), RangesMask(np.zeros((10, 1, 2), dtype=np.int32)), **HEADS, config=cfg)
        out["mask_error"] = "no error"
    except dcp.DcpError as err:
        out["mask_error"] = type(err).__name__
    # a batch the planner refuses (fewer token blocks than ranks): the planning rank raises it, the others
    # PlanningError (none hangs)
    try:
        dcp.varlen_plan(_cu((5,)), **HEADS, causal=True, config=dataclasses.replace(cfg, block_size=64, allow_idle_devices=False))
        out["planning_error"] = "no error"
    except dcp.DcpError as err:
        out["planning_error"] = type(err).__name__
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_dense_attention_and_plan_once(world, tmp_path):
    results = run_ranks(_ranks_match_dense, world, tmp_path, deadline_s=120.0)
    assert sum(r["n_local"] for r in results) == sum(LENS)
    for rank, r in enumerate(results):
        for case in ("causal", "window"):
            assert max(r[case].values()) < TOL, (rank, case, r[case])
        # the long sequence is split over ranks and the plans move data: the test crosses ranks
        assert len(r["long_seq_homes"]) > 1 and len(r["window_homes"]) > 1, r
        assert r["comm_bytes"] > 0 and r["window_comm_bytes"] > 0
        # two batches (causal, window), two plans, made on rank 0 only; the second varlen_attention call
        # and the one after varlen_plan were cache hits on every rank
        long = tuple(x for x in LENS if x)
        assert r["planner_calls"] == ([long, long] if rank == 0 else []), r["planner_calls"]
        assert r["cache"]["hits"] == 2 and r["cache"]["misses"] == 2, r["cache"]
        assert "different batches" in r["mismatch"] and "cu_seqlens" in r["mismatch"], r["mismatch"]
        assert r["mask_error"] == "InvalidMaskError", r["mask_error"]
        assert r["planning_error"] == ("TooFewBlocksError" if rank == 0 else "PlanningError"), r["planning_error"]


# -------------------------------------------------------------------------------------- example
def test_varlen_example_script_runs_on_spawned_gloo_ranks():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "varlen_example.py"), "--nproc", "2",
                          "--window", "100", "--lengths", "700", "200", "64"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "2 ranks ran varlen_attention" in res.stdout and "max |o, dq, dk, dv - dense|" in res.stdout


def test_readme_shows_the_drop_in_call():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Drop-in varlen attention", 1)[1].split("### Masks", 1)[0]
    assert "dcp.varlen_attention(" in section and "experiments/varlen_example.py" in section
    assert np.all(np.diff([readme.index(s) for s in ("## Use it", "### Drop-in varlen attention",
                                                       "### Masks")]) > 0)
