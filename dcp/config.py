"""Planner configuration: a tree of frozen dataclasses; algorithms are typed objects, not strings."""
from __future__ import annotations

from dataclasses import dataclass, field

from dcp.cost import CostModel
from dcp.errors import InvalidConfigError
from dcp.partition import MtKaHyParPartitioner, Partitioner

OBJECTIVES = ("time", "bytes")


def _default_cost() -> CostModel:
    return CostModel.named("a100")


def _default_partitioner() -> Partitioner:
    # deterministic (the same inputs give the same plan in every process, on any thread count) with
    # Mt-KaHyPar's stronger refinement: 2-7 % fewer bytes than its plain deterministic preset for about
    # 10 % more partitioning time (benchmarks/results/README.md)
    return MtKaHyParPartitioner(preset="deterministic_quality")


def _default_warm_starts() -> tuple:
    from dcp.baselines import default_warm_planners  # lazily: ``import dcp.config`` stays light

    return default_warm_planners()


def _numbers(name: str, values, low: float, high: float, integer: bool = False) -> tuple:
    if not isinstance(values, (tuple, list)) or not values:
        raise InvalidConfigError(f"{name} must be a non-empty tuple, got {values!r}")
    for v in values:
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if not ok or isinstance(v, bool) or not low <= v <= high:
            raise InvalidConfigError(f"{name} must hold {'ints' if integer else 'numbers'} in [{low}, {high}], "
                                     f"got {v!r}")
    return tuple(values)


