"""A randomized plan-quality sweep: dcp against every static baseline on drawn batches, through the simulator.

``draw_case(rng) -> SweepCase`` draws one batch and cluster; ``run_case(case, planners) -> rows`` plans it
with dcp and the baselines, simulates every plan (forward and backward) with the case's profile and
returns one row per planner; ``summarize(rows)`` aggregates per (devices, profile). The command line is
``benchmarks/bench_sweep.py``; ``tests/test_sweep.py`` runs a small fixed-seed slice and asserts dcp's
invariants on it.

How a case is drawn (every choice uniform unless said otherwise):

- devices from ``DEVICES`` (2, 4, 8, 32, 64, 1024); 2 and 4 devices are one node, 8 devices one node of
  8 or two nodes of 4, more devices nodes of 8 GPUs;
- the cost-model profile from ``PROFILES``; dcp plans with that profile's cost model
  (``PlannerConfig(cost_model=...)``) and every plan of the case is simulated with it;
- total tokens T log-uniform in [devices x 256, min(devices x 16,384, ``max_tokens``)]: every device has
  work (at least 256 tokens on average) and at most 16K tokens on average; ``max_tokens`` (default
  2,097,152) keeps a 1,024-device case plannable and simulable in minutes on a CPU;
- 1-64 sequences (clipped so that every length fits [64, 1,048,576]); lengths are drawn log-uniform in
  [64, 1M], then scaled by one common factor (each clipped to [64, 1M]) so that they sum to exactly T:
  a few long and many short sequences, as in long-context training data;
- per sequence a mask family from ``MASK_FAMILIES`` with parameters drawn relative to its length
  (``draw_mask``);
- heads / KV heads / head dim / dtype from ``HEAD_CONFIGS``;
- dcp's block size: ``PlannerConfig``'s default (1024), or when the batch has fewer tokens per device
  than that, the largest power of two <= T / devices (at least 64).

Every time here is *simulated* (``dcp.sim``) except planning times (measured wall-clock seconds on the
machine in each row's ``machine`` column); rows carry ``simulated=True``.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from dcp.bench.common import BASELINE_NAMES, git_revision, machine, plan_quietly
from dcp.planner.budget import MemoryBudget

DEVICES = (2, 4, 8, 32, 64, 1024)
PROFILES = ("a100", "h100", "cpu_amd_epyc_2c")
MASK_FAMILIES = ("causal", "full", "sliding_window", "lambda", "shared_question", "causal_blockwise", "modality",
                 "prefix_lm", "document")
HEAD_CONFIGS = ((8, 2, 128, "bfloat16"), (32, 8, 128, "bfloat16"), (4, 2, 64, "float32"), (16, 16, 64, "float16"))
"""(query heads, KV heads, head dim, dtype)."""
MIN_LEN, MAX_LEN = 64, 1 << 20
MIN_TOKENS_PER_DEVICE, MAX_TOKENS_PER_DEVICE = 256, 16384
MAX_TOKENS = 1 << 21
MAX_SEQS = 64
DEFAULT_BLOCK = 1024
PLANNERS = ("dcp", *BASELINE_NAMES)
WARM_START_SLACK = 0.02
"""dcp considered a baseline's placement (``search_warm_starts``), so its simulated forward + backward
should not exceed that baseline's; 2 % is allowed because dcp chooses by its estimate
(``dcp.cost.estimate``) while the rows are scored by the full simulator, and the two differ slightly."""
MEMORY_WARNING = "memory budget"
"""What the RuntimeWarning says when dcp could not keep resident tokens within its memory tolerance."""


@dataclasses.dataclass(frozen=True)
class SweepCase:
    """One drawn batch on one cluster, with the profile that plans and simulates it."""

    case_id: int
    seed: int
    nodes: int
    gpus_per_node: int
    profile: str
    seqlens: tuple[int, ...]
    masks: tuple  # one dcp.masks.Mask per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    def spec(self):
        from dcp.spec import BatchSpec

        return BatchSpec(self.seqlens, self.masks, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype)

    def cluster(self):
        from dcp.cluster import Cluster

        return Cluster(self.nodes, self.gpus_per_node)

    def masks_summary(self) -> str:
        """Mask families and how many sequences use each, e.g. ``causal:3;lambda:1`` (most used first)."""
        counts = Counter(m.name for m in self.masks)
        return ";".join(f"{k}:{v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

    def label(self) -> str:
        return (f"case {self.case_id}: {self.devices} devices ({self.nodes}x{self.gpus_per_node}), {self.profile}, "
                f"{len(self.seqlens)} seqs, {self.total_tokens:,} tokens (max {max(self.seqlens):,}), "
                f"{self.num_heads}/{self.num_kv_heads}/{self.head_dim} {self.dtype}, B={self.block_size}")

    def fields(self) -> dict:
        """The CSV fields describing the case (shared by its rows)."""
        return dict(case_id=self.case_id, seed=self.seed, devices=self.devices, nodes=self.nodes,
                    gpus_per_node=self.gpus_per_node, profile=self.profile, n_seqs=len(self.seqlens),
                    total_tokens=self.total_tokens, max_seqlen=max(self.seqlens), masks=self.masks_summary(),
                    heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                    block_size=self.block_size)


def case_rng(seed: int, case_id: int) -> np.random.Generator:
    """The generator of case ``case_id`` of a sweep with ``seed``: each case can be redrawn on its own."""
    return np.random.default_rng([int(seed), int(case_id)])


def draw_cases(n: int, seed: int = 0, **bounds) -> list[SweepCase]:
    """Cases 0 .. n-1 of the sweep with ``seed`` (``bounds``: ``draw_case``'s keyword arguments)."""
    return [draw_case(case_rng(seed, i), case_id=i, seed=seed, **bounds) for i in range(n)]


def log_uniform(rng: np.random.Generator, lo: float, hi: float, size=None):
    return np.exp(rng.uniform(math.log(lo), math.log(hi), size))


def node_shape(rng: np.random.Generator, devices: int) -> tuple[int, int]:
    """(nodes, GPUs per node): <= 4 devices one node; 8 one node of 8 or two of 4; more, nodes of 8."""
    if devices <= 4:
        return 1, devices
    if devices == 8:
        return ((1, 8), (2, 4))[int(rng.integers(2))]
    if devices % 8:
        raise ValueError(f"{devices} devices: more than 8 must be a multiple of 8")
    return devices // 8, 8


def block_size_for(total_tokens: int, devices: int) -> int:
    """dcp's block size: the default, or below it a power of two <= tokens per device (at least 64)."""
    per_device = total_tokens // devices
    if per_device >= DEFAULT_BLOCK:
        return DEFAULT_BLOCK
    return max(MIN_LEN, 1 << (max(per_device, 1).bit_length() - 1))


def lengths_summing_to(rng: np.random.Generator, n: int, total: int) -> tuple[int, ...]:
    """``n`` lengths in [MIN_LEN, MAX_LEN] summing to ``total``: log-uniform draws scaled by one factor."""
    if not n * MIN_LEN <= total <= n * MAX_LEN:
        raise ValueError(f"{n} sequences cannot hold {total} tokens within [{MIN_LEN}, {MAX_LEN}] each")
    raw = log_uniform(rng, MIN_LEN, MAX_LEN, n)
    fill = lambda s: np.clip(raw * math.exp(s), MIN_LEN, MAX_LEN)  # noqa: E731
    lo, hi = math.log(MIN_LEN / raw.max()) - 1, math.log(MAX_LEN / raw.min()) + 1
    for _ in range(100):  # sum(fill(s)) grows with s: bisect for the factor reaching ``total``
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fill(mid).sum() < total else (lo, mid)
    lens = np.floor(fill(hi)).astype(np.int64)
    lens = np.clip(lens, MIN_LEN, MAX_LEN)
    rest = total - int(lens.sum())
    for i in np.argsort(lens, kind="stable") if rest > 0 else np.argsort(-lens, kind="stable"):
        step = min(rest, MAX_LEN - lens[i]) if rest > 0 else max(rest, MIN_LEN - lens[i])
        lens[i] += step
        rest -= step
        if rest == 0:
            break
    order = rng.permutation(n)  # packing order is not sorted by length
    return tuple(int(x) for x in lens[order])


def draw_mask(rng: np.random.Generator, seqlen: int, family: str | None = None):
    """A mask of ``family`` (drawn from ``MASK_FAMILIES`` when None), parameters relative to ``seqlen``."""
    from dcp import masks as M

    family = family or MASK_FAMILIES[int(rng.integers(len(MASK_FAMILIES)))]
    span = lambda lo, hi: max(1, int(log_uniform(rng, max(1, min(lo, hi)), max(1, hi))))  # noqa: E731
    if family == "causal":
        return M.CausalMask()
    if family == "full":
        return M.FullMask()
    if family == "sliding_window":
        return M.SlidingWindowMask(span(16, seqlen))
    if family == "lambda":
        return M.LambdaMask(sink=int(rng.choice((0, 4, 64))), window=span(16, seqlen))
    if family == "shared_question":
        return M.SharedQuestionMask(float(rng.uniform(0.05, 0.5)), int(rng.integers(1, 9)))
    if family == "causal_blockwise":
        return M.CausalBlockwiseMask(span(16, max(16, seqlen // 4)), int(rng.integers(0, 5)))
    if family == "modality":
        return M.ModalityMask(span(16, max(16, seqlen // 2)), span(16, max(16, seqlen // 2)))
    if family == "prefix_lm":
        return M.PrefixLMMask(float(rng.uniform(0.05, 0.95)))
    if family == "document":
        k = min(int(rng.integers(2, 9)), seqlen)
        cuts = np.sort(rng.choice(np.arange(1, seqlen), size=k - 1, replace=False)) if k > 1 else np.array([], int)
        return M.DocumentMask(tuple(int(x) for x in np.diff(np.concatenate([[0], cuts, [seqlen]]))))
    raise ValueError(f"unknown mask family {family!r}; choose from {MASK_FAMILIES}")


def draw_case(rng: np.random.Generator, *, case_id: int = 0, seed: int = 0, devices=DEVICES, profiles=PROFILES,
              max_tokens: int = MAX_TOKENS, max_seqs: int = MAX_SEQS) -> SweepCase:
    """One case (module docstring for the rules). ``devices``/``profiles`` restrict the choices;
    ``max_tokens`` caps the total (it must allow 256 tokens per device); ``case_id``/``seed`` are only
    recorded (the draw depends on ``rng`` alone)."""
    n_dev = int(devices[int(rng.integers(len(devices)))])
    nodes, gpn = node_shape(rng, n_dev)
    profile = str(profiles[int(rng.integers(len(profiles)))])
    lo = n_dev * MIN_TOKENS_PER_DEVICE
    hi = min(n_dev * MAX_TOKENS_PER_DEVICE, int(max_tokens))
    if hi < lo:
        raise ValueError(f"max_tokens={max_tokens} is below {MIN_TOKENS_PER_DEVICE} tokens per device for "
                         f"{n_dev} devices ({lo})")
    total = int(round(log_uniform(rng, lo, hi))) if hi > lo else lo
    n = int(rng.integers(1, max_seqs + 1))
    n = min(max(n, -(-total // MAX_LEN)), total // MIN_LEN)
    lens = lengths_summing_to(rng, n, total)
    masks = tuple(draw_mask(rng, L) for L in lens)
    heads, kv_heads, head_dim, dtype = HEAD_CONFIGS[int(rng.integers(len(HEAD_CONFIGS)))]
    return SweepCase(case_id, seed, nodes, gpn, profile, lens, masks, heads, kv_heads, head_dim, dtype,
                     block_size_for(total, n_dev))


def _stats_fields(s) -> dict:
    """CSV fields of a ``PlanStats``."""
    return dict(compute_imbalance=round(s.compute_imbalance, 4), memory_imbalance=s.memory_imbalance,
                comm_bytes_total=s.comm_bytes_total, comm_bytes_inter_node=s.comm_bytes_inter_node,
                idle_devices=s.idle_devices, valid=s.valid, max_resident_tokens=s.max_resident_tokens,
                peak_transient_bytes_forward=s.peak_transient_bytes_forward,
                peak_transient_bytes_backward=s.peak_transient_bytes_backward)


def warm_starts(plan) -> tuple[str, ...]:
    """Baselines whose placement dcp's search considered (``plan.meta["search_warm_starts"]``; empty
    when the planner does not record them)."""
    return tuple(x.strip() for x in str(plan.meta.get("search_warm_starts", "") or "").split(",") if x.strip())


def memory_budget(spec, cluster, config) -> tuple[float, float | None]:
    """dcp's per-device memory budget for this batch (``dcp.planner.budget.MemoryBudget``): (resident tokens,
    transient bytes or None)."""
    budget = MemoryBudget.of(spec, cluster, config)
    return float(budget.tokens), budget.transient_bytes


def within_budget(stats, budget: tuple[float, float | None]) -> bool:
    """Whether a plan keeps every device within ``budget`` (so that dcp's search could choose it)."""
    tokens, transient = budget
    if stats.max_resident_tokens > tokens * (1 + 1e-9):
        return False
    peak = max(stats.peak_transient_bytes_forward, stats.peak_transient_bytes_backward)
    return transient is None or peak <= transient * (1 + 1e-9)


def run_case(case: SweepCase, planners=PLANNERS, mach: str | None = None, rev: str | None = None) -> list[dict]:
    """Plan ``case`` with each of ``planners`` ("dcp" and names of ``dcp.baselines.BASELINES``), simulate
    every plan with the case's profile, and return one row per planner. A planner that cannot plan the
    batch (a ``DcpError``) gets a row with its ``error``; other exceptions propagate.

    dcp's row says whether its memory imbalance exceeds ``1 + epsilon_memory`` (``memory_violation``) and
    whether planning warned about its "memory budget"; a baseline's row, whether dcp's search considered
    its placement (``in_dcp_warm_starts``), whether the plan is within dcp's memory budget (only then may
    dcp choose it), and ``warm_start_regression``: considered, within the budget, dcp did not warn, and
    dcp's simulated fwd+bwd is above the baseline's by more than ``WARM_START_SLACK``."""
    from dcp.baselines import BASELINES
    from dcp.config import PlannerConfig
    from dcp.cost import CostModel
    from dcp.errors import DcpError
    from dcp.planner.dcp_planner import DCPPlanner
    from dcp.sim import simulate_both

    bad = [p for p in planners if p != "dcp" and p not in BASELINES]
    if bad:
        raise ValueError(f"unknown planners {bad}; choose from {PLANNERS}")
    spec, cluster = case.spec(), case.cluster()
    cost = CostModel.named(case.profile)
    config = PlannerConfig(cost_model=cost, block_size=case.block_size)
    budget = memory_budget(spec, cluster, config)
    out: dict[str, dict] = {}
    for name in planners:
        planner = DCPPlanner(config) if name == "dcp" else BASELINES[name]()
        row = dict(planner=name, fwd_ms=None, bwd_ms=None, step_ms=None, planning_time_s=None, error="")
        try:
            plan, warns = plan_quietly(planner, spec, cluster)
        except DcpError as err:
            row["error"] = f"{type(err).__name__}: {err}"
            out[name] = row
            continue
        fwd, bwd = simulate_both(plan, cost, record_events=False)
        stats = plan.stats()
        row.update(fwd_ms=round(fwd.makespan_s * 1e3, 6), bwd_ms=round(bwd.makespan_s * 1e3, 6),
                   step_ms=round((fwd.makespan_s + bwd.makespan_s) * 1e3, 6),
                   planning_time_s=round(plan.planning_time_s, 4), **_stats_fields(stats),
                   within_dcp_memory_budget=within_budget(stats, budget), warnings=" | ".join(warns))
        if name == "dcp":
            row.update(dcp_chosen=plan.meta.get("search_chosen", ""), search_warm_starts=",".join(warm_starts(plan)),
                       epsilon_memory=config.epsilon_memory,
                       memory_violation=bool(stats.memory_imbalance > 1 + config.epsilon_memory + 1e-9),
                       memory_budget_warning=any(MEMORY_WARNING in w for w in warns))
        out[name] = row
    dcp = out.get("dcp", {})
    dcp_step, dcp_warm = dcp.get("step_ms"), set(dcp.get("search_warm_starts", "").split(","))
    mach = machine() if mach is None else mach
    rev = git_revision() if rev is None else rev
    rows = []
    for name, row in out.items():
        step = row["step_ms"]
        extra = dict(in_dcp_warm_starts=None, dcp_speedup=round(step / dcp_step, 4) if step and dcp_step else None,
                     warm_start_regression=None)
        if name != "dcp":
            extra["in_dcp_warm_starts"] = name in dcp_warm
            extra["warm_start_regression"] = bool(
                name in dcp_warm and step and dcp_step and row.get("within_dcp_memory_budget")
                and not dcp.get("memory_budget_warning") and dcp_step > step * (1 + WARM_START_SLACK))
        rows.append(dict(case.fields(), **row, **extra, machine=mach, revision=rev, simulated=True))
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [{c: r.get(c, "") for c in cols} for r in rows]


def _num(v) -> float | None:
    """A CSV cell (or a row value) as a float; None for empty/missing."""
    if v is None or v == "":
        return None
    return float(v)


def _true(v) -> bool:
    return v is True or str(v) == "True"


def geomean(xs) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list[dict]) -> list[dict]:
    """Per (devices, profile), then per devices over all profiles and overall: cases, dcp's speedup over
    each baseline and over the best (fastest successful) baseline of each case (min, geomean), also over
    the best of those within dcp's memory budget (``best_in_budget``: the plans dcp may choose), memory
    violations (dcp's memory_imbalance above 1 + epsilon_memory; ``_unwarned``: without a "memory budget"
    warning), warm-start regressions (dcp slower than a baseline it considered, beyond the 2 % slack),
    planner errors. Works on ``run_case`` rows and on rows read back from the CSV."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault(int(_num(r["case_id"])), []).append(r)
    cells = sorted({(int(_num(r["devices"])), r["profile"]) for r in rows})
    groups = [(f"{d}", p, lambda c, d=d, p=p: c == (d, p)) for d, p in cells]
    groups += [(f"{d}", "all", lambda c, d=d: c[0] == d) for d in sorted({d for d, _ in cells})]
    groups.append(("all", "all", lambda c: True))
    names = [n for n in BASELINE_NAMES if any(r["planner"] == n for r in rows)]
    out = []
    for dev, prof, want in groups:
        cases = [rs for rs in by_case.values() if want((int(_num(rs[0]["devices"])), rs[0]["profile"]))]
        if not cases:
            continue
        dcp = [next((r for r in rs if r["planner"] == "dcp"), None) for rs in cases]
        row = dict(devices=dev, profile=prof, cases=len(cases),
                   dcp_errors=sum(1 for d in dcp if d is None or d["error"]),
                   memory_violations=sum(1 for d in dcp if d and _true(d.get("memory_violation"))),
                   memory_violations_unwarned=sum(1 for d in dcp if d and _true(d.get("memory_violation"))
                                                  and not _true(d.get("memory_budget_warning"))),
                   memory_budget_warnings=sum(1 for d in dcp if d and _true(d.get("memory_budget_warning"))),
                   warm_start_regressions=sum(1 for rs in cases for r in rs if _true(r.get("warm_start_regression"))),
                   max_dcp_memory_imbalance=max((_num(d["memory_imbalance"]) for d in dcp
                                                 if d and _num(d.get("memory_imbalance")) is not None), default=None))
        best, best_in = [], []  # the fastest baseline gives dcp its smallest speedup
        for rs in cases:
            sp = [(_num(r["dcp_speedup"]), _true(r.get("within_dcp_memory_budget"))) for r in rs
                  if r["planner"] in names and _num(r.get("dcp_speedup"))]
            best.append(min((x for x, _ in sp), default=None))
            best_in.append(min((x for x, ok in sp if ok), default=None))
        for label, xs in [(n, [_num(r["dcp_speedup"]) for rs in cases for r in rs if r["planner"] == n])
                          for n in names] + [("best", best), ("best_in_budget", best_in)]:
            xs = [x for x in xs if x is not None]
            row[f"speedup_vs_{label}_min"] = round(min(xs), 4) if xs else None
            row[f"speedup_vs_{label}_geomean"] = round(geomean(xs), 4) if xs else None
        for n in names:
            row[f"{n}_errors"] = sum(1 for rs in cases for r in rs if r["planner"] == n and r["error"])
        times = sorted(_num(d["planning_time_s"]) for d in dcp if d and _num(d.get("planning_time_s")) is not None)
        row["dcp_median_planning_s"] = round(times[len(times) // 2], 3) if times else None
        row.update(simulated=True, machine=rows[0]["machine"])
        out.append(row)
    return out
