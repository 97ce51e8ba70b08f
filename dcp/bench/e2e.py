"""``dcp bench e2e``: the DCP paper's GPT-8B end-to-end iteration time, SIMULATED (not measured).

Setup (the end-to-end evaluation of the DCP paper: Jiang et al., SOSP 2025, arXiv:2510.10620): GPT-8B (32 layers, hidden 4096, 32 heads, 8 KV
groups, FFN 14336, head dim 128), TP=4, 64 A100 GPUs = 8 nodes x 8. dcp runs over the 16-way data-parallel
group, modelled as ``Cluster(nodes=8, gpus_per_node=2)``: each "device" is one TP group of 4 GPUs, and
attention per TP rank is the micro-benchmark setup (32/4 = 8 query heads, 8/4 = 2 KV heads, head dim 128,
bf16). All 4 ranks of a TP group run their head shards in parallel, so a device's attention time is the
simulated time of one rank's plan.

Model of an iteration (every number simulated with a ``dcp.cost`` profile, default a100):

- attention per layer = simulated forward + backward makespan of the plan;
- non-attention per layer = FLOPs of the device holding the most tokens / (MFU x peak_tflops), with
  forward FLOPs per token ``2 * (h*(h + 2*kv_dim) + h*h + 3*h*ffn)`` (QKV, out proj, SwiGLU MLP; kv_dim =
  kv_groups * head_dim) divided by TP, backward = 2 x forward, MFU a parameter (default 0.6);
- iteration = layers x (attention + non-attention). Summing the two maxima (instead of the max of the
  per-device sums) is a simplification.
- Ignored (equal for dcp and the baseline): TP all-reduces, the DP gradient all-reduce, embedding / LM
  head, optimizer step. Memory is not modelled (a sequence longer than a group's capacity is still placed).
- Network: all 8 GPUs of a node send their own head shard at once, so each TP rank gets 1/8 of the node's
  NIC. The simulator gives a device 1/gpus_per_node (= 1/2) of ``nic_gbps_per_node``, so the profile's
  ``nic_gbps_per_node`` is scaled by gpus_per_node / physical_gpus_per_node (2/8). NVLink is per GPU and
  kept as is.

Baseline ``megatron_cp<c>``: Megatron-style static context parallelism, CP size c in {1, 2, 4, 8, 16};
the batch's sequences go to the 16/c CP groups greedily by tokens (longest first, least-loaded group), and
inside a group every sequence runs zigzag ring attention over the group's c devices (``ZigzagPlanner`` on
the group's sub-batch, ``Cluster(max(1, c // gpn), min(c, gpn))``); attention time = slowest group.
``megatron_best`` = the CP size with the least iteration time (grid search, as the paper's baseline).
``best_tuned`` = every static baseline of ``dcp.baselines`` over the whole DP group at the best point of
its tuning grid, scored by attention plus the non-attention time of its device with the most tokens
(``dcp.bench.tuned``); dcp's ``speedup_vs_best_tuned`` is against the faster of it and ``megatron_best``.

dcp: ``dcp.plan`` with its default configuration, told what a training step costs besides attention:
its cost model is the profile above and ``SearchConfig.token_time_s`` the non-attention seconds per token
per layer (the model's FLOPs at the given MFU), so it scores candidates on attention + the linear layers
of the device with the most tokens, as the iteration model does. ``planning_time_s`` is its planning wall
time on this machine.

Output: ``e2e_<profile><tag>.csv``, one row per (dataset, max_len, mask, planner).
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from dcp.bench.common import (DEFAULT_OUT, E2ESetting, add_dcp_args, config_fields, dcp_config, e2e_cost_model,
                              fmt_table, git_revision, machine, options_from_args, parse_list, plan_quietly, progress,
                              write_csv)
from dcp.cluster import Cluster

DATASETS = ("longalign", "ldc")
MAX_LENS = (16384, 32768, 65536, 131072)
MASKS = ("causal", "lambda")
CP_SIZES = (1, 2, 4, 8, 16)
QUICK = dict(max_lens=(16384, 32768), masks=("lambda",))

PAPER_REFERENCE = {
    ("longalign", 131072, "lambda"): "paper: 2.80 s -> 1.92 s (1.46x)",
    "causal": "paper: causal 0.95-1.13x",
    "lambda": "paper: lambda up to 1.46x",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer whose iteration is modelled (default: the paper's GPT-8B with TP=4)."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_groups: int = 8
    ffn: int = 14336
    head_dim: int = 128
    tp: int = 4

    def __post_init__(self):
        if self.heads % self.tp or self.kv_groups % self.tp:
            raise ValueError(f"heads ({self.heads}) and kv_groups ({self.kv_groups}) must divide by tp ({self.tp})")

    @property
    def kv_dim(self) -> int:
        return self.kv_groups * self.head_dim

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_groups // self.tp

    def fwd_flops_per_token(self) -> float:
        """Non-attention forward FLOPs per token per layer on one TP rank (QKV, out proj, SwiGLU MLP) / TP."""
        h = self.hidden
        return 2.0 * (h * (h + 2 * self.kv_dim) + h * h + 3 * h * self.ffn) / self.tp

    def fwd_bwd_flops_per_token(self) -> float:
        """Forward + backward (= 2 x forward) non-attention FLOPs per token per layer per TP rank."""
        return 3.0 * self.fwd_flops_per_token()


def other_time_s(tokens: float, model: ModelConfig, peak_tflops: float, mfu: float) -> float:
    """Non-attention fwd+bwd seconds per layer for a device (TP group) holding ``tokens`` tokens."""
    return tokens * model.fwd_bwd_flops_per_token() / (mfu * peak_tflops * 1e12)


def tokens_per_device(plan) -> np.ndarray:
    """Home tokens of every device of ``plan``."""
    return np.bincount(plan.home, weights=plan.layout.tb_len, minlength=plan.n_devices)


def greedy_groups(lens, n_groups: int) -> list[list[int]]:
    """Sequence lengths onto ``n_groups`` groups: longest first, each to the least-loaded group
    (``dcp.baselines.megatron_cp.token_groups``), each group's lengths longest first."""
    from dcp.baselines.megatron_cp import token_groups

    lens = np.asarray(lens, dtype=np.int64)
    group = token_groups(lens, n_groups)
    order = np.argsort(-lens, kind="stable")
    return [[int(lens[s]) for s in order if group[s] == g] for g in range(n_groups)]


