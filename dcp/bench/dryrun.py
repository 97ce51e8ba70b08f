"""``dcp bench dryrun``: the DCP paper's dry-run sweeps (planning only, then the simulator).

Setting (the dry runs of the DCP paper: Jiang et al., SOSP 2025, arXiv:2510.10620): 64 GPUs = 8 nodes x 8, maximum sequence length 64K. We
follow the paper's end-to-end convention "max length = batch tokens": batches of 65,536 tokens
(``--tokens``), lengths from the synthetic LongAlign / Long-Data-Collections stand-ins at scale 1
(sequences longer than the batch are dropped), 8 query / 2 KV heads, head dim 128, bf16, A100 profile.
65,536 tokens on 64 GPUs is 1,024 tokens per GPU, so at B=2048/4096 a batch has fewer token blocks than
devices and some devices stay idle (recorded as ``idle_devices``); that is what a 64K batch on 64 GPUs
means, and it is why communication rises with B here.

dcp is ``DCPPlanner`` with the paper's objective (``SearchConfig(objective="bytes")``: the fewest bytes
within the compute tolerance) and the paper's tolerances (epsilon_inter 0.4, epsilon_intra 0.1) unless
swept, at each block size swept, with its default partitioner (Mt-KaHyPar's deterministic_quality
preset); the sweeps study the bytes trade-offs the paper plots. Flags override the objective and the rest.
Four sweeps, one CSV each under ``--out-dir``:

- ``dryrun_block_size.csv``: B in {512, 1024, 2048, 4096} x masks {causal, lambda}: communication
  (total, inter-node) and planning time vs block size;
- ``dryrun_sparsity.csv``: lambda masks (64 sink tokens + window w) for windows from 256 to 65,536
  tokens (the largest equals causal) at B=1024: communication vs the unmasked fraction relative to
  causal (``unmasked_frac_vs_causal``, computed from the mask's real area of this batch);
- ``dryrun_epsilon.csv``: epsilon_inter = epsilon_intra in {0.02, 0.05, 0.1, 0.2, 0.4} at B=1024:
  communication and imbalance vs epsilon.

Every row has the measured planning time beside the simulated iteration time (forward + backward
attention, ``sim_iter_ms``). Planning is off the critical path when it runs one batch ahead in the data
loader (as in the paper and ``dcp.integration``): it only needs to be shorter than a training iteration
times the number of planner processes, not shorter than the attention time.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from dcp.bench.common import (DEFAULT_OUT, PAPER_EPSILON_INTER, PAPER_EPSILON_INTRA, DcpOptions, add_dcp_args,
                              config_fields, dcp_config, fmt_table, git_revision, machine, options_from_args,
                              parse_list, plan_quietly, progress, sim_fields, stat_fields, write_csv)
from dcp.cluster import Cluster

SWEEPS = ("block_size", "sparsity", "epsilon")


@dataclasses.dataclass(frozen=True)
class DryrunConfig:
    sweeps: tuple[str, ...] = SWEEPS
    datasets: tuple[str, ...] = ("longalign", "ldc")
    scale: float = 1.0
    batches: int = 2
    nodes: int = 8
    gpus_per_node: int = 8
    tokens: int = 65536
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bfloat16"
    profile: str = "a100"
    block_sizes: tuple[int, ...] = (512, 1024, 2048, 4096)
    masks: tuple[str, ...] = ("causal", "lambda")
    windows: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    epsilons: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.4)
    sweep_block_size: int = 1024
    seed: int = 0
    dcp: DcpOptions = DcpOptions(epsilon_inter=PAPER_EPSILON_INTER, epsilon_intra=PAPER_EPSILON_INTRA,
                                 objective="bytes")


def mask_area(mask, seqlens) -> tuple[int, int]:
    """(unmasked (query, key) pairs of ``mask``, pairs of the causal mask) over the sequences."""
    import numpy as np

    area = causal = 0
    for L in (int(x) for x in seqlens):
        r = mask.kv_ranges(L).astype(np.int64)
        area += int((r[:, :, 1] - r[:, :, 0]).clip(min=0).sum())
        causal += L * (L + 1) // 2
    return area, causal


def _jobs(cfg: DryrunConfig):
    from dcp.masks import CausalMask, LambdaMask

    masks = {"causal": CausalMask(), "lambda": LambdaMask(sink=64, window=4096)}
    for sweep in cfg.sweeps:
        if sweep == "block_size":
            for m in cfg.masks:
                for b in cfg.block_sizes:
                    yield sweep, m, masks[m], dict(block_size=b)
        elif sweep == "sparsity":
            for w in cfg.windows:
                yield sweep, f"lambda_w{w}", LambdaMask(sink=64, window=w), dict(block_size=cfg.sweep_block_size,
                                                                                  window=w)
        elif sweep == "epsilon":
            for m in cfg.masks:
                for e in cfg.epsilons:
                    yield sweep, m, masks[m], dict(block_size=cfg.sweep_block_size, epsilon=e)
        else:
            raise ValueError(f"unknown sweep {sweep!r}; one of {SWEEPS}")


def run_dryrun(cfg: DryrunConfig) -> dict[str, list[dict]]:
    """Run the sweeps; returns ``{sweep: rows}``."""
    from dcp.cost import CostModel
    from dcp.data import make_batches
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import simulate_both
    from dcp.spec import BatchSpec

    cluster = Cluster(cfg.nodes, cfg.gpus_per_node)
    cost = CostModel.named(cfg.profile)
    mach, rev = machine(), git_revision()
    batches = {d: make_batches(d, cfg.scale, tokens_per_batch=cfg.tokens, num_batches=cfg.batches, seed=cfg.seed)
               for d in cfg.datasets}
    jobs = [(sweep, label, mask, knobs, d, bi) for sweep, label, mask, knobs in _jobs(cfg)
            for d in cfg.datasets for bi in range(cfg.batches)]
    rows: dict[str, list[dict]] = {s: [] for s in cfg.sweeps}
    for sweep, label, mask, knobs, dataset, bi in progress(jobs, desc="dryrun"):
        lens = batches[dataset][bi]
        spec = BatchSpec(lens, mask, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.dtype)
        eps = knobs.get("epsilon")
        opts = dataclasses.replace(cfg.dcp, block_size=knobs["block_size"])
        if eps is not None:
            opts = dataclasses.replace(opts, epsilon_inter=eps, epsilon_intra=eps)
        config = dcp_config(cfg.profile, opts)
        t0 = time.perf_counter()
        plan, warns = plan_quietly(DCPPlanner(config), spec, cluster)
        wall = time.perf_counter() - t0
        fwd, bwd = simulate_both(plan, cost, record_events=False)
        area, causal = mask_area(mask, lens)
        sim = sim_fields(fwd, bwd)
        rows[sweep].append(dict(
            sweep=sweep, dataset=dataset, scale=cfg.scale, batch=bi, mask=label, window=knobs.get("window", ""),
            unmasked_frac_vs_causal=round(area / causal, 5), block_size=knobs["block_size"],
            epsilon_inter=config.epsilon_inter, epsilon_intra=config.epsilon_intra, **config_fields(config),
            num_seqs=spec.num_seqs,
            tokens=spec.total_tokens, max_seqlen=int(max(lens)), nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node,
            planner="dcp", planning_time_s=round(wall, 4), plan_time_stamped_s=round(plan.planning_time_s, 4),
            **sim, sim_iter_ms=round(sim["fwd_ms"] + sim["bwd_ms"], 5),
            planning_over_sim_iter=round(wall / ((sim["fwd_ms"] + sim["bwd_ms"]) / 1e3), 1),
            **stat_fields(plan), warnings=len(warns), simulated=True, profile=cfg.profile, machine=mach,
            revision=rev))
    return rows


def add_parser(sub) -> None:
    p = sub.add_parser("dryrun", help="the paper's dry-run sweeps on 64 GPUs (planning + simulation)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweeps", default=",".join(SWEEPS))
    p.add_argument("--datasets", default="longalign,ldc")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch (= max sequence length)")
    p.add_argument("--profile", default="a100")
    p.add_argument("--block-sizes", default="512,1024,2048,4096")
    p.add_argument("--windows", default="256,512,1024,2048,4096,8192,16384,32768,65536")
    p.add_argument("--epsilons", default="0.02,0.05,0.1,0.2,0.4")
    p.add_argument("--seed", type=int, default=0)
    add_dcp_args(p)
    p.add_argument("--quick", action="store_true", help="1 batch, longalign only")
    p.add_argument("--out-dir", default=str(DEFAULT_OUT),
                   help="where the CSVs go (the committed results: --out-dir benchmarks/results)")
    p.set_defaults(func=cmd_dryrun)


def config_from_args(args) -> DryrunConfig:
    kw = dict(sweeps=parse_list(args.sweeps), datasets=parse_list(args.datasets), batches=args.batches,
              nodes=args.nodes, gpus_per_node=args.gpus_per_node, tokens=args.tokens, profile=args.profile,
              block_sizes=parse_list(args.block_sizes, int), windows=parse_list(args.windows, int),
              epsilons=parse_list(args.epsilons, float), seed=args.seed,
              dcp=dataclasses.replace(DryrunConfig.dcp, **options_from_args(args).changed()))
    if args.quick:
        kw.update(batches=1, datasets=("longalign",))
    return DryrunConfig(**kw)


def write_results(rows: dict[str, list[dict]], out_dir) -> list[Path]:
    return [write_csv(Path(out_dir) / f"dryrun_{sweep}.csv", r) for sweep, r in rows.items() if r]


def cmd_dryrun(args) -> int:
    cfg = config_from_args(args)
    rows = run_dryrun(cfg)
    for path in write_results(rows, args.out_dir):
        print(f"wrote {path}")
    cols = ["dataset", "batch", "mask", "block_size", "epsilon_inter", "unmasked_frac_vs_causal",
            "comm_bytes_total", "comm_bytes_inter_node", "compute_imbalance", "planning_time_s", "sim_iter_ms"]
    for sweep, r in rows.items():
        print(f"\n{sweep} sweep (SIMULATED, {cfg.profile} profile; planning time measured on this machine)")
        print(fmt_table(r, cols))
    return 0