@dataclass(frozen=True)
class SearchConfig:
    """How the planner chooses its balance/communication trade-off per batch.

    The planner builds candidate placements: packings (``dcp.planner.pack``: whole sequences where they fit,
    zigzag splits where they must, at each compute tolerance of ``pack_epsilons``); with
    ``aligned_groups`` (time objective) also a packing on aligned power-of-two device groups, the shape of
    Megatron-Core's dynamic CP (``dcp.planner.pack.pack_aligned``); with ``hypergraph`` the two-level hypergraph
    partition at ``PlannerConfig.epsilon_inter/intra``. It schedules each direction of each at the
    middle stage count of ``stage_counts``, the three estimated fastest at every one of them, and keeps one:

    - ``objective="time"`` (default): the candidate with the least estimated forward + backward
      makespan under ``PlannerConfig.cost_model`` (``dcp.cost.estimate``);
    - ``objective="bytes"``: the paper's objective — the candidate that communicates the fewest bytes
      among those within the compute tolerance ``(1 + epsilon_inter)(1 + epsilon_intra)`` (of those
      within 3 % of the fewest, the best balanced).

    With ``objective="time"``, a chosen packing is then refined (``dcp.planner.refine``: whole sequences move off
    the device estimated to finish last while the estimate drops), with at most ``refine_evaluations``
    re-schedules (0: no refinement).

    ``hypergraph_max_tiles``: with the time objective, the hypergraph candidate's block size doubles
    until it has at most this many tiles (0: never), so that partitioning stays within a second or so.

    ``token_time_s``: seconds of non-attention work (forward + backward) per home token per layer; the
    time objective then adds ``token_time_s × (most tokens on one device)``, because the linear layers of
    a training step run on each device's home tokens (0: score attention alone).

    ``warm_starts``: static planners whose placements enter the search as candidates (``dcp.planner.warm``; default
    every baseline: ring, zigzag, TE a2a+p2p, LoongTrain, Megatron-Core dynamic CP), each skipped when it
    estimates more than ``warm_start_max_tiles`` tiles. With the time objective only.

    ``block_size_factors``: with the time objective, the chosen packing is rebuilt at these multiples of
    ``PlannerConfig.block_size`` (at least 64 tokens) and the fastest block size kept: tile size decides
    kernel efficiency and how finely stages overlap transfers (``()``: the configured block size only).

    ``simulate_top``: with the time objective, the final choice simulates this many of the fastest
    candidates by the estimate (those within the memory budget) with the discrete-event simulator and keeps
    the fastest simulated one (the estimate's ranking differs from the simulator's by a few per cent;
    0 or 1: the estimate decides).

    ``max_compute_imbalance`` (optional): candidates whose device compute imbalance (max / mean tile
    FLOPs) exceeds it are not considered (when every candidate does, the most balanced one is kept).
    """

    objective: str = "time"
    pack_epsilons: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.4)
    stage_counts: tuple[int, ...] = (1, 2, 4, 8)
    hypergraph: bool = True
    aligned_groups: bool = True
    max_compute_imbalance: float | None = None
    refine_evaluations: int = 12
    token_time_s: float = 0.0
    hypergraph_max_tiles: int = 4096
    warm_starts: tuple = field(default_factory=_default_warm_starts)
    warm_start_max_tiles: int = 131072
    simulate_top: int = 6
    block_size_factors: tuple[float, ...] = (0.5, 2.0)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise InvalidConfigError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        eps = self.pack_epsilons
        object.__setattr__(self, "pack_epsilons", () if eps in ((), []) else _numbers("pack_epsilons", eps, 0, 10))
        object.__setattr__(self, "stage_counts", _numbers("stage_counts", self.stage_counts, 1, 64, integer=True))
        for name in ("hypergraph", "aligned_groups"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.objective != "time":
            object.__setattr__(self, "warm_starts", ())
        ws = self.warm_starts
        if not isinstance(ws, (tuple, list)) or any(not hasattr(p, "static_parts") for p in ws):
            raise InvalidConfigError(f"warm_starts must be a tuple of static planners (dcp.baselines), got {ws!r}")
        object.__setattr__(self, "warm_starts", tuple(ws))
        if not self.hypergraph and not self.pack_epsilons and not self.aligned_groups and not self.warm_starts:
            raise InvalidConfigError("the search needs candidates: give pack_epsilons, aligned_groups=True, "
                                     "warm_starts or hypergraph=True")
        tt = self.token_time_s
        if not isinstance(tt, (int, float)) or isinstance(tt, bool) or not tt >= 0:
            raise InvalidConfigError(f"token_time_s must be a number >= 0, got {tt!r}")
        bf = self.block_size_factors
        object.__setattr__(self, "block_size_factors", () if bf in ((), []) else
                           _numbers("block_size_factors", bf, 1 / 64, 64))
        for name in ("simulate_top", "warm_start_max_tiles", "hypergraph_max_tiles", "refine_evaluations"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidConfigError(f"{name} must be an int >= 0, got {v!r}")
        m = self.max_compute_imbalance
        if m is not None and (not isinstance(m, (int, float)) or isinstance(m, bool) or not m >= 1):
            raise InvalidConfigError(f"max_compute_imbalance must be a number >= 1 or None, got {m!r}")


@dataclass(frozen=True)
class PlannerConfig:
    """How dcp plans a batch.

    Args:
        block_size: tokens per token block (the last block of a sequence keeps the remainder). Packing
            candidates cut sequences they split finer where balance needs it.
        head_block_size: query heads per head block. None (default): the packings keep all heads in one
            block (their tiles stay with their queries anyway) and the hypergraph candidate cuts the heads
            into two blocks of whole KV-head groups when there are at least two KV heads, so a device can
            take one group's work without the other group's KV (``hypergraph_head_block_size``).
        partitioner: ``MtKaHyParPartitioner(preset="deterministic_quality")`` (default: the same plan in every
            process), ``MtKaHyParPartitioner()`` (faster, varies run to run), ``KaHyParPartitioner()`` or
            ``GreedyPartitioner()``.
        epsilon_inter: compute (tile FLOPs) imbalance the hypergraph candidate allows between nodes.
        epsilon_intra: compute imbalance it allows between the GPUs of a node. Its device imbalance stays
            below (1 + epsilon_inter)(1 + epsilon_intra), unless a single tile is larger than that slack.
        epsilon_memory: the memory budget: every candidate placement (packings, refinement, the
            hypergraph partition and the static plans the search starts from) keeps each device's
            resident (home) tokens within ``(1 + epsilon_memory) x`` the mean. Resident tokens are what
            every non-attention layer stores activations for, so a faster plan that needs more memory
            than static CP is not chosen. When no candidate fits (e.g. one token block larger than the
            budget) the plan holding the fewest tokens on its busiest device is kept with a
            ``RuntimeWarning`` naming the device, or ``MemoryBudgetError`` with ``strict_memory``.
        max_tokens_per_device: an explicit cap on resident tokens per device (Megatron's
            ``max_seqlen_per_rank`` plays this role); the budget is the smaller of the two. None: no cap.
        transient_budget: the peak bytes of transient buffers (received inputs and partial outputs
            alive at once, ``dcp.ir.memory``) a device may hold in either direction, as a multiple of the
            bytes of one layer's attention activations (q, k, v and o) of the budget's tokens; candidates
            above it are chosen only when none is within it (with the same warning/error). The default, 8,
            admits every static CP plan of the paper's grid (TE a2a+p2p needs up to 4.7, ring 1.1) and
            stops q-stationary plans from gathering a long sequence's keys onto one device at once. This is
            per-layer working memory, freed after the layer. None: no limit.
        strict_memory: raise ``MemoryBudgetError`` instead of warning when no candidate fits the budget.
        seed: partitioner seed.
        max_stages: rounds of transfers overlapped with compute when the search does not choose them
            (``objective="bytes"`` schedules at this count only).
        two_phase: relay inputs and merge partial outputs inside a remote node so that each unit
            crosses the network once per node.
        time_budget_s: limit on the hypergraph partitioning; past it (or on partitioner failure) that
            candidate is dropped with a note, or, when it is the only one, replaced by the greedy
            partitioner's. None: no limit, partition in this process.
        cost_model: kernel and link model that schedules and scores the candidates.
        allow_idle_devices: plan batches with fewer token blocks than devices (idle devices are
            reported in the stats); False raises ``TooFewBlocksError`` instead.
        search: how the candidates are built and chosen (``SearchConfig``).
    """

    block_size: int = 1024
    head_block_size: int | None = None
    partitioner: Partitioner = field(default_factory=_default_partitioner)
    epsilon_inter: float = 0.045
    epsilon_intra: float = 0.045
    epsilon_memory: float = 0.1
    max_tokens_per_device: int | None = None
    transient_budget: float | None = 8.0
    strict_memory: bool = False
    seed: int = 0
    max_stages: int = 4
    two_phase: bool = True
    time_budget_s: float | None = 60.0
    cost_model: CostModel = field(default_factory=_default_cost)
    allow_idle_devices: bool = True
    search: SearchConfig = field(default_factory=SearchConfig)

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise InvalidConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        for name in ("epsilon_inter", "epsilon_intra", "epsilon_memory"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v <= 10:
                raise InvalidConfigError(f"{name} must be a number in [0, 10], got {v!r}")
        m = self.max_tokens_per_device
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m <= 0):
            raise InvalidConfigError(f"max_tokens_per_device must be a positive int or None, got {m!r}")
        tb = self.transient_budget
        if tb is not None and (not isinstance(tb, (int, float)) or isinstance(tb, bool) or not tb > 0):
            raise InvalidConfigError(f"transient_budget must be a positive number or None, got {tb!r}")
        if not isinstance(self.strict_memory, bool):
            raise InvalidConfigError(f"strict_memory must be True or False, got {self.strict_memory!r}")
        if not isinstance(self.max_stages, int) or self.max_stages < 1:
            raise InvalidConfigError(f"max_stages must be an int >= 1, got {self.max_stages!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise InvalidConfigError(f"time_budget_s must be positive or None, got {self.time_budget_s!r}")
        if not isinstance(self.partitioner, Partitioner):
            raise InvalidConfigError(f"partitioner must be a dcp.partition.Partitioner, got {self.partitioner!r}")
        if not isinstance(self.search, SearchConfig):
            raise InvalidConfigError(f"search must be a dcp.SearchConfig, got {self.search!r}")

    def hypergraph_head_block_size(self, num_heads: int, num_kv_heads: int) -> int | None:
        """The hypergraph candidate's head block: ``head_block_size`` if given, else half the query heads
        when there are at least two KV heads (an even number of them), else all of them."""
        if self.head_block_size is not None:
            return self.head_block_size
        if num_kv_heads >= 2 and num_kv_heads % 2 == 0:
            return num_heads // 2
        return None

    def token_budget(self, total_tokens: int, n_devices: int) -> float:
        """Most resident tokens one device may hold: ``(1 + epsilon_memory) x mean``, or
        ``max_tokens_per_device`` when smaller."""
        budget = (1 + self.epsilon_memory) * total_tokens / n_devices
        if self.max_tokens_per_device is not None:
            budget = min(budget, float(self.max_tokens_per_device))
        return budget

    def budget_ratio(self, total_tokens: int, n_devices: int) -> float:
        """``token_budget`` over the mean tokens per device (1 + the effective memory tolerance)."""
        return self.token_budget(total_tokens, n_devices) * n_devices / total_tokens

    @property
    def compute_tolerance(self) -> float:
        """The hypergraph candidate's device compute imbalance bound, (1 + eps_inter)(1 + eps_intra)."""
        return (1 + self.epsilon_inter) * (1 + self.epsilon_intra)
