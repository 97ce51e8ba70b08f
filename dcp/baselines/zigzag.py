"""Zigzag ring attention (load-balanced causal ring, as in ring-flash-attn's zigzag / Llama 3 CP).

Every sequence is cut into 2P near-equal contiguous chunks; device d homes chunks d and 2P-1-d, so each
device holds an early and a late piece of every sequence and causal work is balanced. Otherwise as
``RingPlanner``: tiles run on their q chunk's device, KV chunks are relayed around the ring of all
devices (only as far as needed), dKV partials accumulate hop by hop back home.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from dcp.baselines.common import (BlockBuilder, causal_tiles, check_shards, near_equal_chunks, plan_ring, shard_note,
                                  zigzag_device)
from dcp.cluster import Cluster
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def add_zigzag(builder: BlockBuilder, seqlen: int, base: int, size: int) -> None:
    """Zigzag blocks of one sequence over the contiguous ring of devices [base, base + size)."""
    starts, chunk = near_equal_chunks(seqlen, 2 * size)
    builder.add(starts, base + zigzag_device(chunk, size), ring_base=base, ring_size=size)


def zigzag_parts(spec: BatchSpec, n_devices: int, shards: bool | None = False):
    """(layout, tiles, home, tile_device, tile_stage, routes) of zigzag ring attention over all devices
    (``shards``: ``dcp.baselines.common.use_shards``)."""
    builder = BlockBuilder(spec)
    for n in spec.seqlens:
        add_zigzag(builder, n, 0, n_devices)
    return plan_ring(spec, builder, shards=shards)


@dataclass(frozen=True)
class ZigzagPlanner(Planner):
    """Zigzag ring attention over all devices: 2P chunks per sequence, device d homes d and 2P-1-d.
    ``shards``: as ``RingPlanner``'s."""

    shards: bool | None = None
    name = "zigzag"

    def __post_init__(self):
        check_shards(self.shards)

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        return assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        p = cluster.n_devices
        parts = zigzag_parts(spec, p, self.shards)
        notes = ("zigzag: sequences shorter than 2x the device count leave some chunks empty",) \
            if min(spec.seqlens) < 2 * p else ()
        return StaticParts(*parts, notes + shard_note(self.name, parts[0]))

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        return causal_tiles(spec.seqlens, 2 * cluster.n_devices)
