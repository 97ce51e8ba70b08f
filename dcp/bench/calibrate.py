"""``dcp bench calibrate --device cpu``: fit a cost profile to this machine from timed native calls.

What is timed (each point the median of ``repeats`` calls after a warm-up, one intra-op thread unless
``--threads`` says otherwise, as ``dcp bench run --threads`` runs the executor):

- tiles: the native forward and backward kernels (``dcp.kernels.native``) on n x n tiles, full and
  causal, n in ``tile_sizes``, each call over ``max(tile_sizes) / n`` tiles on the diagonal (the call's
  fixed cost shared, so small tiles show the kernel's own efficiency), timed in two processes at once
  (both cores busy, as in the runs) -> ``attn_fwd_tflops``, ``attn_bwd_tflops``, ``half_rows`` =
  ``half_cols``, ``partial_tile_efficiency`` (``dcp.cost.fit.fit_tiles``); ``efficiency_group`` is
  "q_block" (the native kernel runs a call's tiles segment by segment, not as merged sequences);
- partial tiles: the causal tiles above and other shapes (``time_band_tiles``: bands of 16-256 keys,
  16 sink keys), each relative to the same tiles full -> ``partial_waste_keys`` (the native kernel
  computes whole key sub-blocks: a row costs its attended keys plus about this many);
- merges: the native log-sum-exp merge (``merge_into``) of partial outputs of several sizes ->
  ``hbm_gbps`` (the executor's merges, sums and delta are memory-bound; their fixed cost comes from the
  executor fit below);
- executor fixed costs: tiny plans of every planner run by ``DistributedExecutor`` on two local gloo
  processes; per-rank times regressed on instruction counts -> ``kernel_overhead_us`` (per Compute),
  ``memory_overhead_us`` (per Reduce), ``round_overhead_us`` (per round with transfers),
  ``program_overhead_us`` (per program run);
- links: ``batch_isend_irecv`` ping-pongs between two local gloo processes, message sizes
  ``link_sizes`` -> ``link_latency_us`` and ``nvlink_gbps`` (two processes on one machine = one node of
  two devices, so the intra-node link; ``nic_gbps_per_node`` is set to the same, unused on one node).

Writes ``--out`` (default ``./dcp_profiles/cpu_<machine>.json``: outside the package, so a user's
calibration never replaces the shipped profile of the same name) with the fitted constants, the fit data
(every timed point) and the fits' errors, prints them and how to use the file (``--profile PATH``).
Timing on a busy machine fits the load, not the machine: it refuses when the 1-minute load average is
above half the cores, unless ``--force``.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import statistics
import time
from pathlib import Path

from dcp.bench.common import git_revision, machine
from dcp.cost.fit import TilePoint, fit_affine, fit_partial_waste, fit_tiles
from dcp.errors import InvalidConfigError

PROFILES_DIR = Path(__file__).resolve().parents[1] / "cost" / "profiles"
"""The shipped profiles (``--out-dir`` there regenerates one; users write to ``USER_PROFILES_DIR``)."""
USER_PROFILES_DIR = Path("dcp_profiles")
"""Where calibrations go by default, relative to the working directory."""
MAX_LOAD_PER_CORE = 0.5
"""Above this 1-minute load average per core, calibration refuses (other work would be fitted)."""


EXEC_BATCHES = (((64,) * 8, 16), ((96, 64, 48, 32, 32, 16), 16), ((256, 64), 32))
"""Tiny batches (lengths, dcp block size) whose plans' run time is almost all fixed costs."""


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    tile_sizes: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048)
    merge_rows: tuple[int, ...] = (64, 256, 1024, 4096, 16384)
    link_sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24)
    exec_batches: tuple[tuple[tuple[int, ...], int], ...] = EXEC_BATCHES
    repeats: int = 7
    threads: int = 1
    name: str | None = None

    def __post_init__(self):
        if self.repeats < 1 or self.threads < 1:
            raise InvalidConfigError(f"repeats and threads must be >= 1, got {self.repeats}, {self.threads}")
        if len(self.tile_sizes) < 3 or len(self.merge_rows) < 2 or len(self.link_sizes) < 2 or not self.exec_batches:
            raise InvalidConfigError("calibration needs >= 3 tile sizes, >= 2 merge sizes, >= 2 link sizes and "
                                     "one executor batch")


