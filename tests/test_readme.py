"""Every code block of the README runs as shown, or names the test that runs it.

Each fenced block is extracted. Python blocks run in a fresh interpreter; shell blocks run line by line
in a scratch directory (commands are what a user types at the repository root, so ``experiments/...``
resolves against it). A line that is too slow or cannot run inside the suite must be listed in
``COVERED_ELSEWHERE`` with the test or script that exercises it; a README line that is neither run nor
listed fails this test, so a new block cannot go untested.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

#: command prefix -> where it is exercised instead of here
COVERED_ELSEWHERE = {
    "pip install torch==": ".ci/run installs torch from the same CPU index in a fresh venv",
    "pip install --no-build-isolation -e": ".ci/run installs dcp this way; `dcp demo` is "
                                           "tests/test_cli.py::test_demo_plans_prints_a_verdict_and_says_the_checked_batch_is_small",
    "python -m pytest -q tests": "the suite itself (.ci/run)",
    "torchrun --nproc-per-node 4 experiments/train_gpt.py": "tests/test_train_parity.py (4 gloo processes)",
    "python experiments/train_gpt.py": "tests/test_train_parity.py (the 1-process run)",
    "torchrun --nproc-per-node 4 experiments/train_hf.py": "tests/test_hf_parity.py (4 gloo processes)",
    "python experiments/train_hf.py": "tests/test_hf_parity.py (the 1-process reference)",
    "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d": "a GPU cluster command (dcp bench run); its code runs "
                                                                    "on 2 gloo processes in tests/test_bench_run.py",
    "dcp bench calibrate --device cpu": "tests/test_bench_run.py::test_calibrate_at_tiny_sizes_writes_a_profile_the_"
                                        "simulator_loads (the full calibration takes about a minute)",
    "dcp bench run --nproc 2": "tests/test_bench_run.py::test_cli_bench_run_spawns_two_gloo_processes",
}
#: python blocks that are excerpts, not programs: a phrase they contain -> what runs them
EXCERPTS = {
    "dcp_hf.register()": "the loop of experiments/train_hf.py, run by tests/test_hf_parity.py",
}


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def _commands() -> list[str]:
    lines = [line.strip() for block in _blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _covered(cmd: str) -> bool:
    return any(cmd.startswith(prefix) for prefix in COVERED_ELSEWHERE)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def test_every_readme_block_is_run_or_accounted_for():
    assert _commands() and _blocks("python")
    python_run = [b for b in _blocks("python") if not any(k in b for k in EXCERPTS)]
    assert len(python_run) >= 2  # "Use it" and experiments/run_plan.py
    for prefix in COVERED_ELSEWHERE:  # every exemption is still in use
        assert any(c.startswith(prefix) for c in _commands()), f"stale exemption {prefix!r}"


@pytest.mark.parametrize("cmd", [c for c in _commands() if not _covered(c)])
def test_shell_line_runs(cmd, tmp_path):
    # run from a scratch copy of the layout a user has: the repository root, with files made by earlier lines
    cwd = tmp_path
    for name in ("experiments",):
        (cwd / name).symlink_to(ROOT / name)
    for earlier in _commands():  # files an earlier line of the README creates (echo ... > file)
        if earlier == cmd:
            break
        if earlier.startswith("echo ") and ">" in earlier:
            subprocess.run(earlier, shell=True, check=True, cwd=cwd)
    res = subprocess.run(cmd, shell=True, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{cmd}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"


def test_python_blocks_run():
    for block in _blocks("python"):
        if any(k in block for k in EXCERPTS):
            continue
        if "torchrun" in block or "dist.init_process_group" in block:
            continue  # experiments/run_plan.py: checked below and run by its torchrun line
        res = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, f"{block}\n{res.stderr[-3000:]}"


def test_the_running_plans_block_is_experiments_run_plan_py():
    script = (ROOT / "experiments" / "run_plan.py").read_text().rstrip("\n")
    assert any(block.rstrip("\n") == script for block in _blocks("python")), \
        "README's 'Running a plan' block differs from experiments/run_plan.py"
    assert "torchrun --nproc-per-node 4 experiments/run_plan.py" in _commands()


def test_the_numbers_the_readme_states_about_dcp_demo():
    """The demo's batch and the executed check's batch hold the token counts the README names."""
    from dcp.data import make_batches
    from dcp.execute.demo_run import SMALL_TOKENS

    demo = make_batches("ldc", 1.0, tokens_per_batch=131072, num_batches=1, seed=0)[0]
    small = make_batches("ldc", 1.0 / 16, tokens_per_batch=SMALL_TOKENS, num_batches=1, seed=0)[0]
    text = " ".join(README.split())
    assert f"{int(demo.sum()):,}-token batch ({len(demo)} sequences" in text
    assert f"small {int(small.sum()):,}-token batch" in text
