"""Placement: token blocks to home devices and tiles to devices, two levels, two balance constraints.

The hypergraph has a vertex per home (token block, weight = tokens) and per tile (weight = its
forward + backward FLOPs), and a net per data unit over its home and the tiles that read or write it:
the Q side (Q, O, dO, dQ ... of a q block and head block) and the KV side (KV and dKV). Net weights are
the bytes that cross when the net spans two parts, so km1 is the bytes communicated.

KaHyPar and Mt-KaHyPar balance one weight per vertex. Two constraints (compute ≤ (1+ε_c)·mean,
resident tokens ≤ (1+ε_m)·mean) are met in three steps per level:
1. partition with both weights folded in (a home's tokens rescaled to compute units, so homes and tiles
   each carry half the total) — this places homes next to the tiles they feed;
2. repair memory: move homes out of over-full parts to the part where they add the fewest bytes;
3. fix every home to its part and place the tiles again with compute weights only and caps
   (1+ε_c)·mean, twice: partitioned anew, and step 1's placement refined (V-cycles; repaired first to
   meet the caps); the one that cuts fewer bytes stays. A final greedy pass moves tiles only if the
   partitioner still left a part above its cap.
Levels: first the nodes (ε_inter), then the GPUs of each node (ε_intra) on the node's sub-hypergraph. A
wide node tolerance (ε_inter > 0.1) is a limit, not a target: the node split is also made at half of it
and kept when it cuts at most 3 % more bytes.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from dcp.errors import PartitionerError
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.units import Kind, bytes_per_token
from dcp.partition import WORKER, GreedyPartitioner, Hypergraph, Partitioner, run_partitioner, scale_to_int32
from dcp.spec import BatchSpec


@dataclass(frozen=True, eq=False)
class Assignment:
    """``home[tb]``: device of each token block; ``tile_device[t]``: device of each tile."""

    home: np.ndarray
    tile_device: np.ndarray
    fallbacks: tuple[str, ...] = ()


def vertex_ids(layout: BlockLayout, tiles: TileSet) -> tuple[np.ndarray, np.ndarray]:
    """(home vertex of each token block, vertex of each tile): each home comes right before the tiles of
    its q block, so vertex order follows sequences (the greedy partitioner cuts that order into runs)."""
    n_tb = layout.n_token_blocks
    before = np.searchsorted(tiles.q_tb, np.arange(n_tb), side="left")  # tiles are sorted by q block
    home_vertex = np.arange(n_tb, dtype=np.int64) + before
    tile_vertex = np.arange(tiles.n_tiles, dtype=np.int64) + tiles.q_tb + 1
    return home_vertex, tile_vertex


def build_hypergraph(spec: BatchSpec, layout: BlockLayout, tiles: TileSet, tile_cost: np.ndarray) -> tuple[Hypergraph, np.ndarray, np.ndarray]:
    """Vertices: homes and tiles (see ``vertex_ids``). Returns (hypergraph with compute weights on tiles
    and zero on homes, memory weight per vertex, net weights in bytes as float)."""
    n_tb = layout.n_token_blocks
    n_v = n_tb + tiles.n_tiles
    bpt = bytes_per_token(spec, layout)
    q_side = bpt[Kind.Q] + bpt[Kind.O] + bpt[Kind.QG] + bpt[Kind.DQ]
    kv_side = 2 * bpt[Kind.KV] + bpt[Kind.DKV]
    home_vertex, tile_vertex = vertex_ids(layout, tiles)
    nets_ptr, nets_pins, nets_w = [], [], []
    offset = 0
    for blocks, side_bytes in ((tiles.q_tb, q_side), (tiles.kv_tb, kv_side)):
        key = blocks.astype(np.int64) * layout.n_head_blocks + tiles.hb
        order = np.argsort(key, kind="stable")
        skey = key[order]
        starts = np.flatnonzero(np.r_[True, skey[1:] != skey[:-1]])
        group_tb = blocks[order][starts]
        pins = np.insert(tile_vertex[order], starts, home_vertex[group_tb])
        counts = np.diff(np.r_[starts, skey.size]) + 1
        nets_ptr.append(offset + np.r_[0, np.cumsum(counts)][:-1])
        offset += pins.size
        nets_pins.append(pins)
        nets_w.append(side_bytes * layout.tb_len[group_tb].astype(np.float64))
    net_ptr = np.r_[np.concatenate(nets_ptr), offset]
    net_bytes = np.concatenate(nets_w)
    vw = np.zeros(n_v)
    vw[tile_vertex] = tile_cost
    mem = np.zeros(n_v)
    mem[home_vertex] = layout.tb_len
    hg = Hypergraph(vw, net_ptr, np.concatenate(nets_pins).astype(np.int32), net_bytes)
    return hg, mem, net_bytes


def _int_hypergraph(hg: Hypergraph, vertex_w: np.ndarray) -> Hypergraph:
    return Hypergraph(scale_to_int32(vertex_w), hg.net_ptr, hg.net_pins, scale_to_int32(hg.net_weight, 1 << 24))


def _pin_counts(hg: Hypergraph, parts: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(hg.net_of_pin() * k + parts[hg.net_pins], minlength=hg.n_nets * k).reshape(hg.n_nets, k)


def _vertex_nets(hg: Hypergraph):
    """CSR of nets per vertex."""
    net = hg.net_of_pin()
    order = np.argsort(hg.net_pins, kind="stable")
    ptr = np.r_[0, np.cumsum(np.bincount(hg.net_pins, minlength=hg.n_vertices))]
    return ptr, net[order]


def _repair(hg: Hypergraph, parts: np.ndarray, k: int, weight: np.ndarray, cap: np.ndarray,
            movable: np.ndarray) -> np.ndarray:
    """Greedy: while a part exceeds its cap, move the movable vertex of that part (to a part with room)
    whose move adds the fewest bytes per unit of weight moved."""
    parts = parts.copy()
    load = np.bincount(parts, weights=weight, minlength=k)
    if (load <= cap * (1 + 1e-9)).all():
        return parts
    counts = _pin_counts(hg, parts, k)
    vptr, vnets = _vertex_nets(hg)
    net_w = hg.net_weight.astype(np.float64)
    for _ in range(hg.n_vertices):
        over = np.flatnonzero(load > cap * (1 + 1e-9))
        if over.size == 0:
            break
        p = int(over[np.argmax(load[over] - cap[over])])
        cand = np.flatnonzero((parts == p) & movable & (weight > 0))
        if cand.size == 0:
            break
        room = cap - load
        best = None
        # cost of moving v from p to q: nets gaining q minus nets losing p, per weight moved
        lens = vptr[cand + 1] - vptr[cand]
        owner = np.repeat(np.arange(cand.size), lens)
        # the candidates' nets, gathered from the CSR without a Python loop
        starts = np.repeat(vptr[cand] - (np.cumsum(lens) - lens), lens)
        nets = vnets[starts + np.arange(int(lens.sum()))]
        leave_gain = np.bincount(owner, weights=net_w[nets] * (counts[nets, p] == 1), minlength=cand.size)
        for q in range(k):
            if q == p:
                continue
            fits = weight[cand] <= room[q]
            if not fits.any():
                continue
            add = np.bincount(owner, weights=net_w[nets] * (counts[nets, q] == 0), minlength=cand.size)
            score = (add - leave_gain) / weight[cand]
            score[~fits] = np.inf
            i = int(np.argmin(score))
            if best is None or score[i] < best[0]:
                best = (score[i], int(cand[i]), q)
        if best is None or not np.isfinite(best[0]):
            # nothing fits anywhere: move the lightest vertex to the least loaded part
            i = int(cand[np.argmin(weight[cand])])
            others = [q for q in range(k) if q != p]
            best = (0.0, i, int(others[np.argmin(load[others])]))
        _, v, q = best
        for e in vnets[vptr[v]:vptr[v + 1]]:
            counts[e, p] -= 1
            counts[e, q] += 1
        load[p] -= weight[v]
        load[q] += weight[v]
        parts[v] = q
    return parts


def _split(hg: Hypergraph, is_home: np.ndarray, compute: np.ndarray, mem: np.ndarray, k: int,
           eps_c: float, eps_m: float, partitioner: Partitioner, seed: int, notes: list[str]) -> np.ndarray:
    """One level's split, by ``partitioner`` and by the greedy partitioner (milliseconds): the one with
    fewer bytes cut wins, so a placement is never worse than contiguous packing."""
    if k == 1 or hg.n_vertices == 0:  # a node may receive nothing when blocks are fewer than nodes
        return np.zeros(hg.n_vertices, dtype=np.int64)
    parts = _split_with(hg, is_home, compute, mem, k, eps_c, eps_m, partitioner, seed, notes)
    if isinstance(partitioner, GreedyPartitioner):
        return parts
    greedy = _split_with(hg, is_home, compute, mem, k, eps_c, eps_m, GreedyPartitioner(), seed, notes)
    return greedy if hg.km1(greedy) < hg.km1(parts) else parts


def _split_with(hg, is_home, compute, mem, k, eps_c, eps_m, partitioner, seed, notes) -> np.ndarray:
    c_total, m_total = compute.sum(), mem.sum()
    combined = compute + mem * (c_total / m_total if m_total > 0 else 0.0)
    ihg = _int_hypergraph(hg, combined)
    caps = np.full(k, int(np.ceil(ihg.vertex_weight.sum() / k * (1 + eps_c))))
    parts = _run(partitioner, ihg, k, caps, None, seed, notes)
    mem_cap = np.full(k, max(m_total / k * (1 + eps_m), mem.max()))
    parts = _repair(hg, parts, k, mem, mem_cap, is_home)
    fixed = np.where(is_home, parts, -1)
    ihg = _int_hypergraph(hg, np.where(is_home, 0.0, compute))
    caps = np.full(k, int(np.ceil(ihg.vertex_weight.sum() / k * (1 + eps_c))))
    comp_cap = np.full(k, max(c_total / k * (1 + eps_c), compute.max()))
    # step 3 twice: tiles partitioned anew around the fixed homes, and step 1's placement (made to meet
    # the compute caps) refined; the one that cuts fewer bytes stays
    scratch = _repair(hg, _run(partitioner, ihg, k, caps, fixed, seed, notes), k, compute, comp_cap, ~is_home)
    start = _repair(hg, parts, k, compute, comp_cap, ~is_home)
    refined = _repair(hg, _run(partitioner, ihg, k, caps, fixed, seed, notes, initial=start), k, compute, comp_cap,
                      ~is_home)
    return refined if hg.km1(refined) < hg.km1(scratch) else scratch


def _run(partitioner, ihg, k, caps, fixed, seed, notes, initial=None):
    try:
        return run_partitioner(partitioner, ihg, k, caps, fixed, seed, initial)
    except PartitionerError as err:
        notes.append(f"{partitioner.name} failed ({err}); used the greedy partitioner for one split")
        if initial is not None:
            return np.asarray(initial, dtype=np.int64)
        return run_partitioner(GreedyPartitioner(), ihg, k, caps, fixed, seed)


def place_two_levels(hg: Hypergraph, is_home: np.ndarray, mem: np.ndarray, nodes: int, gpus_per_node: int,
                     partitioner: Partitioner, eps_inter: float, eps_intra: float, eps_memory: float,
                     seed: int) -> tuple[np.ndarray, list[str]]:
    """Device of every vertex: nodes first, then the GPUs of each node. Returns (device, notes)."""
    compute = hg.vertex_weight.astype(np.float64)
    notes: list[str] = []
    node_of = _split(hg, is_home, compute, mem, nodes, eps_inter, eps_memory, partitioner, seed, notes)
    if nodes > 1 and eps_inter > SLACK_PROBE:
        # a wide tolerance is a limit, not a target: half of it, if that cuts at most a few percent
        # more bytes, balances the nodes better for about the same communication
        tight = _split(hg, is_home, compute, mem, nodes, eps_inter / 2, eps_memory, partitioner, seed, notes)
        if hg.km1(tight) <= (1 + SLACK_COST) * hg.km1(node_of):
            node_of = tight
    device = np.empty(hg.n_vertices, dtype=np.int64)
    for node in range(nodes):
        sub, ids = hg.sub(node_of == node)
        local = _split(sub, is_home[ids], compute[ids], mem[ids], gpus_per_node, eps_intra, eps_memory,
                       partitioner, seed, notes)
        device[ids] = node * gpus_per_node + local
    return device, notes


SLACK_PROBE = 0.1
"""Node tolerances above this are also tried at half their value (``place_two_levels``)."""
SLACK_COST = 0.03
"""... and the half is kept when it cuts at most this fraction more bytes."""


class PendingAssignment:
    """A two-level placement being computed in the partitioner worker (``start_assign``)."""

    def __init__(self, job, home_vertex: np.ndarray, tile_vertex: np.ndarray, inline_args: tuple | None):
        self._job, self._home_vertex, self._tile_vertex, self._inline = job, home_vertex, tile_vertex, inline_args

    def result(self) -> Assignment:
        """The placement; raises ``PartitionerError`` (``PartitionerTimeout`` past the budget)."""
        if self._job is None:
            device, notes = place_two_levels(*self._inline)
        else:
            device, notes = self._job.result()
        return Assignment(device[self._home_vertex].astype(np.int32), device[self._tile_vertex].astype(np.int32),
                          tuple(notes))

    def cancel(self) -> None:
        if self._job is not None:
            self._job.cancel()


def start_assign(spec: BatchSpec, layout: BlockLayout, tiles: TileSet, tile_cost: np.ndarray, nodes: int,
                 gpus_per_node: int, partitioner: Partitioner, eps_inter: float, eps_intra: float,
                 eps_memory: float, seed: int, time_budget_s: float | None) -> PendingAssignment:
    """Start the two-level placement (module docstring) in the partitioner worker under
    ``time_budget_s`` and return at once (None, or the greedy partitioner: computed in this process
    when ``result()`` is called)."""
    hg, mem, _ = build_hypergraph(spec, layout, tiles, tile_cost)
    home_vertex, tile_vertex = vertex_ids(layout, tiles)
    is_home = np.zeros(hg.n_vertices, dtype=bool)
    is_home[home_vertex] = True
    args = (hg, is_home, mem, nodes, gpus_per_node, partitioner, eps_inter, eps_intra, eps_memory, seed)
    if time_budget_s is None or isinstance(partitioner, GreedyPartitioner):
        return PendingAssignment(None, home_vertex, tile_vertex, args)
    return PendingAssignment(WORKER.submit(place_two_levels, args, time_budget_s), home_vertex, tile_vertex, None)


def assign(spec: BatchSpec, layout: BlockLayout, tiles: TileSet, tile_cost: np.ndarray, nodes: int,
           gpus_per_node: int, partitioner: Partitioner, eps_inter: float, eps_intra: float,
           eps_memory: float, seed: int, time_budget_s: float | None) -> Assignment:
    """Two-level placement (see module docstring). ``tile_cost``: compute weight per tile (FLOPs).

    The partitioning runs in the partitioner worker process under ``time_budget_s`` (None: in this
    process, unbounded); on timeout or failure it falls back to the greedy partitioner and warns."""
    pending = start_assign(spec, layout, tiles, tile_cost, nodes, gpus_per_node, partitioner, eps_inter,
                           eps_intra, eps_memory, seed, time_budget_s)
    try:
        placed = pending.result()
    except PartitionerError as err:
        msg = f"{partitioner.name}: {err}; fell back to the greedy partitioner"
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
        placed = start_assign(spec, layout, tiles, tile_cost, nodes, gpus_per_node, GreedyPartitioner(), eps_inter,
                              eps_intra, eps_memory, seed, None).result()
        return Assignment(placed.home, placed.tile_device, (msg,) + placed.fallbacks)
    for note in placed.fallbacks:
        warnings.warn(note, RuntimeWarning, stacklevel=2)
    return placed
