"""Packing placement: whole sequences where they fit, balanced splits where they must, q-stationary tiles.

The strongest static plans (Megatron-Core's dynamic CP, zigzag rings) are points of dcp's plan space:
every tile runs on its q block's home, so only KV travels (the cheaper side under GQA), and each
sequence lives on a *group* of devices. This module builds such placements without the static plans'
restrictions (power-of-two groups, aligned device ranges, 2·cp equal chunks, one ring per group):

1. **Groups.** Sequences go in decreasing order of work (the modelled compute time of each, whole). One that fits on a
   device — work within the compute cap ``(1 + epsilon) · mean`` and tokens within the memory cap — goes
   whole to the least-loaded device with room: no communication at all. One that fits nowhere is split
   over as few devices as its work needs: inside the node with the most room when that node suffices
   (NVLink only), else over the nodes with the most room; each member's *share* of the sequence is
   its free capacity.
2. **Blocks.** Whole sequences are cut at the configured block size; a sequence split over g devices
   is cut finer (at least three blocks per member, never below ``MIN_SPLIT_BLOCK`` tokens), so the
   shares can be met closely.
3. **Deal.** A split sequence's blocks, heaviest first, go to the member whose share is least filled
   (between nodes first, then between the devices of each node).
The planner builds packings at several ``epsilon`` and keeps the one whose schedule is estimated fastest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.blocks import BlockLayout, TileSet, enumerate_tiles, make_layout, uniform_cuts
from dcp.cluster import Cluster
from dcp.spec import BatchSpec

MIN_SPLIT_BLOCK = 256
"""Smallest token block a split sequence is cut into (tiles below this run far below peak)."""


@dataclass(frozen=True, eq=False)
class Packing:
    """A packing placement: its own block layout and tiles, the home of every token block (tiles run on
    their q block's home), and the device group of every sequence."""

    layout: BlockLayout
    tiles: TileSet
    home: np.ndarray
    groups: tuple[tuple[int, ...], ...]

    @property
    def tile_device(self) -> np.ndarray:
        return self.home[self.tiles.q_tb]


def sequence_areas(spec: BatchSpec) -> np.ndarray:
    """Exact attended (q, kv) pairs of every sequence (one head)."""
    out = np.empty(spec.num_seqs)
    for s in range(spec.num_seqs):
        r = spec.kv_ranges(s)
        out[s] = float((r[:, :, 1].astype(np.int64) - r[:, :, 0]).sum())
    return out


def pack(spec: BatchSpec, cluster: Cluster, block_size: int, head_block_size: int | None, epsilon: float,
         epsilon_memory: float, weights: np.ndarray | None = None, half_extent: float = 0.0) -> Packing:
    """The packing placement of the module docstring. ``weights``: the work of every sequence (default
    its mask's area; the planner gives its modelled compute time, in which short sequences weigh more
    than their FLOPs because small kernels run below peak). ``half_extent``: the query extent at which
    kernels run at half speed (the cost profile's ``half_rows``): a member holding a share of a split
    sequence runs its part on fewer query rows than the whole, so its load counts that slow-down."""
    n_dev, gpn = cluster.n_devices, cluster.gpus_per_node
    seq_w = sequence_areas(spec) if weights is None else np.asarray(weights, float)
    seq_t = np.asarray(spec.seqlens, float)
    cap_w = (1 + epsilon) * seq_w.sum() / n_dev
    cap_t = (1 + epsilon_memory) * seq_t.sum() / n_dev
    load, tokens = np.zeros(n_dev), np.zeros(n_dev)
    groups: list[tuple[int, ...]] = [()] * spec.num_seqs
    shares: list[np.ndarray] = [np.ones(1)] * spec.num_seqs
    for s in np.lexsort((np.arange(spec.num_seqs), -seq_t, -seq_w)).tolist():
        w, t = float(seq_w[s]), float(seq_t[s])
        room = (load + w <= cap_w * (1 + 1e-9)) & (tokens + t <= cap_t * (1 + 1e-9))
        if room.any() or spec.seqlens[s] <= MIN_SPLIT_BLOCK:
            cand = np.flatnonzero(room) if room.any() else np.arange(n_dev)
            d = int(cand[np.lexsort((cand, tokens[cand], load[cand]))[0]])
            groups[s] = (d,)
            load[d] += w
            tokens[d] += t
            continue
        n = float(spec.seqlens[s])
        slow = lambda share: (n / (n + half_extent)) / (share * n / (share * n + half_extent))  # noqa: E731
        members = _group(load, cap_w, w * slow(cap_w / w), gpn)
        free = np.maximum(cap_w - load[members], 0.0)
        share = free / free.sum() if free.sum() > 0 else np.full(members.size, 1.0 / members.size)
        groups[s], shares[s] = tuple(members.tolist()), share
        load[members] += share * w * slow(share)
        tokens[members] += share * t
    bounds, homes = [], []
    for s, n in enumerate(spec.seqlens):
        if len(groups[s]) == 1:
            cuts = uniform_cuts(n, block_size)
            bounds.append(cuts)
            homes.append(np.full(cuts.size - 1, groups[s][0], dtype=np.int64))
        else:
            cuts, owner = zigzag_cuts(spec.kv_ranges(s), np.asarray(groups[s]), shares[s], block_size)
            bounds.append(cuts)
            homes.append(owner)
    layout = make_layout(spec, bounds, head_block_size)
    return Packing(layout, enumerate_tiles(spec, layout), np.concatenate(homes), tuple(groups))


def zigzag_cuts(ranges_tr2: np.ndarray, members: np.ndarray, share: np.ndarray,
                block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Block boundaries ``[0, ..., L]`` of one split sequence and the member owning each block.

    Member m (in node-major order) owns the m-th *pair* of strips counted from both ends,
    ``[x_m, x_m+1)`` and ``[L − x_m+1, L − x_m)`` (the last member the middle): a zigzag, so each member
    — and each node, whose members' strips are adjacent — holds early and late tokens. The cut points
    ``x`` are placed on the exact per-token work of the mask so that every pair's work is its member's
    share (for causal masks a pair's work is proportional to its length, so tokens follow the shares
    too). Strips longer than ``block_size`` are cut into blocks of at most ``block_size`` tokens."""
    seqlen = ranges_tr2.shape[0]
    work = (ranges_tr2[:, :, 1].astype(np.int64) - ranges_tr2[:, :, 0]).sum(axis=1)
    cum = np.concatenate([[0], np.cumsum(work)])
    total = float(cum[-1])
    half = seqlen // 2
    x = np.arange(half + 1)
    strip = cum[x] + (total - cum[seqlen - x])  # work of [0, x) and [L - x, L)
    target = np.cumsum(share)[:-1] / share.sum() * total
    xs = np.maximum.accumulate(np.concatenate([[0], np.searchsorted(strip, target), [half]]).clip(0, half))
    g = members.size
    pieces = []
    for m in range(g):
        if m < g - 1:
            strips = ((xs[m], xs[m + 1]), (seqlen - xs[m + 1], seqlen - xs[m]))
        else:
            strips = ((xs[m], seqlen - xs[m]),)
        pieces += [(int(a), int(b), int(members[m])) for a, b in strips if b > a]
    pieces.sort()
    cuts, owner = [0], []
    for a, b, d in pieces:
        k = -(-(b - a) // block_size)
        cuts += (a + (np.arange(1, k + 1) * (b - a)) // k).tolist()
        owner += [d] * k
    return np.asarray(cuts, dtype=np.int64), np.asarray(owner, dtype=np.int64)


def _group(load: np.ndarray, cap_w: float, w: float, gpn: int) -> np.ndarray:
    """Devices a sequence of work ``w`` is split over: the fewest with enough free capacity, inside the
    node with the most room if it suffices, else over the nodes with the most room."""
    free = np.maximum(cap_w - load, 0.0)
    node_free = free.reshape(-1, gpn).sum(axis=1)
    chosen: list[int] = []
    need = w
    for nd in np.lexsort((np.arange(node_free.size), -node_free)).tolist():
        devs = nd * gpn + np.arange(gpn)
        devs = devs[np.lexsort((devs, -free[devs]))]
        devs = devs[free[devs] > 0]
        if node_free[nd] >= need * (1 - 1e-9):  # this node finishes it: its fewest devices that suffice
            take = int(np.searchsorted(np.cumsum(free[devs]), need * (1 - 1e-9))) + 1
            chosen += devs[:take].tolist()
            need = 0.0
            break
        chosen += devs.tolist()
        need -= node_free[nd]
    if need > 0 or len(chosen) < 2:  # not enough room anywhere: the least-loaded devices
        k = max(2, int(np.ceil(w / max(cap_w, 1e-300))))
        chosen = np.lexsort((np.arange(load.size), load))[:k].tolist()
    return np.asarray(sorted(chosen), dtype=np.int64)
