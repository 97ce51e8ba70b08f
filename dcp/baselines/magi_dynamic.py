"""MagiAttention's dynamic attention solver (SandAI, github.com/SandAI-org/MagiAttention): tiles placed
anywhere, with Q/O as well as KV movable (the blog's "scheduling with QO-comm enabled").

Reproduced: the binary-greedy solver of releases v1.1.0/v1.1.1 (``BinaryGreedyParallelDynamicAttnAlgorithm``,
the default of ``DynamicAttnSolver``; unchanged between the two), with its unbalance rate 1.10 as ``mu``;
its QO-comm mode turns multi-stage overlap off (v1.1.1: ``degree=1``), the default here. The blog post on
this solver is still "coming soon"; the behaviour below is read from the released source and
re-implemented, not copied.

Tokens stay where the data loader put them: the packed stream is cut into P contiguous near-equal
shards, rank i homes shard i; token blocks are cut at sequence boundaries, at shard boundaries and every
``chunk_size`` tokens from each shard's start. A task is one (q block, kv block) tile with all heads
together (one head block); its weight is its mask area. The solver:

1. *Edges.* Every q block and every kv block may be copied from its home to any other rank; such a copy
   is an edge costing, as in Magi, the block's length x its heads (query heads for a q block, KV heads
   for a kv block) on both endpoints. An edge's score is its weight per cost, the weight being
   0.95 x (the area of the block's tiles the last feasible placement ran on that rank, or before any
   placement 0.95/P of the block's area) + 0.05 x the mean per-rank area / P.
2. *Selection under a volume threshold.* Edges by decreasing score (the best max(2048, half) of them,
   as Magi keeps) are taken while both endpoints' send + receive volume stays within the threshold. A
   tile may run on a rank holding both its q block and its kv block (homes included); a tile with no
   such rank makes the threshold infeasible.
3. *Greedy placement.* Tiles by increasing number of allowed ranks, then decreasing area: a tile whose
   blocks share a home stays there; otherwise its q block's home if allowed and still below the mean
   area, else the least-loaded allowed rank.
4. *Refinement.* Up to 5 passes move tiles off ranks above ``mu`` x the mean area to the allowed rank
   where they land lowest, if that is below their current rank's load.
5. *Binary search* on the threshold (from everything movable twice, down to 1 % precision, at most 20
   tries; the first try allows every edge): the smallest threshold whose placement keeps every rank
   within ``mu`` x the mean wins; edges are re-scored after each feasible try. If none is feasible, the
   try allowing every edge stands (noted in the plan).

Routes by ``dcp.baselines.common.direct_schedule``: Q and KV multicast straight from home, O/dQ/dKV
partials straight home. Remote work is staged as in ``dcp.baselines.magi``: on each rank the tiles with a
remote input, ordered by (kv block, q block), are cut into ``degree`` groups of near-equal area; group g
asks for its inputs in round g+1 (a block shared by groups comes with the earliest).

Simplified: a task is a block pair, not one of Magi's rectangles from its recursive grid split of the
mask; Magi's head-group ("usp") preference in step 3 is left out (with its default of one head group it
is the q block's home, which step 3 already prefers); tiles whose blocks share a home are placed before
the others (Magi interleaves them in the degree order, so the loads step 3 compares with the mean grow
in another order).
"""
from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass

import numpy as np

from dcp.baselines.magi import (SolvedPlanner, blocks_per_seq, causal_bound, check_chunk_size, check_degree,
                                global_cuts, layout_from_cuts, resolve_chunk_size, stage_notes, staged_schedule)
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.layout.blocks import BlockLayout, TileSet
from dcp.layout.tiles import enumerate_tiles
from dcp.schedule.assemble import Planner, StaticParts
from dcp.spec import BatchSpec

try:  # the greedy placement's C++ loop, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE_PLACE = hasattr(_C, "magi_place")
except ImportError:
    _C, _NATIVE_PLACE = None, False

MAX_TRIES = 20  # binary search steps
EPS = 1e-2  # relative precision of the threshold
REFINE_PASSES = 5
TOP_EDGES = 2048  # edges beyond the best max(TOP_EDGES, half) are never selected
#: the tuning grid of ``MagiDynamicPlanner``
CHUNK_GRID = (1024, 2048)
DEGREE_GRID = (1, 2, 4)
MU_GRID = (1.05, 1.2)


