"""The executor on PyTorch's ``meta`` device (``dcp.execute.noop``) and ``dcp bench overhead``.

On ``meta`` tensors nothing holds data: any host read of a value (``.item()``, ``.tolist()``, ``bool()``)
raises, so a step that runs there touches no data. The compiled steps must execute every instruction
of the plan (one Reduce step may merge several Reduce instructions), return results of the right shapes,
and the per-plan buffers they reuse between steps must not leak one step's data into the next. No
timing is asserted here: the timing targets live in the benchmark's CSV.
"""
from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.execute import ReferenceExecutor, reference_attention
from dcp.execute.local import DeviceRunner, default_scale
from dcp.execute.noop import NoopComm, NoopKernels, meta_home
from dcp.execute.tables import plan_tables
from dcp.masks import CausalMask, LambdaMask
from dcp.partition import GreedyPartitioner
from dcp.planner import plan as make_plan
from dcp.spec import BatchSpec

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
KINDS = ("launch", "wait", "compute", "reduce")
IR_KIND = {"CommLaunch": "launch", "CommWait": "wait", "Compute": "compute", "Reduce": "reduce"}


def small_plan(dtype="bfloat16", hbs=None, cluster=(2, 2)):
    spec = BatchSpec([300, 170, 90, 41], [CausalMask(), LambdaMask(sink=4, window=32), CausalMask(), CausalMask()],
                     4, 2, 16, dtype=dtype)
    cfg = PlannerConfig(block_size=32, head_block_size=hbs, partitioner=GreedyPartitioner(), time_budget_s=None)
    return make_plan(spec, Cluster(*cluster), cfg)


def ir_counts(plan, direction, device):
    counts = dict.fromkeys(KINDS, 0)
    for ins in plan_tables(plan).plan.program(direction)[device].instructions:
        counts[IR_KIND[type(ins).__name__]] += 1
    return counts


def test_meta_tensors_refuse_host_reads():
    """The guarantee the meta runs rely on."""
    x = torch.empty(3, device="meta")
    for read in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x[0])):
        with pytest.raises(Exception):
            read()


@pytest.mark.parametrize("hbs", [None, 2])
def test_meta_run_executes_every_instruction(hbs):
    plan = small_plan(hbs=hbs)
    spec, tab = plan.spec, plan_tables(plan)
    kernels, scale = NoopKernels(), default_scale(plan, None)
    seen = dict.fromkeys(KINDS, 0)
    for direction in ("forward", "backward"):
        for d in range(plan.n_devices):
            home = meta_home(plan, d, direction, torch.bfloat16)
            run = DeviceRunner(plan, d, direction, home, NoopComm(), kernels, scale)
            done = dict.fromkeys(KINDS, 0)
            for st in run.steps:
                run.step(st)
                done[st.code] += st.n_ir
            assert done == ir_counts(plan, direction, d)
            for k in KINDS:
                seen[k] += done[k]
            n = int(tab.n_local[d])
            res = run.finish_forward() if direction == "forward" else run.finish_backward()
            assert all(t.device.type == "meta" for t in res)
            if direction == "forward":
                o, lse = res
                assert o.shape == (n, spec.num_heads, spec.head_dim) and o.dtype == torch.bfloat16
                assert lse.shape == (spec.num_heads, n) and lse.dtype == torch.float32
            else:
                dq, dk, dv = res
                assert dq.shape == (n, spec.num_heads, spec.head_dim)
                assert dk.shape == dv.shape == (n, spec.num_kv_heads, spec.head_dim)
                assert {dq.dtype, dk.dtype, dv.dtype} == {torch.bfloat16}
    assert all(seen[k] > 0 for k in KINDS), seen  # the plan exercises every instruction kind


def test_reference_executor_on_meta_tensors():
    plan = small_plan()
    spec = plan.spec
    t, hq, hkv, d = spec.total_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
    q = torch.empty(t, hq, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(t, hkv, d, dtype=torch.bfloat16, device="meta")
    ex = ReferenceExecutor(kernels=NoopKernels(), validate=False)
    o, lse = ex.run_forward(plan, q, k, torch.empty_like(k))
    assert o.shape == q.shape and lse.shape == (hq, t) and o.device.type == "meta"
    dq, dk, dv = ex.run_backward(plan, q, k, torch.empty_like(k), o, lse, torch.empty_like(q))
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.device.type == "meta"


def _inputs(spec, seed):
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = spec.total_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((t, hq, d), (t, hkv, d), (t, hkv, d),
                                                                         (t, hq, d))]


