"""What a new user hits first (issue 23, item 2): ``dcp plan`` shows the simulated time it optimizes and why
its search chose a plan, plans every batch of a lengths file, calibration writes outside the package and
refuses a busy machine, one mask syntax everywhere, help texts that say what the code does, no citation of
files users do not have, the transformers example whole, and small things (plurals, ``--version``,
``--nproc`` above the cores, the loader's rejections said once)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

import dcp
from dcp.bench.args import MaskArg, default_partitioner_name, masks_from_args, nproc_warning, plural
from dcp.cli import main

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("--nodes", "1", "--gpus-per-node", "4", "--partitioner", "greedy", "--block-size", "256")


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------------------ 1. simulated time
def test_plan_shows_simulated_time_and_why_dcp_chose_its_plan(capsys):
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL, "--json")
    row = json.loads(out)
    assert code == 0 and row["profile"] == "a100"
    assert row["sim_forward_ms"] > 0 and row["sim_backward_ms"] > 0
    assert row["sim_fwd_bwd_ms"] == pytest.approx(row["sim_forward_ms"] + row["sim_backward_ms"], abs=1e-3)
    search = row["search"]
    assert search["objective"] == "time" and search["chosen"] in search["candidates"]
    assert search["est_forward_ms"] > 0 and search["token_budget"] > 0
    assert row["why"].startswith(f"dcp chose {search['chosen']}") and "within the memory budget" in row["why"]
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL)
    assert code == 0 and "sim_forward_ms" in out and "why (dcp): dcp chose" in out and "SIMULATED" in out


def test_plan_all_reports_the_speedup_over_the_fastest_baseline(capsys):
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL, "--planner", "all", "--json")
    rows = json.loads(out)
    ours = rows[0]
    bases = [r for r in rows if r["planner"] != "dcp"]
    best = min(bases, key=lambda r: r["sim_fwd_bwd_ms"])
    assert code == 0 and ours["planner"] == "dcp" and ours["best_baseline"] == best["planner"]
    assert ours["speedup_vs_best_baseline"] == pytest.approx(best["sim_fwd_bwd_ms"] / ours["sim_fwd_bwd_ms"],
                                                             rel=1e-3)
    assert all("speedup_vs_best_baseline" not in r and r["sim_forward_ms"] > 0 for r in bases)


def test_dcp_auto_says_which_candidate_it_kept(capsys):
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL, "--planner", "dcp_auto", "--json")
    row = json.loads(out)
    assert code == 0 and row["search"]["chosen"] in row["search"]["candidates"]
    assert row["why"].startswith(f"dcp_auto kept {row['search']['chosen']}, the fastest of 3 candidates")


def test_trace_writes_the_simulated_timeline(capsys, tmp_path):
    trace = tmp_path / "out" / "trace.json"
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL, "--trace", str(trace))
    doc = json.loads(trace.read_text())
    assert code == 0 and f"wrote {trace}" in out
    assert doc["traceEvents"] and len(doc["otherData"]["results"]) == 2  # forward and backward


# ------------------------------------------------------------------------------------------ 2. every batch
def test_a_lengths_file_plans_every_batch_or_the_one_asked_for(capsys, tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text("[[3000, 900, 200], [2048, 2048]]")
    code, out, _ = _run(capsys, "plan", "--lengths-file", str(path), *SMALL, "--json", "--output",
                        str(tmp_path / "plan.bin"))
    rows = json.loads(out)
    assert code == 0 and [r["batch_index"] for r in rows] == [0, 1] and [r["num_seqs"] for r in rows] == [3, 2]
    for i, n in enumerate((3, 2)):  # one plan file per batch
        assert dcp.Plan.from_bytes((tmp_path / f"plan.{i}.bin").read_bytes()).spec.num_seqs == n
    code, out, _ = _run(capsys, "plan", "--lengths-file", str(path), *SMALL)
    assert code == 0 and "batch 0 (1 of 2 planned): 3 sequences" in out
    assert "batch 1 (2 of 2 planned): 2 sequences" in out
    code, out, _ = _run(capsys, "plan", "--lengths-file", str(path), *SMALL, "--batch-index", "1", "--json")
    row = json.loads(out)
    assert code == 0 and row["batch_index"] == 1 and row["num_seqs"] == 2
    code, _, err = _run(capsys, "plan", "--lengths-file", str(path), *SMALL, "--batch-index", "2")
    assert code == 2 and "the file holds 2 batches" in err


# ------------------------------------------------------------------------------------------ 3. calibration
def _fake_profile(name: str = "cpu_test_machine") -> dict:
    doc = json.loads((ROOT / "dcp" / "cost" / "profiles" / "cpu_amd_epyc_2c.json").read_text())
    return {**doc, "name": name}


@pytest.fixture
def fake_calibration(monkeypatch):
    from dcp.bench import calibrate

    monkeypatch.setattr(calibrate, "calibrate", lambda cfg: _fake_profile())  # no timing in this test
    return calibrate


def test_calibrate_writes_outside_the_package_and_says_how_to_use_it(capsys, tmp_path, monkeypatch,
                                                                       fake_calibration):
    shipped = ROOT / "dcp" / "cost" / "profiles" / "cpu_amd_epyc_2c.json"
    before = shipped.read_bytes()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fake_calibration.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    code, out, _ = _run(capsys, "bench", "calibrate")
    written = Path("dcp_profiles") / "cpu_test_machine.json"
    assert code == 0 and written.is_file() and shipped.read_bytes() == before
    assert f"wrote {written}" in out and f"--profile {written}" in out
    code, out, _ = _run(capsys, "bench", "calibrate", "--out", str(tmp_path / "mine.json"))
    assert code == 0 and (tmp_path / "mine.json").is_file()
    # the written file is a profile every --profile takes
    code, out, _ = _run(capsys, "plan", "--lengths", "3000,900,200", *SMALL, "--profile", str(written), "--json")
    assert code == 0 and json.loads(out)["profile"] == "cpu_test_machine"
    code, _, err = _run(capsys, "plan", "--lengths", "3000", *SMALL, "--profile", str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in err


def test_calibrate_refuses_a_busy_machine_unless_forced(capsys, tmp_path, monkeypatch, fake_calibration):
    from dcp.bench.args import usable_cores

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(fake_calibration.os, "getloadavg", lambda: (0.6 * usable_cores() + 0.1, 0.0, 0.0))
    code, _, err = _run(capsys, "bench", "calibrate")
    assert code == 2 and "the machine is busy" in err and "--force" in err
    assert not (tmp_path / "dcp_profiles").exists()
    code, out, _ = _run(capsys, "bench", "calibrate", "--force")
    assert code == 0 and "wrote dcp_profiles" in out


# ------------------------------------------------------------------------------------------ 4. citations
def test_nothing_users_get_cites_the_shared_folder():
    suffixes = {".py", ".md", ".json", ".txt", ".csv", ".ini", ".cfg", ".toml"}
    paths = [ROOT / "README.md"] + [p for folder in ("dcp", "benchmarks", "experiments", "paper_figs")
                                    for p in (ROOT / folder).rglob("*") if p.suffix in suffixes]
    offenders = [str(p.relative_to(ROOT)) for p in paths if "shared/" in p.read_text(errors="replace")]
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------ 5. one mask syntax
def test_one_mask_syntax_everywhere(capsys):
    import argparse

    from dcp.bench.args import add_mask_args
    from dcp.bench.run import add_parser, batches_from_args
    from experiments.train_gpt import build_mask
    from experiments.train_gpt import parse_args as gpt_args
    from experiments.train_hf import parse_args as hf_args
    from experiments.train_hf import parse_mask

    p = argparse.ArgumentParser()
    add_mask_args(p)
    lam = masks_from_args(p.parse_args(["--mask", "lambda", "--mask-param", "sink=4", "--mask-param", "window=64"]))
    assert lam == [MaskArg.of("lambda", sink=4, window=64)] and lam[0].build() == dcp.masks.LambdaMask(4, 64)
    assert build_mask(gpt_args(["--mask", "lambda", "--mask-param", "sink=4", "--mask-param", "window=64"])) == \
        lam[0].build()
    assert [parse_mask(m) for m in hf_args(["--mask", "lambda", "--mask-param", "sink=4", "--mask-param",
                                            "window=64", "--mask", "causal"]).masks] == \
        [lam[0].build(), dcp.masks.CausalMask()]
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    run = sub.choices["run"].parse_args(["--lengths", "300", "--mask", "lambda", "--mask-param", "sink=4",
                                         "--mask-param", "window=64"])
    assert batches_from_args(run)[0].masks() == lam[0].build()
    code, out, _ = _run(capsys, "plan", "--lengths", "3000", *SMALL, "--mask", "lambda", "--mask-param", "window=64",
                        "--json")
    assert code == 0 and json.loads(out)["mask"] == "lambda"
    code, _, err = _run(capsys, "plan", "--lengths", "3000", *SMALL, "--mask", "lambda", "--mask", "causal")
    assert code == 2 and "this command takes one mask" in err
    # the old spellings work for one release, with a warning
    with pytest.warns(FutureWarning, match="deprecated"):
        old = hf_args(["--mask", "lambda:sink=4,window=64"]).masks
    assert [parse_mask(m) for m in old] == [lam[0].build()]
    with pytest.warns(FutureWarning, match="--mask-arg is deprecated"):
        cfg = gpt_args(["--mask", "lambda", "--mask-arg", "sink=4", "--mask-arg", "window=64"])
    assert build_mask(cfg) == lam[0].build()


# ------------------------------------------------------------------------------------------ 6. partitioner
def test_the_default_partitioner_is_documented_as_the_code_has_it(capsys):
    from dcp.partition import named_partitioner

    name = default_partitioner_name()
    assert named_partitioner(name) == dcp.PlannerConfig().partitioner
    preset = dcp.PlannerConfig().partitioner.preset
    for argv in (["plan", "--help"], ["bench", "megatron", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = re.sub(r"(?<=-) ", "", " ".join(capsys.readouterr().out.split()))  # argparse wraps at hyphens
        assert f"default {name} = Mt-KaHyPar's {preset} preset" in text, argv
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"the default partitioner is Mt-KaHyPar's `{preset}` preset" in readme
    assert "deterministic preset (the default)" not in readme
    assert '(preset="deterministic")` (the default)' not in readme


# ------------------------------------------------------------------------------------------ 8. transformers example
def test_the_readme_shows_the_whole_transformers_example():
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / "experiments" / "hf_example.py").read_text().rstrip("\n")
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.S | re.M)
    assert any(b.rstrip("\n") == script for b in blocks), "README's transformers block is not experiments/hf_example.py"
    # tests/test_readme.py runs this command (it is not exempted there)
    assert "torchrun --nproc-per-node 2 experiments/hf_example.py" in readme
    assert 'if __name__ == "__main__":' in script and "AutoModelForCausalLM.from_config" in script


# ------------------------------------------------------------------------------------------ 9. small things
def test_counts_are_pluralized_and_version_is_printed(capsys):
    assert plural(1, "sequence") == "1 sequence" and plural(3, "batch", "batches") == "3 batches"
    code, out, _ = _run(capsys, "plan", "--lengths", "3000", *SMALL)
    assert code == 0 and "1 sequence," in out and "1 sequences" not in out
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dcp {dcp.__version__}"


def test_nproc_above_the_cores_warns(monkeypatch):
    from dcp.bench import args

    monkeypatch.setattr(args, "usable_cores", lambda: 2)
    assert nproc_warning(2) is None and nproc_warning(1, threads=2) is None
    assert "--nproc 4 = 4 busy threads on 2 cores" in nproc_warning(4)
    assert "--nproc 2 x --threads 2" in nproc_warning(2, threads=2)


def test_the_loader_says_a_rejection_on_rank_0_only(caplog):
    from dcp.integration import DCPLoader

    loader = DCPLoader([np.arange(10)], dcp.Cluster(1, 1), dcp.PlannerConfig(block_size=16), 64, 2, 1, 16, "float32")
    with caplog.at_level(logging.DEBUG, logger="dcp.integration"):
        loader._reject(7, 100, "longer than the token budget (64)")
        loader.rank = 1  # what every other rank of a process group does with the same sample
        loader._reject(8, 100, "longer than the token budget (64)")
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "rejected" in r.getMessage()]
    assert [lvl for lvl, _ in said] == [logging.WARNING, logging.DEBUG] and "sample 7" in said[0][1]
    assert len(loader.rejected) == 2


def test_sample_rejected_error_is_exported_at_the_top():
    from dcp.integration import SampleRejectedError

    assert dcp.SampleRejectedError is SampleRejectedError and "SampleRejectedError" in dcp.__all__
