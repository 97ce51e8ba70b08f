"""PyTorch context parallelism (``torch.distributed.tensor.experimental.context_parallel``).

PyTorch shards Q, K and V along the sequence after reordering the tokens with a *load balancer*
(``_context_parallel/_load_balancer.py``); Q stays sharded and K/V are all-gathered (the default rotate
method "allgather"; FlexAttention's CP always all-gathers), so every rank computes its own queries
against the whole KV, and the backward reduce-scatters dK/dV. Two balancers:

- ``"head_tail"`` (``_PerDocumentHeadTailLoadBalancer``, the per-document head-tail balancer of varlen /
  document-masked CP): every sequence (document) is cut into 2P chunks and rank i takes chunks i and
  2P-1-i. PyTorch requires (pads) every document to a multiple of 2P tokens; dcp does not pad: chunks
  are near-equal (sizes differ by one) and a document shorter than 2P tokens has fewer, one-token chunks.
- ``"ptrr"`` (``_PTRRLoadBalancer``, processing-time round-robin for FlexAttention block masks): the packed
  batch is one sequence of ``block_size``-token blocks. A q-block row's processing time is what PyTorch
  reads off the ``BlockMask``: the number of non-empty KV blocks in the row (``kv_num_blocks +
  full_kv_num_blocks``), not the number of attended pairs. Rows are sorted by it, descending (stable),
  and dealt zig-zag over the ranks: the sorted rows 0..P-1 to ranks 0..P-1, rows P..2P-1 to ranks
  P-1..0, and so on. PyTorch needs the block count to be a multiple of P; dcp deals a last partial round
  as any other (ranks then hold one block more or less) and keeps a short last block (no padding). A dcp
  token block belongs to one sequence, so a packed block that straddles sequences is cut at their
  boundaries into pieces that all go to that block's rank.

Plan in dcp's IR (both balancers): tiles run on their q block's home (Q, O and dQ never move); every KV
unit goes from its home to every other rank in round 1 whether a tile there needs it or not (an
all-gather: the unneeded copies are ``direct_schedule`` extra inputs, so their bytes are charged); tiles
whose KV is local run in stage 0 while the all-gather is in flight, the rest in stage 1; dKV partials go
straight home (the reduce-scatter). Across nodes the collectives are hierarchical, as NCCL's are: a unit
enters a remote node once (round 1, to the GPU with its home's local index) and is relayed inside it
(round 2; tiles needing it run in stage 2), and a remote node's dKV partials merge there before one
transfer home (``direct_schedule(..., gpus_per_node)``). Departures: dcp's backward gathers KV again (PyTorch keeps the
gathered K/V of the forward alive for its backward: memory instead of bytes); FlexAttention's all-gather
is waited for before its single attention call, so dcp's stage 0 overlap is slightly optimistic for
``ptrr`` (the varlen/SDPA path does overlap its local step with the gather).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import BlockBuilder, causal_tiles, direct_schedule, near_equal_chunks, zigzag_device
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.layout.blocks import BlockLayout, TileSet, make_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec

BALANCERS = ("head_tail", "ptrr")
FLEX_BLOCK_SIZE = 128  # FlexAttention's default BlockMask block size


def ptrr_ranks(work: np.ndarray, n_ranks: int) -> np.ndarray:
    """Rank of every task under processing-time round-robin: tasks sorted by ``work`` (descending, ties
    in index order) are dealt 0..P-1, then P-1..0, then 0..P-1, ... (int64 ``[n_tasks]``)."""
    order = np.argsort(-np.asarray(work), kind="stable")
    pos = np.arange(order.size, dtype=np.int64)
    col = pos % n_ranks
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.where((pos // n_ranks) % 2 == 0, col, n_ranks - 1 - col)
    return rank


def packed_block_cuts(spec: BatchSpec, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Token blocks of the packed batch cut every ``block_size`` tokens and at every sequence start:
    (int64 start of each block as a packed row, int64 index of the ``block_size`` block it lies in)."""
    cu = spec.cu_seqlens.astype(np.int64)
    starts = np.union1d(np.arange(0, spec.total_tokens, block_size, dtype=np.int64), cu[:-1])
    return starts, starts // block_size


