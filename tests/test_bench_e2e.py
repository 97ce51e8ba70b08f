"""``dcp bench e2e`` on a tiny configuration: the non-attention FLOP formula, the CSV columns, the figure."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from dcp.bench import e2e
from dcp.bench.common import DcpOptions
from dcp.bench.common import read_csv

ROOT = Path(__file__).resolve().parents[1]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None

COLUMNS = {"dataset", "max_len", "mask", "planner", "attention_ms", "other_ms", "iteration_s",
           "speedup_vs_megatron_best", "simulated", "profile", "machine", "paper_reference"}


def test_flop_formula_hand_checked():
    # hidden 8, kv 2 groups x head dim 2 = kv_dim 4, ffn 16, tp 2:
    # QKV 8*(8+2*4)=128, out 8*8=64, MLP 3*8*16=384 -> 576 MACs -> 1152 FLOPs, /tp -> 576
    m = e2e.ModelConfig(layers=2, hidden=8, heads=4, kv_groups=2, ffn=16, head_dim=2, tp=2)
    assert m.kv_dim == 4
    assert m.fwd_flops_per_token() == 576
    assert m.fwd_bwd_flops_per_token() == 3 * 576
    assert e2e.other_time_s(1000, m, peak_tflops=1.0, mfu=0.5) == pytest.approx(1000 * 1728 / 0.5e12)
    # the paper's GPT-8B: 2*(4096*(4096+2048) + 4096^2 + 3*4096*14336) / 4
    assert e2e.ModelConfig().fwd_flops_per_token() == 2 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336) / 4


def test_greedy_groups_longest_first():
    groups = e2e.greedy_groups([5, 1, 9, 3], 2)
    assert sorted(map(sum, groups)) == [9, 9]
    assert sorted(x for g in groups for x in g) == [1, 3, 5, 9]


def test_tiny_run_writes_csv(tmp_path):
    cfg = e2e.E2EConfig(datasets=("ldc",), max_lens=(2048,), masks=("causal",), cp_sizes=(1, 2, 4),
                        model=e2e.ModelConfig(layers=2, hidden=256, heads=8, kv_groups=4, ffn=512, head_dim=32, tp=4),
                        nodes=2, gpus_per_node=2, physical_gpus_per_node=8,
                        dcp=DcpOptions(partitioner="greedy", block_size=256))
    rows = e2e.run_e2e(cfg)
    path = e2e.write_results(rows, tmp_path, "a100")
    got = read_csv(path)
    assert COLUMNS <= set(got[0])
    planners = {r["planner"] for r in got}
    assert planners == {"dcp", "megatron_cp1", "megatron_cp2", "megatron_cp4", "megatron_best", "best_tuned"}
    for r in got:
        assert float(r["attention_ms"]) > 0 and float(r["other_ms"]) > 0 and float(r["iteration_s"]) > 0
        assert r["simulated"] == "True"
    best = next(r for r in got if r["planner"] == "megatron_best")
    cps = [float(r["iteration_s"]) for r in got if r["planner"].startswith("megatron_cp")]
    assert float(best["iteration_s"]) == min(cps)
    dcp = next(r for r in got if r["planner"] == "dcp")
    assert float(dcp["speedup_vs_megatron_best"]) == pytest.approx(
        float(best["iteration_s"]) / float(dcp["iteration_s"]), rel=1e-3)
    tuned = next(r for r in got if r["planner"] == "best_tuned")
    opponent = min(float(best["iteration_s"]), float(tuned["iteration_s"]))
    assert float(dcp["speedup_vs_best_tuned"]) == pytest.approx(opponent / float(dcp["iteration_s"]), rel=1e-3)
    assert tuned["chosen"] and dcp["best_tuned"]
    if HAS_MPL:
        out = tmp_path / "figs"
        subprocess.run([sys.executable, str(ROOT / "paper_figs" / "fig_e2e.py"), "--results-dir", str(tmp_path),
                        "--out-dir", str(out)], check=True, capture_output=True)
        assert (out / "e2e_a100.png").exists()
