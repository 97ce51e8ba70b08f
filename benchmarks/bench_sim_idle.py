"""Idle devices cost the simulator and the validator (almost) nothing: one plan, more and more idle devices.

Issue 14 asks for a simulator whose per-event cost does not depend on the devices that take no part. A
plan for 4 x 8 devices (dcp's default planner, one 131,072-token LDC x1 causal batch, 8/2 heads, D 128)
is placed unchanged on clusters of 32, 256 and 1,024 devices (8 per node; the extra devices hold no data
and run nothing), validated and simulated forward and backward (best of 5; A100 profile). The simulated
makespans must not change; the costs should grow only by the per-device setup (lists of n entries).

    python benchmarks/bench_sim_idle.py     # ~1 min -> benchmarks/results/sim_idle_cpu.csv
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402


def _best(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="32,256,1024")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS / "sim_idle_cpu.csv"))
    args = ap.parse_args(argv)
    import dcp
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.ir.validate import validate
    from dcp.masks import CausalMask
    from dcp.sim import simulate

    lens = make_batches("ldc", 1.0, tokens_per_batch=131072, num_batches=1, seed=0)[0]
    spec = dcp.BatchSpec(lens, CausalMask(), 8, 2, 128, "bfloat16")
    base = dcp.DCPPlanner().plan(spec, dcp.Cluster(4, 8))
    cost = CostModel.named("a100")
    rows, mach, rev = [], machine(), git_revision()
    for n in (int(x) for x in args.devices.split(",")):
        plan = dataclasses.replace(base, cluster=dcp.Cluster(n // 8, 8))
        row = {"devices": n, "busy_devices": 32, "n_tiles": plan.tiles.n_tiles,
               "validate_s": round(_best(lambda: validate(plan), args.repeats)[0], 5)}
        for d in ("forward", "backward"):
            secs, res = _best(lambda: simulate(plan, cost, d, record_events=False), args.repeats)
            row[f"sim_{d[:3]}_s"] = round(secs, 5)
            row[f"sim_{d[:3]}_ms"] = round(res.makespan_s * 1e3, 6)
        rows.append({**row, "simulated": True, "machine": mach, "revision": rev})
        print(rows[-1], flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
