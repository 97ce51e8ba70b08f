"""``dcp bench run`` and ``dcp bench calibrate`` at tiny sizes, the profile fits on synthetic timings, and
the profile fields that model what the CPU runs and the paper's cluster need (defaults change nothing).

The run smoke test starts 2 gloo processes (one thread each) on a 3-sequence batch with every planner,
so the command that times real execution beside the simulator never rots.
"""
import dataclasses
import json
import math

import numpy as np
import pytest

from dcp.bench import run as bench_run
from dcp.bench.calibrate import machine_slug
from dcp.cost import CostModel
from dcp.cost.fit import TilePoint, fit_affine, fit_tiles
from dcp.cost.model import load_profile
from dcp.errors import InvalidConfigError
from tests._spawn import run_ranks


def _a100():
    """The bundled a100 profile as a host-side executor's tests need it: its GPU host costs (``host_*``, an
    asynchronous host; tests/test_sim_host.py) set to 0, so only the fields under test charge the host."""
    return load_profile("a100").without_host()


TINY = bench_run.RunConfig(batches=(bench_run.RunBatch((300, 120, 70), "causal", (), "tiny#0"),
                                    bench_run.RunBatch((200, 180), "lambda", (("sink", "8"), ("window", "64")),
                                                       "tiny#1")),
                           heads=2, kv_heads=1, head_dim=16, dtype="float32", profile="a100", warmup=1, repeats=2,
                           threads=1, dcp=bench_run.DcpOptions(partitioner="greedy", block_size=64))


def _run_tiny(rank, world):
    import torch

    return {"rows": bench_run.run_on_rank(TINY, rank, world, torch.device("cpu"))}


def test_bench_run_two_gloo_processes(tmp_path):
    res = run_ranks(_run_tiny, 2, tmp_path, deadline_s=240, group_timeout_s=120)
    rows, other = res[0]["rows"], res[1]["rows"]
    assert other == []  # only rank 0 reports
    assert len(rows) == 2 * len(bench_run.RUN_PLANNERS) * 2  # batches x planners x directions
    assert {r["planner"] for r in rows} == set(bench_run.RUN_PLANNERS)
    for r in rows:
        assert r["measured_ms"] > 0 and r["simulated_ms"] > 0 and r["measured_min_ms"] <= r["measured_ms"]
        assert len(json.loads(r["rank_ms"])) == 2 and r["rank_spread"] >= 1.0
        assert math.isclose(r["sim_rel_error"], (r["simulated_ms"] - r["measured_ms"]) / r["measured_ms"],
                            abs_tol=1e-3)
        assert r["world"] == 2 and r["threads"] == 1 and r["profile"] == "a100" and r["repeats"] == 2


def test_run_config_rejects_bad_input():
    with pytest.raises(InvalidConfigError, match="unknown planners"):
        bench_run.RunConfig(batches=TINY.batches, planners=("dcp", "nope"))
    with pytest.raises(InvalidConfigError, match="at least one batch"):
        bench_run.RunConfig(batches=())
    with pytest.raises(InvalidConfigError, match="repeats"):
        bench_run.RunConfig(batches=TINY.batches, repeats=0)


def test_measured_fields_take_the_slowest_rank_per_repeat():
    f = bench_run.measured_fields([[0.010, 0.030, 0.012], [0.020, 0.011, 0.013]])
    assert f["measured_ms"] == 20.0 and f["measured_min_ms"] == 13.0  # makespans 20, 30, 13 ms
    assert json.loads(f["rank_ms"]) == [12.0, 13.0] and f["rank_spread"] == round(13 / 12, 4)


