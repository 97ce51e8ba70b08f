"""``dcp bench micro``: the DCP paper's attention micro-benchmark grid, through the simulator.

Grid (the micro-benchmarks of the DCP paper: Jiang et al., SOSP 2025, arXiv:2510.10620): lengths {longalign, ldc} (synthetic
stand-ins, ``dcp.data.lengths``) x scale {0.5, 1, 2, 4} x masks {causal, lambda, shared_question,
causal_blockwise} x planners on 4 nodes x 8 GPUs, 131,072-token batches, 8 query / 2 KV heads, head dim
128, bf16, several batches per cell. Planners:

- ``dcp``: ``dcp.plan`` with its DEFAULT configuration (the time-optimizing search, Mt-KaHyPar's
  ``deterministic_quality`` partitioner), its cost model set to the profile being simulated, as a user
  configures it for their hardware; ``--partitioner/--epsilon-*/--objective/--block-size`` override it
  for ablations. The candidate the search chose is recorded.
- ``dcp_auto``: ``AutoPlanner`` with ``baselines=(ZigzagPlanner(), MegatronDynCPPlanner())``: dcp's plan
  plus two static plans, by simulated time (to show how rarely running a static plan would help).
- the static baselines ring, zigzag, te_a2a_p2p, loongtrain (default degrees), megatron_dyncp.
- ``dcp_same_memory``: dcp given the memory a faster over-budget baseline holds. dcp keeps every device
  within ``(1 + epsilon_memory) x`` the mean resident tokens (default 1.1); a baseline that holds more
  (megatron_dyncp: 1.5-2x) may be faster only because of that memory. Whenever the fastest baseline of a
  batch (at default knobs, or the best tuned one) beats dcp while holding more than dcp's budget, dcp is
  planned again with ``epsilon_memory`` = that imbalance - 1 and reported beside it (column ``opponent``;
  the summary's ``dcp_same_memory_{fwd,bwd}_speedup`` is against that opponent in those batches; dcp's
  default budget is never loosened in the ``dcp`` rows).

Per (cell, batch, planner, profile) one CSV row: simulated forward/backward ms, ideal ms, communication
bytes (total, inter-node), compute/memory imbalance, planning time (measured wall-clock on this machine,
end to end: spec -> validated plans; for dcp_auto its candidates plus their simulations), chosen
candidate. Baseline plans do not depend on the profile and are planned once per batch; dcp plans are
made per profile (its cost model schedules and scores the candidates). ``dcp_auto`` gets its candidate
plans from a per-batch cache (``CachedAutoPlanner``), so it shares planning work with dcp and the
baselines; the planning time it reports still counts the cached candidates' own planning time.

Outputs (``--out-dir``, default ./dcp-bench-results; the committed results were written with
``--out-dir benchmarks/results``): ``micro_<profile>.csv`` (one row per plan) and
``micro_<profile>_summary.csv`` (one row per cell: mean times over batches per planner, best baseline,
speedups of dcp and dcp_auto over it, forward and backward separately, as the paper reports).
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from dcp.bench.common import (BASELINE_NAMES, DEFAULT_OUT, PAPER_BASELINE_NAMES, CachedAutoPlanner, DcpOptions,
                              add_dcp_args, auto_fields, config_fields, dcp_config, fmt_table, git_revision, machine,
                              mean, options_from_args, parse_list, plan_quietly, progress, sim_fields, stat_fields,
                              write_csv)
from dcp.cluster import Cluster

DATASETS = ("longalign", "ldc")
SCALES = (0.5, 1.0, 2.0, 4.0)
MASK_NAMES = ("causal", "lambda", "shared_question", "causal_blockwise")
PLANNER_NAMES = ("dcp", "dcp_auto", *BASELINE_NAMES)
SAME_MEMORY = "dcp_same_memory"
TUNED = "best_tuned"
QUICK = dict(scales=(1.0, 4.0), masks=("causal", "lambda"), batches=1, profiles=("a100",))


def make_mask(name: str):
    """The paper's masks: causal; lambda (64 sink tokens + window 4096); shared-question (20% question,
    4 answers); causal-blockwise (256-token blocks seeing the first block and 2 previous blocks)."""
    from dcp.masks import CausalBlockwiseMask, CausalMask, LambdaMask, SharedQuestionMask

    return {"causal": CausalMask, "lambda": lambda: LambdaMask(sink=64, window=4096),
            "shared_question": lambda: SharedQuestionMask(0.2, 4),
            "causal_blockwise": lambda: CausalBlockwiseMask(256, 2)}[name]()


@dataclasses.dataclass(frozen=True)
class MicroConfig:
    datasets: tuple[str, ...] = DATASETS
    scales: tuple[float, ...] = SCALES
    masks: tuple[str, ...] = MASK_NAMES
    planners: tuple[str, ...] = PLANNER_NAMES
    profiles: tuple[str, ...] = ("a100", "h100")
    batches: int = 3
    nodes: int = 4
    gpus_per_node: int = 8
    tokens: int = 131072
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bfloat16"
    seed: int = 0
    dcp: DcpOptions = DcpOptions()
    tuned: bool = True
    tune_top: int = 2

    def __post_init__(self):
        bad = [p for p in self.planners if p not in PLANNER_NAMES]
        if bad:
            raise ValueError(f"unknown planners {bad}; choose from {PLANNER_NAMES}")
        bad = [m for m in self.masks if m not in MASK_NAMES]
        if bad:
            raise ValueError(f"unknown masks {bad}; choose from {MASK_NAMES}")


def run_micro(cfg: MicroConfig, jobs: int = 1) -> dict[str, list[dict]]:
    """Run the grid; returns ``{profile: rows}`` (one row per cell, batch and planner). ``jobs`` > 1 runs
    cells in that many processes (same rows, same order)."""
    work = [(d, s, m, b) for d in cfg.datasets for s in cfg.scales for m in cfg.masks for b in range(cfg.batches)]
    rows: dict[str, list[dict]] = {p: [] for p in cfg.profiles}
    if jobs > 1:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {w: pool.submit(_cell_rows, cfg, *w) for w in work}
            for w in progress(work, desc=f"micro ({jobs} processes)"):  # in order: same rows as one process
                for profile, got in futures[w].result().items():
                    rows[profile].extend(got)
        return rows
    for w in progress(work, desc="micro"):
        for profile, got in _cell_rows(cfg, *w).items():
            rows[profile].extend(got)
    return rows


def _cell_rows(cfg: MicroConfig, dataset: str, scale: float, mask_name: str, bi: int) -> dict[str, list[dict]]:
    """The rows of one (dataset, scale, mask, batch) cell, per profile."""
    from dcp.baselines import BASELINES, MegatronDynCPPlanner, ZigzagPlanner
    from dcp.bench.tuned import tune, tuned_row
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.errors import InvalidConfigError
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import ideal_time_s, simulate_both
    from dcp.spec import BatchSpec

    cluster = Cluster(cfg.nodes, cfg.gpus_per_node)
    mach, rev = machine(), git_revision()
    rows: dict[str, list[dict]] = {p: [] for p in cfg.profiles}
    base_names = [p for p in cfg.planners if p in BASELINE_NAMES]
    want_auto = "dcp_auto" in cfg.planners
    auto_bases = ("zigzag", "megatron_dyncp")
    plan_bases = list(dict.fromkeys(base_names + (list(auto_bases) if want_auto else [])))
    lens = make_batches(dataset, scale, tokens_per_batch=cfg.tokens, num_batches=cfg.batches, seed=cfg.seed)[bi]
    spec = BatchSpec(lens, make_mask(mask_name), cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
    cell = dict(dataset=dataset, scale=scale, mask=mask_name, batch=bi, num_seqs=spec.num_seqs,
                tokens=spec.total_tokens, max_seqlen=int(max(lens)), nodes=cfg.nodes,
                gpus_per_node=cfg.gpus_per_node, heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                **config_fields(dcp_config("a100", cfg.dcp)))
    base_plans, base_sims = {}, {}
    for name in plan_bases:  # profile-independent: plan once per batch
        try:
            base_plans[name] = plan_quietly(BASELINES[name](), spec, cluster)
        except InvalidConfigError:  # e.g. Ulysses with more devices than heads: not applicable here
            continue
        base_sims[name] = {profile: simulate_both(base_plans[name][0], CostModel.named(profile),
                                                  record_events=False) for profile in cfg.profiles}
    tuned = {}
    if cfg.tuned and base_names:
        tuned = tune(spec, cluster, [BASELINES[n]() for n in base_names if n in base_plans],
                     {p: CostModel.named(p) for p in cfg.profiles}, cfg.tune_top,
                     {n: (base_plans[n][0], base_sims[n]) for n in base_plans})
    for profile in cfg.profiles:
        cost = CostModel.named(profile)
        common = dict(simulated=True, profile=cost.profile.name, machine=mach, revision=rev)
        for name in base_names:
            if name not in base_plans:
                continue
            plan, warns = base_plans[name]
            fwd, bwd = base_sims[name][profile]
            rows[profile].append(dict(cell, planner=name, chosen=name, block_size="",
                                      planning_time_s=round(plan.planning_time_s, 4), **sim_fields(fwd, bwd),
                                      **stat_fields(plan), candidates="", warnings=len(warns), **common))
        if tuned.get(profile):
            rows[profile].append(tuned_row(cell, tuned[profile], common))
        config = dcp_config(profile, cfg.dcp)
        dcp_plan = None
        if "dcp" in cfg.planners or want_auto:
            dcp_plan, dcp_warns = plan_quietly(DCPPlanner(config), spec, cluster)
        if "dcp" in cfg.planners:
            fwd, bwd = simulate_both(dcp_plan, cost, record_events=False)
            rows[profile].append(dict(cell, planner="dcp", chosen=dcp_plan.meta.get("search_chosen", "dcp"),
                                      block_size=config.block_size,
                                      planning_time_s=round(dcp_plan.planning_time_s, 4), **sim_fields(fwd, bwd),
                                      **stat_fields(dcp_plan), candidates=dcp_plan.meta.get("search_candidates", ""),
                                      warnings=len(dcp_warns), **common))
        if "dcp" in cfg.planners:
            # (rows holds this batch's rows only)
            opponents = [r for r in rows[profile] if r["planner"] in BASELINE_NAMES or r["planner"] == TUNED]
            rows[profile].extend(same_memory_rows(rows[profile][-1], opponents, cell, spec, cluster, config, cost,
                                                  common))
        if want_auto:
            cache = {(f"dcp@B{config.block_size}", id(spec), id(cluster)): dcp_plan}
            for name in auto_bases:
                cache[(name, id(spec), id(cluster))] = base_plans[name][0]
            auto = CachedAutoPlanner(config, block_sizes=(config.block_size,),
                                     baselines=(ZigzagPlanner(), MegatronDynCPPlanner()), cache=cache, ledger={})
            plan, warns = plan_quietly(auto, spec, cluster)
            cand = plan.meta["candidates"][plan.meta["chosen"]]
            fwd_ms, bwd_ms = cand["forward_s"] * 1e3, cand["backward_s"] * 1e3
            ideal_f = ideal_time_s(plan, cost, "forward") * 1e3
            ideal_b = ideal_time_s(plan, cost, "backward") * 1e3
            sim = dict(fwd_ms=round(fwd_ms, 5), bwd_ms=round(bwd_ms, 5), ideal_fwd_ms=round(ideal_f, 5),
                       ideal_bwd_ms=round(ideal_b, 5), fwd_efficiency=round(ideal_f / fwd_ms, 4),
                       bwd_efficiency=round(ideal_b / bwd_ms, 4))
            fields = auto_fields(plan, auto.ledger.get("saved_s", 0.0))
            rows[profile].append(dict(cell, planner="dcp_auto", chosen=fields["chosen"], block_size=fields["block_size"],
                                      planning_time_s=fields["planning_time_s"], **sim, **stat_fields(plan),
                                      candidates=fields["candidates"], warnings=len(warns), **common))
    return rows


def same_memory_rows(dcp_row: dict, opponents: list[dict], cell: dict, spec, cluster, config, cost,
                     common) -> list[dict]:
    """A ``dcp_same_memory`` row when the fastest of ``opponents`` (this batch's baseline rows: at default knobs,
    the best tuned one) beats dcp while holding more resident tokens than dcp's budget: dcp planned with that
    baseline's memory imbalance (``opponent`` names it)."""
    if not opponents:
        return []
    best = min(opponents, key=lambda r: r["fwd_ms"] + r["bwd_ms"])
    if best["fwd_ms"] + best["bwd_ms"] >= dcp_row["fwd_ms"] + dcp_row["bwd_ms"]:
        return []
    return dcp_at_memory_rows(SAME_MEMORY, best, cell, spec, cluster, config, cost, common)


