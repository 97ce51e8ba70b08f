"""Planner benchmark: planning time, communication and balance of dcp against the static baselines.

Grid (the paper's micro-benchmark setting): 131,072-token batches, 4 nodes x 8 GPUs, 8 query / 2 KV
heads, head dim 128, bf16; lengths {longalign, ldc} x scale {0.5, 1, 2, 4}; masks {causal, lambda};
dcp with its DEFAULT configuration (``PlannerConfig()``: the time-optimizing search) at B = 1024 and 512,
and with ``objective="bytes"`` at B = 1024 (fewest bytes, the paper's objective); baselines ring,
zigzag, te_a2a_p2p, megatron_dyncp. Several batches per cell; the summary reports medians. Planning time
is end to end: spec -> validated forward + backward plans; run it on a quiet machine (a partitioner
sharing its cores with other work takes longer). It is the time per batch of a process that plans every
batch, as a trainer does: torch is imported before any timing (the planner's C++ loops take torch
tensors; a trainer has it loaded, and importing it takes seconds), and the first plan of the process,
which also pays one-time initialisation, is timed on its own and written as variant ``first_call``
(the first cell's first batch, default configuration), outside the summary.

    python benchmarks/bench_planner.py                 # full grid, ~5-10 min on 2 cores
    python benchmarks/bench_planner.py --quick         # 1 batch per cell, scales {1, 4}
Writes benchmarks/results/planner_cpu.csv (one row per plan) and planner_cpu_summary.csv.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

importlib.import_module("torch")  # loaded before any timing: see the docstring

from benchmarks.common import RESULTS, git_revision, machine, write_csv  # noqa: E402
from dcp import BatchSpec, Cluster, PlannerConfig  # noqa: E402
from dcp.baselines import BASELINES  # noqa: E402
from dcp.data import make_batches  # noqa: E402
from dcp.masks import CausalMask, LambdaMask  # noqa: E402
from dcp.config import SearchConfig  # noqa: E402
from dcp.planner import DCPPlanner  # noqa: E402

MASKS = {"causal": CausalMask(), "lambda": LambdaMask(sink=64, window=4096)}
BASELINE_NAMES = ("ring", "zigzag", "te_a2a_p2p", "megatron_dyncp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--blocks", default="1024,512")
    ap.add_argument("--out", default=str(RESULTS / "planner_cpu.csv"))
    args = ap.parse_args(argv)
    scales = (1.0, 4.0) if args.quick else (0.5, 1.0, 2.0, 4.0)
    n_batches = 1 if args.quick else args.batches
    blocks = [int(b) for b in args.blocks.split(",")]
    # (label, config): the default configuration at each block size, and the bytes objective
    variants = [(f"B{b}", PlannerConfig(block_size=b)) for b in blocks]
    variants.append((f"bytes_B{blocks[0]}", PlannerConfig(block_size=blocks[0],
                                                          search=SearchConfig(objective="bytes"))))
    cluster = Cluster(4, 8)
    mach, rev = machine(), git_revision()
    rows = []
    first = True
    for dataset in ("longalign", "ldc"):
        for scale in scales:
            batches = make_batches(dataset, scale, tokens_per_batch=131072, num_batches=n_batches, seed=0)
            for mask_name, mask in MASKS.items():
                for bi, lens in enumerate(batches):
                    spec = BatchSpec(lens, mask, 8, 2, 128, "bfloat16")
                    planners = [("dcp", label, DCPPlanner(cfg)) for label, cfg in variants]
                    if first:  # the process's first plan, timed on its own (one-time initialisation)
                        planners.insert(0, ("dcp", "first_call", DCPPlanner(variants[0][1])))
                        first = False
                    planners += [(n, None, BASELINES[n]()) for n in BASELINE_NAMES]
                    for name, variant, planner in planners:
                        # a fresh BatchSpec per plan: a trainer plans each batch once, and the spec caches
                        # what a planner derives from it (validated ranges, block pair counts)
                        spec = BatchSpec(lens, mask, 8, 2, 128, "bfloat16")
                        with warnings.catch_warnings(record=True) as caught:
                            warnings.simplefilter("always")
                            t0 = time.perf_counter()
                            plan = planner.plan(spec, cluster)
                            wall = time.perf_counter() - t0
                        s = plan.stats()
                        rows.append(dict(dataset=dataset, scale=scale, mask=mask_name, batch=bi,
                                         num_seqs=spec.num_seqs, tokens=spec.total_tokens, planner=name,
                                         variant=variant or "", chosen=plan.meta.get("search_chosen", ""),
                                         planning_time_s=round(wall, 4),
                                         n_tiles=s.n_tiles, comm_bytes_total=s.comm_bytes_total,
                                         comm_bytes_inter_node=s.comm_bytes_inter_node,
                                         comm_bytes_forward=s.comm_bytes_forward,
                                         max_device_comm_bytes=s.max_device_comm_bytes,
                                         compute_imbalance=round(s.compute_imbalance, 4),
                                         memory_imbalance=round(s.memory_imbalance, 4), valid=s.valid,
                                         warnings=len(caught), machine=mach, revision=rev))
                        print(f"{dataset:9s} x{scale:<3} {mask_name:6s} b{bi} {name:14s} {variant or '-':<11} "
                              f"{wall:6.2f}s comm {s.comm_bytes_total / 1e6:9.1f} MB inter "
                              f"{s.comm_bytes_inter_node / 1e6:8.1f} MB imb {s.compute_imbalance:.3f}", flush=True)
    write_csv(Path(args.out), rows)
    summary = summarize(rows, [label for label, _ in variants])
    write_csv(Path(args.out).with_name(Path(args.out).stem + "_summary.csv"), summary)
    print_summary(summary)
    return 0


def summarize(rows, variants):
    out = []
    cells = sorted({(r["dataset"], r["scale"], r["mask"]) for r in rows})
    for cell in cells:
        sel = [r for r in rows if (r["dataset"], r["scale"], r["mask"]) == cell]
        batches = sorted({r["batch"] for r in sel})
        row = dict(dataset=cell[0], scale=cell[1], mask=cell[2], batches=len(batches))
        for v in variants:
            dcp_rows = [r for r in sel if r["planner"] == "dcp" and r["variant"] == v]
            ratios, inter_ratios = [], []
            for bi in batches:
                d = next(r for r in dcp_rows if r["batch"] == bi)
                base = [r for r in sel if r["batch"] == bi and r["planner"] != "dcp"]
                best = min(r["comm_bytes_total"] for r in base)
                best_inter = min(r["comm_bytes_inter_node"] for r in base)
                ratios.append(d["comm_bytes_total"] / best if best else float("inf"))
                inter_ratios.append(d["comm_bytes_inter_node"] / best_inter if best_inter else float("nan"))
            row[f"{v}_median_planning_s"] = round(statistics.median(r["planning_time_s"] for r in dcp_rows), 3)
            row[f"{v}_comm_vs_best_baseline"] = round(statistics.median(ratios), 3)
            row[f"{v}_inter_vs_best_baseline"] = round(statistics.median(inter_ratios), 3)
            row[f"{v}_max_compute_imbalance"] = max(r["compute_imbalance"] for r in dcp_rows)
            row[f"{v}_max_memory_imbalance"] = max(r["memory_imbalance"] for r in dcp_rows)
        best_name = {}
        for r in sel:
            if r["planner"] != "dcp":
                best_name.setdefault(r["planner"], []).append(r["comm_bytes_total"])
        row["best_baseline"] = min(best_name, key=lambda k: statistics.median(best_name[k]))
        row["machine"] = rows[0]["machine"]
        out.append(row)
    return out


def print_summary(summary):
    cols = list(summary[0].keys())
    cols.remove("machine")
    print("\n" + " | ".join(cols))
    for r in summary:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"machine: {summary[0]['machine']}")


if __name__ == "__main__":
    sys.exit(main())
