"""Shared pieces of the simulated benchmarks: result rows, CSV writing, progress, plan caching.

Every number these benchmarks write is *simulated* (``dcp.sim`` driven by a ``dcp.cost`` profile) except
planning times, which are measured wall-clock seconds on the machine named in each row. Rows carry
``simulated=True``, the profile name and ``machine``.

``dcp`` must not import the repository's ``benchmarks`` package (dependencies point one way), so the
machine description below mirrors ``benchmarks/common.py``'s ``machine()`` (same format).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Iterable, Iterator

from dcp.cluster import Cluster
from dcp.ir.plan import Plan
from dcp.planner.search import AutoPlanner
from dcp.schedule.assemble import Planner
from dcp.spec import BatchSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "benchmarks" / "results"
"""The repository's committed results (written only when a command is given ``--out-dir`` there)."""
DEFAULT_OUT = Path("dcp-bench-results")
"""Where ``dcp bench`` writes unless told otherwise (relative to the working directory), so that running a
benchmark never overwrites the committed results."""

BASELINE_NAMES = ("ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_cp", "megatron_dyncp", "torch_cp", "ulysses",
                  "magi", "magi_dynamic")
"""Every static baseline; "best baseline" in the summaries means the fastest of these."""

PAPER_BASELINE_NAMES = ("ring", "zigzag", "te_a2a_p2p", "loongtrain")
"""The baselines of the DCP paper's micro-benchmarks (Megatron dynamic CP postdates the paper)."""

DCP_NAMES = ("dcp", "dcp_auto")


def machine() -> str:
    """A short description of this machine (CPU model, cores, memory); same format as
    ``benchmarks.common.machine``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages / 2**30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        pass
    return f"{cpu}, {os.cpu_count()} cores{mem}"


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                       stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_csv(path: Path | str, rows: list[dict]) -> Path:
    """Write ``rows`` (union of their keys, first-seen order) to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return path