def dcp_at_memory_rows(label: str, opponent: dict, cell: dict, spec, cluster, config, cost, common) -> list[dict]:
    """A row ``planner=label``: dcp planned with ``opponent``'s memory imbalance (its row) when that exceeds
    dcp's budget (``config.epsilon_memory``); none otherwise. ``opponent`` names that row's planner."""
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import simulate_both

    if float(opponent["memory_imbalance"]) <= 1 + config.epsilon_memory + 1e-9:
        return []
    same = dataclasses.replace(config, epsilon_memory=float(opponent["memory_imbalance"]) - 1)
    plan, warns = plan_quietly(DCPPlanner(same), spec, cluster)
    fwd, bwd = simulate_both(plan, cost, record_events=False)
    return [dict(cell, planner=label, chosen=plan.meta.get("search_chosen", "dcp"), block_size=same.block_size,
                 planning_time_s=round(plan.planning_time_s, 4), **sim_fields(fwd, bwd), **stat_fields(plan),
                 candidates=f"epsilon_memory={same.epsilon_memory:.4f} ({opponent['planner']}'s memory)",
                 warnings=len(warns), opponent=opponent["planner"], **common)]


def summarize(rows: list[dict], planners=(*PLANNER_NAMES, TUNED)) -> list[dict]:
    """One row per (dataset, scale, mask, profile): mean forward/backward ms per planner over batches, the
    best baseline (fastest mean, separately forward and backward) and the speedups of dcp and dcp_auto
    over it; also over the paper's baselines only (without megatron_dyncp) and over te_a2a_p2p (the
    paper's sparse-mask comparison)."""
    out = []
    keys = list(dict.fromkeys((r["dataset"], float(r["scale"]), r["mask"], r["profile"]) for r in rows))
    for ds, sc, mk, prof in keys:
        sel = [r for r in rows if (r["dataset"], float(r["scale"]), r["mask"], r["profile"]) == (ds, sc, mk, prof)]
        names = [p for p in planners if any(r["planner"] == p for r in sel)]
        t = {(p, d): mean(r[f"{d}_ms"] for r in sel if r["planner"] == p) for p in names for d in ("fwd", "bwd")}
        row = dict(dataset=ds, scale=sc, mask=mk, profile=prof, simulated=True,
                   batches=len({r["batch"] for r in sel}),
                   mean_num_seqs=round(mean(r["num_seqs"] for r in sel if r["planner"] == names[0]), 2))
        budget = 1 + float(next((r.get("dcp_epsilon_memory") for r in sel if r.get("dcp_epsilon_memory") not in
                                 (None, "")), 0.1))
        mem = {p: max(float(r["memory_imbalance"]) for r in sel if r["planner"] == p) for p in names}
        for d in ("fwd", "bwd"):
            bases = [p for p in names if p in BASELINE_NAMES]
            within = [p for p in bases if mem[p] <= budget + 1e-9]
            best_within = min(within, key=lambda p: t[(p, d)]) if within else None
            if "dcp" in names and best_within:
                row[f"best_within_memory_{d}"] = best_within
                row[f"dcp_{d}_speedup_within_memory"] = round(t[(best_within, d)] / t[("dcp", d)], 3)
            paper = [p for p in names if p in PAPER_BASELINE_NAMES]
            best = min(bases, key=lambda p: t[(p, d)]) if bases else None
            best_paper = min(paper, key=lambda p: t[(p, d)]) if paper else None
            row[f"best_baseline_{d}"] = best or ""
            row[f"best_baseline_{d}_ms"] = round(t[(best, d)], 4) if best else ""
            for who in ("dcp", "dcp_auto"):
                if who not in names:
                    continue
                mine = t[(who, d)]
                row[f"{who}_{d}_ms"] = round(mine, 4)
                row[f"{who}_{d}_speedup"] = round(t[(best, d)] / mine, 3) if best else ""
                row[f"{who}_{d}_speedup_vs_paper_baselines"] = round(t[(best_paper, d)] / mine, 3) if best_paper else ""
                if "te_a2a_p2p" in names:
                    row[f"{who}_{d}_speedup_vs_te"] = round(t[("te_a2a_p2p", d)] / mine, 3)
                if TUNED in names:  # the best tuned baseline of each batch (dcp.bench.tuned), averaged
                    row[f"{who}_{d}_speedup_vs_tuned"] = round(t[(TUNED, d)] / mine, 3)
        for who in ("dcp", "dcp_auto"):
            if who in names:
                row[f"{who}_chosen"] = ";".join(r["chosen"] for r in sel if r["planner"] == who)
        if TUNED in names:
            row["best_tuned_fwd_ms"] = round(t[(TUNED, "fwd")], 4)
            row["best_tuned_bwd_ms"] = round(t[(TUNED, "bwd")], 4)
            row["best_tuned_chosen"] = ";".join(r["chosen"] for r in sel if r["planner"] == TUNED)
        same = [r for r in sel if r["planner"] == SAME_MEMORY]
        for d in ("fwd", "bwd") if same else ():  # dcp given the memory of the over-budget baseline it lost to
            # (CSVs before the ``opponent`` column: the cell's best baseline at default knobs)
            opp = {r["batch"]: r.get("opponent") or row[f"best_baseline_{d}"] for r in same}
            theirs = [r[f"{d}_ms"] for r in sel if r["batch"] in opp and r["planner"] == opp[r["batch"]]]
            if len(theirs) == len(same):
                row[f"dcp_same_memory_{d}_speedup"] = round(mean(theirs) / mean(r[f"{d}_ms"] for r in same), 3)
                row["dcp_same_memory_batches"] = len(same)
                row["dcp_same_memory_opponents"] = ";".join(str(opp[r["batch"]]) for r in same)
        for p in names:
            row[f"{p}_memory_imbalance"] = round(mem[p], 3)
        for p in names:
            row[f"{p}_fwd_ms"] = round(t[(p, "fwd")], 4)
            row[f"{p}_bwd_ms"] = round(t[(p, "bwd")], 4)
            row[f"{p}_inter_node_MB"] = round(mean(r["comm_bytes_inter_node"] for r in sel if r["planner"] == p) / 1e6, 3)
            row[f"{p}_planning_s"] = round(mean(r["planning_time_s"] for r in sel if r["planner"] == p), 3)
        row["machine"] = sel[0]["machine"]
        out.append(row)
    return out


