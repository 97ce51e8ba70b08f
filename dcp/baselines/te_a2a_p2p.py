"""TransformerEngine's hierarchical context parallelism (``cp_comm_type="a2a+p2p"``).

All-to-all over heads (Ulysses) inside a node, a p2p ring across nodes. Every sequence is zigzag-split
over the N nodes (2N chunks, node n holds chunks n and 2N-1-n), and each node chunk is split evenly over
the node's G GPUs: those sub-blocks are the token blocks, homed on their GPU. Heads are cut into G head
blocks; the tiles of head block h whose q block lives on node n run on GPU (n, h mod G).

Inputs: q-side units go from their home to (their node, hb) in round 1 (the all-to-all); KV-side units
take the same all-to-all in round 1, then travel the node ring (n, g) → (n+1, g) in rounds 2, 3, …, only
as far as needed. Outputs: O/dQ partials go straight home (the reverse all-to-all); dKV partials
accumulate hop by hop along the node ring, end at (origin node, hb) and go home from there. With one
node this is pure Ulysses. When the heads cannot be cut into G blocks (num_heads % G, or GQA groups
that neither divide nor are divided by num_heads / G), TE's all-to-all is impossible and the planner
falls back to its p2p-only mode: a zigzag ring over all devices (noted in the plan).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import (BlockBuilder, causal_tiles, check_shards, near_equal_chunks, near_equal_parts,
                                  relay_schedule, shard_note, zigzag_device)
from dcp.baselines.zigzag import zigzag_parts
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.layout.blocks import head_blocking
from dcp.layout.tiles import enumerate_tiles
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def a2a_head_block_size(spec: BatchSpec, gpus: int) -> int | None:
    """Query heads per head block for an all-to-all over ``gpus`` GPUs, or None when impossible."""
    if spec.num_heads % gpus:
        return None
    try:
        head_blocking(spec, spec.num_heads // gpus)
    except InvalidConfigError:
        return None
    return spec.num_heads // gpus


def hierarchical_tiles(seqlens, n_devices: int, hp: int) -> int:
    """Tiles of ``hierarchical_parts`` under causal masks (about): zigzag chunks over the cp ranks, each
    cut into ``hp`` parts, times ``hp`` head blocks."""
    if hp == 1:
        return causal_tiles(seqlens, 2 * n_devices)
    return causal_tiles(seqlens, 2 * (n_devices // hp), hp) * hp


def hierarchical_parts(spec: BatchSpec, n_devices: int, hp: int, inner: int, shards: bool | None = False):
    """(layout, tiles, home, tile_device, tile_stage, routes) of head x context parallelism.

    ``hp`` devices in a row form a head-parallel (all-to-all) group; the ``cp = n_devices / hp`` groups
    are the context ranks, ranked in device order. Sequences are zigzag-split over the cp ranks and each
    rank's chunk is split evenly over its hp devices. Tiles of head block h whose q block lives on rank r
    run on device r*hp + h mod hp. KV units relay over the ranks sharing their hp index, as a double ring
    with inner rings of ``inner`` consecutive ranks (``inner=1``: one plain ring over the ranks).
    ``shards``: group each device's blocks (``dcp.baselines.common.use_shards``)."""
    cp = n_devices // hp
    builder = BlockBuilder(spec)
    for n in spec.seqlens:
        starts, chunk = near_equal_chunks(n, 2 * cp)
        rank = zigzag_device(chunk, cp)
        # each rank chunk cut into hp near-equal parts, homed on the rank's hp devices (empty parts dropped)
        offset, keep = near_equal_parts(np.diff(np.append(starts, n)), hp)
        builder.add((starts[:, None] + offset)[keep], (rank[:, None] * hp + np.arange(hp))[keep])
    layout, home = builder.parts(None if hp == 1 else spec.num_heads // hp, shards)[:2]
    tiles = enumerate_tiles(spec, layout)
    nhb = layout.n_head_blocks
    rank_of = home // hp
    tile_device = rank_of[tiles.q_tb] * hp + tiles.hb.astype(np.int64) % hp
    kv_base = np.tile(np.arange(nhb, dtype=np.int64), layout.n_token_blocks) % hp
    full = lambda v: np.full_like(kv_base, v)  # noqa: E731
    tile_stage, routes = relay_schedule(layout, tiles, home, tile_device, kv_base, full(hp), full(cp),
                                        np.repeat(rank_of, nhb), offset=int(hp > 1), kv_inner=full(inner))
    return layout, tiles, home, tile_device, tile_stage, routes


@dataclass(frozen=True)
class TEA2AP2PPlanner(Planner):
    """Hierarchical CP: Ulysses all-to-all inside groups of ``head_parallel`` GPUs of a node, zigzag p2p
    ring across the groups. ``head_parallel``: the all-to-all size (None: the node's GPUs, TE's usual
    configuration; it must divide the GPUs per node and split the heads); ``shards``: as ``RingPlanner``'s.
    Tuning grid: every ``head_parallel`` dividing the GPUs per node that the heads allow (1: a zigzag ring
    over all devices)."""

    shards: bool | None = None
    head_parallel: int | None = None
    name = "te_a2a_p2p"

    def __post_init__(self):
        check_shards(self.shards)
        hp = self.head_parallel
        if hp is not None and (not isinstance(hp, (int, np.integer)) or isinstance(hp, bool) or hp < 1):
            raise InvalidConfigError(f"head_parallel must be a positive int or None, got {hp!r}")

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        plan.meta.update(head_parallel=self._head_parallel(spec, cluster))
        return plan

    def _head_parallel(self, spec: BatchSpec, cluster: Cluster) -> int:
        """GPUs per all-to-all group: the knob, else the node's, or 1 (a zigzag ring) when the heads cannot
        be split over the node."""
        g = cluster.gpus_per_node
        hp = self.head_parallel
        if hp is None:
            return 1 if g > 1 and a2a_head_block_size(spec, g) is None else g
        if g % hp or (hp > 1 and a2a_head_block_size(spec, hp) is None):
            raise InvalidConfigError(f"head_parallel={hp} must divide the {g} GPUs per node and split the "
                                     f"{spec.num_heads} query heads ({spec.num_kv_heads} KV heads) evenly")
        return hp

    def warm_points(self, spec: BatchSpec, cluster: Cluster, token_budget: float) -> tuple[Planner, ...]:
        """``head_parallel=None``: this planner and, where the heads allow it, the all-to-all over a half, a
        quarter, ... of a node, down to 2 GPUs (its ring then spans 2, 4, ... times the groups: on the micro
        grid's LongAlign x4 causal batches those starts won where dcp had lost to TE tuned to a smaller
        all-to-all; a single 104K-token sequence on 4 x 8 A100s is fastest forward at 2); a set size: this
        planner. Every setting holds the mean tokens per device."""
        g = cluster.gpus_per_node
        if self.head_parallel is not None or g < 4 or self._head_parallel(spec, cluster) != g:
            return (self,)
        smaller, hp = [], g // 2
        while hp >= 2 and g % hp == 0:
            if a2a_head_block_size(spec, hp) is not None:
                smaller.append(TEA2AP2PPlanner(self.shards, hp))
            hp //= 2
        return (self, *smaller)

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        g = cluster.gpus_per_node
        hps = [h for h in range(1, g + 1) if g % h == 0 and (h == 1 or a2a_head_block_size(spec, h) is not None)]
        return tuple(TEA2AP2PPlanner(self.shards, h) for h in hps)

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        g = cluster.gpus_per_node
        hp = self._head_parallel(spec, cluster)
        if self.head_parallel is None and hp != g:
            note = (f"te_a2a_p2p: {spec.num_heads} query heads ({spec.num_kv_heads} KV heads) cannot be split "
                    f"over {g} GPUs for the all-to-all; fell back to a p2p zigzag ring over all devices")
            parts = zigzag_parts(spec, cluster.n_devices, self.shards)
            return StaticParts(*parts, (note, *shard_note(self.name, parts[0])))
        if hp == 1:
            parts = zigzag_parts(spec, cluster.n_devices, self.shards)
            return StaticParts(*parts, shard_note(self.name, parts[0]))
        parts = hierarchical_parts(spec, cluster.n_devices, hp, 1, self.shards)
        return StaticParts(*parts, shard_note(self.name, parts[0]))

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        hp = self._head_parallel(spec, cluster)
        return hierarchical_tiles(spec.seqlens, cluster.n_devices, hp)
