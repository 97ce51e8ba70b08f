"""The planner interface, and a placement plus its schedule assembled into a validated ``Plan``.

Every planner — dcp's (``dcp.planner``) and the static baselines (``dcp.baselines``) — is a ``Planner``:
``plan(spec, cluster) -> Plan``. A static planner also exposes its ``StaticParts`` (placement and own
schedule before programs are built), which dcp's search takes as warm starts. ``assemble`` builds both
directions' programs (``dcp.schedule.build``), validates and stamps the planning time.
"""
from __future__ import annotations

import abc
import dataclasses
import time
from typing import NamedTuple

import numpy as np

from dcp.cluster import Cluster
from dcp.errors import InvalidBatchError, InvalidClusterError
from dcp.ir.plan import Plan
from dcp.ir.validate import validate
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.schedule.build import build_program
from dcp.schedule.stages import Routes, Schedule
from dcp.spec import BatchSpec


class StaticParts(NamedTuple):
    """A static planner's placement and its own schedule, before programs are built (what ``assemble``
    takes; dcp's search starts from it, ``dcp.planner.warm``)."""

    layout: BlockLayout
    tiles: TileSet
    home: np.ndarray
    tile_device: np.ndarray
    tile_stage: np.ndarray
    routes: Routes
    notes: tuple[str, ...] = ()


class Planner(abc.ABC):
    name: str = "planner"

    @abc.abstractmethod
    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        """A validated plan for this batch on this cluster."""

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        """The placement and schedule of a static planner (``NotImplementedError`` for search planners)."""
        raise NotImplementedError(f"{type(self).__name__} is not a static planner")

    def schedule_variants(self, spec: BatchSpec, cluster: Cluster, parts: StaticParts) -> tuple[StaticParts, ...]:
        """The same placement as ``parts`` under other settings of this planner's own schedule knobs (e.g.
        Magi's overlap degree), cheap to build: dcp's search estimates each per direction beside the
        planner's own (a static planner runs one setting for both directions; dcp may pick one per
        direction). Default: none."""
        return ()

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        """About how many tiles ``static_parts`` gives (causal masks: an upper bound), without building
        them; dcp's search skips a warm start above ``SearchConfig.warm_start_max_tiles``."""
        raise NotImplementedError(f"{type(self).__name__} is not a static planner")

    def warm_points(self, spec: BatchSpec, cluster: Cluster, token_budget: float) -> tuple["Planner", ...]:
        """The settings of this planner that start dcp's search (``dcp.planner.warm``) for this batch, given
        dcp's memory budget (tokens per device): default this planner as it is; a planner whose knob
        picks among placements (Megatron's static CP size) may list several, or none that fits."""
        return (self,)

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple["Planner", ...]:
        """The knob settings a tuned comparison tries for this batch and cluster, as planners (default:
        this planner as it is; planners with knobs state their grid in their docstring)."""
        return (self,)

    def label(self) -> str:
        """``name``, with the knobs set away from their defaults: ``magi(chunk_size=1024 degree=2)``
        (``shards``, a layout choice, is left out)."""
        if not dataclasses.is_dataclass(self):
            return self.name
        changed = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                   if f.name != "shards" and f.default is not dataclasses.MISSING and getattr(self, f.name) != f.default]
        return self.name + (f"({' '.join(changed)})" if changed else "")  # no commas: labels are listed comma-separated

    def knobs(self) -> dict:
        """This planner's knob values (its dataclass fields), for tables and plan metadata."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def assemble(spec: BatchSpec, cluster: Cluster, layout: BlockLayout, tiles: TileSet, home: np.ndarray,
             tile_device: np.ndarray, tile_stage: np.ndarray, routes: Routes, planner: str, started: float,
             notes: tuple[str, ...] = (), check: bool = True, backward: Schedule | None = None) -> Plan:
    """Build both programs, validate, and stamp the planning time (spec → validated plans).

    ``tile_stage``/``routes`` schedule the forward, and the backward too unless ``backward`` gives it
    its own schedule."""
    bwd_stage, bwd_routes = (tile_stage, routes) if backward is None else (backward.tile_stage, backward.routes)
    plan = Plan(spec, cluster, layout, tiles, np.asarray(home, dtype=np.int32),
                np.asarray(tile_device, dtype=np.int32), build_program("forward", tile_stage, routes),
                build_program("backward", bwd_stage, bwd_routes), planner, 0.0, tuple(notes))
    meta = {}
    if check:
        validate(plan)
        meta["valid"] = True
    return dataclasses.replace(plan, planning_time_s=time.perf_counter() - started, meta=meta)


def assemble_static(spec: BatchSpec, cluster: Cluster, parts: StaticParts, planner: str, started: float) -> Plan:
    """``assemble`` for a static planner's parts (its own schedule in both directions, its notes)."""
    return assemble(spec, cluster, parts.layout, parts.tiles, parts.home, parts.tile_device, parts.tile_stage,
                    parts.routes, planner, started, parts.notes)


def check_inputs(spec: BatchSpec, cluster: Cluster, layered: bool = False) -> None:
    """Named errors for a planner called with something other than a batch and a cluster (``layered``: the
    planner takes a batch with layer kinds; the static planners plan one kind at a time)."""
    if not isinstance(spec, BatchSpec):
        raise InvalidBatchError(f"expected a dcp.BatchSpec, got {type(spec).__name__}")
    if spec.layered and not layered:
        raise InvalidBatchError(f"this planner plans one layer kind at a time; the batch has kinds "
                                f"{list(spec.kinds)}: plan spec.for_kind(name) per kind, or use dcp's planner, "
                                "which places the tokens once for every kind (a dcp.LayeredPlan)")
    if not isinstance(cluster, Cluster):
        raise InvalidClusterError(f"expected a dcp.Cluster, got {type(cluster).__name__}")
