"""``dcp bench run``: run planners' plans for real, time them, and put the simulator's prediction beside.

One process per device (torchrun, or ``--nproc N`` to start N local gloo processes itself). For every
batch and planner: rank 0 plans, ``dcp.broadcast_plan`` ships the plan, every rank runs its forward and
backward through ``DistributedExecutor`` (native tile kernels on the CPU, fused varlen calls on a GPU),
``warmup`` untimed runs then ``repeats`` timed ones. A timed run starts after a barrier; each rank times
its own program (CUDA events on a GPU, ``perf_counter`` on the CPU) and the run's time is the slowest
rank's (the makespan, as the simulator defines it). One CSV row per (batch, planner, direction): median
measured ms over repeats, the per-rank medians and their spread, and the simulator's makespan for the
same plan under ``--profile``.

    torchrun --nproc-per-node 8 -m dcp.cli bench run --dataset ldc --scale 1 --tokens 131072 --profile a100
    dcp bench run --nproc 2 --threads 1 --lengths 3000,1200,700 --heads 4 --kv-heads 2 --head-dim 64 \\
        --dtype float32 --profile dcp_profiles/cpu_amd_epyc_2c.json   # written by dcp bench calibrate
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

from dcp.bench.args import add_mask_args, check_profile, masks_from_args, nproc_warning, profile_help
from dcp.bench.common import (BASELINE_NAMES, DEFAULT_OUT, DcpOptions, add_dcp_args, dcp_config, fmt_table,
                              git_revision, machine, options_from_args, parse_list, plan_quietly, stat_fields,
                              write_csv)
from dcp.errors import InvalidConfigError

RUN_PLANNERS = ("dcp", *BASELINE_NAMES)


@dataclasses.dataclass(frozen=True)
class RunBatch:
    """One batch to run: sequence lengths, a mask family by name (``dcp.masks.from_cli``) with its
    parameters, and a label for the CSV."""

    lengths: tuple[int, ...]
    mask: str = "causal"
    mask_params: tuple[tuple[str, str], ...] = ()
    label: str = ""

    def masks(self):
        from dcp.masks import from_cli

        return from_cli(self.mask, **dict(self.mask_params))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What ``dcp bench run`` runs. ``gpus_per_node`` None: the world size over ``nodes``;
    ``threads`` None: leave torch's intra-op threads as they are."""

    batches: tuple[RunBatch, ...]
    planners: tuple[str, ...] = RUN_PLANNERS
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 128
    dtype: str = "bfloat16"
    nodes: int = 1
    gpus_per_node: int | None = None
    profile: str = "a100"
    warmup: int = 2
    repeats: int = 5
    threads: int | None = None
    seed: int = 0
    dcp: DcpOptions = DcpOptions()

    def __post_init__(self):
        bad = [p for p in self.planners if p not in RUN_PLANNERS]
        if bad:
            raise InvalidConfigError(f"unknown planners {bad}; choose from {RUN_PLANNERS}")
        if not self.batches:
            raise InvalidConfigError("dcp bench run needs at least one batch")
        if self.repeats < 1 or self.warmup < 0:
            raise InvalidConfigError(f"repeats must be >= 1 and warmup >= 0, got {self.repeats}, {self.warmup}")


def load_average() -> float:
    """The 1-minute load average (nan where the OS has none): timings taken under load are suspect."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return float("nan")


def _all_have(plan) -> bool:
    """Whether rank 0 has a plan to broadcast (every rank learns it, so all skip an inapplicable planner)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if plan is not None else 0])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _planner(name: str, cfg: RunConfig):
    from dcp.baselines import BASELINES
    from dcp.cost import CostModel
    from dcp.cost.model import load_profile
    from dcp.planner.dcp_planner import DCPPlanner

    if name == "dcp":
        return DCPPlanner(dcp_config(cfg.profile, cfg.dcp, cost=CostModel(load_profile(cfg.profile))))
    return BASELINES[name]()


class _Timer:
    """Times one call on this rank after a barrier: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device):
        self.device = device

    def __call__(self, fn):
        import torch
        import torch.distributed as dist

        dist.barrier()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return out, a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0


def _gather_seconds(x: list[float], world: int) -> list[list[float]]:
    """Every rank's list of seconds (same length on every rank), ``[rank][repeat]``."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(x, dtype=torch.float64, device=dev)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [o.cpu().tolist() for o in out]


