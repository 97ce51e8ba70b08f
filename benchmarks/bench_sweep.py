"""Randomized plan-quality sweep: dcp against every static baseline on drawn batches (simulated).

Each case draws a cluster (2 ... 1,024 devices), a cost-model profile (a100, h100, cpu_amd_epyc_2c), a
batch (1-64 sequences, log-uniform lengths in [64, 1M], 256-16K tokens per device on average, a mask
family per sequence) and a head geometry; the rules are in ``dcp/bench/sweep.py``. dcp plans with its
default configuration except the cost model (the case's profile) and, for batches with fewer than 1,024
tokens per device, a smaller block size; every plan is simulated (forward and backward) with that same
profile. Case i of a sweep with seed S is drawn from ``numpy.random.default_rng([S, i])``, so any row can
be reproduced on its own (``dcp.bench.sweep.draw_cases``).

    python benchmarks/bench_sweep.py --cases 200                  # the sweep (1,024-device cases take minutes)
    python benchmarks/bench_sweep.py --cases 100 --max-devices 64
    python benchmarks/bench_sweep.py --quick                      # 6 small cases, < 1 minute on 2 cores

Writes ``--out`` (default benchmarks/results/sweep.csv, ``sweep_quick.csv`` with --quick; one row per
case and planner; rewritten after every case, so an interrupted sweep keeps what it finished) and
``--summary`` (default: the same name with ``_summary``; per devices x profile, per devices, overall:
min and geomean of dcp's simulated fwd+bwd speedup over each baseline and over the best baseline of each
case, dcp's memory-tolerance violations, warm-start regressions, errors). Progress goes to stderr.
Times are SIMULATED except planning times (wall-clock on the machine named in each row).
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
from dcp.bench.common import fmt_table, parse_list  # noqa: E402
from dcp.bench.sweep import DEVICES, MAX_TOKENS, PLANNERS, PROFILES, draw_cases, run_case, summarize  # noqa: E402

QUICK = dict(cases=6, max_devices=8, max_tokens=16384)
HEADLINE = ["devices", "profile", "cases", "speedup_vs_best_min", "speedup_vs_best_geomean",
            "speedup_vs_best_in_budget_min", "speedup_vs_best_in_budget_geomean",
            "memory_violations", "memory_budget_warnings", "warm_start_regressions", "dcp_errors",
            "max_dcp_memory_imbalance", "dcp_median_planning_s"]


def failed_rows(case, planners, err: BaseException, mach: str, rev: str) -> list[dict]:
    """Rows of a case whose run raised something other than a ``DcpError`` (a bug): recorded, not fatal."""
    text = f"internal {type(err).__name__}: {err}"
    return [dict(case.fields(), planner=p, error=text, machine=mach, revision=rev, simulated=True) for p in planners]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100, help="number of cases (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="sweep seed (case i uses default_rng([seed, i]))")
    ap.add_argument("--max-devices", type=int, default=max(DEVICES),
                    help=f"draw only device counts <= this from {DEVICES}")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="cap on a batch's total tokens")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="cost-model profiles to draw from")
    ap.add_argument("--planners", default=",".join(PLANNERS), help="dcp and baseline names")
    ap.add_argument("--out", default=None, help="rows CSV (default benchmarks/results/sweep[_quick].csv)")
    ap.add_argument("--summary", default=None, help="summary CSV (default: --out with a _summary suffix)")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['cases']} cases, <= {QUICK['max_devices']} devices, <= {QUICK['max_tokens']} "
                         "tokens (< 1 minute on 2 cores)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.max_devices = QUICK["cases"], min(args.max_devices, QUICK["max_devices"])
        args.max_tokens = min(args.max_tokens, QUICK["max_tokens"])
    out = Path(args.out or RESULTS / ("sweep_quick.csv" if args.quick else "sweep.csv"))
    summary_path = Path(args.summary or out.with_name(out.stem + "_summary.csv"))
    devices = tuple(d for d in DEVICES if d <= args.max_devices)
    if not devices:
        ap.error(f"--max-devices {args.max_devices} leaves none of {DEVICES}")
    planners = parse_list(args.planners)
    cases = draw_cases(args.cases, args.seed, devices=devices, profiles=parse_list(args.profiles),
                       max_tokens=args.max_tokens)
    mach, rev = machine(), git_revision()
    rows: list[dict] = []
    started = time.perf_counter()
    for i, case in enumerate(cases):
        print(f"[sweep {i + 1}/{len(cases)}] {case.label()}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            got = run_case(case, planners, mach, rev)
        except Exception as err:  # a bug in a planner or the simulator: record it and go on
            traceback.print_exc(file=sys.stderr)
            got = failed_rows(case, planners, err, mach, rev)
        rows += got
        write_csv(out, rows)
        dcp = next((r for r in got if r["planner"] == "dcp"), {})
        speedups = [r.get("dcp_speedup") for r in got if r["planner"] != "dcp" and r.get("dcp_speedup")]
        vs_best = f"{min(speedups):.3f}" if speedups else "-"
        mem = dcp.get("memory_imbalance")
        print(f"    {time.perf_counter() - t0:.1f} s; dcp {dcp.get('dcp_chosen', '') or dcp.get('error', '')}, "
              f"speedup over best baseline {vs_best}, memory imbalance {f'{mem:.4f}' if mem else '-'}"
              f"{' (memory budget warning)' if dcp.get('memory_budget_warning') else ''}, "
              f"warm starts [{dcp.get('search_warm_starts', '')}]; elapsed {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
    summary = summarize(rows)
    write_csv(summary_path, summary)
    print(f"wrote {out} ({len(rows)} rows) and {summary_path}")
    print(f"\nSIMULATED: dcp's forward+backward speedup over the best baseline of each case (seed {args.seed})")
    print(fmt_table(summary, [c for c in HEADLINE if c in summary[0]]))
    per_base = [c for c in summary[-1] if c.startswith("speedup_vs_") and c not in HEADLINE]
    print("\nall cases, per baseline: " + ", ".join(f"{c[len('speedup_vs_'):]}={summary[-1][c]}" for c in per_base))
    print(f"\nsweep: {len(cases)} cases in {time.perf_counter() - started:.0f} s on {mach}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