# ------------------------------------------------------------------------------------------ fits
def _synthetic_tiles(rate_f, rate_b, half, part, over, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    pts = []
    for n in (32, 64, 128, 256, 512, 1024, 2048):
        for full in (True, False):
            pairs = n * n if full else n * (n + 1) // 2
            for direction, rate, mult in (("forward", rate_f, 1.0), ("backward", rate_b, 2.5)):
                flops = 4.0 * pairs * 4 * 64 * mult
                t = over + flops / (rate * (n / (n + half)) ** 2 * (1.0 if full else part))
                pts.append(TilePoint(n, n, flops, full, direction, t * (1 + noise * rng.standard_normal())))
    return pts


def test_fit_tiles_recovers_known_constants():
    fit = fit_tiles(_synthetic_tiles(60e9, 40e9, 96.0, 0.6, 25e-6))
    assert fit.fwd_rate == pytest.approx(60e9, rel=0.03)
    assert fit.bwd_rate == pytest.approx(40e9, rel=0.03)
    assert fit.half == pytest.approx(96.0, rel=0.06)
    assert fit.partial_efficiency == pytest.approx(0.6, rel=0.03)
    assert fit.overhead_s == pytest.approx(25e-6, rel=0.1)
    assert fit.worst_rel_err < 0.02


def test_fit_tiles_tolerates_noise_and_needs_enough_points():
    fit = fit_tiles(_synthetic_tiles(60e9, 40e9, 96.0, 0.6, 25e-6, noise=0.03))
    assert fit.fwd_rate == pytest.approx(60e9, rel=0.15) and fit.partial_efficiency == pytest.approx(0.6, rel=0.15)
    with pytest.raises(InvalidConfigError, match="full forward tiles"):
        fit_tiles([TilePoint(64, 64, 1e6, True, "forward", 1e-4)])


def test_fit_affine_recovers_latency_and_bandwidth():
    sizes = [1 << k for k in range(10, 25, 2)]
    fit = fit_affine(sizes, [50e-6 + s / 3e9 for s in sizes])
    assert fit.intercept_s == pytest.approx(50e-6, rel=1e-6) and fit.bytes_per_s == pytest.approx(3e9, rel=1e-6)
    with pytest.raises(InvalidConfigError):
        fit_affine([1024, 1024], [1e-5, 1e-5])


def test_machine_slug_names_a_cpu_profile():
    slug = machine_slug()
    assert slug.startswith("cpu_") and slug.endswith("c") and slug == slug.lower()


# ------------------------------------------------------------------------------------------ profile fields
def test_optional_profile_fields_default_to_the_old_model():
    a100 = _a100()
    assert a100.memory_overhead_us is None and a100.nics_per_node is None
    cost = CostModel(a100)
    assert float(cost.memory_bound_s(1e6)) == pytest.approx(a100.kernel_overhead_us * 1e-6 + 1e6 / (a100.hbm_gbps * 1e9))
    assert cost.nic_layout(8, 4) == (8, 4, a100.nic_gbps_per_node * 1e9)
    four = CostModel(dataclasses.replace(a100, nics_per_node=4, memory_overhead_us=3.0))
    assert four.nic_layout(8, 4) == (2, 16, a100.nic_gbps_per_node * 1e9 / 4)
    assert float(four.memory_bound_s(0)) == pytest.approx(3e-6)


def test_nics_per_node_equal_to_gpus_is_the_rail_model():
    import dcp
    from dcp.baselines import RingPlanner
    from dcp.sim import simulate

    spec = dcp.BatchSpec([2048, 1024], "causal", 4, 2, 64, dtype="bfloat16")
    plan = RingPlanner().plan(spec, dcp.Cluster(2, 2))
    a100 = _a100()
    rail = simulate(plan, CostModel(a100), "forward", nic="rail", record_events=False).makespan_s
    node = simulate(plan, CostModel(a100), "forward", record_events=False).makespan_s
    per_gpu = simulate(plan, CostModel(dataclasses.replace(a100, nics_per_node=2)), "forward",
                       record_events=False).makespan_s
    assert per_gpu == pytest.approx(rail, rel=1e-9) and per_gpu > node


def test_kendall_tau():
    assert bench_run.kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert bench_run.kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert bench_run.kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    with pytest.raises(InvalidConfigError):
        bench_run.kendall_tau([1, 2], [1])


def test_kendall_tau_resolved_skips_overlapping_measurements():
    sim, meas = [1.0, 2.0, 3.0], [10.0, 11.0, 30.0]
    lo, hi = [9.0, 10.5, 29.0], [10.8, 12.0, 31.0]  # the first two overlap: their order is noise
    assert bench_run.kendall_tau_resolved(sim, meas, lo, hi) == (1.0, 2)
    tau, pairs = bench_run.kendall_tau_resolved([3.0, 2.0, 1.0], meas, lo, hi)
    assert (tau, pairs) == (-1.0, 2)
    tau, pairs = bench_run.kendall_tau_resolved([1.0, 1.0, 1.0], meas, lo, hi)  # sim ties on resolved pairs
    assert (tau, pairs) == (-1.0, 2)


def test_cli_bench_run_spawns_two_gloo_processes(tmp_path):
    import csv
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "run.csv"
    cmd = [sys.executable, "-m", "dcp.cli", "bench", "run", "--nproc", "2", "--threads", "1", "--lengths", "200,100",
           "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "float32", "--planners", "dcp,ring",
           "--warmup", "0", "--repeats", "1", "--partitioner", "greedy", "--block-size", "64", "--out", str(out)]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["planner"], r["direction"]) for r in rows] == [("dcp", "forward"), ("dcp", "backward"),
                                                               ("ring", "forward"), ("ring", "backward")]
    assert all(float(r["measured_ms"]) > 0 and r["world"] == "2" for r in rows)