class PlanRun:
    """One plan made ready to run on this rank: its executor and this rank's inputs (the same random
    batch on every rank, dispatched by the plan)."""

    def __init__(self, plan, rank: int, device, seed: int):
        import torch

        import dcp
        from dcp.execute import DistributedExecutor

        spec = plan.spec
        g = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, spec.dtype)
        full = [torch.randn(spec.total_tokens, h, spec.head_dim, generator=g).to(dtype)
                for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads, spec.num_heads)]
        self.q, self.k, self.v, self.do = (dcp.dispatch(plan, rank, x).to(device) for x in full)
        self.plan = plan
        self.ex = DistributedExecutor(plan, kernels="auto")
        self.o, self.lse = self.ex.forward(self.q, self.k, self.v)  # plan agreement, validation, caches

    def forward(self):
        self.o, self.lse = self.ex.forward(self.q, self.k, self.v)

    def backward(self):
        self.ex.backward(self.q, self.k, self.v, self.o, self.lse, self.do)


def time_plans(runs: list[PlanRun], world: int, device, cfg: RunConfig) -> list[dict[str, list[list[float]]]]:
    """Run every plan forward then backward, ``warmup + repeats`` rounds, the plans interleaved within
    each round (so that a load change on a shared machine hits every plan alike). Returns per plan
    ``{direction: seconds[rank][repeat]}`` of the timed rounds (every rank gets every rank's times)."""
    timer = _Timer(device)
    times = [{"forward": [], "backward": []} for _ in runs]
    for i in range(cfg.warmup + cfg.repeats):
        for run, t in zip(runs, times):
            _, t_f = timer(run.forward)
            _, t_b = timer(run.backward)
            if i >= cfg.warmup:
                t["forward"].append(t_f)
                t["backward"].append(t_b)
    return [{d: _gather_seconds(t[d], world) for d in t} for t in times]


def measured_fields(per_rank: list[list[float]]) -> dict:
    """CSV fields of one direction's timings ``[rank][repeat]`` (seconds): the median over repeats of the
    slowest rank (``measured_ms``), the fastest and slowest repeats' makespans, each rank's median and their spread
    (slowest rank's median / fastest rank's)."""
    makespans = [max(col) for col in zip(*per_rank)]
    rank_med = [statistics.median(r) for r in per_rank]
    return dict(measured_ms=round(statistics.median(makespans) * 1e3, 4),
                measured_min_ms=round(min(makespans) * 1e3, 4), measured_max_ms=round(max(makespans) * 1e3, 4),
                rank_ms=json.dumps([round(t * 1e3, 4) for t in rank_med]),
                rank_spread=round(max(rank_med) / min(rank_med), 4) if min(rank_med) > 0 else float("inf"),
                repeats=len(makespans))