@dataclasses.dataclass(frozen=True)
class E2EConfig(E2ESetting):
    datasets: tuple[str, ...] = DATASETS
    max_lens: tuple[int, ...] = MAX_LENS
    masks: tuple[str, ...] = MASKS
    cp_sizes: tuple[int, ...] = CP_SIZES
    model: ModelConfig = ModelConfig()

    @property
    def n_devices(self) -> int:
        return self.nodes * self.gpus_per_node


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (iteration times span microseconds in tests to seconds)."""
    return float(f"{x:.{digits}g}")


def _paper_ref(dataset: str, max_len: int, mask: str) -> str:
    return PAPER_REFERENCE.get((dataset, max_len, mask)) or PAPER_REFERENCE.get(mask, "")


def _peak_buffer(plan) -> int:
    """The most transient bytes one device holds at once in either direction (``dcp.ir.memory``)."""
    st = plan.stats()
    return max(st.peak_transient_bytes_forward, st.peak_transient_bytes_backward)


def run_e2e(cfg: E2EConfig) -> list[dict]:
    """Run the grid; one row per (dataset, max_len, mask, planner)."""
    from dcp.baselines import BASELINES, ZigzagPlanner
    from dcp.bench.common import BASELINE_NAMES
    from dcp.bench.micro import make_mask
    from dcp.bench.tuned import tune
    from dcp.data import make_batches
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import simulate_both
    from dcp.spec import BatchSpec

    m = cfg.model
    cost = e2e_cost_model(cfg.profile, cfg.gpus_per_node, cfg.physical_gpus_per_node)
    peak = cost.profile.peak_tflops
    cluster = Cluster(cfg.nodes, cfg.gpus_per_node)
    mach, rev = machine(), git_revision()
    cps = [c for c in cfg.cp_sizes if c <= cfg.n_devices and cfg.n_devices % c == 0]
    rows: list[dict] = []
    work = [(d, L, mk) for d in cfg.datasets for L in cfg.max_lens for mk in cfg.masks]

    def spec_of(lens, mask_name):
        return BatchSpec(np.asarray(lens, dtype=np.int64), make_mask(mask_name), m.heads_per_rank,
                         m.kv_heads_per_rank, m.head_dim, "bfloat16")

    for dataset, max_len, mask_name in progress(work, desc="e2e"):
        lens = make_batches(dataset, 1.0, tokens_per_batch=max_len, num_batches=1, seed=cfg.seed)[0]
        cell = dict(dataset=dataset, max_len=max_len, mask=mask_name, num_seqs=len(lens), tokens=int(sum(lens)),
                    max_seqlen=int(max(lens)))
        common = dict(simulated=True, profile=cfg.profile, mfu=cfg.mfu, layers=m.layers, tp=m.tp,
                      dp_devices=cfg.n_devices, machine=mach, revision=rev)
        cell_rows = []
        # Megatron-style static CP, one row per CP size
        for c in cps:
            started = time.perf_counter()
            groups = greedy_groups(lens, cfg.n_devices // c)
            gcl = Cluster(max(1, c // cfg.gpus_per_node), min(c, cfg.gpus_per_node))
            attn_s, fwd_s, bwd_s, max_tok, buf = 0.0, 0.0, 0.0, 0.0, 0
            for sub in groups:
                if not sub:
                    continue
                plan, _ = plan_quietly(ZigzagPlanner(), spec_of(sub, mask_name), gcl)
                fwd, bwd = simulate_both(plan, cost, record_events=False)
                if fwd.makespan_s + bwd.makespan_s > attn_s:
                    attn_s, fwd_s, bwd_s = fwd.makespan_s + bwd.makespan_s, fwd.makespan_s, bwd.makespan_s
                max_tok = max(max_tok, float(tokens_per_device(plan).max()))
                buf = max(buf, _peak_buffer(plan))
            other_s = other_time_s(max_tok, m, peak, cfg.mfu)
            cell_rows.append(dict(cell, planner=f"megatron_cp{c}", cp_size=c, block_size="",
                                  attention_fwd_ms=round(fwd_s * 1e3, 4), attention_bwd_ms=round(bwd_s * 1e3, 4),
                                  attention_ms=round(attn_s * 1e3, 4), other_ms=round(other_s * 1e3, 4),
                                  max_device_tokens=int(max_tok),
                                  memory_imbalance=round(max_tok * cfg.n_devices / sum(lens), 4),
                                  peak_buffer_MiB=round(buf / 2**20, 3),
                                  iteration_s=_sig(m.layers * (attn_s + other_s)),
                                  planning_time_s=round(time.perf_counter() - started, 3)))
        best = min(cell_rows, key=lambda r: r["iteration_s"])
        cell_rows.append(dict(best, planner="megatron_best"))
        if cfg.tuned:  # every static baseline over the whole DP group at its best knobs (dcp.bench.tuned)
            started = time.perf_counter()
            other = lambda layout, home: other_time_s(  # noqa: E731
                float(np.bincount(home, weights=layout.tb_len, minlength=cfg.n_devices).max()), m, peak, cfg.mfu)
            got = tune(spec_of(lens, mask_name), cluster, [BASELINES[n]() for n in BASELINE_NAMES],
                       {cfg.profile: cost}, cfg.tune_top, extra_s=other).get(cfg.profile, {})
            if got:
                t = got["best_tuned"]
                max_tok = float(tokens_per_device(t.plan).max())
                cell_rows.append(dict(cell, planner="best_tuned", cp_size="", block_size="", chosen=t.label,
                                      attention_fwd_ms=round(t.fwd.makespan_s * 1e3, 4),
                                      attention_bwd_ms=round(t.bwd.makespan_s * 1e3, 4),
                                      attention_ms=round((t.fwd.makespan_s + t.bwd.makespan_s) * 1e3, 4),
                                      other_ms=round(t.extra_s * 1e3, 4), max_device_tokens=int(max_tok),
                                      memory_imbalance=round(max_tok * cfg.n_devices / sum(lens), 4),
                                      peak_buffer_MiB=round(_peak_buffer(t.plan) / 2**20, 3),
                                      iteration_s=_sig(m.layers * t.total_s),
                                      planning_time_s=round(time.perf_counter() - started, 3)))
        opponent = min((r for r in cell_rows if r["planner"] in ("megatron_best", "best_tuned")),
                       key=lambda r: r["iteration_s"])
        # dcp over the whole DP group, scoring attention plus each device's non-attention work
        config = dcp_config(cfg.profile, cfg.dcp, cost=cost, token_time_s=other_time_s(1.0, m, peak, cfg.mfu))
        started = time.perf_counter()
        plan, _ = plan_quietly(DCPPlanner(config), spec_of(lens, mask_name), cluster)
        plan_s = time.perf_counter() - started
        fwd, bwd = simulate_both(plan, cost, record_events=False)
        max_tok = float(tokens_per_device(plan).max())
        other_s = other_time_s(max_tok, m, peak, cfg.mfu)
        fwd_s, bwd_s, bsz = fwd.makespan_s, bwd.makespan_s, config.block_size
        it = m.layers * (fwd_s + bwd_s + other_s)
        cell_rows.append(dict(cell, planner="dcp", cp_size="",
                              block_size=bsz,
                              attention_fwd_ms=round(fwd_s * 1e3, 4), attention_bwd_ms=round(bwd_s * 1e3, 4),
                              attention_ms=round((fwd_s + bwd_s) * 1e3, 4), other_ms=round(other_s * 1e3, 4),
                              max_device_tokens=int(max_tok),
                              memory_imbalance=round(max_tok * cfg.n_devices / sum(lens), 4),
                              peak_buffer_MiB=round(_peak_buffer(plan) / 2**20, 3), iteration_s=_sig(it),
                              planning_time_s=round(plan_s, 3), chosen=plan.meta.get("search_chosen", ""),
                              **config_fields(config),
                              speedup_vs_megatron_best=round(best["iteration_s"] / _sig(it), 4),
                              speedup_vs_best_tuned=round(opponent["iteration_s"] / _sig(it), 4),
                              best_tuned=opponent.get("chosen") or opponent["planner"] + f"(cp={opponent['cp_size']})",
                              megatron_best_cp=best["cp_size"], paper_reference=_paper_ref(dataset, max_len, mask_name)))
        for r in cell_rows:
            r.setdefault("speedup_vs_megatron_best", "")
            r.setdefault("speedup_vs_best_tuned", "")
            r.setdefault("best_tuned", "")
            r.setdefault("chosen", "")
            r.setdefault("megatron_best_cp", "")
            r.setdefault("paper_reference", "")
            rows.append(dict(r, **common))
    return rows


HEADLINE = ["dataset", "max_len", "mask", "num_seqs", "megatron_best_cp", "block_size", "attention_ms", "other_ms",
            "memory_imbalance", "peak_buffer_MiB", "iteration_s", "speedup_vs_megatron_best", "speedup_vs_best_tuned",
            "best_tuned"]


def add_parser(sub) -> None:
    p = sub.add_parser("e2e", help="GPT-8B end-to-end iteration time, dcp vs Megatron static CP (simulated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt-8b", "gpt-oss"), default="gpt-8b",
                   help="gpt-8b (default): the DCP paper's model; gpt-oss: a gpt-oss-like model whose layers alternate "
                        "128-token sliding-window and full attention (dcp.bench.e2e_layers; --masks is ignored)")
    p.add_argument("--quick", action="store_true", help="max lengths 16K,32K; mask lambda (1-2 minutes on 2 cores)")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--max-lens", default=",".join(str(x) for x in MAX_LENS),
                   help="max sequence length = global batch tokens, comma-separated")
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--cp-sizes", default=",".join(str(x) for x in CP_SIZES), help="Megatron CP sizes to grid-search")
    p.add_argument("--profile", default="a100")
    p.add_argument("--mfu", type=float, default=0.6, help="model FLOPs utilisation of the non-attention layers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tuned", action="store_true", help="skip the best tuned baseline (dcp.bench.tuned)")
    p.add_argument("--tune-top", type=int, default=2, help="grid points per baseline simulated (default 2)")
    add_dcp_args(p)
    p.add_argument("--out-dir", default=str(DEFAULT_OUT),
                   help="where the CSV goes (the committed results: --out-dir benchmarks/results)")
    p.add_argument("--tag", default=None, help="suffix: e2e_<profile><tag>.csv (default '_quick' with --quick, else '')")
    p.set_defaults(func=cmd_e2e)


def config_from_args(args) -> E2EConfig:
    kw = dict(datasets=parse_list(args.datasets), max_lens=parse_list(args.max_lens, int), masks=parse_list(args.masks),
              cp_sizes=parse_list(args.cp_sizes, int), profile=args.profile, mfu=args.mfu, seed=args.seed,
              dcp=options_from_args(args), tuned=not args.no_tuned, tune_top=args.tune_top)
    if args.quick:
        kw.update(QUICK)
    return E2EConfig(**kw)


def write_results(rows: list[dict], out_dir, profile: str, tag: str = "") -> Path:
    return write_csv(Path(out_dir) / f"e2e_{profile}{tag}.csv", rows)


def cmd_e2e(args) -> int:
    if args.model == "gpt-oss":
        return _cmd_e2e_layers(args)
    cfg = config_from_args(args)
    started = time.perf_counter()
    rows = run_e2e(cfg)
    tag = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    print(f"wrote {write_results(rows, args.out_dir, cfg.profile, tag)}")
    print(f"\nSIMULATED ({cfg.profile} profile, MFU {cfg.mfu}): GPT-8B iteration, dcp vs best Megatron static CP")
    print(fmt_table([r for r in rows if r["planner"] == "dcp"], HEADLINE))
    print(f"\ne2e grid: {time.perf_counter() - started:.0f} s on {machine()}")
    return 0


def _cmd_e2e_layers(args) -> int:
    from dcp.bench import e2e_layers

    cfg = e2e_layers.E2ELayersConfig(
        datasets=parse_list(args.datasets), max_lens=(16384, 32768) if args.quick else parse_list(args.max_lens, int),
        profile=args.profile, mfu=args.mfu, seed=args.seed, dcp=options_from_args(args), tuned=not args.no_tuned,
        tune_top=args.tune_top)
    started = time.perf_counter()
    rows = e2e_layers.run_e2e_layers(cfg)
    tag = args.tag if args.tag is not None else ("_quick" if args.quick else "")
    print(f"wrote {e2e_layers.write_results(rows, args.out_dir, cfg.profile, tag)}")
    print(f"\nSIMULATED ({cfg.profile} profile, MFU {cfg.mfu}): gpt-oss-like iteration, dcp with layer kinds vs dcp "
          "planned for the full mask only and vs the best tuned baseline")
    print(fmt_table([r for r in rows if r["planner"] == "dcp"], e2e_layers.HEADLINE))
    print(f"\ne2e gpt-oss grid: {time.perf_counter() - started:.0f} s on {machine()}")
    return 0
