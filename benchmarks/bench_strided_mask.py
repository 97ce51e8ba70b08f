"""Time building and planning a strided mask_mod: issue 23's case, end to end as a user runs it.

The mask: causal ∧ (window 512 ∨ the first 64 keys ∨ ``kv_idx % 8 == 0``) — thousands of KV ranges per
query token (4,025 at 32K tokens). A fresh Python process (imports included, no warm caches) materializes
it with ``dcp.masks.from_mask_mod`` for a 32,768-token and an 8,192-token sequence, then runs
``dcp.plan`` on ``BatchSpec([32768, 8192], masks, 8 heads)`` over ``dcp.Cluster(1, 8)`` (8 devices). The
``no_stride`` case (window ∨ first keys only) is the reference a strided mask should stay near.

    python benchmarks/bench_strided_mask.py [--cases strided no_stride] [--timeout 1800]

Writes ``benchmarks/results/strided_mask_cpu.csv``: one row per case, with the machine, the revision and
the 1-minute load average before and after the case (this kind of machine is often shared), the build
and plan seconds, the slots and ranges of the 32K mask, the plan's tiles and whether it validates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402

SEQLENS = (32768, 8192)
HEADS = dict(num_heads=8, num_kv_heads=8, head_dim=128)
CASES = ("strided", "no_stride")


def strided(b, h, q_idx, kv_idx):
    """causal ∧ (window 512 ∨ first 64 keys ∨ every 8th key): FlexAttention's four-argument form."""
    return (q_idx >= kv_idx) & (((q_idx - kv_idx) < 512) | (kv_idx < 64) | ((kv_idx % 8) == 0))


def no_stride(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (((q_idx - kv_idx) < 512) | (kv_idx < 64))


def run_case(case: str) -> dict:
    """One measurement in this (fresh) process."""
    t0 = time.perf_counter()
    import dcp
    from dcp.masks import from_mask_mod

    fn = {"strided": strided, "no_stride": no_stride}[case]
    t_import = time.perf_counter() - t0
    t1 = time.perf_counter()
    masks = [from_mask_mod(fn, n) for n in SEQLENS]
    t_build = time.perf_counter() - t1
    spec = dcp.BatchSpec(list(SEQLENS), masks, **HEADS)
    t2 = time.perf_counter()
    plan = dcp.plan(spec, dcp.Cluster(1, 8))
    t_plan = time.perf_counter() - t2
    big, stats = masks[0].ranges, plan.stats()
    return dict(case=case, seqlens=" ".join(map(str, SEQLENS)), devices=8, **HEADS,
                import_s=round(t_import, 2), build_s=round(t_build, 2), plan_s=round(t_plan, 2),
                build_plus_plan_s=round(t_build + t_plan, 2), range_slots_32k=int(big.shape[1]),
                ranges_32k=int((big[:, :, 1] > big[:, :, 0]).sum()), n_tiles=int(stats.n_tiles),
                valid=bool(stats.valid))


def spawn(case: str, timeout: float) -> dict:
    """``run_case`` in a fresh interpreter; its JSON result (or the failure)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case]
    load_before = round(os.getloadavg()[0], 2)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case=case, load_avg_1m_before=load_before, error=f"timed out after {timeout:.0f} s")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(case=case, load_avg_1m_before=load_before,
                    error=(done.stderr.strip().splitlines() or ["?"])[-1])
    return dict(load_avg_1m_before=load_before, **json.loads(lines[-1]),
                load_avg_1m_after=round(os.getloadavg()[0], 2))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per case")
    ap.add_argument("--out", default=str(RESULTS / "strided_mask_cpu.csv"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child)))
        return
    header = dict(machine=machine(), revision=git_revision(), cpu_count=os.cpu_count())
    rows = []
    for case in args.cases:
        row = {**header, **spawn(case, args.timeout)}
        rows.append(row)
        print(f"{case:<10} build {row.get('build_s', float('nan')):>7.2f} s  plan {row.get('plan_s', float('nan')):>7.2f} s"
              f"  total {row.get('build_plus_plan_s', float('nan')):>7.2f} s  load {row.get('load_avg_1m_before')}"
              f"  {row.get('error', '')}", flush=True)
    print(f"wrote {write_csv(args.out, rows)}")


if __name__ == "__main__":
    main()