def run_on_rank(cfg: RunConfig, rank: int, world: int, device) -> list[dict]:
    """Every batch x planner on this rank (a collective: every rank calls it). Rank 0 returns the rows,
    the others ``[]``."""
    import torch

    import dcp
    from dcp.cluster import Cluster
    from dcp.cost import CostModel
    from dcp.cost.model import load_profile
    from dcp.sim import simulate_both
    from dcp.spec import BatchSpec

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    gpn = cfg.gpus_per_node or world // cfg.nodes
    if cfg.nodes * gpn != world:
        raise InvalidConfigError(f"{cfg.nodes} nodes x {gpn} devices is not the world size {world}")
    cluster = Cluster(cfg.nodes, gpn)
    cost = CostModel(load_profile(cfg.profile))
    info = dict(profile=cost.profile.name, world=world, nodes=cfg.nodes, gpus_per_node=gpn,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                threads=torch.get_num_threads(), machine=machine(), revision=git_revision(),
                heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)
    rows = []
    for batch in cfg.batches:
        spec = BatchSpec(list(batch.lengths), batch.masks(), cfg.heads, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype)
        plans, runs = [], []
        for name in cfg.planners:
            if rank == 0:
                try:
                    plan, warns = plan_quietly(_planner(name, cfg), spec, cluster)
                except InvalidConfigError as err:  # e.g. Ulysses with more ranks than heads: not applicable
                    print(f"{name}: not applicable to batch {batch.label} ({err})", flush=True)
                    plan, warns = None, []
            else:
                plan, warns = None, []
            plan = dcp.broadcast_plan(plan, src=0) if _all_have(plan) else None
            if plan is None:
                continue
            plans.append((name, plan, warns))
            runs.append(PlanRun(plans[-1][1], rank, device, cfg.seed))
        load_before = load_average()
        timed = time_plans(runs, world, device, cfg)
        load_after = load_average()
        del runs
        if rank != 0:
            continue
        for (name, plan, warns), times in zip(plans, timed):
            fwd, bwd = simulate_both(plan, cost, record_events=False)
            stats = stat_fields(plan)
            for direction, sim in (("forward", fwd), ("backward", bwd)):
                meas = measured_fields(times[direction])
                rel = (sim.makespan_s * 1e3 - meas["measured_ms"]) / meas["measured_ms"]
                rows.append(dict(batch=batch.label, mask=batch.mask,
                                 mask_params=";".join(f"{k}={v}" for k, v in batch.mask_params),
                                 num_seqs=spec.num_seqs, tokens=spec.total_tokens, planner=name,
                                 chosen=plan.meta.get("search_chosen", name) if name == "dcp" else name,
                                 block_size=dcp_config(cfg.profile, cfg.dcp).block_size if name == "dcp" else "",
                                 max_block_tokens=int(plan.layout.tb_len.max()),
                                 direction=direction, **meas, simulated_ms=round(sim.makespan_s * 1e3, 4),
                                 sim_rel_error=round(rel, 4), ideal_ms=round(sim.ideal_s * 1e3, 4),
                                 sim_rank_ms=json.dumps([round(t * 1e3, 4) for t in sim.end_s.tolist()]),
                                 planning_time_s=round(plan.planning_time_s, 4), warnings=len(warns),
                                 n_tiles=stats["n_tiles"], comm_bytes=stats[f"comm_bytes_{direction}"],
                                 compute_imbalance=stats["compute_imbalance"],
                                 load_before=round(load_before, 2), load_after=round(load_after, 2), **info))
    return rows


