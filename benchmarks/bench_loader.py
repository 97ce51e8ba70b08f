"""Loader benchmark: does background planning keep the trainer from waiting for plans?

Runs ``experiments/train_gpt.py``'s training loop at 4 gloo processes (CPU) for N steps, once per
configuration: planner in a background process (the default) or inline (the contrast: every step waits
for its own plan), with the greedy and the Mt-KaHyPar partitioner. Reports, from rank 0's per-step
records: the share of steps that waited > 1 ms for their plan (all steps, and after the first, whose
plan cannot be ready: the worker is just starting), the planner's time per batch (mean, p95), the step
time and tokens/s.

    python benchmarks/bench_loader.py                  # 40 steps per configuration
    python benchmarks/bench_loader.py --steps 10 --quick
Writes benchmarks/results/loader_cpu.csv (one row per configuration, with a machine column).
"""
from __future__ import annotations

import argparse
import datetime
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
from experiments.train_gpt import TrainConfig, train  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, outdir: str, cfg: TrainConfig) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=5))
        res = train(cfg, rank, world)
        out = {"records": res.records, "stats": res.loader_stats}
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001
        out = {"crash": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)


def run(world: int, cfg: TrainConfig, deadline_s: float) -> dict:
    """Rank 0's result of one ``world``-process training run."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_rank_main, args=(world, _free_port(), tmp, cfg), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run did not finish in {deadline_s:.0f} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        with open(os.path.join(tmp, "rank0.pkl"), "rb") as f:
            out = pickle.load(f)
    if "crash" in out:
        raise RuntimeError(out["crash"])
    return out


def summarize(records: list[dict]) -> dict:
    waited = [r["waited"] for r in records]
    planned = [r["planning_time_s"] for r in records if not r["cache_hit"]]
    steady = records[1:] or records
    step_ms = [1e3 * r["step_s"] for r in steady]
    p95 = sorted(planned)[max(0, int(round(0.95 * len(planned))) - 1)] if planned else 0.0
    return {"steps": len(records), "waited_steps": sum(waited),
            "waited_share": round(sum(waited) / len(waited), 4),
            "waited_share_after_first": round(sum(waited[1:]) / max(1, len(waited) - 1), 4),
            "wait_ms_mean_after_first": round(1e3 * statistics.fmean(r["waited_s"] for r in steady), 3),
            "planning_ms_mean": round(1e3 * statistics.fmean(planned), 2) if planned else 0.0,
            "planning_ms_p95": round(1e3 * p95, 2),
            "step_ms_median": round(statistics.median(step_ms), 1),
            "tokens_per_s": round(sum(r["tokens"] for r in steady) / sum(r["step_s"] for r in steady)),
            "first_loss": round(records[0]["loss"], 4), "final_loss": round(records[-1]["loss"], 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--mask", default="causal")
    ap.add_argument("--quick", action="store_true", help="only the background-process planner with greedy")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds allowed per run")
    ap.add_argument("--out", default=str(RESULTS / "loader_cpu.csv"))
    args = ap.parse_args(argv)
    base = TrainConfig(steps=args.steps, tokens_per_batch=args.tokens_per_batch, block_size=args.block_size,
                       mask=args.mask, quiet=True)
    configs = [("process", "greedy"), ("process", "mtkahypar"), ("inline", "greedy"), ("inline", "mtkahypar")]
    if args.quick:
        configs = configs[:1]
    mach, rev = machine(), git_revision()
    rows = []
    for planner, partitioner in configs:
        cfg = replace(base, planner=planner, partitioner=partitioner)
        t0 = time.perf_counter()
        out = run(args.world, cfg, args.deadline)
        row = {"machine": mach, "git": rev, "world": args.world, "planner": planner, "partitioner": partitioner,
               "tokens_per_batch": args.tokens_per_batch, "block_size": args.block_size, "mask": args.mask,
               **summarize(out["records"]), "wall_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(f"{planner:>7} {partitioner:>9}: waited {row['waited_steps']}/{row['steps']} steps "
              f"(after the first: {100 * row['waited_share_after_first']:.0f}%), planning "
              f"{row['planning_ms_mean']:.1f} ms/batch (p95 {row['planning_ms_p95']:.1f}), step "
              f"{row['step_ms_median']:.0f} ms, {row['tokens_per_s']:,} tok/s, loss {row['first_loss']} -> "
              f"{row['final_loss']}", flush=True)
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
