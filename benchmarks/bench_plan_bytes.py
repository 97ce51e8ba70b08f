"""Plan bytes of a many-range mask: one 131,072-token sequence with 31 KV ranges per token.

Issue 14's target: a plan at 131K tokens with a 31-ranges-per-token mask (natten-like) serializes to at
most 8 MiB. The mask is 2-D neighbourhood attention over a 256 x 512 token grid with a 31 x 31 window
(NATTEN's border rule), given as explicit ranges (32 MB as int32 ``[L, 31, 2]``); every planner plans it
on 4 x 8 devices (8/2 heads, D 128), and the row records planning seconds, tiles, plan MiB and whether
``from_bytes(to_bytes())`` gives the same bytes.

    python benchmarks/bench_plan_bytes.py     # ~1 min -> benchmarks/results/plan_bytes_natten_cpu.csv
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402


def natten_ranges(h: int, w: int, k: int) -> np.ndarray:
    """k ranges per token of an h x w grid (row-major): the k x k window, shifted inside at the borders."""
    y, x = np.divmod(np.arange(h * w), w)
    x0, y0 = np.clip(x - k // 2, 0, w - k), np.clip(y - k // 2, 0, h - k)
    start = (y0[:, None] + np.arange(k)[None, :]) * w + x0[:, None]
    return np.stack([start, start + k], axis=-1).astype(np.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(RESULTS / "plan_bytes_natten_cpu.csv"))
    args = ap.parse_args(argv)
    import dcp
    from dcp.baselines import BASELINES
    from dcp.masks import RangesMask

    ranges = natten_ranges(256, 512, 31)
    spec = dcp.BatchSpec([ranges.shape[0]], RangesMask(ranges), 8, 2, 128, "bfloat16")
    cluster = dcp.Cluster(4, 8)
    planners = [("dcp", dcp.DCPPlanner())] + [(n, BASELINES[n]()) for n in sorted(BASELINES)]
    rows, mach, rev = [], machine(), git_revision()
    for name, planner in planners:
        t = time.perf_counter()
        plan = planner.plan(spec, cluster)
        plan_s = time.perf_counter() - t
        blob = plan.to_bytes()
        rows.append({"planner": name, "tokens": spec.total_tokens, "ranges_per_token": ranges.shape[1],
                     "raw_ranges_mib": round(ranges.nbytes / 2**20, 3), "devices": cluster.n_devices,
                     "plan_s": round(plan_s, 3), "n_tiles": plan.tiles.n_tiles,
                     "plan_mib": round(len(blob) / 2**20, 3),
                     "roundtrip_exact": dcp.Plan.from_bytes(blob).to_bytes() == blob,
                     "machine": mach, "revision": rev})
        print(rows[-1], flush=True)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
