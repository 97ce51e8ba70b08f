"""Planner configuration: a tree of frozen dataclasses; algorithms are typed objects, not strings."""
from __future__ import annotations

from dataclasses import dataclass, field

from dcp.cost import CostModel
from dcp.errors import InvalidConfigError
from dcp.partition import MtKaHyParPartitioner, Partitioner


def _default_cost() -> CostModel:
    return CostModel.named("a100")


@dataclass(frozen=True)
class PlannerConfig:
    """How dcp plans a batch.

    Args:
        block_size: tokens per token block (the last block of a sequence keeps the remainder).
        head_block_size: query heads per head block (None: all heads in one block).
        partitioner: ``MtKaHyParPartitioner()`` (default), ``KaHyParPartitioner()`` or ``GreedyPartitioner()``.
        epsilon_inter: compute (tile FLOPs) imbalance allowed between nodes (level 1).
        epsilon_intra: compute imbalance allowed between the GPUs of a node (level 2). The overall
            device imbalance stays below (1 + epsilon_inter)(1 + epsilon_intra) (1.092 by default),
            unless a single tile is larger than that slack.
        epsilon_memory: resident-token imbalance allowed at each level (a single token block larger
            than the mean share is never split, so small batches may exceed it; see ``plan.stats()``).
        seed: partitioner seed.
        max_stages: rounds of transfers overlapped with compute (stage 0 needs no transfer).
        two_phase: relay inputs and merge partial outputs inside a remote node so that each unit
            crosses the network once per node.
        time_budget_s: limit on partitioning; past it (or on partitioner failure) the planner warns and
            falls back to the greedy partitioner. None: no limit, partition in this process.
        cost_model: kernel and link model used for vertex weights and stage budgets.
        allow_idle_devices: plan batches with fewer token blocks than devices (idle devices are
            reported in the stats); False raises ``TooFewBlocksError`` instead.
    """

    block_size: int = 1024
    head_block_size: int | None = None
    partitioner: Partitioner = field(default_factory=MtKaHyParPartitioner)
    epsilon_inter: float = 0.045
    epsilon_intra: float = 0.045
    epsilon_memory: float = 0.1
    seed: int = 0
    max_stages: int = 4
    two_phase: bool = True
    time_budget_s: float | None = 60.0
    cost_model: CostModel = field(default_factory=_default_cost)
    allow_idle_devices: bool = True

    def __post_init__(self):
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size <= 0:
            raise InvalidConfigError(f"block_size must be a positive int, got {self.block_size!r}")
        for name in ("epsilon_inter", "epsilon_intra", "epsilon_memory"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v <= 10:
                raise InvalidConfigError(f"{name} must be a number in [0, 10], got {v!r}")
        if not isinstance(self.max_stages, int) or self.max_stages < 1:
            raise InvalidConfigError(f"max_stages must be an int >= 1, got {self.max_stages!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise InvalidConfigError(f"time_budget_s must be positive or None, got {self.time_budget_s!r}")
        if not isinstance(self.partitioner, Partitioner):
            raise InvalidConfigError(f"partitioner must be a dcp.partition.Partitioner, got {self.partitioner!r}")