def read_csv(path: Path | str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def parse_list(text: str, kind=str) -> tuple:
    """``"a,b"`` -> ``("a", "b")`` converted by ``kind``."""
    return tuple(kind(x.strip()) for x in str(text).split(",") if x.strip())


def progress(items: Iterable, total: int | None = None, desc: str = "") -> Iterator:
    """``tqdm`` over ``items`` when it is installed, else one plain line per item on stderr."""
    items = list(items)
    total = len(items) if total is None else total
    try:
        from tqdm import tqdm  # optional ([bench] extra)
    except ImportError:
        tqdm = None
    if tqdm is not None and sys.stderr.isatty():
        yield from tqdm(items, total=total, desc=desc, dynamic_ncols=True)
        return
    started = time.perf_counter()
    for i, item in enumerate(items):
        elapsed = time.perf_counter() - started
        eta = f"{elapsed / i * (total - i):.0f} s" if i else "?"
        print(f"[{desc} {i + 1}/{total}] {label_of(item)}  elapsed {elapsed:.0f} s, eta {eta}",
              file=sys.stderr, flush=True)
        yield item
    print(f"[{desc}] done: {total} items in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def label_of(item) -> str:
    if isinstance(item, tuple):
        return " ".join(str(x) for x in item if not isinstance(x, (BatchSpec, Planner, dict, list)))
    return str(item)


def plan_quietly(planner: Planner, spec: BatchSpec, cluster: Cluster) -> tuple[Plan, list[str]]:
    """Plan, collecting warnings (e.g. a partitioner fallback) instead of printing them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = planner.plan(spec, cluster)
    return plan, sorted({str(w.message) for w in caught})


def sim_fields(fwd, bwd) -> dict:
    """CSV fields of a simulated forward/backward pair (milliseconds)."""
    return dict(fwd_ms=round(fwd.makespan_s * 1e3, 5), bwd_ms=round(bwd.makespan_s * 1e3, 5),
                ideal_fwd_ms=round(fwd.ideal_s * 1e3, 5), ideal_bwd_ms=round(bwd.ideal_s * 1e3, 5),
                fwd_efficiency=round(fwd.efficiency, 4), bwd_efficiency=round(bwd.efficiency, 4))


def stat_fields(plan: Plan) -> dict:
    """CSV fields of ``plan.stats()`` (communication bytes, balance, tiles)."""
    s = plan.stats()
    return dict(n_tiles=s.n_tiles, n_token_blocks=s.n_token_blocks, comm_bytes_total=s.comm_bytes_total,
                comm_bytes_inter_node=s.comm_bytes_inter_node, comm_bytes_forward=s.comm_bytes_forward,
                comm_bytes_backward=s.comm_bytes_backward, max_device_comm_bytes=s.max_device_comm_bytes,
                compute_imbalance=round(s.compute_imbalance, 4), memory_imbalance=round(s.memory_imbalance, 4),
                max_resident_tokens=s.max_resident_tokens,
                peak_buffer_fwd_MiB=round(s.peak_transient_bytes_forward / 2**20, 3),
                peak_buffer_bwd_MiB=round(s.peak_transient_bytes_backward / 2**20, 3),
                idle_devices=s.idle_devices, valid=s.valid)


class _CachedPlanner(Planner):
    """Serves a candidate's plan from ``cache`` (keyed by label and the batch object) so that two
    ``AutoPlanner`` runs on the same batch and profile plan each candidate once. ``saved_s`` adds up the
    planning time the cache saved, so reported planning times stay end-to-end."""

    def __init__(self, label: str, inner: Planner, cache: dict, ledger: dict):
        self.label, self.inner, self.cache, self.ledger = label, inner, cache, ledger
        self.name = inner.name

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        key = (self.label, id(spec), id(cluster))
        hit = self.cache.get(key)
        if hit is not None:
            self.ledger["saved_s"] = self.ledger.get("saved_s", 0.0) + hit.planning_time_s
            return hit
        plan = self.inner.plan(spec, cluster)
        self.cache[key] = plan
        return plan


@dataclasses.dataclass(frozen=True)
class CachedAutoPlanner(AutoPlanner):
    """``AutoPlanner`` whose candidate plans come from (and go to) a shared cache.

    Exactly ``AutoPlanner``'s choice (same candidates, same simulation, same rule); only repeated
    planning of one candidate on one batch is avoided. ``ledger["saved_s"]`` holds the seconds saved.
    """

    cache: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)
    ledger: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    def candidates(self):
        return [(label, _CachedPlanner(label, p, self.cache, self.ledger)) for label, p in super().candidates()]


def auto_fields(plan: Plan, saved_s: float) -> dict:
    """CSV fields of an ``AutoPlanner`` result: chosen candidate, its block size, every candidate's
    simulated times (JSON), and the end-to-end planning time (wall time + time served from cache)."""
    chosen = plan.meta["chosen"]
    cands = {k: (None if v is None else {"fwd_ms": round(v["forward_s"] * 1e3, 5),
                                         "bwd_ms": round(v["backward_s"] * 1e3, 5)})
             for k, v in plan.meta["candidates"].items()}
    block = int(chosen.split("@B", 1)[1]) if chosen.startswith("dcp@B") else ""
    return dict(chosen=chosen, block_size=block, planning_time_s=round(plan.planning_time_s + saved_s, 4),
                candidates=json.dumps(cands, sort_keys=True))


def mean(xs) -> float:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else float("nan")


def fmt_table(rows: list[dict], columns: list[str]) -> str:
    """A plain text table (right-aligned) of ``columns`` of ``rows``."""
    def f(v):
        if isinstance(v, float):
            return f"{v:.3f}"
        return str(v)
    cells = [columns] + [[f(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(x.rjust(w) for x, w in zip(row, widths)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


PAPER_EPSILON_INTER = 0.4
PAPER_EPSILON_INTRA = 0.1
"""The paper's compute imbalance tolerances (across nodes, inside a node), used where a benchmark studies
the paper's bytes objective (``dcp bench dryrun``, ``benchmarks/bench_bytes.py``)."""


@dataclasses.dataclass(frozen=True)
class DcpOptions:
    """Overrides of dcp's ``PlannerConfig`` for a benchmark run; ``None`` keeps the planner's default, so a
    plain run measures ``dcp.plan`` exactly as a user gets it (only the cost model follows the profile
    being simulated, as a user would configure it for their hardware)."""

    partitioner: str | None = None
    epsilon_inter: float | None = None
    epsilon_intra: float | None = None
    objective: str | None = None
    block_size: int | None = None
    epsilon_memory: float | None = None

    def changed(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def dcp_config(profile: str, options: DcpOptions = DcpOptions(), cost=None, **search_changes):
    """The ``PlannerConfig`` a benchmark gives dcp: the defaults, the profile's cost model (or ``cost``),
    the options' overrides and ``search_changes`` (fields of ``SearchConfig``)."""
    from dcp.config import PlannerConfig, SearchConfig
    from dcp.cost import CostModel
    from dcp.partition import named_partitioner

    kw = {}
    if options.partitioner is not None:
        kw["partitioner"] = named_partitioner(options.partitioner)
    for name in ("epsilon_inter", "epsilon_intra", "block_size", "epsilon_memory"):
        if getattr(options, name) is not None:
            kw[name] = getattr(options, name)
    search = dict(search_changes)
    if options.objective is not None:
        search["objective"] = options.objective
    return PlannerConfig(cost_model=cost or CostModel.named(profile), search=SearchConfig(**search), **kw)


def config_fields(config) -> dict:
    """CSV fields naming the dcp configuration a row used (the effective values)."""
    part = config.partitioner
    return dict(dcp_partitioner=f"{part.name}:{getattr(part, 'preset', '')}".rstrip(":"),
                dcp_objective=config.search.objective, dcp_block_size=config.block_size,
                dcp_epsilon_inter=config.epsilon_inter, dcp_epsilon_intra=config.epsilon_intra,
                dcp_epsilon_memory=config.epsilon_memory)


def add_dcp_args(p) -> None:
    """Flags overriding dcp's configuration (shared by the bench subcommands); unset flags keep
    ``PlannerConfig``'s defaults."""
    from dcp.config import OBJECTIVES
    from dcp.partition import PARTITIONER_NAMES

    g = p.add_argument_group("dcp's configuration (default: dcp.plan's own)")
    from dcp.bench.args import partitioner_help

    g.add_argument("--partitioner", default=None, choices=PARTITIONER_NAMES, help=partitioner_help())
    g.add_argument("--epsilon-inter", type=float, default=None, help="hypergraph tolerance across nodes")
    g.add_argument("--epsilon-intra", type=float, default=None, help="hypergraph tolerance inside a node")
    g.add_argument("--objective", default=None, choices=OBJECTIVES, help="search objective (default: time)")
    g.add_argument("--block-size", type=int, default=None, help="dcp's token block size (default 1024)")
    g.add_argument("--epsilon-memory", type=float, default=None,
                   help="dcp's memory budget: resident tokens per device <= (1 + this) x mean (default 0.1)")


def options_from_args(args) -> DcpOptions:
    return DcpOptions(partitioner=args.partitioner, epsilon_inter=args.epsilon_inter,
                      epsilon_intra=args.epsilon_intra, objective=args.objective, block_size=args.block_size,
                      epsilon_memory=args.epsilon_memory)


def e2e_cost_model(profile: str, gpus_per_node: int, physical_gpus_per_node: int):
    """The profile with its NIC scaled so that one simulated device gets 1/physical_gpus_per_node of it."""
    from dcp.cost import CostModel

    cm = CostModel.named(profile)
    p = cm.profile
    scaled = dataclasses.replace(p, nic_gbps_per_node=p.nic_gbps_per_node * gpus_per_node / physical_gpus_per_node)
    return CostModel(scaled)


@dataclasses.dataclass(frozen=True)
class E2ESetting:
    """What every end-to-end simulation shares (``dcp.bench.e2e``, ``dcp.bench.e2e_layers``): the data-parallel
    group as ``Cluster(nodes, gpus_per_node)`` of TP groups (``physical_gpus_per_node`` GPUs share a node's
    NIC, ``e2e_cost_model``), the cost profile, the non-attention layers' MFU, the batch seed, dcp's options
    and whether (and how deep) the baselines are tuned."""

    nodes: int = 8
    gpus_per_node: int = 2
    physical_gpus_per_node: int = 8
    profile: str = "a100"
    mfu: float = 0.6
    seed: int = 0
    dcp: DcpOptions = DcpOptions()
    tuned: bool = True
    tune_top: int = 2
