"""Ring attention (varlen, as ring-flash-attn's varlen variant) over all devices of the cluster.

Every sequence is cut into P near-equal contiguous chunks (P = number of devices; a sequence shorter than
P tokens gets fewer, one-token chunks and some devices hold none of it); device d homes chunk d of every
sequence. Tiles run where their q chunk lives. KV chunks circulate around the ring 0 → 1 → … → P-1 → 0:
in round r device d receives from d-1 the KV that originated on device d-r, and the tile (q on d, KV from
d-r) runs in stage r. A KV chunk is relayed hop by hop only as far as the farthest device that needs it
(under a causal mask, chunk j stops at device P-1). Backward: dQ stays home; dKV partials travel with
the ring, accumulated hop by hop, and the last one goes home (see ``dcp.baselines.common``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from dcp.baselines.common import BlockBuilder, causal_tiles, check_shards, near_equal_chunks, plan_ring, shard_note
from dcp.cluster import Cluster
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


@dataclass(frozen=True)
class RingPlanner(Planner):
    """Ring attention: P contiguous chunks per sequence, KV relayed around one ring of all devices.

    ``shards``: group each device's chunks of every sequence into one token block (``dcp.layout.pieces``; the
    plan a real ring runs, with P^2 tiles instead of P^2 per sequence); None: when the per-sequence plan
    would exceed ``dcp.baselines.common.SHARD_TILES`` tiles."""

    shards: bool | None = None
    name = "ring"

    def __post_init__(self):
        check_shards(self.shards)

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        return assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        p = cluster.n_devices
        builder = BlockBuilder(spec)
        for n in spec.seqlens:
            starts, chunk = near_equal_chunks(n, p)
            builder.add(starts, chunk, ring_base=0, ring_size=p)
        parts = plan_ring(spec, builder, shards=self.shards)
        notes = ("ring: sequences shorter than the device count leave some devices without a chunk",) \
            if min(spec.seqlens) < p else ()
        return StaticParts(*parts, notes + shard_note(self.name, parts[0]))

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        return causal_tiles(spec.seqlens, cluster.n_devices)
