"""Time and peak memory of building dcp masks from FlexAttention-style mask_mods at long lengths.

Each case runs in a fresh Python process (so its peak RSS is its own): it builds the mask_mod of
``dcp.masks.mask_mod_zoo`` for the length, then times one evaluation:

- ``blocks``: ``evaluate_mask_mod(fn, L, method="blocks")`` — bounds for whole blocks, exact values only
  for the partial 16 x 16 leaves (what ``from_mask_mod`` / ``MaskModMask`` do by default);
- ``dense_stream``: every pair, transition encoder into reused buffers (the fallback for predicates the
  bounds cannot follow);
- ``dense_reference``: every pair through ``dense_to_ranges`` (the reference; only at ``--compare-len``);
- ``cached_spec``: a ``MaskModMask`` read by a second ``BatchSpec`` after a first one evaluated it.

At ``--compare-len`` every method's ranges are compared with the reference (``equal_to_reference``).

    python benchmarks/bench_mask_mod.py [--seqlen 131072] [--compare-len 16384] [--masks causal document ...]

Writes ``benchmarks/results/mask_mod_cpu.csv`` (machine, torch threads and the load average at the start
named in every row) and prints a table. Peak RSS includes the interpreter with numpy and torch imported
(``baseline_rss_gib``, measured before the evaluation).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402

TARGET_MASKS = ("causal", "sliding_window", "document", "natten", "vsa_topk", "sta", "dilated_sliding_window",
                "prefix_lm", "block_causal")
COMPARE_MASKS = ("causal", "document", "natten")


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def run_case(mask: str, seqlen: int, method: str, compare: bool) -> dict:
    """One measurement in this process (the child side)."""
    import numpy as np
    import torch

    import dcp
    from dcp.masks import MaskModMask, RangesMask
    from dcp.masks.mask_mod import evaluate_mask_mod
    from dcp.masks.mask_mod_zoo import ZOO

    fn = ZOO[mask](seqlen)
    baseline = _rss_gib()
    row = dict(mask=mask, seqlen=seqlen, method=method, torch_threads=torch.get_num_threads())
    t0 = time.perf_counter()
    if method == "cached_spec":
        mm_mask = MaskModMask(fn)
        spec = dict(num_heads=8, num_kv_heads=2, head_dim=128)
        dcp.BatchSpec([seqlen], mm_mask, **spec).kv_ranges(0)
        t0 = time.perf_counter()
        ranges = dcp.BatchSpec([seqlen], mm_mask, **spec).kv_ranges(0)
        stats = None
    else:
        kind = {"blocks": "blocks", "dense_reference": "dense", "dense_stream": "auto"}[method]
        if method == "dense_stream":  # force the fallback: the bounds refuse every call
            from dcp.masks import mask_mod_blocks
            from dcp.masks.bounds import Refused

            def refuse(*args, **kwargs):
                raise Refused("benchmark: dense_stream")
            mask_mod_blocks.classify = refuse
        ranges, stats = evaluate_mask_mod(fn, seqlen, method=kind)
    row["seconds"] = round(time.perf_counter() - t0, 3)
    row["peak_rss_gib"] = round(_rss_gib(), 3)
    row["baseline_rss_gib"] = round(baseline, 3)
    row["range_slots"] = int(ranges.shape[1])
    row["allowed_pairs"] = int((ranges[:, :, 1] - ranges[:, :, 0]).sum())
    if stats is not None:
        row.update(exact_fraction=round(stats.exact_fraction, 5), full_blocks=stats.full_blocks,
                   empty_blocks=stats.empty_blocks, partial_leaves=stats.partial_leaves,
                   abstract_calls=stats.abstract_calls, exact_calls=stats.exact_calls,
                   fallback=stats.fallback or "")
    if compare:
        reference, _ = evaluate_mask_mod(fn, seqlen, method="dense")
        row["equal_to_reference"] = bool(RangesMask(ranges) == RangesMask(reference))
        del reference
    del np
    return row


def spawn(mask: str, seqlen: int, method: str, compare: bool, timeout: float) -> dict:
    """``run_case`` in a fresh interpreter; its JSON result (or the failure)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([mask, seqlen, method, compare])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(mask=mask, seqlen=seqlen, method=method, error=f"timed out after {timeout:.0f} s")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return dict(mask=mask, seqlen=seqlen, method=method, error=(done.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(lines[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--compare-len", type=int, default=16384, help="length of the rows checked against the "
                                                                   "reference (0: none)")
    ap.add_argument("--masks", nargs="+", default=list(TARGET_MASKS))
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per case")
    ap.add_argument("--out", default=str(RESULTS / "mask_mod_cpu.csv"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(*json.loads(args.child))))
        return
    header = dict(machine=machine(), load_avg_1m=round(os.getloadavg()[0], 2), revision=git_revision())
    plan = [(m, args.seqlen, "blocks", False) for m in args.masks]
    plan += [(m, args.seqlen, "cached_spec", False) for m in ("causal", "document") if m in args.masks]
    if args.compare_len:
        plan += [(m, args.compare_len, method, True) for m in COMPARE_MASKS if m in args.masks
                 for method in ("blocks", "dense_stream", "dense_reference")]
    rows = []
    for mask, seqlen, method, compare in plan:
        row = {**header, **spawn(mask, seqlen, method, compare, args.timeout)}
        rows.append(row)
        print(f"{mask:<24}{seqlen:>8} {method:<16}{row.get('seconds', float('nan')):>9.2f} s"
              f"{row.get('peak_rss_gib', float('nan')):>8.2f} GiB  exact {row.get('exact_fraction', '')!s:<9}"
              f"{'' if 'equal_to_reference' not in row else 'equal' if row['equal_to_reference'] else 'DIFFERENT'}"
              f"{row.get('error', '')}", flush=True)
    print(f"machine: {header['machine']}, load average at start {header['load_avg_1m']}")
    print(f"wrote {write_csv(args.out, rows)}")


if __name__ == "__main__":
    main()
