"""The simulated benchmark machinery on tiny configurations: CSV columns, dcp_auto's choice, figure scripts.

Tiny: 2 x 2 devices (1 x 2 for the megatron mock), one short batch, one mask, one scale; the whole
module runs in well under a minute on 2 cores.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dcp.bench import dryrun, megatron_mock, micro
from dcp.bench.common import BASELINE_NAMES, DcpOptions, read_csv

ROOT = Path(__file__).resolve().parents[1]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None

ROW_COLUMNS = {"dataset", "scale", "mask", "batch", "num_seqs", "tokens", "planner", "chosen", "block_size",
               "planning_time_s", "fwd_ms", "bwd_ms", "ideal_fwd_ms", "ideal_bwd_ms", "comm_bytes_total",
               "comm_bytes_inter_node", "compute_imbalance", "memory_imbalance", "candidates", "simulated",
               "profile", "machine"}
SUMMARY_COLUMNS = {"dataset", "scale", "mask", "profile", "best_baseline_fwd", "best_baseline_bwd",
                   "dcp_fwd_speedup", "dcp_bwd_speedup", "dcp_auto_fwd_speedup", "dcp_auto_bwd_speedup",
                   "dcp_chosen", "dcp_fwd_ms", "ring_fwd_ms", "megatron_dyncp_bwd_ms"}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    fast = DcpOptions(partitioner="greedy", block_size=256)
    cfg = micro.MicroConfig(datasets=("ldc",), scales=(1.0,), masks=("causal",), profiles=("a100",), batches=1,
                            nodes=2, gpus_per_node=2, tokens=8192, dcp=fast)
    rows = micro.run_micro(cfg)
    micro.write_results(rows, out)
    dcfg = dryrun.DryrunConfig(datasets=("ldc",), batches=1, nodes=2, gpus_per_node=2, tokens=8192,
                               block_sizes=(256, 512), masks=("causal",), windows=(256, 8192),
                               epsilons=(0.05, 0.4), sweep_block_size=256)
    dryrun.write_results(dryrun.run_dryrun(dcfg), out)
    mcfg = megatron_mock.MegatronMockConfig(clusters=((1, 2),), tokens_per_rank=2048, batches=1,
                                            profiles=("a100",), dcp=fast)
    mrows = megatron_mock.run_megatron_mock(mcfg)
    from dcp.bench.common import write_csv

    write_csv(out / "megatron_mock.csv", mrows)
    write_csv(out / "megatron_mock_summary.csv", megatron_mock.summarize(mrows))
    return out


def test_micro_csv_columns(results):
    rows = read_csv(results / "micro_a100.csv")
    assert ROW_COLUMNS <= set(rows[0])
    # dcp_same_memory rows appear only where a faster baseline holds more memory than dcp's budget
    names = {r["planner"] for r in rows}
    assert names <= {*micro.PLANNER_NAMES, micro.SAME_MEMORY, micro.TUNED} and micro.TUNED in names
    # every planner the cluster allows has its default row (Ulysses: 8 heads cannot go over more devices)
    assert set(micro.PLANNER_NAMES) - {"ulysses"} <= names
    # the best tuned baseline contains every baseline's default configuration: never slower than one
    for tuned in (r for r in rows if r["planner"] == micro.TUNED):
        same = [r for r in rows if r["batch"] == tuned["batch"] and r["planner"] in BASELINE_NAMES]
        assert same and float(tuned["fwd_ms"]) + float(tuned["bwd_ms"]) <= \
            min(float(r["fwd_ms"]) + float(r["bwd_ms"]) for r in same) + 1e-6
        assert "(" in tuned["candidates"]  # each planner's tuned point is listed
    assert all(r["simulated"] == "True" and r["profile"] == "a100" and r["machine"] for r in rows)
    assert all(float(r["fwd_ms"]) >= float(r["ideal_fwd_ms"]) * (1 - 1e-9) for r in rows)
    summary = read_csv(results / "micro_a100_summary.csv")
    assert len(summary) == 1 and SUMMARY_COLUMNS <= set(summary[0])
    assert summary[0]["best_baseline_fwd"] in BASELINE_NAMES
    dcp_row = next(r for r in rows if r["planner"] == "dcp")
    cands = json.loads(dcp_row["candidates"])
    assert dcp_row["chosen"] in cands and int(dcp_row["block_size"]) == 256  # the search's choice is recorded
    assert dcp_row["dcp_partitioner"] == "greedy" and dcp_row["dcp_objective"] == "time"


def test_micro_takes_a_profile_file_named_by_its_name(tmp_path):
    # a sensitivity profile (the host keeps ahead) given as a JSON file: rows and CSVs carry its own name
    import dataclasses

    from dcp.cost import load_profile

    raw = json.loads((ROOT / "dcp" / "cost" / "profiles" / "a100.json").read_text())
    raw.update(name="a100_test_nohost", **{k: 0.0 for k in raw if k.startswith("host_")})
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(raw))
    assert load_profile(str(path)) == dataclasses.replace(load_profile("a100"), name="a100_test_nohost").without_host()
    cfg = micro.MicroConfig(datasets=("ldc",), scales=(1.0,), masks=("causal",), planners=("ring", "dcp"),
                            profiles=(str(path),), batches=1, nodes=1, gpus_per_node=2, tokens=4096, tuned=False,
                            dcp=DcpOptions(partitioner="greedy", block_size=256))
    rows = micro.run_micro(cfg)
    written = micro.write_results(rows, tmp_path)
    assert [p.name for p in written] == ["micro_a100_test_nohost.csv", "micro_a100_test_nohost_summary.csv"]
    got = read_csv(tmp_path / "micro_a100_test_nohost.csv")
    assert {r["profile"] for r in got} == {"a100_test_nohost"} and {r["planner"] for r in got} == {"ring", "dcp"}


def test_dcp_auto_never_slower_than_its_candidates(results):
    rows = read_csv(results / "micro_a100.csv") + read_csv(results / "megatron_mock.csv")
    autos = [r for r in rows if r["planner"] in ("dcp", "dcp_auto")]
    assert autos
    for r in autos:
        assert r["chosen"] in json.loads(r["candidates"])
        if r["planner"] == "dcp_auto":  # simulated candidates: the chosen one is the fastest
            cands = {k: v for k, v in json.loads(r["candidates"]).items() if v is not None}
            mine = float(r["fwd_ms"]) + float(r["bwd_ms"])
            assert mine <= min(v["fwd_ms"] + v["bwd_ms"] for v in cands.values()) + 1e-6
            assert {"zigzag", "megatron_dyncp"} <= set(cands)
    # dcp_auto considers dcp's candidates too, so it is never slower than dcp in total
    for r in (x for x in autos if x["planner"] == "dcp_auto"):
        d = next(x for x in autos if x["planner"] == "dcp" and x["batch"] == r["batch"]
                 and x.get("profile") == r.get("profile") and x.get("nodes") == r.get("nodes"))
        assert float(r["fwd_ms"]) + float(r["bwd_ms"]) <= float(d["fwd_ms"]) + float(d["bwd_ms"]) + 1e-6


def test_dryrun_and_megatron_csvs(results):
    for sweep in dryrun.SWEEPS:
        rows = read_csv(results / f"dryrun_{sweep}.csv")
        assert rows and {"comm_bytes_total", "planning_time_s", "sim_iter_ms", "simulated", "profile",
                         "unmasked_frac_vs_causal", "machine"} <= set(rows[0])
    fracs = [float(r["unmasked_frac_vs_causal"]) for r in read_csv(results / "dryrun_sparsity.csv")]
    assert 0 < min(fracs) < max(fracs) <= 1.0 + 1e-9
    eps = {float(r["epsilon_inter"]) for r in read_csv(results / "dryrun_epsilon.csv")}
    assert eps == {0.05, 0.4}
    summary = read_csv(results / "megatron_mock_summary.csv")
    assert summary and {"dcp_speedup_iter", "dcp_auto_speedup_iter", "megatron_dyncp_iter_ms"} <= set(summary[0])


def test_table_and_figure_scripts(results, tmp_path):
    cmd = [sys.executable, str(ROOT / "paper_figs" / "make_tables.py"), "--results-dir", str(results),
           "--out", str(tmp_path / "speedups.md"), "--profiles", "a100"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    text = (tmp_path / "speedups.md").read_text()
    assert "ldc" in text and "SIMULATED" in text and "2.12 / 1.95" in text  # paper's LDC x1 causal numbers
    if not HAS_MPL:
        pytest.skip("matplotlib not installed: PNG part skipped")
    cmd = [sys.executable, str(ROOT / "paper_figs" / "make_all.py"), "--results-dir", str(results),
           "--out-dir", str(tmp_path), "--profiles", "a100"]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True)
    pngs = {p.name for p in tmp_path.glob("*.png")}
    assert {"micro_causal_ldc_a100.png", "dryrun_comm_vs_block.png", "dryrun_planning_vs_block.png",
            "dryrun_comm_vs_sparsity.png", "dryrun_comm_vs_epsilon.png", "megatron_mock.png"} <= pngs


def test_cli_registers_bench_subcommands():
    out = subprocess.run([sys.executable, "-m", "dcp.cli", "bench", "--help"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and all(w in out.stdout for w in ("micro", "dryrun", "megatron"))


def test_scale_benchmark_script_runs_at_tiny_sizes(tmp_path):
    """``benchmarks/bench_scale.py`` on a small batch: one ok row per planner with a bit-exact round trip."""
    import csv

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scale.py"
    out = tmp_path / "scale.csv"
    subprocess.run([sys.executable, str(script), "--tokens", "8192", "--devices", "16", "--blocks", "512",
                    "--paper-batches", "0", "--timeout", "240", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    rows = list(csv.DictReader(open(out)))
    assert [r["planner"] for r in rows] == ["dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp"]
    for r in rows:
        assert r["status"] == "ok" and r["roundtrip_exact"] == "True" and r["machine"], r
        assert float(r["plan_s"]) > 0 and float(r["peak_rss_gib"]) > 0 and float(r["sim_bac_ms"]) > 0


def test_same_memory_answers_a_faster_tuned_opponent_over_budget():
    """A best tuned baseline that beats dcp only by holding more tokens per device than dcp's budget gets a
    ``dcp_same_memory`` row (dcp planned at that opponent's memory imbalance), and the summary compares
    the two in that batch; an opponent within the budget, or slower, gets none."""
    import dcp
    from dcp.bench.common import dcp_config
    from dcp.cost import CostModel

    spec = dcp.BatchSpec([3000, 1200, 700, 400, 200], dcp.masks.CausalMask(), 8, 2, 64)
    cluster = dcp.Cluster(1, 4)
    config = dcp_config("a100", DcpOptions(partitioner="greedy", block_size=256))
    cell = dict(dataset="x", scale=1.0, mask="causal", batch=0, num_seqs=5)
    base = dict(cell, memory_imbalance=1.05, planning_time_s=0.0, profile="a100", machine="m",
                comm_bytes_inter_node=0, chosen="c")
    dcp_row = dict(base, planner="dcp", fwd_ms=2.0, bwd_ms=4.0, memory_imbalance=1.1)
    rows = [dict(base, planner="zigzag", fwd_ms=3.0, bwd_ms=6.0), dcp_row,
            dict(base, planner=micro.TUNED, fwd_ms=1.5, bwd_ms=3.5, memory_imbalance=1.6)]
    common = dict(simulated=True, profile="a100", machine="m", revision="r")
    cost = CostModel.named("a100")
    got = micro.same_memory_rows(dcp_row, [rows[0], rows[2]], cell, spec, cluster, config, cost, common)
    assert len(got) == 1 and got[0]["opponent"] == micro.TUNED and got[0]["planner"] == micro.SAME_MEMORY
    assert "epsilon_memory=0.6000" in got[0]["candidates"] and got[0]["memory_imbalance"] <= 1.6 + 1e-9
    summary = micro.summarize(rows + got)[0]
    assert summary["dcp_same_memory_opponents"] == micro.TUNED and summary["dcp_same_memory_batches"] == 1
    assert summary["dcp_same_memory_fwd_speedup"] == round(1.5 / got[0]["fwd_ms"], 3)
    within = [*rows[:2], dict(rows[2], memory_imbalance=1.08)]
    assert micro.same_memory_rows(dcp_row, [within[0], within[2]], cell, spec, cluster, config, cost, common) == []
    slower = [*rows[:2], dict(rows[2], fwd_ms=2.5)]
    assert micro.same_memory_rows(dcp_row, [slower[0], slower[2]], cell, spec, cluster, config, cost, common) == []


def _mock_row(planner, fwd, bwd, batch, mem=1.05, **kw):
    return dict(workload="megatron_mock", nodes=1, gpus_per_node=4, batch=batch, num_seqs=9, profile="a100",
                planner=planner, chosen=planner, fwd_ms=fwd, bwd_ms=bwd, comm_bytes_inter_node=0,
                memory_imbalance=mem, peak_buffer_fwd_MiB=1.0, peak_buffer_bwd_MiB=1.0, machine="m", **kw)


def test_megatron_summary_compares_same_memory_dcp_with_its_opponent():
    row = _mock_row
    rows = [row("megatron_dyncp", 2.0, 4.0, 0), row("best_tuned", 1.0, 2.0, 0, mem=1.7), row("dcp", 1.2, 2.4, 0),
            row(megatron_mock.SAME_MEMORY, 0.9, 1.5, 0, mem=1.6, opponent="best_tuned"),
            row("megatron_dyncp", 2.0, 4.0, 1), row("best_tuned", 1.5, 3.0, 1), row("dcp", 1.2, 2.4, 1)]
    (summary,) = megatron_mock.summarize(rows)
    assert summary["dcp_same_memory_batches"] == 1 and summary["dcp_same_memory_opponents"] == "best_tuned"
    assert summary["dcp_same_memory_speedup_iter"] == round(3.0 / 2.4, 3)
    assert summary["dcp_same_memory_memory_imbalance"] == 1.6
    assert summary["dcp_speedup_iter_vs_best_tuned"] == round(mean([3.0, 4.5]) / 3.6, 3)  # same-memory rows aside
    assert "dcp_at_megatron_memory_batches" not in summary  # no such rows


def test_megatron_summary_prices_dcps_memory_budget():
    """``dcp_at_megatron_memory`` rows (dcp at tuned Megatron's memory, where that exceeds dcp's budget): the
    summary sets tuned Megatron against dcp at its memory and against dcp within its budget, over the batches
    that have such a row only; those rows stay out of dcp's own means."""
    row, at = _mock_row, megatron_mock.AT_MEGATRON_MEMORY
    rows = [row("megatron_dyncp", 2.0, 4.0, 0), row("megatron_tuned", 1.0, 2.0, 0, mem=1.5), row("dcp", 0.9, 1.8, 0),
            row(at, 0.8, 1.6, 0, mem=1.45, opponent="megatron_tuned"),
            row("megatron_dyncp", 2.0, 4.0, 1), row("megatron_tuned", 1.0, 2.0, 1), row("dcp", 0.5, 1.0, 1)]
    (summary,) = megatron_mock.summarize(rows)
    assert summary["dcp_at_megatron_memory_batches"] == 1
    assert summary["dcp_at_megatron_memory_iter_ms"] == 2.4
    assert summary["dcp_at_megatron_memory_speedup_iter"] == round(3.0 / 2.4, 3)
    assert summary["dcp_in_budget_speedup_iter_same_batches"] == round(3.0 / 2.7, 3)
    assert summary["dcp_at_megatron_memory_memory_imbalance"] == 1.45
    assert summary["dcp_iter_ms"] == round(mean([2.7, 1.5]), 4)


def test_dcp_at_memory_rows_plan_at_the_opponents_imbalance_only_above_the_budget():
    import dcp
    from dcp.bench.common import dcp_config
    from dcp.cost import CostModel

    spec = dcp.BatchSpec([3000, 1200, 700, 400, 200], dcp.masks.CausalMask(), 8, 2, 64)
    config = dcp_config("a100", DcpOptions(partitioner="greedy", block_size=256))
    cell, common = dict(batch=0), dict(profile="a100")
    opponent = dict(planner="megatron_tuned", memory_imbalance=1.5, fwd_ms=9.0, bwd_ms=9.0)
    args = (cell, spec, dcp.Cluster(1, 4), config, CostModel.named("a100"), common)
    (got,) = micro.dcp_at_memory_rows("label", opponent, *args)
    assert got["planner"] == "label" and got["opponent"] == "megatron_tuned"
    assert "epsilon_memory=0.5000" in got["candidates"] and got["memory_imbalance"] <= 1.5 + 1e-9
    assert micro.dcp_at_memory_rows("label", dict(opponent, memory_imbalance=1.1), *args) == []


def mean(xs):
    return sum(xs) / len(xs)
