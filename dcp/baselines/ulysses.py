"""DeepSpeed-Ulysses: all-to-all head parallelism (DeepSpeed's ``DistributedAttention``, arXiv 2309.14509).

Each rank holds a contiguous 1/P of the packed token stream (rank i homes shard i; dcp cuts shards
near-equal where DeepSpeed asserts the length divides by P, and cuts token blocks at shard and sequence
boundaries). Before attention an all-to-all over heads turns "all heads of my tokens" into "my heads of
all tokens": rank h receives query heads [h·H/P, (h+1)·H/P) of every token, with the KV heads they read,
computes attention of whole sequences for those heads, and the reverse all-to-all returns every token's
output to its home. In dcp's IR: P head blocks of H/P query heads; every tile of head block h runs on
rank h; each q-side and kv-side unit (tb, h) not homed on rank h goes there in round 1 (all of them,
used by a tile or not: the all-to-all moves whole shards); O, dQ and dKV partials go straight home in
round 3 (the reverse all-to-all, two rounds after stage 1).

Stages: every tile runs in stage 1, after the all-to-all, including those whose units rank h homes.
DeepSpeed issues the three all-to-alls synchronously and then calls the local attention once on the
gathered sequence; there is no separate call on the local shard that could overlap the exchange (and
it would hide only 1/P of the work).

Requires ``num_heads % P == 0`` (DeepSpeed's even-head path; its newer uneven-head all-to-all is not
modelled) and a head block of H/P query heads that holds whole GQA groups or lies inside one. GQA with
fewer KV heads than P: DeepSpeed replicates each KV head P/H_kv times before the all-to-all so that
rank h receives the KV head of its query heads; dcp's head blocking (``kv_heads_per_block`` = 1 when a
head block lies inside a group) sends each rank exactly that head, so the KV bytes are Ulysses' own
(a KV head shared by r ranks is sent r times; its r dKV partials return and sum at home). Departure:
dcp's backward sends Q-side inputs (q, dO, lse, delta) and KV again, where DeepSpeed keeps the
head-sharded q, k, v, o of the forward and moves only dO (memory instead of bytes).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import direct_schedule, near_equal_chunks
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.layout.blocks import BlockLayout, head_blocking, make_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def ulysses_head_block_size(spec: BatchSpec, n_devices: int) -> int:
    """Query heads per rank (H/P), or ``InvalidConfigError`` naming why the heads cannot be split."""
    if spec.num_heads % n_devices:
        raise InvalidConfigError(f"ulysses: num_heads={spec.num_heads} is not divisible by the {n_devices} "
                                 "devices (the all-to-all gives every rank num_heads / P query heads)")
    hqb = spec.num_heads // n_devices
    try:
        head_blocking(spec, hqb)
    except InvalidConfigError as err:
        raise InvalidConfigError(f"ulysses: {hqb} query heads per rank split the GQA groups of "
                                 f"{spec.group_size} query heads per KV head unevenly ({err})") from None
    return hqb


def shard_blocks(spec: BatchSpec, n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Token blocks of P contiguous near-equal shards of the packed stream, cut at sequence starts too:
    (int64 start of each block as a packed row, int64 its shard = home)."""
    shard_start, shard = near_equal_chunks(spec.total_tokens, n_devices)
    starts = np.union1d(shard_start, spec.cu_seqlens[:-1].astype(np.int64))
    return starts, shard[np.searchsorted(shard_start, starts, side="right") - 1]


def _layout(spec: BatchSpec, starts: np.ndarray, head_block_size: int) -> BlockLayout:
    cu = spec.cu_seqlens.astype(np.int64)
    cuts = np.searchsorted(starts, cu)  # first block of every sequence
    bounds = [np.append(starts[a:b] - cu[s], spec.seqlens[s]) for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    return make_layout(spec, bounds, head_block_size)


@dataclass(frozen=True)
class UlyssesPlanner(Planner):
    """DeepSpeed-Ulysses: contiguous shards, an all-to-all to H/P heads of every token per rank, all
    tiles of head block h on rank h after it, outputs back by the reverse all-to-all. No knobs; tuning
    grid: itself."""

    name = "ulysses"

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        hqb = plan.layout.head_block_size
        plan.meta.update(heads_per_rank=hqb, kv_heads_per_rank=plan.layout.kv_heads_per_block,
                         kv_replication=spec.group_size // hqb if hqb < spec.group_size else 1)
        return plan

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        p = cluster.n_devices
        hqb = ulysses_head_block_size(spec, p)
        starts, home = shard_blocks(spec, p)
        layout = _layout(spec, starts, hqb)
        tiles = enumerate_tiles(spec, layout)
        tile_device = tiles.hb.astype(np.int64)
        # the all-to-all: every (tb, h) unit of both sides to rank h, whether a tile there reads it or not
        ntb = layout.n_token_blocks
        tb, hb = np.repeat(np.arange(ntb, dtype=np.int64), p), np.tile(np.arange(p, dtype=np.int64), ntb)
        extra = np.concatenate([np.stack([np.full_like(tb, side), tb, hb, hb], 1) for side in (0, 1)])
        tile_stage, routes = direct_schedule(layout, tiles, home, tile_device, 1, 1, extra_inputs=extra)
        if p > 1:
            # one attention call after the all-to-all; a tile away from a unit's home is in stage 1
            # already, so every partial still leaves in round 3
            tile_stage = np.maximum(tile_stage, 1)
        notes = []
        if hqb < spec.group_size:
            notes.append(f"ulysses: {spec.num_kv_heads} KV heads for {p} ranks: each KV head is sent to "
                         f"{spec.group_size // hqb} ranks (DeepSpeed's KV-head replication)")
        return StaticParts(layout, tiles, home, tile_device, tile_stage, routes, tuple(notes))

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        starts, _ = shard_blocks(spec, cluster.n_devices)
        nb = np.diff(np.searchsorted(starts, spec.cu_seqlens.astype(np.int64)))
        return int((nb * (nb + 1) // 2).sum()) * cluster.n_devices
