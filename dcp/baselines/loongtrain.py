"""LoongTrain's 2-D attention: head parallelism (Ulysses all-to-all) x context parallelism (double ring).

The P devices form ``cp = P / hp`` context ranks of ``hp`` consecutive devices ("head-first"
placement: an all-to-all group stays inside a node). Sequences are zigzag-split over the cp ranks and each
rank's chunk is split evenly over its hp devices; after the all-to-all (round 1), device (rank r, head
index h) holds head block h's q/KV of rank r's whole chunk. KV then travels a double ring over the ranks
sharing h: inner rings of ``inner_ring`` consecutive ranks (inside a node by default) and an outer ring
connecting the inner rings. A unit's outer hop k leaves at the first round of outer step k-1, overlapping
that step's inner-ring rounds, so inner rings keep intra-node links busy while the inter-node hop is in
flight. Relays stop where no later device needs the unit. Outputs go back as in ``dcp.baselines.common``:
O/dQ straight home, dKV accumulated along the inner chains and the outer chain to the origin, then home.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import check_shards, shard_note
from dcp.baselines.te_a2a_p2p import a2a_head_block_size, hierarchical_parts, hierarchical_tiles
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def _check_opt_int(v, name):
    if v is not None and (not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0):
        raise InvalidConfigError(f"{name} must be a positive int or None, got {v!r}")


@dataclass(frozen=True)
class LoongTrainPlanner(Planner):
    """2-D head x context parallelism with double-ring attention.

    ``head_parallel``: devices per all-to-all group (None: the largest divisor of gpus_per_node that is
    at most half of it and that the heads allow, so a node holds several context ranks and the double
    ring is exercised); ``inner_ring``: context ranks per inner ring (None: the ranks of one node);
    ``shards``: as ``RingPlanner``'s. Tuning grid: every ``head_parallel`` dividing the GPUs per node that
    the heads allow, each with inner rings of 1, the context ranks of one node, and all context ranks."""

    head_parallel: int | None = None
    inner_ring: int | None = None
    shards: bool | None = None
    name = "loongtrain"

    def __post_init__(self):
        _check_opt_int(self.head_parallel, "head_parallel")
        _check_opt_int(self.inner_ring, "inner_ring")
        check_shards(self.shards)

    def degrees(self, spec: BatchSpec, cluster: Cluster) -> tuple[int, int]:
        """(head-parallel degree, inner ring size) for this batch and cluster."""
        p, g = cluster.n_devices, cluster.gpus_per_node
        hp = self.head_parallel
        if hp is None:
            hp = next(h for h in range(max(1, g // 2), 0, -1)
                      if g % h == 0 and (h == 1 or a2a_head_block_size(spec, h) is not None))
        elif p % hp or (hp > 1 and a2a_head_block_size(spec, hp) is None):
            raise InvalidConfigError(f"head_parallel={hp} must divide the {p} devices and split the "
                                     f"{spec.num_heads} query heads ({spec.num_kv_heads} KV heads) evenly")
        cp = p // hp
        inner = self.inner_ring
        if inner is None:
            inner = g // hp if g % hp == 0 and cp % max(g // hp, 1) == 0 else 1
            inner = max(inner, 1)
        elif cp % inner:
            raise InvalidConfigError(f"inner_ring={inner} must divide the {cp} context ranks")
        return hp, inner

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        p, g = cluster.n_devices, cluster.gpus_per_node
        out = []
        for hp in range(1, g + 1):
            if g % hp or p % hp or (hp > 1 and a2a_head_block_size(spec, hp) is None):
                continue
            cp = p // hp
            for inner in sorted({1, max(g // hp, 1), cp}):
                if cp % inner == 0:
                    out.append(LoongTrainPlanner(hp, inner, self.shards))
        return tuple(out)

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        hp, inner = self.degrees(spec, cluster)
        plan.meta.update(head_parallel=hp, inner_ring=inner)
        return plan

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        hp, inner = self.degrees(spec, cluster)
        parts = hierarchical_parts(spec, cluster.n_devices, hp, inner, self.shards)
        cp = cluster.n_devices // hp
        notes = (f"loongtrain: head parallel {hp}, context parallel {cp} (inner rings of {inner}, "
                 f"outer ring of {cp // inner})", *shard_note(self.name, parts[0]))
        return StaticParts(*parts, notes)

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        return hierarchical_tiles(spec.seqlens, cluster.n_devices, self.degrees(spec, cluster)[0])