def machine_slug() -> str:
    """``cpu_<cpu model>_<cores>c`` in lower case, e.g. ``cpu_amd_epyc_2c``."""
    model = machine().split(",")[0]
    slug = re.sub(r"[^a-z0-9]+", "_", model.lower()).strip("_")
    slug = re.sub(r"_(processor|cpu|\d+_core)\b", "", slug)
    return f"cpu_{slug}_{os.cpu_count()}c"


def _median_s(fn, repeats: int, min_s: float = 0.002) -> float:
    """Median seconds of ``fn()``; calls shorter than ``min_s`` are looped and averaged per sample."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    inner = max(1, int(min_s / max(once, 1e-7)))
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def _diagonal_table(n: int, m: int, causal: bool):
    """A table of ``m`` n x n tiles on the diagonal of m*n rows and keys (each q block its own segment),
    full or causal; returns (table, allowed (row, key) pairs)."""
    import numpy as np

    from dcp.kernels import TileTable

    if not causal:
        return TileTable.from_segments([(n, [(i * n, n)]) for i in range(m)]), m * n * n
    t = np.arange(n)
    ranges = np.stack([np.zeros(n), t + 1], 1)[:, None].astype(np.int64)
    return TileTable.from_segments([(n, [(i * n, n, ranges)]) for i in range(m)]), m * n * (n + 1) // 2


def time_tiles(cfg: CalibrateConfig) -> list[TilePoint]:
    """Native forward/backward of n x n tiles, full and causal, for n in ``cfg.tile_sizes``: one call
    over ``max(tile_sizes) // n`` tiles on the diagonal (as the executor's calls hold many tiles), so the
    call's fixed cost is shared and the curve measures the kernel's efficiency on small tiles (the
    executor's fixed costs are fitted separately, ``time_executor``)."""
    import torch

    from dcp.kernels import native

    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(0)
    span = max(cfg.tile_sizes)
    points = []
    for n in cfg.tile_sizes:
        m = max(1, span // n)
        q, do = (torch.randn(m * n, cfg.heads, cfg.head_dim, generator=g).to(dtype) for _ in range(2))
        k, v = (torch.randn(m * n, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype) for _ in range(2))
        for causal in (False, True):
            table, pairs = _diagonal_table(n, m, causal)
            o, lse = native.attention_forward(q, k, v, table)
            delta = (do.float() * o.float()).sum(-1).t().contiguous()
            flops = 4.0 * pairs * cfg.heads * cfg.head_dim
            t_f = _median_s(lambda: native.attention_forward(q, k, v, table), cfg.repeats)
            t_b = _median_s(lambda: native.attention_backward(do, q, k, v, lse, delta, table), cfg.repeats)
            points.append(TilePoint(n, n, flops, not causal, "forward", t_f))
            points.append(TilePoint(n, n, 2.5 * flops, not causal, "backward", t_b))
    return points


def _tiles_rank(rank: int, world: int, port: int, cfg: CalibrateConfig, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    points = [dataclasses.asdict(p) for p in time_tiles(cfg)]
    gathered = [None] * world
    dist.all_gather_object(gathered, points)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def time_tiles_two(cfg: CalibrateConfig) -> list[TilePoint]:
    """``time_tiles`` in two processes at once (as ``dcp bench run --nproc 2`` runs: both cores busy, the
    memory system shared); each point's time is the mean of the two processes' medians."""
    both = _spawn_two(_tiles_rank, (cfg,), "tiles.json")
    return [TilePoint(**{**a, "seconds": (a["seconds"] + b["seconds"]) / 2}) for a, b in zip(*both)]


BAND_SHAPES = (("band", 256), ("band", 64), ("band", 16), ("sink", 16))
"""Partial tiles of other shapes than the causal triangle (``band``: each row sees the w keys up to
itself; ``sink``: each row sees the first w keys only)."""


def time_band_tiles(cfg: CalibrateConfig, n: int = 512) -> list[dict]:
    """Per shape of ``BAND_SHAPES``: forward time of 4 n x n diagonal tiles of that mask relative to
    the same tiles full, timed back to back in this process, and the attended fraction of pairs (a kernel
    that computes whole key sub-blocks pays far more than that fraction for narrow shapes)."""
    import numpy as np
    import torch

    from dcp.kernels import TileTable, native

    dtype = getattr(torch, cfg.dtype)
    g = torch.Generator().manual_seed(1)
    m = 4
    q = torch.randn(m * n, cfg.heads, cfg.head_dim, generator=g).to(dtype)
    k, v = (torch.randn(m * n, cfg.kv_heads, cfg.head_dim, generator=g).to(dtype) for _ in range(2))
    full, _ = _diagonal_table(n, m, False)
    t = np.arange(n)
    out = []
    for shape, w in BAND_SHAPES:
        lo = np.maximum(t + 1 - w, 0) if shape == "band" else np.zeros(n)
        hi = t + 1 if shape == "band" else np.full(n, min(w, n))
        ranges = np.stack([lo, hi], 1)[:, None].astype(np.int64)
        table = TileTable.from_segments([(n, [(i * n, n, ranges)]) for i in range(m)])
        t_full = _median_s(lambda: native.attention_forward(q, k, v, full), cfg.repeats)
        t_part = _median_s(lambda: native.attention_forward(q, k, v, table), cfg.repeats)
        out.append(dict(shape=shape, width=w, rows=n, allowed_fraction=float((hi - lo).sum() / (n * n)),
                        time_vs_full=t_part / t_full))
    return out


def time_merges(cfg: CalibrateConfig) -> list[tuple[int, float]]:
    """(bytes, seconds) of the native merge of one partial output into an accumulator, as the simulator
    counts a merge's bytes: (2 + sources) units of o + lse."""
    import torch

    from dcp.kernels import native
    from dcp.layout.units import LSE_BYTES

    dtype = getattr(torch, cfg.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for rows in cfg.merge_rows:
        o_acc, o_new = (torch.randn(rows, cfg.heads, cfg.head_dim).to(dtype) for _ in range(2))
        lse_acc, lse_new = torch.randn(cfg.heads, rows), torch.randn(cfg.heads, rows)
        secs = _median_s(lambda: native.merge_into(o_acc, lse_acc, o_new, lse_new), cfg.repeats)
        out.append((3 * rows * cfg.heads * (cfg.head_dim * elem + LSE_BYTES), secs))
    return out


def _link_rank(rank: int, world: int, port: int, sizes: tuple[int, ...], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    peer = 1 - rank
    result = []
    for size in sizes:
        send, recv = torch.zeros(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)

        def ping():  # rank 0 -> 1, then 1 -> 0: one round trip, as the executor posts a round
            for src in (0, 1):
                op = dist.P2POp(dist.isend, send, peer) if rank == src else dist.P2POp(dist.irecv, recv, peer)
                for w in dist.batch_isend_irecv([op]):
                    w.wait()

        for _ in range(2):
            ping()
        dist.barrier()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ping()
            times.append((time.perf_counter() - t0) / 2)
        result.append((size, statistics.median(times)))
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def time_links(cfg: CalibrateConfig) -> list[tuple[int, float]]:
    """(bytes, one-way seconds) between two local gloo processes (half a ping-pong's round trip)."""
    return [tuple(x) for x in _spawn_two(_link_rank, (cfg.link_sizes, cfg.repeats), "links.json")]




def program_counts(plan, direction: str, device: int) -> tuple[int, int, int]:
    """(Compute instructions with tiles, Reduce instructions, rounds with transfers) of one program."""
    from dcp.ir.instructions import CommLaunch, Compute, Reduce

    ins = plan.program(direction)[device].instructions
    return (sum(isinstance(i, Compute) and len(i.tiles) > 0 for i in ins), sum(isinstance(i, Reduce) for i in ins),
            sum(isinstance(i, CommLaunch) and bool(i.sends or i.recvs) for i in ins))


#: the plans whose instruction counts and times fit the executor's fixed costs (the shipped profile's set;
#: every planner runs on the same executor, so more of them add rows, not information)
CALIBRATION_PLANNERS = ("dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp")


def _exec_rank(rank: int, world: int, port: int, batches, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import dcp
    from dcp.bench.common import DcpOptions
    from dcp.bench.run import PlanRun, RunBatch, RunConfig, _planner, time_plans

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    result = []
    for lengths, block in batches:
        cfg = RunConfig(batches=(RunBatch(lengths),), heads=1, kv_heads=1, head_dim=16, dtype="float32",
                        profile="a100", warmup=2, repeats=repeats, dcp=DcpOptions(partitioner="greedy", block_size=block))
        spec = dcp.BatchSpec(list(lengths), "causal", 1, 1, 16, dtype="float32")
        plans = [dcp.broadcast_plan(_planner(n, cfg).plan(spec, dcp.Cluster(1, world)) if rank == 0 else None)
                 for n in CALIBRATION_PLANNERS]
        runs = [PlanRun(p, rank, torch.device("cpu"), 0) for p in plans]
        for plan, times in zip(plans, time_plans(runs, world, torch.device("cpu"), cfg)):
            for direction, per_rank in times.items():
                for d in range(world):
                    result.append(dict(direction=direction, counts=program_counts(plan, direction, d),
                                       seconds=statistics.median(per_rank[d])))
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def time_executor(cfg: CalibrateConfig) -> list[dict]:
    """Per (tiny plan, direction, rank): instruction counts and the median seconds of the program run by
    ``DistributedExecutor`` on two local gloo processes (compute and bytes are negligible at these sizes)."""
    return _spawn_two(_exec_rank, (cfg.exec_batches, cfg.repeats), "exec.json")


def fit_executor(points: list[dict]) -> dict[str, float]:
    """Least squares (relative error) of ``seconds = program + compute * n_compute + reduce * n_reduce +
    round * n_rounds``; returns the four constants in seconds (negative ones clipped to 0 and refitted)."""
    import numpy as np

    x = np.array([[1.0, *p["counts"]] for p in points])
    t = np.array([p["seconds"] for p in points])
    active = np.ones(4, dtype=bool)
    for _ in range(4):
        coef = np.zeros(4)
        sol, *_ = np.linalg.lstsq(x[:, active] / t[:, None], np.ones_like(t), rcond=None)
        coef[active] = sol
        if (coef >= 0).all():
            break
        active &= coef > 0
    rel = np.abs(x @ coef / t - 1)
    return dict(program_s=float(coef[0]), compute_s=float(coef[1]), reduce_s=float(coef[2]), round_s=float(coef[3]),
                median_rel_err=float(np.median(rel)), worst_rel_err=float(rel.max()))


def _spawn_two(fn, args: tuple, name: str):
    """``fn`` in two local processes (``dcp.bench.run.spawn_local``); the JSON they wrote."""
    from dcp.bench.run import spawn_local

    return spawn_local(fn, 2, args, name)


def calibrate(cfg: CalibrateConfig) -> dict:
    """Time, fit, and return the profile document (constants, ``sources``, ``fit``)."""
    import torch

    torch.set_num_threads(cfg.threads)
    load_before = os.getloadavg()[0]
    tiles = time_tiles_two(cfg)
    bands = time_band_tiles(cfg)
    merges = time_merges(cfg)
    links = time_links(cfg)
    execs = time_executor(cfg)
    tf = fit_tiles(tiles, overhead_s=0.0)  # per-call costs: the executor fit below
    # partial tiles: the causal n x n ones (vs full ones of the same size and direction) and the bands
    full_t = {(p.q_len, p.direction): p for p in tiles if p.full}
    shapes = [(p.q_len, p.flops / full_t[p.q_len, p.direction].flops, p.seconds / full_t[p.q_len, p.direction].seconds)
              for p in tiles if not p.full]
    shapes += [(b["rows"], b["allowed_fraction"], b["time_vs_full"]) for b in bands]
    waste, waste_med, waste_worst = fit_partial_waste(shapes)
    for b in bands:
        b["model_vs_full"] = round(min(b["allowed_fraction"] + waste / b["rows"], 1.0), 4)
    ef = fit_executor(execs)
    mf = fit_affine([b for b, _ in merges], [s for _, s in merges])
    lf = fit_affine([b for b, _ in links], [s for _, s in links])
    name = cfg.name or machine_slug()
    how = f"fitted by `dcp bench calibrate --device cpu` on {machine()}"
    doc = dict(
        name=name, peak_tflops=tf.fwd_rate / 1e12, attn_fwd_tflops=tf.fwd_rate / 1e12,
        attn_bwd_tflops=tf.bwd_rate / 1e12, half_rows=tf.half, half_cols=tf.half,
        partial_tile_efficiency=tf.partial_efficiency, partial_waste_keys=waste,
        kernel_overhead_us=ef["compute_s"] * 1e6,
        hbm_gbps=mf.bytes_per_s / 1e9, memory_overhead_us=ef["reduce_s"] * 1e6,
        round_overhead_us=ef["round_s"] * 1e6, program_overhead_us=ef["program_s"] * 1e6,
        efficiency_group="q_block",
        nvlink_gbps=lf.bytes_per_s / 1e9, nic_gbps_per_node=lf.bytes_per_s / 1e9,
        link_latency_us=lf.intercept_s * 1e6,
        sources={
            "peak_tflops": "= attn_fwd_tflops (no separate matmul ceiling is fitted on the CPU)",
            "attn_fwd_tflops": f"{how}: native forward on n x n tiles, full and causal",
            "attn_bwd_tflops": f"{how}: native backward on the same tiles",
            "half_rows": f"{how}: the tile size at half the large-tile rate", "half_cols": "= half_rows",
            "partial_tile_efficiency": f"{how}: causal tiles' rate relative to full ones (used only where the "
                                       "attended pairs are unknown: per-tile estimates)",
            "partial_waste_keys": f"{how}: causal n x n tiles (n = 32..2048) and 512-row band / sink tiles timed "
                                  "against the same tiles full: each row costs its keys plus this many",
            "kernel_overhead_us": f"{how}: the executor's fixed cost per Compute instruction (tiny plans run by "
                                  "DistributedExecutor on 2 gloo processes, least squares over instruction counts)",
            "hbm_gbps": f"{how}: native LSE merge (bytes as the simulator counts them)",
            "memory_overhead_us": f"{how}: the executor's fixed cost per Reduce instruction (same fit)",
            "round_overhead_us": f"{how}: the executor's fixed cost per round with transfers: packing, posting, "
                                 "unpacking (same fit)",
            "program_overhead_us": f"{how}: the executor's fixed cost per program run (same fit)",
            "efficiency_group": "the native CPU kernel walks a call's tile table q block by q block: a block's "
                                "efficiency follows its own rows and the keys of its tiles, not its sequence's",
            "nvlink_gbps": f"{how}: batch_isend_irecv ping-pong between two local gloo processes",
            "nic_gbps_per_node": "= nvlink_gbps (the two processes are one node; unused)",
            "link_latency_us": f"{how}: the ping-pong's fixed cost per message"},
        fit=dict(machine=machine(), revision=git_revision(), torch=torch.__version__, threads=cfg.threads,
                 heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype,
                 load_before=round(load_before, 2), load_after=round(os.getloadavg()[0], 2),
                 tiles=[dataclasses.asdict(p) for p in tiles],
                 tile_fit_rel_error=dict(median=round(tf.median_rel_err, 4), worst=round(tf.worst_rel_err, 4)),
                 partial_shapes=bands, partial_waste_fit_rel_error=dict(median=round(waste_med, 4),
                                                                        worst=round(waste_worst, 4)),
                 executor=execs, executor_fit_rel_error=dict(median=round(ef["median_rel_err"], 4),
                                                             worst=round(ef["worst_rel_err"], 4)),
                 merges=[dict(bytes=b, seconds=s) for b, s in merges],
                 merge_fit_rel_error=dict(median=round(mf.median_rel_err, 4), worst=round(mf.worst_rel_err, 4)),
                 links=[dict(bytes=b, seconds=s) for b, s in links],
                 link_fit_rel_error=dict(median=round(lf.median_rel_err, 4), worst=round(lf.worst_rel_err, 4))))
    return doc


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit a cost profile to this machine (CPU: native kernels, gloo links)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tile-sizes", default=",".join(map(str, CalibrateConfig.tile_sizes)))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (as dcp bench run --threads)")
    p.add_argument("--name", default=None, help="profile name (default cpu_<machine>)")
    p.add_argument("--out", default=None, metavar="PATH.json",
                   help="where the profile goes (default: --out-dir/<name>.json)")
    p.add_argument("--out-dir", default=str(USER_PROFILES_DIR),
                   help="folder for <name>.json when --out is not given (dcp/cost/profiles regenerates the shipped "
                        "profile)")
    p.add_argument("--force", action="store_true",
                   help=f"calibrate even when the 1-minute load average is above {MAX_LOAD_PER_CORE:g} x the cores")
    p.set_defaults(func=cmd_calibrate)


def check_load(force: bool) -> float:
    """The 1-minute load average; refuses (``InvalidConfigError``) above ``MAX_LOAD_PER_CORE`` x the cores
    unless ``force``: other processes' work would be fitted as this machine's speed."""
    from dcp.bench.args import plural, usable_cores

    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this OS: nothing to check
        return float("nan")
    cores = usable_cores()
    if load > MAX_LOAD_PER_CORE * cores and not force:
        raise InvalidConfigError(
            f"the machine is busy: 1-minute load average {load:.2f} on {plural(cores, 'core')} (above "
            f"{MAX_LOAD_PER_CORE:g} x cores = {MAX_LOAD_PER_CORE * cores:g}); a calibration now would fit the other "
            f"processes' load, not this machine. Wait until `uptime` shows a lower load, or pass --force")
    return load


def cmd_calibrate(args) -> int:
    if args.device != "cpu":
        raise InvalidConfigError("dcp bench calibrate --device cuda: run `python benchmarks/bench_gpu.py` on the "
                                 "GPU machine (it fits the GPU profile from the varlen tile kernels)")
    cfg = CalibrateConfig(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                          tile_sizes=tuple(int(x) for x in args.tile_sizes.split(",")), repeats=args.repeats,
                          threads=args.threads, name=args.name)
    check_load(args.force)
    doc = calibrate(cfg)
    out = Path(args.out) if args.out else Path(args.out_dir) / f"{doc['name']}.json"
    if out.suffix != ".json":  # --profile takes a path only when it ends in .json
        out = out.with_name(out.name + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    keys = [k for k in doc if k not in ("sources", "fit", "name")]
    for k in keys:
        print(f"{k:<26} {doc[k]:.6g}" if isinstance(doc[k], float) else f"{k:<26} {doc[k]}")
    for b in doc["fit"]["partial_shapes"]:
        print(f"partial tile {b['shape']:>6} w={b['width']:<4} allowed {b['allowed_fraction']:.3f}: measured "
              f"{b['time_vs_full']:.3f} x the full tile, model {b['model_vs_full']:.3f}")
    print(f"fit errors: tiles {doc['fit']['tile_fit_rel_error']}, merges {doc['fit']['merge_fit_rel_error']}, "
          f"links {doc['fit']['link_fit_rel_error']}; load {doc['fit']['load_before']} -> {doc['fit']['load_after']}")
    print(f"wrote {out}\nuse it with --profile {out} (e.g. dcp bench run --nproc 2 --profile {out}, "
          f"dcp plan --profile {out})")
    return 0
