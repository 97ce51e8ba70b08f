"""Hypergraph partitioners behind one interface, and a time-budgeted runner.

Every partitioner takes per-block weight caps (both KaHyPar and Mt-KaHyPar support them) and optional
fixed vertices, and returns a block id per vertex. ``run_partitioner`` runs one and checks its answer; it is called
as part of a job of ``dcp.partition.worker``, which enforces the time budget.
"""
from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from importlib import resources
from typing import ClassVar

import numpy as np

from dcp.errors import PartitionerError
from dcp.partition.hypergraph import Hypergraph


class Partitioner(abc.ABC):
    """Minimise km1 under per-block vertex-weight caps."""

    name: ClassVar[str] = "partitioner"

    @abc.abstractmethod
    def partition(self, hg: Hypergraph, k: int, max_block_weight: np.ndarray,
                  fixed: np.ndarray | None, seed: int) -> np.ndarray:
        """Block id (int64 ``[n_vertices]``) of every vertex; ``fixed[v] >= 0`` pins v to that block."""

    def available(self) -> bool:
        return True

    def improve(self, hg: Hypergraph, k: int, max_block_weight: np.ndarray, fixed: np.ndarray | None, seed: int,
                initial: np.ndarray) -> np.ndarray:
        """Refine ``initial`` (a feasible partition) for km1 under the caps; partitioners without a
        refinement entry return it unchanged."""
        return np.asarray(initial, dtype=np.int64)


def _epsilon_for(hg: Hypergraph, k: int, caps: np.ndarray) -> float:
    total = float(hg.vertex_weight.sum())
    return max(float(caps.max()) * k / total - 1.0, 0.001) if total > 0 else 0.03


@dataclass(frozen=True)
class KaHyParPartitioner(Partitioner):
    """KaHyPar direct k-way km1 with k-way FM refinement (the bundled preset has no flow refinement)."""

    preset: str = "kahypar_km1_fm.ini"
    name: ClassVar[str] = "kahypar"

    def available(self) -> bool:
        try:
            import kahypar  # noqa: F401
        except ImportError:
            return False
        return True

    def partition(self, hg, k, max_block_weight, fixed, seed):
        try:
            import kahypar
        except ImportError as err:
            raise PartitionerError("KaHyPar is not installed: pip install kahypar") from err
        path = self.preset
        if not os.path.isabs(path):
            path = str(resources.files("dcp.partition").joinpath(self.preset))
        if not os.path.exists(path):
            raise PartitionerError(f"KaHyPar preset {path} not found")
        ctx = kahypar.Context()
        ctx.loadINIconfiguration(path)
        ctx.setK(int(k))
        ctx.setEpsilon(_epsilon_for(hg, k, max_block_weight))
        ctx.setCustomTargetBlockWeights([int(c) for c in max_block_weight])
        ctx.setSeed(int(seed))
        ctx.suppressOutput(True)
        h = kahypar.Hypergraph(hg.n_vertices, hg.n_nets, hg.net_ptr.tolist(), hg.net_pins.tolist(), int(k),
                               hg.net_weight.tolist(), hg.vertex_weight.tolist())
        if fixed is not None:
            for v in np.flatnonzero(fixed >= 0):
                h.fixNodeToBlock(int(v), int(fixed[v]))
        kahypar.partition(h, ctx)
        return np.fromiter((h.blockID(v) for v in range(hg.n_vertices)), dtype=np.int64, count=hg.n_vertices)


_MTK = {}


@dataclass(frozen=True)
class MtKaHyParPartitioner(Partitioner):
    """Mt-KaHyPar, multi-threaded. ``preset="default"`` is the fast one (2-4x faster than
    "deterministic" on plan-sized hypergraphs, similar km1); ``preset="deterministic"`` and
    ``"deterministic_quality"`` (the planner's default: stronger refinement, a few % fewer bytes) give
    identical partitions for a seed regardless of thread count, so plans reproduce exactly."""

    preset: str = "default"
    threads: int = 0  # 0: all cores
    name: ClassVar[str] = "mtkahypar"

    def available(self) -> bool:
        try:
            import mtkahypar  # noqa: F401
        except ImportError:
            return False
        return True

    def partition(self, hg, k, max_block_weight, fixed, seed):
        h, ctx = self._prepare(hg, k, max_block_weight, fixed, seed)
        return np.asarray(h.partition(ctx).get_partition(), dtype=np.int64)

    def _prepare(self, hg, k, max_block_weight, fixed, seed):
        try:
            import mtkahypar
        except ImportError as err:
            raise PartitionerError("Mt-KaHyPar is not installed: pip install mtkahypar") from err
        threads = self.threads or os.cpu_count() or 1
        mtk = _MTK.get("init")
        if mtk is None:
            mtk = _MTK["init"] = mtkahypar.initialize(threads, False)
        presets = {p.lower(): getattr(mtkahypar.PresetType, p) for p in mtkahypar.PresetType.__members__}
        if self.preset.lower() not in presets:
            raise PartitionerError(f"unknown Mt-KaHyPar preset {self.preset!r}; one of {sorted(presets)}")
        ctx = mtk.context_from_preset(presets[self.preset.lower()])
        ctx.set_partitioning_parameters(int(k), _epsilon_for(hg, k, max_block_weight), mtkahypar.Objective.KM1)
        ctx.set_individual_target_block_weights([int(c) for c in max_block_weight])
        ctx.logging = False
        mtkahypar.set_seed(int(seed))
        edges = [a.tolist() for a in np.split(hg.net_pins, hg.net_ptr[1:-1])] if hg.n_nets else []
        h = mtk.create_hypergraph(ctx, hg.n_vertices, hg.n_nets, edges, hg.vertex_weight.tolist(),
                                  hg.net_weight.tolist())
        if fixed is not None and (fixed >= 0).any():
            h.add_fixed_vertices(fixed.astype(np.int64).tolist(), int(k))
        return h, ctx

    def improve(self, hg, k, max_block_weight, fixed, seed, initial):
        """Mt-KaHyPar's V-cycle refinement of a given partition (fixed vertices stay)."""
        h, ctx = self._prepare(hg, k, max_block_weight, fixed, seed)
        phg = h.create_partitioned_hypergraph(ctx, int(k), np.asarray(initial, dtype=np.int64).tolist())
        phg.improve_partition(ctx, 1)
        return np.asarray(phg.get_partition(), dtype=np.int64)