def _layout_from_packed_starts(spec: BatchSpec, starts: np.ndarray) -> BlockLayout:
    """Layout whose blocks start at the packed rows ``starts`` (increasing, every sequence start among
    them), one head block of all heads."""
    cu = spec.cu_seqlens.astype(np.int64)
    seq = np.searchsorted(cu, starts, side="right") - 1
    cuts = np.searchsorted(seq, np.arange(spec.num_seqs + 1))
    bounds = [np.append(starts[a:b] - cu[s], spec.seqlens[s]) for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    return make_layout(spec, bounds, None)


def all_gather_extras(layout: BlockLayout, n_devices: int) -> np.ndarray:
    """Rows (side 1, tb, hb, dst) sending every KV unit to every device (``direct_schedule`` drops the
    home and the deliveries tiles ask for): int64 ``[n_units * n_devices, 4]``."""
    unit = np.tile(np.arange(layout.n_token_blocks * layout.n_head_blocks, dtype=np.int64), n_devices)
    dst = np.repeat(np.arange(n_devices, dtype=np.int64), layout.n_token_blocks * layout.n_head_blocks)
    nhb = layout.n_head_blocks
    return np.stack([np.ones_like(unit), unit // nhb, unit % nhb, dst], 1)


@dataclass(frozen=True)
class TorchCPPlanner(Planner):
    """PyTorch context parallelism: Q sharded by a load balancer, KV all-gathered, dKV reduce-scattered.

    ``balancer``: "head_tail" (default; per-document chunks i and 2P-1-i on rank i) or "ptrr"
    (processing-time round-robin of ``block_size``-token q-block rows, FlexAttention CP). ``block_size``:
    ptrr's block (FlexAttention's default 128; unused by head_tail). Tuning grid: head_tail, and ptrr at
    block_size 128 and 256."""

    balancer: str = "head_tail"
    block_size: int = FLEX_BLOCK_SIZE
    name = "torch_cp"

    def __post_init__(self):
        if self.balancer not in BALANCERS:
            raise InvalidConfigError(f"torch_cp: balancer must be one of {BALANCERS}, got {self.balancer!r}")
        b = self.block_size
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b <= 0:
            raise InvalidConfigError(f"torch_cp: block_size must be a positive int, got {b!r}")

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        plan.meta.update(balancer=self.balancer, block_size=int(self.block_size))
        return plan

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        return (TorchCPPlanner("head_tail"), TorchCPPlanner("ptrr", 128), TorchCPPlanner("ptrr", 256))

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        p = cluster.n_devices
        if self.balancer == "head_tail":
            layout, tiles, home = self._head_tail(spec, p)
            notes = ("torch_cp: documents are cut into 2P near-equal chunks without padding to a multiple "
                     "of 2P; shorter ones leave some chunks empty",) if min(spec.seqlens) < 2 * p else ()
        else:
            layout, tiles, home, n_blocks = self._ptrr(spec, p)
            notes = (f"torch_cp: {n_blocks} blocks of {self.block_size} tokens is not a multiple of {p} ranks "
                     "(PyTorch's PTRR requires it); the last round of the deal is partial",) if n_blocks % p else ()
        tile_device = home[tiles.q_tb]
        # all-gather: every KV unit everywhere in round 1; local-KV tiles run in stage 0 meanwhile
        tile_stage, routes = direct_schedule(layout, tiles, home, tile_device, 1, 1,
                                             extra_inputs=all_gather_extras(layout, p),
                                             gpus_per_node=cluster.gpus_per_node)
        return StaticParts(layout, tiles, home, tile_device, tile_stage, routes, notes)

    def _head_tail(self, spec: BatchSpec, p: int) -> tuple[BlockLayout, TileSet, np.ndarray]:
        builder = BlockBuilder(spec)
        for n in spec.seqlens:
            starts, chunk = near_equal_chunks(n, 2 * p)
            builder.add(starts, zigzag_device(chunk, p))
        layout = builder.layout(None)
        return layout, enumerate_tiles(spec, layout), builder.arrays()[0]

    def _ptrr(self, spec: BatchSpec, p: int) -> tuple[BlockLayout, TileSet, np.ndarray, int]:
        starts, packed = packed_block_cuts(spec, int(self.block_size))
        layout = _layout_from_packed_starts(spec, starts)
        tiles = enumerate_tiles(spec, layout)
        n_blocks = int(packed[-1]) + 1
        # a packed q-block row's work: its distinct non-empty packed KV blocks (PyTorch's BlockMask count)
        one = tiles.hb == 0
        pair = np.unique(packed[tiles.q_tb[one]] * n_blocks + packed[tiles.kv_tb[one]])
        work = np.bincount(pair // n_blocks, minlength=n_blocks)
        return layout, tiles, ptrr_ranks(work, p)[packed], n_blocks

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        if self.balancer == "head_tail":
            return causal_tiles(spec.seqlens, 2 * cluster.n_devices)
        starts, _ = packed_block_cuts(spec, int(self.block_size))
        cu = spec.cu_seqlens.astype(np.int64)
        nb = np.diff(np.searchsorted(starts, cu))  # blocks per sequence
        return int((nb * (nb + 1) // 2).sum())