def shard_cuts(total_tokens: int, n_ranks: int, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard starts, int64 ``[P + 1]``; cut positions: shard boundaries and every ``chunk_size`` tokens
    from each shard's start)."""
    shard = np.arange(n_ranks + 1, dtype=np.int64) * total_tokens // n_ranks
    size = np.diff(shard)
    per = -(-size // chunk_size)  # chunk starts per shard
    first = np.repeat(shard[:-1], per)
    offs = np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)
    return shard, np.concatenate([shard, first + offs * chunk_size])


@dataclass
class Solution:
    """The solver's placement: ``rank`` (int64 per tile), whether every rank is within the cap, the
    threshold it was found at (inf: the first try, every copy allowed) and the tries made."""

    rank: np.ndarray
    feasible: bool
    threshold: float
    tries: int


def solve(q_unit, kv_unit, area, unit_home, q_cost, kv_cost, n_ranks: int, mu: float,
          trace: list | None = None, native: bool | None = None) -> Solution:
    """The binary-greedy solver (module docstring) on tiles ``(q_unit, kv_unit, area)``; units are token
    blocks with ``unit_home`` and per-copy costs ``q_cost``/``kv_cost``. Returns the rank of every tile;
    ``trace`` (a list) receives (threshold, feasible, largest rank area / mean) per try. ``native``: the
    greedy placement in C++ (``dcp._C.magi_place``, csrc/magi_place.cpp, the same loop; up to 64 ranks) or
    in Python (False); None: C++ when built and the ranks fit."""
    p = n_ranks
    if native is None:
        native = _NATIVE_PLACE and p <= 64
    elif native and not (_NATIVE_PLACE and p <= 64):
        raise InvalidConfigError(f"magi_dynamic: the native placement needs dcp._C and at most 64 ranks, got {p}")
    n_units = unit_home.size
    area = np.asarray(area, dtype=np.float64)
    avg = float(area.sum()) / p
    cap = avg * max(mu, 1.0)
    hq, hk = unit_home[q_unit], unit_home[kv_unit]
    fixed = hq == hk
    # edges: (side, unit, rank) for every rank other than the unit's home; q edges first
    e_unit = np.tile(np.repeat(np.arange(n_units), p), 2)
    e_rank = np.tile(np.arange(p), 2 * n_units)
    e_side = np.repeat([0, 1], n_units * p)
    keep = e_rank != unit_home[e_unit]
    e_unit, e_rank, e_side = e_unit[keep], e_rank[keep], e_side[keep]
    e_cost = np.where(e_side == 0, q_cost[e_unit], kv_cost[e_unit]).astype(np.float64)
    e_home = unit_home[e_unit]
    row_sum = np.bincount(q_unit, weights=area, minlength=n_units)
    col_sum = np.bincount(kv_unit, weights=area, minlength=n_units)
    unit_sum = np.where(e_side == 0, row_sum[e_unit], col_sum[e_unit])

    def edge_order(prev: np.ndarray | None) -> np.ndarray:
        if prev is None:  # nothing placed yet: every rank gets an even share of the block's area
            on_rank = np.zeros(e_unit.size)
            unsolved = unit_sum
        else:
            on_q = np.bincount(q_unit * p + prev, weights=area, minlength=n_units * p)
            on_k = np.bincount(kv_unit * p + prev, weights=area, minlength=n_units * p)
            at = e_unit * p + e_rank
            on_rank = np.where(e_side == 0, on_q[at], on_k[at])
            unsolved = 0.0
        weight = (on_rank + unsolved * 0.95 / p) * 0.95 + avg * 0.05 / p
        order = np.argsort(-(weight / np.maximum(e_cost, 1e-6)), kind="stable")
        return order[:max(TOP_EDGES, order.size // 2)]

    base_q = [1 << int(h) for h in unit_home.tolist()]
    q_l, k_l, h_l = q_unit.tolist(), kv_unit.tolist(), hq.tolist()
    area_l = area.tolist()
    # tiles whose blocks share a home (float64 even with none: bincount of no tiles is int64)
    fixed_load = np.bincount(hq[fixed], weights=area[fixed], minlength=p).astype(np.float64)
    fixed_rank = np.where(fixed, hq, -1).astype(np.int64)

    def unplaceable() -> tuple[bool, np.ndarray, np.ndarray]:  # a tile with no allowed rank
        return False, np.full(area.size, -1, dtype=np.int64), np.zeros(p)

    def tile_orders(degree: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the tiles to place, fewest allowed ranks first, then largest area; the tiles the refinement may
        move, those with a choice, in the same order)."""
        by = lambda tiles: tiles[np.lexsort((-area[tiles], degree[tiles]))]  # noqa: E731
        return by(np.flatnonzero(~fixed)), by(np.flatnonzero(degree > 1))

    if native:  # the arrays every try passes alike
        import torch

        tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
        per_solve = (tensor(hq.astype(np.int64)), tensor(area))
        per_try = (tensor(fixed_rank), tensor(fixed_load))  # (the call copies them)

    def place_native(q_mask: list, k_mask: list) -> tuple[bool, np.ndarray, np.ndarray]:
        mask = np.array(q_mask, dtype=np.uint64)[q_unit] & np.array(k_mask, dtype=np.uint64)[kv_unit]
        degree = np.bitwise_count(mask).astype(np.int64)
        if (degree == 0).any():
            return unplaceable()
        free, movable = tile_orders(degree)
        ok, rank, load = _C.magi_place(tensor(mask.view(np.int64)), tensor(degree), *per_solve, tensor(free),
                                       tensor(movable), *per_try, float(avg), float(cap), REFINE_PASSES)
        return bool(ok), rank.numpy(), load.numpy()

    def place(q_mask: list, k_mask: list) -> tuple[bool, np.ndarray, np.ndarray]:
        if native:
            return place_native(q_mask, k_mask)
        masks = [q_mask[a] & k_mask[b] for a, b in zip(q_l, k_l)]
        degree = np.fromiter((m.bit_count() for m in masks), dtype=np.int64, count=len(masks))
        if (degree == 0).any():
            return unplaceable()
        free, movable = tile_orders(degree)
        load = fixed_load.tolist()
        # ranks sorted by load, to find the least-loaded allowed rank of a dense mask quickly
        by_load = sorted((load[r], r) for r in range(p))
        rank_l, degree_l = fixed_rank.tolist(), degree.tolist()  # (lists: numpy scalar indexing per tile is slow)
        for t in free.tolist():
            m, h, a = masks[t], h_l[t], area_l[t]
            if (m >> h) & 1 and load[h] < avg:
                r = h
            elif degree_l[t] <= 4:
                r, best, mm = -1, math.inf, m
                while mm:
                    low = mm & -mm
                    c = low.bit_length() - 1
                    if load[c] < best:
                        r, best = c, load[c]
                    mm ^= low
            else:
                r = next(c for _, c in by_load if (m >> c) & 1)
            by_load.remove((load[r], r))
            load[r] += a
            insort(by_load, (load[r], r))
            rank_l[t] = r
        # refinement: tiles with a choice, in placement order (fixed ones with several ranks too)
        movable = movable.tolist()
        for _ in range(REFINE_PASSES):
            if max(load) <= cap:
                break
            changed = False
            for t in movable:
                cur = rank_l[t]
                if load[cur] <= cap:
                    continue
                a, best, target, mm = area_l[t], load[cur], -1, masks[t] & ~(1 << cur)
                while mm:
                    low = mm & -mm
                    c = low.bit_length() - 1
                    if load[c] + a < best:
                        target, best = c, load[c] + a
                    mm ^= low
                if target >= 0:
                    load[cur] -= a
                    load[target] += a
                    rank_l[t] = target
                    changed = True
            if not changed:
                break
        return max(load) <= cap, np.asarray(rank_l, dtype=np.int64), np.asarray(load)

    def select(order: np.ndarray, threshold: float) -> tuple[list, list]:
        q_mask, k_mask = list(base_q), list(base_q)
        used = [0.0] * p
        ok = order[e_cost[order] <= threshold]
        for side, u, r, h, c in zip(e_side[ok].tolist(), e_unit[ok].tolist(), e_rank[ok].tolist(),
                                     e_home[ok].tolist(), e_cost[ok].tolist()):
            if used[r] + c <= threshold and used[h] + c <= threshold:
                used[r] += c
                used[h] += c
                if side == 0:
                    q_mask[u] |= 1 << r
                else:
                    k_mask[u] |= 1 << r
        return q_mask, k_mask

    everything = 2.0 * (q_cost.sum() + kv_cost.sum())
    low, high = 0.0, float(everything)
    order = edge_order(None)
    best, first_try, tries = None, None, 0
    for it in range(MAX_TRIES):
        mid = (low + high) / 2
        tries += 1
        masks = select(np.arange(e_unit.size) if it == 0 else order, math.inf if it == 0 else mid)
        ok, rank, load = place(*masks)
        if trace is not None:
            spread = float(load.max()) / avg if rank.min() >= 0 else math.inf  # inf: a tile had no rank
            trace.append((math.inf if it == 0 else mid, ok, spread))
        if it == 0:
            first_try = rank
        if ok:
            best = Solution(rank, True, math.inf if it == 0 else mid, 0)
            high = mid
            order = edge_order(rank)
        else:
            low = mid
        if low > 0 and high - low <= EPS * high:
            break
    if best is None:
        best = Solution(first_try, False, math.inf, 0)
    best.tries = tries
    return best


@dataclass(frozen=True)
class MagiDynamicPlanner(SolvedPlanner):
    """MagiAttention's dynamic solver: contiguous token shards stay home, every tile (all heads) placed on
    a rank holding or receiving both its q and kv blocks under a compute cap ``mu`` x mean, with the
    smallest per-rank send + receive volume the binary-greedy search finds (module docstring).

    ``chunk_size``: longest token block (None: ``ceil(total / (8 * P))``, as ``magi``); ``degree``: remote
    overlap stages (1: Magi's QO-comm mode forces it; 0 = no overlap); ``mu``: per-rank area cap over the
    mean (1.10, Magi's unbalance rate). Tuning grid: chunk_size in {1024, 2048} x degree in {1, 2, 4} x mu
    in {1.05, 1.2}."""

    chunk_size: int | None = None
    degree: int = 1
    mu: float = 1.10
    name = "magi_dynamic"

    def __post_init__(self):
        check_chunk_size(self.chunk_size)
        check_degree(self.degree)
        mu = self.mu
        if not isinstance(mu, (int, float, np.integer, np.floating)) or isinstance(mu, bool) \
                or not math.isfinite(mu) or mu < 1.0:
            raise InvalidConfigError(f"mu must be a finite number >= 1 (per-rank compute cap over the mean), "
                                     f"got {mu!r}")

    def _solve(self, spec: BatchSpec, cluster: Cluster) -> tuple[StaticParts, dict]:
        p = cluster.n_devices
        size = resolve_chunk_size(self.chunk_size, spec.total_tokens, p)
        shard, cuts = shard_cuts(spec.total_tokens, p, size)
        layout = layout_from_cuts(spec, global_cuts(spec, cuts))
        # a block's home: the shard holding its first token (the last of equal starts: empty shards hold none)
        home = np.searchsorted(shard[:-1], layout.tb_start, side="right").astype(np.int64) - 1
        tiles = enumerate_tiles(spec, layout)
        q_tb, kv_tb = tiles.q_tb.astype(np.int64), tiles.kv_tb.astype(np.int64)
        tb_len = layout.tb_len.astype(np.float64)
        sol = solve(q_tb, kv_tb, tiles.unmasked, home, tb_len * spec.num_heads, tb_len * spec.num_kv_heads,
                    p, float(self.mu))
        tile_device = sol.rank
        tile_stage, routes = staged_schedule(layout, tiles, home, tile_device, self._stage_key(layout, tiles),
                                             self.degree)
        load = np.bincount(tile_device, weights=tiles.unmasked, minlength=p)
        imbalance = float(load.max() / max(load.mean(), 1e-300))
        notes = [f"magi_dynamic: {layout.n_token_blocks} blocks in {p} contiguous shards; largest rank area "
                 f"{imbalance:.3f}x the mean after {sol.tries} threshold tries"]
        if not sol.feasible:
            notes.append(f"magi_dynamic: no threshold kept every rank within mu={self.mu} x the mean area "
                         "(a tile larger than the slack); the placement allowing every copy stands")
        notes.extend(stage_notes(self.name, self.degree))
        meta = {"chunk_tokens": size, "area_imbalance": imbalance, "feasible": sol.feasible, "tries": sol.tries,
                "threshold": sol.threshold if math.isfinite(sol.threshold) else None}
        return StaticParts(layout, tiles, home, tile_device, tile_stage, routes, tuple(notes)), meta

    def _stage_key(self, layout: BlockLayout, tiles: TileSet) -> np.ndarray:
        # remote tiles by kv block, then q block: both of a tile's blocks may be remote here
        return tiles.kv_tb.astype(np.int64) * layout.n_token_blocks + tiles.q_tb.astype(np.int64)

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        size = resolve_chunk_size(self.chunk_size, spec.total_tokens, cluster.n_devices)
        cuts = global_cuts(spec, shard_cuts(spec.total_tokens, cluster.n_devices, size)[1])
        return causal_bound(blocks_per_seq(spec, cuts))

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        return tuple(MagiDynamicPlanner(c, d, m) for c in CHUNK_GRID for d in DEGREE_GRID for m in MU_GRID)
