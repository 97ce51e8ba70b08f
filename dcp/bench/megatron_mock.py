"""``dcp bench megatron``: Megatron-Core Dynamic CP's own mock workload, attention only, simulated.

Workload (the mock benchmark of Megatron-LM's dynamic context parallelism, github.com/NVIDIA/Megatron-LM): lengths from ``megatron_mock`` (log-normal,
untruncated mean 1024, sigma 1.5, clipped to [128, 8192]); 2,048 tokens per rank, so a batch holds
``2048 x n_gpus`` tokens (packed as in the paper, >= 75% full); clusters 1x4, 1x8, 2x8, 4x8, 8x8. The
mock's model is a GPT with 12 layers, hidden 2048 and 16 heads; **we compare the attention part only**
(16 query heads, 16 KV heads, head dim 128, bf16, causal), forward + backward of one layer as simulated by
``dcp.sim`` — not the whole model, and not Megatron's measured TFLOPS.

Planners: ``megatron_dyncp`` (power-of-two CP groups per sequence, ``max_seqlen_per_rank`` = 2048,
greedy packing, the current dev scheduler); ``megatron_tuned`` (megatron_dyncp at its best point of its
tuning grid per batch: ``max_seqlen_per_rank`` 512..4096 x scheduler version); ``best_tuned`` (every
static baseline at its best knobs, the fastest: ``dcp.bench.tuned``); ``dcp`` (``dcp.plan`` with its default configuration, its cost model set to the simulated
profile; flags override it for ablations); ``dcp_auto`` (dcp's plan plus zigzag and megatron_dyncp as
candidates, by simulated time). CSV: ``megatron_mock.csv`` (one row per plan)
and ``megatron_mock_summary.csv`` (per cluster and profile: mean times and megatron_dyncp / dcp ratios).
``dcp_same_memory`` rows: where an opponent (megatron_dyncp at default or tuned knobs, the best tuned
baseline) beats dcp while holding more tokens per device than dcp's memory budget, dcp planned again with
that opponent's memory imbalance (as in ``dcp bench micro``); the summary's ``dcp_same_memory_speedup_iter``
is that opponent's time over dcp's at the same memory, in those batches. ``dcp_at_megatron_memory`` rows:
in every batch where tuned Megatron holds more tokens per device than dcp's budget, faster or not, dcp planned
with tuned Megatron's memory imbalance, so the summary's ``dcp_at_megatron_memory_speedup_iter`` (tuned
Megatron's time over it, in those batches) says how much of dcp's margin its memory budget costs.
The target set for dcp is >= 1.2x megatron_dyncp on forward + backward at >= 16 GPUs, >= 1.0 everywhere.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from dcp.bench.common import (BASELINE_NAMES, DEFAULT_OUT, CachedAutoPlanner, DcpOptions, add_dcp_args, auto_fields, config_fields,
                              dcp_config, fmt_table, git_revision, machine, mean, options_from_args, parse_list,
                              plan_quietly, progress, sim_fields, stat_fields, write_csv)
from dcp.cluster import Cluster

CLUSTERS = ((1, 4), (1, 8), (2, 8), (4, 8), (8, 8))
#: the rows a ``dcp_same_memory`` row answers (``dcp.bench.micro.same_memory_rows``)
OPPONENTS = ("megatron_dyncp", "megatron_tuned", "best_tuned")
SAME_MEMORY = "dcp_same_memory"
#: dcp at tuned Megatron's memory, in every batch where that exceeds dcp's budget (module docstring)
AT_MEGATRON_MEMORY = "dcp_at_megatron_memory"


@dataclasses.dataclass(frozen=True)
class MegatronMockConfig:
    clusters: tuple[tuple[int, int], ...] = CLUSTERS
    tokens_per_rank: int = 2048
    batches: int = 3
    profiles: tuple[str, ...] = ("a100", "h100")
    heads: int = 16
    kv_heads: int = 16
    head_dim: int = 128
    dtype: str = "bfloat16"
    seed: int = 0
    dcp: DcpOptions = DcpOptions()
    tuned: bool = True
    tune_top: int = 2


def run_megatron_mock(cfg: MegatronMockConfig) -> list[dict]:
    from dcp.baselines import BASELINES, MegatronDynCPPlanner, ZigzagPlanner
    from dcp.bench.micro import dcp_at_memory_rows, same_memory_rows
    from dcp.bench.tuned import tune, tuned_row
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.masks import CausalMask
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import ideal_time_s, simulate_both
    from dcp.spec import BatchSpec

    mach, rev = machine(), git_revision()
    rows = []
    work = [(n, g, b) for n, g in cfg.clusters for b in range(cfg.batches)]
    batches = {(n, g): make_batches("megatron_mock", 1.0, tokens_per_batch=cfg.tokens_per_rank * n * g,
                                    num_batches=cfg.batches, seed=cfg.seed) for n, g in cfg.clusters}
    for nodes, gpn, bi in progress(work, desc="megatron-mock"):
        cluster = Cluster(nodes, gpn)
        lens = batches[(nodes, gpn)][bi]
        spec = BatchSpec(lens, CausalMask(), cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
        cell = dict(workload="megatron_mock", nodes=nodes, gpus_per_node=gpn, n_gpus=nodes * gpn, batch=bi,
                    num_seqs=spec.num_seqs, tokens=spec.total_tokens, max_seqlen=int(max(lens)),
                    heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, mask="causal",
                    **config_fields(dcp_config("a100", cfg.dcp)))
        mega = MegatronDynCPPlanner(max_seqlen_per_rank=cfg.tokens_per_rank)
        base = {"megatron_dyncp": plan_quietly(mega, spec, cluster), "zigzag": plan_quietly(ZigzagPlanner(), spec, cluster)}
        costs = {p: CostModel.named(p) for p in cfg.profiles}
        mega_sims = {p: simulate_both(base["megatron_dyncp"][0], c, record_events=False) for p, c in costs.items()}
        tuned = {}
        if cfg.tuned:  # megatron at its best knobs, and every baseline at its best (dcp.bench.tuned)
            others = [BASELINES[n]() for n in BASELINE_NAMES if n != "megatron_dyncp"]
            tuned = tune(spec, cluster, [mega, *others], costs, cfg.tune_top,
                         {"megatron_dyncp": (base["megatron_dyncp"][0], mega_sims)})
        for profile in cfg.profiles:
            cost = costs[profile]
            common = dict(simulated=True, profile=cost.profile.name, machine=mach, revision=rev)
            first = len(rows)  # this batch's rows under this profile
            plan, warns = base["megatron_dyncp"]
            fwd, bwd = mega_sims[profile]
            rows.append(dict(cell, planner="megatron_dyncp", chosen="megatron_dyncp", block_size="",
                             planning_time_s=round(plan.planning_time_s, 4), **sim_fields(fwd, bwd),
                             **stat_fields(plan), candidates="", warnings=len(warns), **common))
            if tuned.get(profile):
                mt = tuned[profile]["megatron_dyncp"]
                rows.append(dict(cell, planner="megatron_tuned", chosen=mt.label, block_size="",
                                 planning_time_s=round(mt.plan.planning_time_s, 4), **sim_fields(mt.fwd, mt.bwd),
                                 **stat_fields(mt.plan), candidates=f"{mt.simulated}/{mt.points} grid points simulated",
                                 warnings=0, **common))
                rows.append(tuned_row(cell, tuned[profile], common))
            config = dcp_config(profile, cfg.dcp)
            plan, warns = plan_quietly(DCPPlanner(config), spec, cluster)
            fwd, bwd = simulate_both(plan, cost, record_events=False)
            rows.append(dict(cell, planner="dcp", chosen=plan.meta.get("search_chosen", "dcp"),
                             block_size=config.block_size, planning_time_s=round(plan.planning_time_s, 4),
                             **sim_fields(fwd, bwd), **stat_fields(plan),
                             candidates=plan.meta.get("search_candidates", ""), warnings=len(warns), **common))
            # an opponent faster only by holding more tokens per device: dcp given the same memory
            dcp_row = rows[-1]
            rows.extend(same_memory_rows(dcp_row, [r for r in rows[first:] if r["planner"] in OPPONENTS], cell, spec,
                                         cluster, config, cost, common))
            for r in rows[first:]:
                if r["planner"] == "megatron_tuned":
                    rows.extend(dcp_at_memory_rows(AT_MEGATRON_MEMORY, r, cell, spec, cluster, config, cost, common))
            cache = {(k, id(spec), id(cluster)): v[0] for k, v in base.items()}
            cache[(f"dcp@B{config.block_size}", id(spec), id(cluster))] = plan
            auto = CachedAutoPlanner(config, block_sizes=(config.block_size,), baselines=(ZigzagPlanner(), mega),
                                     cache=cache, ledger={})
            plan, warns = plan_quietly(auto, spec, cluster)
            cand = plan.meta["candidates"][plan.meta["chosen"]]
            fwd_ms, bwd_ms = cand["forward_s"] * 1e3, cand["backward_s"] * 1e3
            ideal_f, ideal_b = (ideal_time_s(plan, cost, d) * 1e3 for d in ("forward", "backward"))
            f = auto_fields(plan, auto.ledger.get("saved_s", 0.0))
            rows.append(dict(cell, planner="dcp_auto", chosen=f["chosen"], block_size=f["block_size"],
                             planning_time_s=f["planning_time_s"], fwd_ms=round(fwd_ms, 5), bwd_ms=round(bwd_ms, 5),
                             ideal_fwd_ms=round(ideal_f, 5), ideal_bwd_ms=round(ideal_b, 5),
                             fwd_efficiency=round(ideal_f / fwd_ms, 4), bwd_efficiency=round(ideal_b / bwd_ms, 4),
                             **stat_fields(plan), candidates=f["candidates"], warnings=len(warns), **common))
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (cluster, profile): mean fwd / bwd / fwd+bwd ms per planner over batches and the ratios
    megatron_dyncp / dcp and megatron_dyncp / dcp_auto (> 1: dcp faster)."""
    out = []
    keys = list(dict.fromkeys((int(r["nodes"]), int(r["gpus_per_node"]), r["profile"]) for r in rows))
    for nodes, gpn, prof in keys:
        sel = [r for r in rows if (int(r["nodes"]), int(r["gpus_per_node"]), r["profile"]) == (nodes, gpn, prof)]
        row = dict(workload="megatron_mock", nodes=nodes, gpus_per_node=gpn, n_gpus=nodes * gpn, profile=prof,
                   simulated=True, batches=len({r["batch"] for r in sel}),
                   mean_num_seqs=round(mean(r["num_seqs"] for r in sel if r["planner"] == "megatron_dyncp"), 1))
        t = {}
        for p in ("megatron_dyncp", "megatron_tuned", "best_tuned", "dcp", "dcp_auto"):
            ps = [r for r in sel if r["planner"] == p]
            if not ps:
                continue
            t[p] = (mean(r["fwd_ms"] for r in ps), mean(r["bwd_ms"] for r in ps))
            row[f"{p}_fwd_ms"], row[f"{p}_bwd_ms"] = round(t[p][0], 4), round(t[p][1], 4)
            row[f"{p}_iter_ms"] = round(sum(t[p]), 4)
            row[f"{p}_inter_node_MB"] = round(mean(r["comm_bytes_inter_node"] for r in ps) / 1e6, 3)
            row[f"{p}_memory_imbalance"] = round(max(float(r["memory_imbalance"]) for r in ps), 3)
            row[f"{p}_peak_buffer_MiB"] = round(max(max(float(r["peak_buffer_fwd_MiB"]), float(r["peak_buffer_bwd_MiB"]))
                                                    for r in ps), 3)
        for p in ("dcp", "dcp_auto"):
            if p in t and "megatron_dyncp" in t:
                m = t["megatron_dyncp"]
                row[f"{p}_speedup_fwd"] = round(m[0] / t[p][0], 3)
                row[f"{p}_speedup_bwd"] = round(m[1] / t[p][1], 3)
                row[f"{p}_speedup_iter"] = round(sum(m) / sum(t[p]), 3)
                row[f"{p}_chosen"] = ";".join(r["chosen"] for r in sel if r["planner"] == p)
            for ref in ("megatron_tuned", "best_tuned"):  # the opponents at their best knobs
                if p in t and ref in t:
                    row[f"{p}_speedup_iter_vs_{ref}"] = round(sum(t[ref]) / sum(t[p]), 3)
                    row[f"{p}_speedup_fwd_vs_{ref}"] = round(t[ref][0] / t[p][0], 3)
                    row[f"{p}_speedup_bwd_vs_{ref}"] = round(t[ref][1] / t[p][1], 3)
        for ref in ("megatron_tuned", "best_tuned"):
            if ref in t:
                row[f"{ref}_chosen"] = ";".join(r["chosen"] for r in sel if r["planner"] == ref)
        same = [r for r in sel if r["planner"] == SAME_MEMORY]
        if same:  # in the batches where an over-budget opponent beat dcp: that opponent / dcp at its memory
            theirs = [next(o for o in sel if o["batch"] == r["batch"] and o["planner"] == r["opponent"]) for r in same]
            row["dcp_same_memory_batches"] = len(same)
            row["dcp_same_memory_opponents"] = ";".join(r["opponent"] for r in same)
            row["dcp_same_memory_speedup_iter"] = round(sum(o["fwd_ms"] + o["bwd_ms"] for o in theirs)
                                                        / sum(r["fwd_ms"] + r["bwd_ms"] for r in same), 3)
            row["dcp_same_memory_memory_imbalance"] = round(max(float(r["memory_imbalance"]) for r in same), 3)
        at = [r for r in sel if r["planner"] == AT_MEGATRON_MEMORY]
        if at:  # in the batches where tuned Megatron holds more than dcp's budget: it / dcp at its memory
            theirs = [next(o for o in sel if o["batch"] == r["batch"] and o["planner"] == "megatron_tuned") for r in at]
            mine = [next(o for o in sel if o["batch"] == r["batch"] and o["planner"] == "dcp") for r in at]
            row["dcp_at_megatron_memory_batches"] = len(at)
            row["dcp_at_megatron_memory_iter_ms"] = round(mean(r["fwd_ms"] + r["bwd_ms"] for r in at), 4)
            row["dcp_at_megatron_memory_speedup_iter"] = round(sum(o["fwd_ms"] + o["bwd_ms"] for o in theirs)
                                                               / sum(r["fwd_ms"] + r["bwd_ms"] for r in at), 3)
            # dcp within its budget, over the same batches
            row["dcp_in_budget_speedup_iter_same_batches"] = round(sum(o["fwd_ms"] + o["bwd_ms"] for o in theirs)
                                                                   / sum(r["fwd_ms"] + r["bwd_ms"] for r in mine), 3)
            row["dcp_at_megatron_memory_memory_imbalance"] = round(max(float(r["memory_imbalance"]) for r in at), 3)
        row["machine"] = sel[0]["machine"]
        out.append(row)
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("megatron", help="Megatron-Core dynamic CP's mock workload, attention only (simulated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", default=",".join(f"{n}x{g}" for n, g in CLUSTERS), help="NODESxGPUS, ...")
    p.add_argument("--tokens-per-rank", type=int, default=2048)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--profiles", default="a100,h100",
                   help="cost-model profiles, comma-separated: bundled names or JSON files (dcp.cost.load_profile)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tuned", action="store_true",
                   help="skip megatron_dyncp at its best knobs and the best tuned baseline (dcp.bench.tuned)")
    p.add_argument("--tune-top", type=int, default=2, help="grid points per baseline simulated (default 2)")
    add_dcp_args(p)
    p.add_argument("--out-dir", default=str(DEFAULT_OUT),
                   help="where the CSVs go (the committed results: --out-dir benchmarks/results)")
    p.set_defaults(func=cmd_megatron)