# ------------------------------------------------------------------------------------------ calibration
def test_fit_executor_recovers_fixed_costs():
    from dcp.bench.calibrate import fit_executor

    rng = np.random.default_rng(0)
    pts = []
    for _ in range(40):
        c, r, k = (int(x) for x in rng.integers(0, 9, 3))
        pts.append(dict(counts=(c, r, k), seconds=150e-6 + 300e-6 * c + 200e-6 * r + 900e-6 * k))
    fit = fit_executor(pts)
    assert fit["program_s"] == pytest.approx(150e-6, rel=1e-6) and fit["compute_s"] == pytest.approx(300e-6, rel=1e-6)
    assert fit["reduce_s"] == pytest.approx(200e-6, rel=1e-6) and fit["round_s"] == pytest.approx(900e-6, rel=1e-6)
    # a term that would come out negative is dropped (clipped to 0) and the rest refitted
    neg = [dict(counts=p["counts"], seconds=400e-6 + 300e-6 * p["counts"][0]) for p in pts]
    fit = fit_executor(neg)
    assert min(fit["program_s"], fit["compute_s"], fit["reduce_s"], fit["round_s"]) >= 0
    assert fit["compute_s"] == pytest.approx(300e-6, rel=1e-6) and fit["worst_rel_err"] < 1e-6


def test_calibrate_at_tiny_sizes_writes_a_profile_the_simulator_loads(tmp_path):
    import dcp
    from dcp.baselines import RingPlanner
    from dcp.bench.calibrate import CalibrateConfig, calibrate
    from dcp.sim import simulate_both

    cfg = CalibrateConfig(tile_sizes=(32, 64, 128), merge_rows=(64, 256), link_sizes=(1024, 16384),
                          exec_batches=(((64,) * 4, 16),), repeats=1, name="cpu_test")
    doc = calibrate(cfg)
    for key in ("attn_fwd_tflops", "attn_bwd_tflops", "hbm_gbps", "nvlink_gbps"):
        assert doc[key] > 0 and math.isfinite(doc[key])
    assert set(doc["sources"]) >= {"kernel_overhead_us", "round_overhead_us", "link_latency_us"}
    assert len(doc["fit"]["tiles"]) == 3 * 2 * 2 and doc["fit"]["executor"]
    path = tmp_path / "cpu_test.json"
    path.write_text(json.dumps(doc))
    prof = load_profile(str(path))
    plan = RingPlanner().plan(dcp.BatchSpec([256, 128], "causal", 2, 1, 16, dtype="float32"), dcp.Cluster(1, 2))
    fwd, bwd = simulate_both(plan, CostModel(prof), record_events=False)
    assert fwd.makespan_s > 0 and bwd.makespan_s > 0
    with pytest.raises(InvalidConfigError):
        CalibrateConfig(tile_sizes=(32, 64))


# ------------------------------------------------------------------------------------------ host-side overheads
def _ring_plan():
    import dcp
    from dcp.baselines import RingPlanner

    return RingPlanner().plan(dcp.BatchSpec([2048, 1024], "causal", 4, 2, 64, dtype="bfloat16"), dcp.Cluster(1, 4))


def test_program_overhead_delays_every_device_by_exactly_that():
    from dcp.sim import simulate

    plan, a100 = _ring_plan(), _a100()
    for direction in ("forward", "backward"):
        base = simulate(plan, CostModel(a100), direction, record_events=False)
        late = simulate(plan, CostModel(dataclasses.replace(a100, program_overhead_us=300.0)), direction,
                        record_events=False)
        assert np.allclose(late.end_s, base.end_s + 300e-6, rtol=0, atol=1e-12)


def test_round_overhead_is_charged_per_round_with_transfers():
    from dcp.ir.instructions import CommLaunch
    from dcp.sim import simulate

    plan, a100 = _ring_plan(), _a100()
    slow = dataclasses.replace(a100, round_overhead_us=500.0)
    for direction in ("forward", "backward"):
        base = simulate(plan, CostModel(a100), direction, record_events=False).makespan_s
        sim = simulate(plan, CostModel(slow), direction, record_events=False).makespan_s
        rounds = max(sum(isinstance(i, CommLaunch) and bool(i.sends or i.recvs) for i in p.instructions)
                     for p in plan.program(direction))
        assert rounds >= 3
        # a ring step is serial across devices: every round's packing lands on the critical path
        assert sim - base == pytest.approx(rounds * 500e-6, rel=0.35)


