"""The simulator checked against real runs on this machine: ``dcp bench run`` over a fixed set of batches.

    python benchmarks/bench_sim_vs_real.py --profile dcp_profiles/cpu_<machine>.json   # after dcp bench calibrate
    python benchmarks/bench_sim_vs_real.py --quick --out /tmp/x          # tiny: a check of the script

2 gloo processes with one thread each (1 node x 2 devices, the machine's 2 cores), fp32, 4 query / 2 KV
heads, head dim 64. Batches: causal and lambda masks, several length mixes, dcp at B = 256 and 512; every
planner (dcp and the five baselines) per batch, timed interleaved. Writes ``run_cpu.csv`` (one row per
batch, planner and direction: measured ms, simulated ms, rank spread, load average) and
``run_cpu_summary.csv`` (per batch and direction: median / worst |simulated - measured| / measured and
Kendall's tau between the planners' simulated and measured order -- over all pairs, and over the pairs
whose measured ranges (fastest to slowest repeat) do not overlap, ``kendall_tau_resolved``; then the
error statistics over all rows).
Goals (issue 11): median error <= 20 %, worst <= 50 %, tau >= 0.8 per batch.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, write_csv  # noqa: E402
from dcp.bench.common import DcpOptions, fmt_table  # noqa: E402
from dcp.bench.run import RUN_PLANNERS, RunBatch, RunConfig, kendall_tau, kendall_tau_resolved, run_local  # noqa: E402

LAMBDA = (("sink", "16"), ("window", "512"))
BATCHES = (  # (label, lengths, mask, mask params, dcp block size)
    ("causal-mix-B256", (2048, 1024, 512, 384, 128), "causal", (), 256),
    ("causal-long-B512", (3072, 768, 256), "causal", (), 512),
    ("causal-many-B256", (768, 640, 512, 512, 384, 384, 256, 256, 192, 128, 128, 96), "causal", (), 256),
    ("lambda-mix-B256", (2560, 1024, 512), "lambda", LAMBDA, 256),
    ("lambda-long-B512", (4096, 512), "lambda", LAMBDA, 512),
)
QUICK_BATCHES = (("quick-causal", (300, 120, 70), "causal", (), 64), ("quick-lambda", (200, 180), "lambda",
                                                                       (("sink", "8"), ("window", "64")), 64))


def summarize(rows: list[dict]) -> list[dict]:
    """Per (batch, direction) and overall: error statistics and Kendall's tau of the planners' order."""
    out = []
    keys = list(dict.fromkeys((r["batch"], r["direction"]) for r in rows))
    for batch, direction in keys + [("all", "both")]:
        sel = [r for r in rows if batch == "all" or (r["batch"], r["direction"]) == (batch, direction)]
        err = [abs(r["sim_rel_error"]) for r in sel]
        row = dict(batch=batch, direction=direction, plans=len(sel), median_abs_error=round(statistics.median(err), 4),
                   worst_abs_error=round(max(err), 4), mean_signed_error=round(statistics.mean(r["sim_rel_error"]
                                                                                                for r in sel), 4))
        if batch != "all":
            row["kendall_tau"] = round(kendall_tau([r["simulated_ms"] for r in sel], [r["measured_ms"] for r in sel]), 3)
            tau_r, pairs = kendall_tau_resolved([r["simulated_ms"] for r in sel], [r["measured_ms"] for r in sel],
                                                [r["measured_min_ms"] for r in sel], [r["measured_max_ms"] for r in sel])
            row["kendall_tau_resolved"], row["resolved_pairs"] = round(tau_r, 3), pairs
            row["fastest_measured"] = min(sel, key=lambda r: r["measured_ms"])["planner"]
            row["fastest_simulated"] = min(sel, key=lambda r: r["simulated_ms"])["planner"]
        row["load_min"] = min(r["load_before"] for r in sel)
        row["load_max"] = max(r["load_after"] for r in sel)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cpu_amd_epyc_2c",
                    help="cost profile of the simulated column: a bundled name (default: the shipped calibration of "
                         "the 2-core AMD EPYC) or the .json path dcp bench calibrate printed")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default=None, help="suffix of the CSV names (default: '_quick' with --quick, else '')")
    args = ap.parse_args(argv)
    rows = []
    started = time.perf_counter()
    for label, lengths, mask, params, block in (QUICK_BATCHES if args.quick else BATCHES):
        cfg = RunConfig(batches=(RunBatch(lengths, mask, params, label),), planners=RUN_PLANNERS,
                        heads=2 if args.quick else 4, kv_heads=1 if args.quick else 2,
                        head_dim=16 if args.quick else 64, dtype="float32", profile=args.profile,
                        warmup=1 if args.quick else args.warmup, repeats=2 if args.quick else args.repeats,
                        threads=1, dcp=DcpOptions(block_size=block))
        rows += run_local(cfg, 2)
        print(f"{label}: done at {time.perf_counter() - started:.0f} s", flush=True)
    out = Path(args.out)
    suffix = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    write_csv(out / f"run_cpu{suffix}.csv", rows)
    summary = summarize(rows)
    write_csv(out / f"run_cpu{suffix}_summary.csv", summary)
    print(fmt_table(rows, ["batch", "planner", "direction", "measured_ms", "simulated_ms", "sim_rel_error",
                           "rank_spread", "load_before"]))
    print(fmt_table(summary, list(summary[0])))
    total = summary[-1]
    taus = [r["kendall_tau"] for r in summary[:-1]]
    print(f"{total['plans']} plans: median |sim - measured| / measured {total['median_abs_error']:.1%} (goal <= 20 %), "
          f"worst {total['worst_abs_error']:.1%} (goal <= 50 %); Kendall tau per batch and direction "
          f"{min(taus):.2f}..{max(taus):.2f}, {sum(t >= 0.8 for t in taus)} of {len(taus)} >= 0.8; "
          f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