HEADLINE = ["dataset", "scale", "mask", "dcp_fwd_speedup_vs_tuned", "dcp_bwd_speedup_vs_tuned", "best_tuned_chosen",
            "best_baseline_fwd", "dcp_fwd_speedup", "best_baseline_bwd", "dcp_bwd_speedup",
            "dcp_memory_imbalance", "megatron_dyncp_memory_imbalance", "dcp_fwd_speedup_within_memory",
            "dcp_bwd_speedup_within_memory", "dcp_same_memory_fwd_speedup", "dcp_same_memory_bwd_speedup"]


def add_parser(sub) -> None:
    p = sub.add_parser("micro", help="the paper's attention micro-benchmark grid (simulated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="scales 1,4; masks causal,lambda; 1 batch; profile a100 (17 s on a quiet 2-core machine, "
                        "71 s at load average 3)")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--scales", default=",".join(f"{s:g}" for s in SCALES))
    p.add_argument("--masks", default=",".join(MASK_NAMES))
    p.add_argument("--planners", default=",".join(PLANNER_NAMES))
    p.add_argument("--profiles", default="a100,h100",
                   help="cost-model profiles, comma-separated: bundled names or JSON files (dcp.cost.load_profile)")
    p.add_argument("--batches", type=int, default=3, help="batches per cell")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens", type=int, default=131072, help="tokens per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="cells planned in parallel processes (same results)")
    p.add_argument("--no-tuned", action="store_true",
                   help="skip the best tuned baseline (every baseline over its tuning grid, dcp.bench.tuned)")
    p.add_argument("--tune-top", type=int, default=2,
                   help="grid points per baseline simulated after ranking by the estimate (default 2)")
    add_dcp_args(p)
    p.add_argument("--out-dir", default=str(DEFAULT_OUT),
                   help="where the CSVs go (the committed results: --out-dir benchmarks/results)")
    p.add_argument("--tag", default=None,
                   help="suffix of the CSV names: micro_<profile><tag>.csv (default: '_quick' with --quick, else '')")
    p.set_defaults(func=cmd_micro)