def cmd_megatron(args) -> int:
    clusters = tuple(tuple(int(x) for x in c.lower().split("x")) for c in parse_list(args.clusters))
    cfg = MegatronMockConfig(clusters=clusters, tokens_per_rank=args.tokens_per_rank, batches=args.batches,
                             profiles=parse_list(args.profiles), seed=args.seed, dcp=options_from_args(args),
                             tuned=not args.no_tuned, tune_top=args.tune_top)
    started = time.perf_counter()
    rows = run_megatron_mock(cfg)
    summary = summarize(rows)
    for path in (write_csv(Path(args.out_dir) / "megatron_mock.csv", rows),
                 write_csv(Path(args.out_dir) / "megatron_mock_summary.csv", summary)):
        print(f"wrote {path}")
    print("\nSIMULATED attention (fwd+bwd of one layer): megatron_dyncp time / dcp time (> 1: dcp faster)")
    cols = ["n_gpus", "profile", "megatron_dyncp_iter_ms", "dcp_iter_ms", "dcp_speedup_iter",
            "dcp_speedup_iter_vs_megatron_tuned", "dcp_speedup_iter_vs_best_tuned", "megatron_tuned_chosen",
            "best_tuned_chosen", "megatron_dyncp_memory_imbalance", "dcp_memory_imbalance", "dcp_chosen",
            "dcp_same_memory_speedup_iter", "dcp_same_memory_opponents", "dcp_at_megatron_memory_speedup_iter"]
    print(fmt_table(summary, [c for c in cols if any(c in r for r in summary)]))
    print(f"\nmegatron mock: {time.perf_counter() - started:.0f} s on {machine()}")
    return 0
