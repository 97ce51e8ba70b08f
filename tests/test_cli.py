"""The command line and ``dcp demo``: defaults from the library, strict flags, warnings, progress, verdict."""
from __future__ import annotations

import io
import json
import subprocess
import sys
import time

import pytest

import dcp
from dcp.cli import CONFIG_DEFAULTS, main
from dcp.demo import run_demo, verdict
from dcp.report import progress


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _option_help(help_text: str, flag: str) -> str:
    """The help entry of ``flag``: its line and the continuation lines under it, joined."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith(flag + " ") or line.strip() == flag)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].lstrip().startswith("-") or not lines[i].strip()),
               len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def test_help_shows_the_library_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    cfg = dcp.PlannerConfig()
    for flag, value in (("--epsilon-intra", cfg.epsilon_intra), ("--epsilon-inter", cfg.epsilon_inter),
                        ("--epsilon-memory", cfg.epsilon_memory), ("--time-budget", cfg.time_budget_s),
                        ("--block-size", cfg.block_size), ("--heads", 8), ("--dataset", "ldc")):
        entry = _option_help(text, flag)
        assert entry.endswith(f"(default: {value})"), (flag, entry)
    assert CONFIG_DEFAULTS["epsilon_intra"] == cfg.epsilon_intra


def test_idle_devices_are_a_warning(capsys):
    # one head: no plan can split heads over devices (with 8 a head-parallel all-to-all keeps all 32 busy)
    code, out, _ = _run(capsys, "plan", "--lengths", "16", "--heads", "1", "--kv-heads", "1", "--json",
                        "--partitioner", "greedy")
    row = json.loads(out)
    idle = row["idle_devices"]
    assert code == 0 and 16 <= idle < 32  # 16 tokens of one head cannot keep 32 devices busy
    assert any(f"{idle} of 32 devices are idle" in w for w in row["warnings"]), row["warnings"]


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "4096,,5"], "entry 1 is empty"),
    (["--lengths", "4096", "--dataset", "ldc"], "--dataset would be ignored"),
    (["--lengths", "4096", "--scale", "2", "--tokens", "10"], "--scale, --tokens would be ignored"),
    (["--lengths", "4096", "--batch-index", "1"], "--batch-index would be ignored"),
])
def test_bad_or_conflicting_flags_are_refused(capsys, argv, message):
    code, _, err = _run(capsys, "plan", *argv)
    assert code == 2 and message in err, err


def test_time_budget_flag(capsys):
    import argparse

    from dcp.cli import HelpFormatter, _add_batch_args, _config

    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    _add_batch_args(p)
    assert _config(p.parse_args(["--time-budget", "none"])).time_budget_s is None
    assert _config(p.parse_args(["--time-budget", "2.5"])).time_budget_s == 2.5
    with pytest.raises(SystemExit):
        p.parse_args(["--time-budget", "0"])
    assert "time budget must be positive" in capsys.readouterr().err


def test_progress_speaks_only_for_slow_steps():
    out = io.StringIO()
    with progress("quick step", out=out, after_s=0.5):
        pass
    with progress("slow step", out=out, after_s=0.05):
        time.sleep(0.3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "slow step ..." and lines[1].startswith("slow step: done in ") and len(lines) == 2


def _row(name, ms, total, inter=0, imbalance=1.0, memory=1.0):
    return {"planner": name, "sim_fwd_bwd_ms": ms, "comm_bytes_total": total, "comm_bytes_inter_node": inter,
            "compute_imbalance": imbalance, "memory_imbalance": memory, "max_resident_tokens": int(1000 * memory),
            "peak_buffer_MiB": 3.0}


def test_verdict_names_the_fastest_the_byte_ratio_and_memory():
    speed, volume, memory = verdict([_row("dcp", 5.0, 2e9, 1e8, 1.05, 1.08), _row("zigzag", 7.5, 8e9),
                                     _row("megatron", 6.0, 1e9)])
    assert speed.startswith("fastest by simulated time: dcp, 5.00 ms") and "1.20x faster" in speed and "megatron" in speed
    assert "2.00x the baseline that moves the fewest (megatron, 1.00 GB)" in volume
    assert "1,080 resident tokens" in memory and "budget 1.10x" in memory and "faster only" not in memory
    speed, _, memory = verdict([_row("dcp", 9.0, 2e9), _row("zigzag", 6.0, 8e9), _row("megatron", 5.0, 1e9, memory=1.6)])
    assert speed.startswith("fastest by simulated time: megatron, 5.00 ms") and "dcp simulates 9.00 ms (1.80x slower)" in speed
    assert "megatron is faster only by holding 1.60x the mean tokens" in memory and "zigzag" not in memory


def test_demo_plans_prints_a_verdict_and_says_the_checked_batch_is_small():
    from dcp.baselines import ZigzagPlanner

    spec = dcp.BatchSpec([3000, 900, 200], "causal", 4, 2, 32)
    cluster = dcp.Cluster(1, 4)
    config = dcp.PlannerConfig(block_size=256, partitioner=dcp.GreedyPartitioner(), time_budget_s=None)
    out = io.StringIO()
    code = run_demo(spec, cluster, config, {"dcp": dcp.DCPPlanner(config), "zigzag": ZigzagPlanner()}, execute=True,
                    out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "Verdict:" in text and "fastest by simulated time" in text and "bytes: dcp moves" in text
    assert "-> OK" in text and "not the 4,100-token batch planned above" in text, text


def test_demo_does_not_import_the_command_line():
    code = "import sys, dcp.demo; assert 'dcp.cli' not in sys.modules, 'dcp.demo imports dcp.cli'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_notes_are_printed(capsys, monkeypatch):
    """A planner's notes (here: a static baseline grouped per device, dcp.pieces) reach the user."""
    from dcp.baselines import common

    monkeypatch.setattr(common, "SHARD_TILES", 10)
    code, out, _ = _run(capsys, "plan", "--lengths", "300,100", "--planner", "ring", "--nodes", "1",
                        "--gpus-per-node", "4")
    assert code == 0 and "note (ring): ring: each device's chunks of every sequence form one token block" in out
    code, out, _ = _run(capsys, "plan", "--lengths", "300,100", "--planner", "ring", "--nodes", "1",
                        "--gpus-per-node", "4", "--json")
    assert code == 0 and any("one token block" in n for n in json.loads(out)["notes"])
