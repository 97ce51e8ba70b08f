"""Planners: typed objects that turn (batch, cluster) into a validated ``Plan``.

``DCPPlanner`` is dcp's hypergraph planner; the static baselines in ``dcp.baselines`` implement the
same interface and emit plans in the same IR, so every comparison runs through the same validator,
statistics and executors.
"""
from __future__ import annotations

import abc
import dataclasses
import time

import numpy as np

from dcp.assign import assign
from dcp.blocks import BlockLayout, TileSet, enumerate_tiles, uniform_layout
from dcp.build import build_program
from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import InvalidBatchError, InvalidClusterError, TooFewBlocksError
from dcp.plan import Plan
from dcp.schedule import Routes, schedule
from dcp.spec import BatchSpec
from dcp.validate import validate


class Planner(abc.ABC):
    name: str = "planner"

    @abc.abstractmethod
    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        """A validated plan for this batch on this cluster."""


def assemble(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
             tile_device: np.ndarray, tile_stage: np.ndarray, routes: Routes, planner: str, started: float,
             notes: tuple[str, ...] = (), check: bool = True) -> Plan:
    """Build both programs, validate, and stamp the planning time (spec → validated plans)."""
    n = cluster.n_devices
    plan = Plan(spec, cluster, layout, tiles, np.asarray(home, dtype=np.int32),
                np.asarray(tile_device, dtype=np.int32), np.asarray(tile_stage, dtype=np.int32),
                build_program("forward", n, tile_device, tile_stage, routes),
                build_program("backward", n, tile_device, tile_stage, routes), planner, 0.0, tuple(notes))
    meta = {}
    if check:
        validate(plan)
        meta["valid"] = True
    return dataclasses.replace(plan, planning_time_s=time.perf_counter() - started, meta=meta)


def check_inputs(spec: BatchSpec, cluster: Cluster) -> None:
    if not isinstance(spec, BatchSpec):
        raise InvalidBatchError(f"expected a dcp.BatchSpec, got {type(spec).__name__}")
    if not isinstance(cluster, Cluster):
        raise InvalidClusterError(f"expected a dcp.Cluster, got {type(cluster).__name__}")


@dataclasses.dataclass(frozen=True)
class DCPPlanner(Planner):
    """Hypergraph placement (``dcp.assign``) + time-aware stages and routes (``dcp.schedule``)."""

    config: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    name = "dcp"

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        cfg = self.config
        layout = uniform_layout(spec, cfg.block_size, cfg.head_block_size)
        if layout.n_token_blocks < cluster.n_devices and not cfg.allow_idle_devices:
            raise TooFewBlocksError(
                f"{layout.n_token_blocks} token blocks for {cluster.n_devices} devices: lower block_size "
                f"(now {cfg.block_size}) or set allow_idle_devices=True")
        tiles = enumerate_tiles(spec, layout)
        q_len, kv_len = layout.tb_len[tiles.q_tb], layout.tb_len[tiles.kv_tb]
        cost = cfg.cost_model
        fwd_t = cost.tile_forward_s(tiles.fwd_flops, q_len, kv_len, tiles.full)
        # balance exact work (FLOPs); the cost model's per-tile times only order stages and transfers,
        # since the executors run each stage as one fused call whose speed depends on merged extents
        placed = assign(spec, layout, tiles, tiles.fwd_flops + tiles.bwd_flops, cluster.nodes, cluster.gpus_per_node,
                        cfg.partitioner, cfg.epsilon_inter, cfg.epsilon_intra, cfg.epsilon_memory, cfg.seed,
                        cfg.time_budget_s)
        tile_stage, routes = schedule(spec, cluster, layout, tiles, placed.home, placed.tile_device, fwd_t,
                                      cost, cfg.max_stages, cfg.two_phase)
        return assemble(spec, cluster, layout, tiles, placed.home, placed.tile_device, tile_stage, routes,
                        self.name, started, placed.fallbacks)


def plan(spec: BatchSpec, cluster: Cluster, config: PlannerConfig | None = None) -> Plan:
    """Plan a batch with dcp's planner: ``dcp.plan(spec, cluster, config) -> Plan`` (validated)."""
    return DCPPlanner(config or PlannerConfig()).plan(spec, cluster)
