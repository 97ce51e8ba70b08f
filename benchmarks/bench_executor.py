"""Executor overhead: the share of an executor's time spent outside the tile kernels.

Runs dcp plans with the reference executor (all devices in this process, in-memory transfers) using the
native kernels wrapped in timers, forward and backward, and reports per configuration: total seconds,
seconds inside kernel calls (forward/backward tile kernels and LSE merges), and the overhead share
(table building on first use excluded: it is cached per plan and measured separately as `first_run_s`).
The tile kernel's own throughput against PyTorch's CPU attention is `benchmarks/bench_kernels.py`.

    python benchmarks/bench_executor.py            # writes benchmarks/results/executor_cpu.csv
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
import dcp  # noqa: E402
from dcp.data import make_batches  # noqa: E402
from dcp.execute import ReferenceExecutor  # noqa: E402
from dcp.kernels import get_kernels  # noqa: E402
from dcp.masks import CausalMask, LambdaMask  # noqa: E402


class TimedKernels:
    """The native kernels with a stopwatch around every call."""

    def __init__(self, inner):
        self.inner, self.seconds, self.calls = inner, 0.0, 0

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return run

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        return self._timed(attr) if name in ("forward", "backward", "merge_partials", "merge_into") else attr


def run_case(tokens: int, mask, dtype: torch.dtype, cluster: tuple[int, int], block: int, reps: int) -> dict:
    lens = make_batches("ldc", 1.0, tokens_per_batch=tokens, num_batches=1, seed=1)[0]
    spec = dcp.BatchSpec(lens, mask, 8, 2, 128, dtype=str(dtype).replace("torch.", ""))
    plan = dcp.plan(spec, dcp.Cluster(*cluster), dcp.PlannerConfig(block_size=block))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(spec.total_tokens, 8, 128, generator=g).to(dtype)
    k = torch.randn(spec.total_tokens, 2, 128, generator=g).to(dtype)
    v = torch.randn(spec.total_tokens, 2, 128, generator=g).to(dtype)
    do = torch.randn(spec.total_tokens, 8, 128, generator=g).to(dtype)
    timed = TimedKernels(get_kernels("native"))
    ex = ReferenceExecutor(kernels=timed, validate=False)
    t0 = time.perf_counter()
    o, lse = ex.run_forward(plan, q, k, v)
    ex.run_backward(plan, q, k, v, o, lse, do)
    first = time.perf_counter() - t0
    row = dict(tokens=spec.total_tokens, seqs=spec.num_seqs, mask=mask.name, dtype=str(dtype).replace("torch.", ""),
               devices=plan.n_devices, block_size=block, tiles=plan.tiles.n_tiles, first_run_s=round(first, 4))
    for direction in ("forward", "backward"):
        timed.seconds, timed.calls = 0.0, 0
        t0 = time.perf_counter()
        for _ in range(reps):
            if direction == "forward":
                ex.run_forward(plan, q, k, v)
            else:
                ex.run_backward(plan, q, k, v, o, lse, do)
        total = (time.perf_counter() - t0) / reps
        kern = timed.seconds / reps
        row[f"{direction}_s"] = round(total, 4)
        row[f"{direction}_kernel_s"] = round(kern, 4)
        row[f"{direction}_overhead_share"] = round(1 - kern / total, 3)
        row[f"{direction}_kernel_calls"] = timed.calls // reps
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "executor_cpu.csv"))
    args = ap.parse_args(argv)
    rows = []
    for mask in (CausalMask(), LambdaMask(sink=64, window=1024)):
        for dtype in (torch.float32, torch.bfloat16):
            for cluster in ((1, 1), (1, 4)):
                for block in (512, 1024):
                    row = run_case(args.tokens, mask, dtype, cluster, block, args.reps)
                    row.update(machine=machine(), threads=torch.get_num_threads(), revision=git_revision())
                    rows.append(row)
                    print({k: row[k] for k in ("mask", "dtype", "devices", "block_size", "tiles", "forward_s",
                                               "forward_overhead_share", "backward_s", "backward_overhead_share")},
                          flush=True)
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