def test_the_planners_estimate_follows_the_host_side_overheads():
    import dcp
    from dcp.bench.common import DcpOptions, dcp_config
    from dcp.sim import simulate_both

    slow = dataclasses.replace(_a100(), round_overhead_us=400.0, program_overhead_us=200.0)
    spec = dcp.BatchSpec([3000, 1500, 700, 300], "causal", 4, 2, 64, dtype="bfloat16")
    cfg = dcp_config("a100", DcpOptions(partitioner="greedy", block_size=256), cost=CostModel(slow))
    plan = dcp.plan(spec, dcp.Cluster(1, 2), cfg)
    fwd, bwd = simulate_both(plan, CostModel(slow), record_events=False)
    assert plan.meta["est_forward_ms"] == pytest.approx(fwd.makespan_s * 1e3, rel=0.25)
    assert plan.meta["est_backward_ms"] == pytest.approx(bwd.makespan_s * 1e3, rel=0.25)
    assert plan.meta["est_forward_ms"] > 0.2  # the program overhead alone


# ------------------------------------------------------------------------------------------ CPU kernel model
def test_fit_partial_waste_recovers_the_keys_a_row_wastes():
    from dcp.cost.fit import fit_partial_waste

    shapes = [(n, (n + 1) / (2 * n), min((n + 1) / (2 * n) + 150.0 / n, 1.0)) for n in (32, 64, 128, 256, 512, 1024, 2048)]
    shapes += [(512, f, min(f + 150.0 / 512, 1.0)) for f in (0.03, 0.12, 0.37)]
    waste, med, worst = fit_partial_waste(shapes)
    assert waste == pytest.approx(150.0, rel=0.03) and worst < 0.02
    with pytest.raises(InvalidConfigError):
        fit_partial_waste(shapes[:1])


def test_cpu_kernel_model_fields_default_to_the_gpu_model():
    import dcp
    from dcp.baselines import ZigzagPlanner
    from dcp.sim import simulate

    a100 = _a100()
    assert a100.efficiency_group == "sequence" and a100.partial_waste_keys is None
    plan = ZigzagPlanner().plan(dcp.BatchSpec([4096, 512, 256, 128], "causal", 4, 2, 64, dtype="bfloat16"),
                                dcp.Cluster(1, 4))
    t = {}
    for name, prof in (("seq", a100), ("qblock", dataclasses.replace(a100, efficiency_group="q_block")),
                       ("waste", dataclasses.replace(a100, partial_waste_keys=64.0, partial_tile_efficiency=1.0))):
        t[name] = simulate(plan, CostModel(prof), "forward", record_events=False).compute_s.sum()
    # zigzag cuts sequences into chunks: per q block the extents are smaller than per sequence -> slower
    assert t["qblock"] > t["seq"] * 1.01
    # wasted keys per row make partial tiles dearer than their pairs at full efficiency
    full_eff = simulate(plan, CostModel(dataclasses.replace(a100, partial_tile_efficiency=1.0)), "forward",
                        record_events=False).compute_s.sum()
    assert t["waste"] > full_eff * 1.01
    with pytest.raises(InvalidConfigError, match="efficiency_group"):
        CostModel(dataclasses.replace(a100, efficiency_group="tile")).tile_groups(plan.layout, plan.tiles)


def test_simulator_and_its_reference_agree_with_every_new_profile_field_set():
    import dcp
    from dcp.baselines import ZigzagPlanner
    from dcp.sim import simulate
    from dcp.sim.reference import simulate_reference

    prof = dataclasses.replace(_a100(), nics_per_node=2, round_overhead_us=50.0,
                               program_overhead_us=30.0, memory_overhead_us=3.0, efficiency_group="q_block",
                               partial_waste_keys=64.0)
    spec = dcp.BatchSpec([3000, 1200, 700, 300, 100], "causal", 4, 2, 64, dtype="bfloat16")
    plan = ZigzagPlanner().plan(spec, dcp.Cluster(2, 4))
    for direction in ("forward", "backward"):
        fast = simulate(plan, CostModel(prof), direction, record_events=False)
        ref = simulate_reference(plan, CostModel(prof), direction, record_events=False)
        assert np.allclose(fast.end_s, ref.end_s, rtol=1e-9, atol=1e-12)
        base = simulate(plan, CostModel(_a100()), direction, record_events=False)
        assert fast.makespan_s > base.makespan_s  # the fields are in effect