# ------------------------------------------------------------------------------------------ launching
def _init_from_env():
    """torchrun's environment -> (rank, world, device), the process group initialized."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def _local_rank_main(rank: int, world: int, port: int, cfg: RunConfig, out: str) -> None:
    import torch
    import torch.distributed as dist

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        rows = run_on_rank(cfg, rank, world, torch.device("cpu"))
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_local(fn, nproc: int, args: tuple, name: str = "result.json"):
    """Run ``fn(rank, nproc, port, *args, out)`` in ``nproc`` spawned processes on this machine (they meet
    at ``port``, a free local TCP port); returns the JSON that the processes wrote to the file ``out``."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, name)
        mp.start_processes(fn, args=(nproc, port, *args, out), nprocs=nproc, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def run_local(cfg: RunConfig, nproc: int) -> list[dict]:
    """Start ``nproc`` gloo processes on this machine (CPU), run ``cfg`` on them, return rank 0's rows."""
    return spawn_local(_local_rank_main, nproc, (cfg,), "rows.json")


# ------------------------------------------------------------------------------------------ CLI
def add_parser(sub) -> None:
    p = sub.add_parser("run", help="run plans for real (torchrun or --nproc), timed, beside the simulator",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("the batch (one of --lengths, --lengths-file, --dataset)")
    src.add_argument("--lengths", default=None, help="comma-separated sequence lengths")
    src.add_argument("--lengths-file", default=None, help="JSON list of batches (lists of lengths)")
    src.add_argument("--dataset", default=None, choices=("longalign", "ldc", "megatron_mock"))
    src.add_argument("--scale", type=float, default=1.0)
    src.add_argument("--tokens", type=int, default=131072, help="tokens per batch (--dataset)")
    src.add_argument("--batches", type=int, default=1, help="batches of --dataset / --lengths-file to run")
    add_mask_args(p)
    p.add_argument("--planners", default=",".join(RUN_PLANNERS))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--nodes", type=int, default=1, help="nodes the world is split into (devices per node = world / nodes)")
    p.add_argument("--profile", default="a100", help="the simulated column's " + profile_help())
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads per process")
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many local gloo processes (CPU) instead of running under torchrun; at most "
                        "the cores (x --threads), or the timings measure time slicing")
    p.add_argument("--seed", type=int, default=0)
    add_dcp_args(p)
    p.add_argument("--out", default=None, help="CSV path (default dcp-bench-results/run_<profile>.csv)")
    p.set_defaults(func=cmd_run)


def batches_from_args(args) -> tuple[RunBatch, ...]:
    from dcp.data import load_length_batches, make_batches, parse_lengths_arg

    given = [x for x in (args.lengths, args.lengths_file, args.dataset) if x]
    if len(given) != 1:
        raise InvalidConfigError("give the batch with exactly one of --lengths, --lengths-file, --dataset")
    mask = masks_from_args(args)[0]
    if args.lengths:
        lens, tag = [parse_lengths_arg(args.lengths)], "lengths"
    elif args.lengths_file:
        lens, tag = load_length_batches(args.lengths_file)[:args.batches], Path(args.lengths_file).stem
    else:
        lens = make_batches(args.dataset, args.scale, tokens_per_batch=args.tokens, num_batches=args.batches,
                            seed=args.seed)
        tag = f"{args.dataset}x{args.scale:g}"
    return tuple(RunBatch(tuple(int(x) for x in b), mask.name, mask.params, f"{tag}#{i}")
                 for i, b in enumerate(lens))


def config_from_args(args) -> RunConfig:
    return RunConfig(batches=batches_from_args(args), planners=parse_list(args.planners), heads=args.heads,
                     kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype, nodes=args.nodes,
                     profile=check_profile(args.profile), warmup=args.warmup, repeats=args.repeats,
                     threads=args.threads, seed=args.seed, dcp=options_from_args(args))


COLUMNS = ["batch", "planner", "direction", "measured_ms", "simulated_ms", "sim_rel_error", "rank_spread",
           "load_before"]


def cmd_run(args) -> int:
    cfg = config_from_args(args)
    if args.nproc is not None:
        warning = nproc_warning(args.nproc, args.threads)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        rows = run_local(cfg, args.nproc)
    elif "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        rank, world, device = _init_from_env()
        rows = run_on_rank(cfg, rank, world, device)
        dist.destroy_process_group()
        if rank != 0:
            return 0
    else:
        raise InvalidConfigError("dcp bench run needs torchrun (one process per device) or --nproc N")
    out = Path(args.out) if args.out else DEFAULT_OUT / f"run_{Path(cfg.profile).stem}.csv"
    write_csv(out, rows)
    print(fmt_table(rows, COLUMNS))
    print(f"wrote {out} ({len(rows)} rows; simulated_ms is the {cfg.profile} profile's prediction, measured_ms "
          f"the median makespan over {cfg.repeats} runs)")
    return 0


def kendall_tau(a, b) -> float:
    """Kendall's tau-b between two equally long sequences (1: same order, -1: reversed; ties count as
    neither; 1.0 for fewer than two items)."""
    n = len(a)
    if n != len(b):
        raise InvalidConfigError(f"kendall_tau needs equally long sequences, got {n} and {len(b)}")
    conc = disc = ties_a = ties_b = 0
    for i in range(n):
        for j in range(i + 1, n):
            da, db = a[i] - a[j], b[i] - b[j]
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif (da > 0) == (db > 0):
                conc += 1
            else:
                disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else 1.0


def kendall_tau_resolved(simulated, measured, lo, hi) -> tuple[float, int]:
    """Kendall's tau over the pairs the measurement resolves: pairs whose measured ranges ``[lo, hi]``
    (fastest to slowest repeat) overlap are left out as noise. Returns ``(tau, pairs used)``; tau is 1.0
    when no pair is resolved. Pairs tied in ``simulated`` count as discordant (the simulator did not
    order two plans the measurement tells apart)."""
    n = len(simulated)
    if not n == len(measured) == len(lo) == len(hi):
        raise InvalidConfigError("kendall_tau_resolved needs equally long sequences")
    conc = disc = 0
    for i in range(n):
        for j in range(i + 1, n):
            if lo[i] <= hi[j] and lo[j] <= hi[i]:
                continue
            if (simulated[i] - simulated[j]) * (measured[i] - measured[j]) > 0:
                conc += 1
            else:
                disc += 1
    return ((conc - disc) / (conc + disc) if conc + disc else 1.0), conc + disc