@dataclass(frozen=True)
class GreedyPartitioner(Partitioner):
    """Dependency-free fallback: cut the vertices, in id order, into k runs of near-equal weight
    (fixed vertices stay put and count against their block). Vertex ids are laid out so that runs are
    local: tiles sorted by (q block, head block, kv block). The planner's repair passes follow it."""

    name: ClassVar[str] = "greedy"

    def partition(self, hg, k, max_block_weight, fixed, seed):
        n = hg.n_vertices
        parts = np.full(n, -1, dtype=np.int64)
        w = hg.vertex_weight.astype(np.float64)
        free = np.ones(n, dtype=bool) if fixed is None else fixed < 0
        fixed_w = np.zeros(k)
        if fixed is not None:
            parts[~free] = fixed[~free]
            fixed_w = np.bincount(fixed[~free], weights=w[~free], minlength=k)
        target = np.maximum(w.sum() / k - fixed_w, 0)
        if target.sum() <= 0:
            target = np.ones(k)
        bounds = np.cumsum(target) / target.sum() * w[free].sum()
        mid = np.cumsum(w[free]) - w[free] / 2
        parts[free] = np.minimum(np.searchsorted(bounds, mid, side="right"), k - 1)
        return parts


PARTITIONER_NAMES = ("quality", "deterministic", "fast", "kahypar", "greedy")
"""Names of the partitioners for command lines and benchmark flags (``named_partitioner``)."""


def named_partitioner(name: str, threads: int = 0) -> Partitioner:
    """The partitioner a name stands for: ``quality`` (Mt-KaHyPar's deterministic_quality preset: the same
    plan for the same inputs in every process and on any thread count, with stronger refinement; the
    planner's default), ``deterministic`` (Mt-KaHyPar's deterministic preset: as reproducible, ~10 %
    faster, a few % more bytes), ``fast`` (Mt-KaHyPar's default preset: faster still, plans vary run to
    run; ``mtkahypar`` is accepted for it), ``kahypar`` (KaHyPar, single-threaded, as the DCP prototype),
    ``greedy`` (no dependency)."""
    from dcp.errors import InvalidConfigError

    key = {"mtkahypar": "fast"}.get(name, name)
    if key == "quality":
        return MtKaHyParPartitioner(preset="deterministic_quality", threads=threads)
    if key == "deterministic":
        return MtKaHyParPartitioner(preset="deterministic", threads=threads)
    if key == "fast":
        return MtKaHyParPartitioner(threads=threads)
    if key == "kahypar":
        return KaHyParPartitioner()
    if key == "greedy":
        return GreedyPartitioner()
    raise InvalidConfigError(f"unknown partitioner {name!r}; one of {PARTITIONER_NAMES}")


def run_partitioner(partitioner: Partitioner, hg: Hypergraph, k: int, caps: np.ndarray,
                    fixed: np.ndarray | None, seed: int, initial: np.ndarray | None = None) -> np.ndarray:
    """Run ``partitioner`` in this process and check its answer (budgets: see ``dcp.partition.worker``);
    with ``initial``, refine that partition instead of partitioning from scratch."""
    caps = np.asarray(caps, dtype=np.int64)
    if initial is None:
        parts = np.asarray(partitioner.partition(hg, k, caps, fixed, seed), dtype=np.int64)
    else:
        parts = np.asarray(partitioner.improve(hg, k, caps, fixed, seed, initial), dtype=np.int64)
    if parts.shape != (hg.n_vertices,) or (parts < 0).any() or (parts >= k).any():
        raise PartitionerError(f"{partitioner.name} returned an invalid partition")
    if fixed is not None and (parts[fixed >= 0] != fixed[fixed >= 0]).any():
        raise PartitionerError(f"{partitioner.name} moved a fixed vertex")
    return parts
