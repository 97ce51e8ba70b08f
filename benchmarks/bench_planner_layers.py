"""Planning time with two layer kinds against one, on the DCP paper's planner configuration.

Grid: 131,072-token batches, 4 nodes x 8 GPUs, 8 query / 2 KV heads, head dim 128, bf16; lengths
{longalign, ldc} x scale {1, 4}; dcp's default configuration (B = 1024). Per batch dcp plans the full
causal mask alone (one kind), then the layered batch of a model alternating full and 128-token
sliding-window layers (``{"full": causal, "sliding": SlidingWindowMask(128)}``, 12 layers each), in the same
process, alternating, ``--repeat`` times each on a fresh spec; the fastest of each counts. Planning time is
end to end (spec -> validated plans, every kind's); run it on a quiet machine.

    python benchmarks/bench_planner_layers.py            # 3 batches per cell, ~2 min on 2 cores
Writes benchmarks/results/planner_layers_cpu.csv (one row per batch) and prints the medians and the worst
ratio (goal of issue 24: two kinds <= 1.5x one kind's planning time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
from dcp import BatchSpec, Cluster, PlannerConfig  # noqa: E402
from dcp.data import make_batches  # noqa: E402
from dcp.masks import CausalMask, SlidingWindowMask  # noqa: E402
from dcp.planner import DCPPlanner  # noqa: E402


def _timed(planner, spec, cluster):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        plan = planner.plan(spec, cluster)
        return plan, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="plans per batch and kind; the fastest counts (timeit's rule)")
    ap.add_argument("--out", default=str(RESULTS / "planner_layers_cpu.csv"))
    args = ap.parse_args(argv)
    cluster, planner = Cluster(4, 8), DCPPlanner(PlannerConfig())
    mach, rev = machine(), git_revision()
    # one plan first: the process's one-time costs (imports, the partitioner's start) are nobody's
    _timed(planner, BatchSpec([8192] * 16, CausalMask(), 8, 2, 128, "bfloat16"), cluster)
    rows = []
    for dataset in ("longalign", "ldc"):
        for scale in (1.0, 4.0):
            for bi, lens in enumerate(make_batches(dataset, scale, tokens_per_batch=131072,
                                                   num_batches=args.batches, seed=0)):
                one = BatchSpec(lens, CausalMask(), 8, 2, 128, "bfloat16")
                two = BatchSpec(lens, {"full": CausalMask(), "sliding": SlidingWindowMask(args.window)}, 8, 2, 128,
                                "bfloat16", layers={"full": 12, "sliding": 12})
                load = os.getloadavg()[0]
                t_one = t_two = float("inf")
                for _ in range(args.repeat):  # alternating, each on a fresh spec (no cache carries over)
                    plan_one, t = _timed(planner, BatchSpec(lens, CausalMask(), 8, 2, 128, "bfloat16"), cluster)
                    t_one = min(t_one, t)
                    plan_two, t = _timed(planner, BatchSpec.from_description(two.describe()), cluster)
                    t_two = min(t_two, t)
                rows.append(dict(dataset=dataset, scale=scale, batch=bi, num_seqs=one.num_seqs, tokens=one.total_tokens,
                                 one_kind_s=round(t_one, 4), two_kinds_s=round(t_two, 4),
                                 ratio=round(t_two / t_one, 3), one_kind_chosen=plan_one.meta["search_chosen"],
                                 two_kinds_chosen=plan_two.meta["layered_chosen"], load_avg_1min=round(load, 2),
                                 machine=mach, revision=rev))
                print(f"{dataset:9s} x{scale:<3} b{bi} one {t_one:6.2f}s two {t_two:6.2f}s "
                      f"ratio {t_two / t_one:5.2f} (load {load:.2f})", flush=True)
    write_csv(Path(args.out), rows)
    ratios = [r["ratio"] for r in rows]
    print(f"\none kind: median {statistics.median(r['one_kind_s'] for r in rows):.2f} s; two kinds: median "
          f"{statistics.median(r['two_kinds_s'] for r in rows):.2f} s; ratio median {statistics.median(ratios):.2f}, "
          f"worst {max(ratios):.2f}   ({mach})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