def config_from_args(args) -> MicroConfig:
    kw = dict(datasets=parse_list(args.datasets), scales=parse_list(args.scales, float),
              masks=parse_list(args.masks), planners=parse_list(args.planners),
              profiles=parse_list(args.profiles), batches=args.batches, nodes=args.nodes,
              gpus_per_node=args.gpus_per_node, tokens=args.tokens, seed=args.seed, dcp=options_from_args(args),
              tuned=not args.no_tuned, tune_top=args.tune_top)
    if args.quick:
        kw.update(QUICK)
    return MicroConfig(**kw)


def write_results(rows_by_profile: dict[str, list[dict]], out_dir, tag: str = "") -> list[Path]:
    """``micro_<profile><tag>.csv`` and its summary per profile; a profile given as a JSON file is named by its
    ``name`` field (a sensitivity profile, e.g. a bundled one with its host costs set to 0)."""
    from dcp.cost import load_profile

    written = []
    for profile, rows in rows_by_profile.items():
        if not rows:
            continue
        name = load_profile(profile).name if profile.endswith(".json") else profile
        written.append(write_csv(Path(out_dir) / f"micro_{name}{tag}.csv", rows))
        written.append(write_csv(Path(out_dir) / f"micro_{name}{tag}_summary.csv", summarize(rows)))
    return written


def cmd_micro(args) -> int:
    cfg = config_from_args(args)
    started = time.perf_counter()
    rows = run_micro(cfg, args.jobs)
    tag = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    for path in write_results(rows, args.out_dir, tag):
        print(f"wrote {path}")
    for profile, prow in rows.items():
        summary = summarize(prow)
        print(f"\nSIMULATED ({profile} profile): speedup over the best baseline (mean over {cfg.batches} batches)")
        print(fmt_table(summary, [c for c in HEADLINE if c in summary[0]]))
    print(f"\nmicro grid: {time.perf_counter() - started:.0f} s on {machine()}")
    return 0