def _check(plan, ex, seed):
    q, k, v, do = _inputs(plan.spec, seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, lse_ref = reference_attention(*leaves, plan.spec, return_lse=True)
    g_ref = torch.autograd.grad(o_ref, leaves, do)
    o, lse = ex.run_forward(plan, q, k, v)
    grads = ex.run_backward(plan, q, k, v, o, lse, do)
    fin = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), fin)
    errs = [float((o - o_ref.detach()).abs().max()), float((lse[fin] - lse_ref.detach()[fin]).abs().max())]
    errs += [float((a - b).abs().max()) for a, b in zip(grads, g_ref)]
    assert max(errs) < 1e-10, errs
    return o


@pytest.mark.parametrize("hbs", [None, 1])
def test_buffers_reused_across_steps_stay_exact(hbs):
    """Every layer reuses the plan's slot buffers: steps with different data (and a step that runs while
    another one of the same device holds the buffers) match dense fp64 attention."""
    plan = small_plan("float64", hbs=hbs, cluster=(1, 4))
    ex = ReferenceExecutor(kernels="auto")
    outs = [_check(plan, ex, seed) for seed in (0, 1, 0)]
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    tab = plan_tables(plan)
    assert tab._workspaces and not any(ws.busy for ws in tab._workspaces.values())
    # a runner of device 0 holds its workspace while the whole plan runs again: that run gets its own
    home = meta_home(plan, 0, "forward", torch.float64, "cpu")
    held = DeviceRunner(plan, 0, "forward", home, NoopComm(), NoopKernels(), 1.0)
    assert held.ws.busy
    _check(plan, ex, 2)
    assert held.ws.busy and held.ws is tab._workspaces[next(k for k in tab._workspaces if k[:2] == ("forward", 0))]
    held.release()


def test_broken_plan_raises_before_running():
    """A plan a device cannot run raises ExecutionError when its runner is built (compiled once per plan)."""
    from _breakers import drop_merge

    from dcp.errors import ExecutionError

    plan = small_plan("float64", cluster=(1, 4))
    bad = drop_merge(plan, "backward")
    assert bad is not None
    q, k, v, do = _inputs(plan.spec, 0)
    ex = ReferenceExecutor(kernels="auto", validate=False)
    o, lse = ex.run_forward(bad, q, k, v)
    with pytest.raises(ExecutionError, match="never merged"):
        ex.run_backward(bad, q, k, v, o, lse, do)


def test_bench_overhead_quick_writes_csv(tmp_path, capsys):
    from dcp.cli import main

    assert main(["bench", "overhead", "--quick", "--out-dir", str(tmp_path)]) == 0
    with open(tmp_path / "overhead_cpu.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    cols = {"case", "direction", "item", "count_median", "us_median", "us_worst", "worst_device",
            "us_per_instruction_median", "us_per_instruction_worst", "wall_us_median", "wall_us_worst", "target_us",
            "meets_target", "n_devices", "tensor_device", "repeats", "load_avg_1m", "machine", "revision"}
    assert rows and cols <= set(rows[0])
    items = {(r["direction"], r["item"]) for r in rows}
    for direction in ("forward", "backward"):
        assert {(direction, i) for i in ("prepare", "setup", *KINDS, "finish", "step")} <= items
    assert ("both", "prepare") in items
    assert {r["tensor_device"] for r in rows} == {"meta"}
    plan_rows = [r for r in rows if r["item"] == "step"]
    assert all(float(r["us_median"]) > 0 and not math.isnan(float(r["us_worst"])) for r in plan_rows)
    assert "executor host time" in capsys.readouterr().out
    np.testing.assert_equal(len({r["case"] for r in rows}), 1)


def test_gc_is_paused_while_timing_and_restored():
    import gc

    from dcp.bench.overhead import gc_paused

    for before in (True, False):
        (gc.enable if before else gc.disable)()
        try:
            with gc_paused():
                assert not gc.isenabled()
            assert gc.isenabled() == before
            with pytest.raises(RuntimeError), gc_paused():
                raise RuntimeError("a failing timed region")
            assert gc.isenabled() == before
        finally:
            gc.enable()


def test_steps_leave_no_cyclic_garbage():
    """A finished step frees its runner, views and partials by reference counting alone: a training step
    runs one runner per layer and direction, and cyclic garbage would leave them to the garbage collector,
    whose full collections scan every object of a torch process (tens of ms)."""
    import gc
    import weakref

    plan = small_plan("float64", cluster=(1, 4))
    ex = ReferenceExecutor(kernels="auto", validate=False)
    _check(plan, ex, 0)  # warm: per-plan tables and workspaces are built (and kept) on the first step
    was = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        runners = []
        for direction in ("forward", "backward"):
            home = meta_home(plan, 1, direction, torch.float64, "cpu")
            run = DeviceRunner(plan, 1, direction, home, NoopComm(), NoopKernels(), 1.0)
            run.run()
            run.finish_forward() if direction == "forward" else run.finish_backward()
            runners.append(weakref.ref(run))
            del run
        assert all(r() is None for r in runners)  # freed at once, no collector needed
        _check(plan, ex, 1)
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()
