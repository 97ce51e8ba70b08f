"""MagiAttention's static solver (SandAI, github.com/SandAI-org/MagiAttention): load-balanced chunk
dispatch, KV-only GroupCast/GroupReduce, multi-stage overlap. Also the code both Magi planners share
(chunk layouts, degree staging); the dynamic solver is ``dcp.baselines.magi_dynamic``.

Reproduced: the static path of releases v1.1.0/v1.1.1 with their defaults — ``DispatchConfig(alg=
MinHeapDispatchAlg())`` and ``OverlapConfig(degree=1, alg=UniformOverlapAlg())``. ``chunk_size=None`` (the
default) is v1.1.1's rule, ``ceil(total tokens / (8 * cp_size))`` (``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK``
= 8; 449 on a 114,700-token batch over 32 ranks, near the 512 of v1.1.0's documented examples); an
explicit ``chunk_size`` is used as given (v1.1.0; v1.1.1 would cap it at that rule's value, which would
collapse a tuning grid).

Dispatch. Magi cuts the packed stream (all sequences back to back) into ``chunk_size``-token chunks
regardless of sequence boundaries; here a token block belongs to one sequence, so every sequence is cut
at the global chunk boundaries and the pieces of one chunk share the chunk's rank. A chunk weighs its mask
area (attended (q, k) pairs). Every rank gets the same number of chunks (Magi pads the stream to a
multiple of ``chunk_size * cp_size``; dcp has no padding, so when the count does not divide, ranks differ
by one chunk), and the largest per-rank area is kept small by the min-heap greedy: chunks by decreasing
area, each to the least-loaded rank that still has room (ties: the lower rank).

Computation and communication. A tile runs on the rank of its q chunk (``tile_device = home[q_tb]``): Q,
O and dQ never move. A KV block goes straight from its home to exactly the ranks whose tiles read it
(GroupCast: multicast, no ring relay) and its dKV partials go straight home (GroupReduce), both by
``dcp.baselines.common.direct_schedule``.

Overlap (``degree``). Stage 0 computes the local tiles (KV at home) while the first remote KV group is in
flight. The remote KV blocks a rank reads are taken in token order and cut into ``degree`` consecutive
groups of near-equal remote area (the area of the tiles they feed; a block's midpoint decides its group;
groups left empty are dropped, as Magi appends idle stages last); group g arrives in round g+1 and its
tiles run in stage g+1, so each group's transfer hides behind the previous stage. Magi's
``UniformOverlapAlg`` cuts the remote KV ranges (chunked by ``min_chunk_size``/``max_num_chunks``) into
groups of equal count; cutting on area instead balances the stages' compute, which is what the overlap
hides transfers behind. Magi's ``degree=0`` (v1.1.1; v1.1.0's ``enable=False``: no overlap, blocking
communication, then one merged attention call) maps to every remote KV block arriving in round 1 and
every tile, local ones too, running in stage 1 (nothing computes while the transfer is in flight);
``degree=1`` is the local stage plus one remote stage.

Simplified: the dynamic overlap search (``degree=None``), dispatch affinities and the other dispatch
algorithms are not modelled; heads are never split (one head block); the pad-to-multiple of Magi is
replaced by the differ-by-one rule above, and a batch with fewer chunks than ranks is refused
(``InvalidConfigError``, as v1.1.1 asserts; v1.1.0 would hand some ranks padding only).
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import direct_schedule
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.layout.blocks import BlockLayout, TileSet, make_layout
from dcp.layout.tiles import enumerate_tiles
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.schedule.stages import Routes
from dcp.spec import BatchSpec

#: the tuning grid of ``MagiPlanner`` (Magi's blog: degree is tuned by hand in {1, 2, 3, 4}); chunk sizes as
#: tokens, and as chunks per rank (v1.1.1's ``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK``, whose default is 8)
CHUNK_GRID = (512, 1024, 1536, 2048, 4096)
CHUNKS_PER_RANK_GRID = (2, 3, 4, 6)
#: overlap degrees dcp's search also estimates a Magi placement at (``SolvedPlanner.schedule_variants``): all
#: of Magi's own; with the executor's host time charged, 1 (fewest instructions) and 3 win batches too
VARIANT_DEGREES = (1, 2, 3, 4)
DEGREE_GRID = (1, 2, 3, 4)


# ------------------------------------------------------------------------------------- knob checks
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


#: v1.1.1's MAGI_ATTENTION_MIN_CHUNKS_PER_RANK default: chunk_size=None gives about this many chunks per rank
MIN_CHUNKS_PER_RANK = 8


def check_chunk_size(chunk_size) -> None:
    if chunk_size is not None and (not _is_int(chunk_size) or chunk_size <= 0):
        raise InvalidConfigError(f"chunk_size must be a positive int (tokens per chunk) or None (Magi's "
                                 f"ceil(total / (8 * ranks))), got {chunk_size!r}")


def check_chunks_per_rank(chunks_per_rank, chunk_size) -> None:
    if chunks_per_rank is None:
        return
    if not _is_int(chunks_per_rank) or chunks_per_rank <= 0:
        raise InvalidConfigError(f"chunks_per_rank must be a positive int or None, got {chunks_per_rank!r}")
    if chunk_size is not None:
        raise InvalidConfigError(f"give chunk_size ({chunk_size}) or chunks_per_rank ({chunks_per_rank}), not both: "
                                 "chunks_per_rank sets the chunk size to ceil(total / (chunks_per_rank * ranks))")


def resolve_chunk_size(chunk_size: int | None, total_tokens: int, n_ranks: int,
                       chunks_per_rank: int | None = None) -> int:
    """The chunk size in tokens: as given, or (None) ``ceil(total / (k * ranks))`` with ``k =
    chunks_per_rank`` (None: Magi v1.1.1's ``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK``, 8)."""
    if chunk_size is not None:
        return int(chunk_size)
    k = MIN_CHUNKS_PER_RANK if chunks_per_rank is None else int(chunks_per_rank)
    return max(1, -(-int(total_tokens) // (k * n_ranks)))


def check_degree(degree) -> None:
    if not _is_int(degree) or degree < 0:
        raise InvalidConfigError(f"degree must be an int >= 0 (remote overlap stages; 0: no overlap), "
                                 f"got {degree!r}")


# ------------------------------------------------------------------------------------------ chunks
def layout_from_cuts(spec: BatchSpec, cuts: np.ndarray) -> BlockLayout:
    """Token blocks between consecutive global cut positions (int64, sorted, unique, containing every
    ``cu_seqlens`` entry), in packed token order: block b spans ``[cuts[b], cuts[b+1])``; one head block."""
    cu = spec.cu_seqlens
    ptr = np.searchsorted(cuts, cu)
    bounds = [cuts[ptr[s]:ptr[s + 1] + 1] - cu[s] for s in range(spec.num_seqs)]
    return make_layout(spec, bounds, None)


def global_cuts(spec: BatchSpec, *grids: np.ndarray) -> np.ndarray:
    """Sorted unique cut positions: the sequence boundaries plus the given positions (packed token rows)."""
    return np.unique(np.concatenate([spec.cu_seqlens, *[np.asarray(g, dtype=np.int64) for g in grids]]))


def n_chunks(total_tokens: int, chunk_size: int) -> int:
    return -(-int(total_tokens) // int(chunk_size))


def chunk_layout(spec: BatchSpec, chunk_size: int) -> tuple[BlockLayout, np.ndarray]:
    """The packed stream cut at multiples of ``chunk_size`` and at sequence boundaries: (layout, int64
    global chunk index per token block)."""
    layout = layout_from_cuts(spec, global_cuts(spec, np.arange(0, spec.total_tokens, chunk_size)))
    return layout, layout.tb_start.astype(np.int64) // chunk_size


def blocks_per_seq(spec: BatchSpec, cuts: np.ndarray) -> np.ndarray:
    """Blocks of every sequence under the global cuts (no layout built): int64 ``[num_seqs]``."""
    return np.diff(np.searchsorted(cuts, spec.cu_seqlens))


def causal_bound(nb: np.ndarray) -> int:
    """Tiles of blocks that each see themselves and every earlier block of their sequence."""
    nb = np.asarray(nb, dtype=np.int64)
    return int((nb * (nb + 1) // 2).sum())


def min_heap_dispatch(area: np.ndarray, n_ranks: int) -> np.ndarray:
    """Rank of every chunk: chunks by decreasing area (stable), each to the least-loaded rank (ties: lower
    rank) that still has room; every rank ends with ``n // P`` or ``n // P + 1`` chunks. int64 ``[n]``."""
    n = int(area.size)
    base, extra = divmod(n, n_ranks)
    heap = [(0.0, r) for r in range(n_ranks)]
    count = [0] * n_ranks
    n_big = 0  # ranks already holding base + 1 chunks
    rank = np.empty(n, dtype=np.int64)
    for c in np.argsort(-np.asarray(area, dtype=np.float64), kind="stable").tolist():
        while True:  # a rank without room never regains it: drop it from the heap
            load, r = heapq.heappop(heap)
            if count[r] < base or (count[r] == base and n_big < extra):
                break
        rank[c] = r
        count[r] += 1
        n_big += count[r] == base + 1
        if count[r] < base + (1 if extra else 0):
            heapq.heappush(heap, (load + float(area[c]), r))
    return rank


# --------------------------------------------------------------------------------- degree staging
def remote_groups(dev: np.ndarray, key: np.ndarray, weight: np.ndarray, remote: np.ndarray,
                  degree: int) -> np.ndarray:
    """Overlap group (0 .. degree-1) of every remote tile, -1 for local ones.

    On each device the remote tiles are ordered by ``key`` (int64; tiles sharing a key stay in one
    group, e.g. the tiles reading one remote KV block) and cut into ``degree`` consecutive groups of
    near-equal ``weight``: a key's group is where the midpoint of its weight falls in the device's
    cumulative weight; groups left empty are dropped (the remaining ones renumbered from 0), so a device
    with fewer keys than groups fills the first rounds."""
    group = np.full(dev.size, -1, dtype=np.int64)
    idx = np.flatnonzero(remote)
    if idx.size == 0 or degree <= 1:
        group[idx] = 0
        return group
    width = int(key.max()) + 1
    pair, inv = np.unique(dev[idx].astype(np.int64) * width + key[idx], return_inverse=True)
    w = np.bincount(inv, weights=np.asarray(weight, dtype=np.float64)[idx], minlength=pair.size)
    pdev = pair // width
    cum = np.cumsum(w)
    first = np.searchsorted(pdev, pdev, side="left")  # first pair of the same device
    before = cum - w - (cum[first] - w[first])
    last = np.searchsorted(pdev, pdev, side="right") - 1
    total = cum[last] - (cum[first] - w[first])
    frac = (before + w / 2) / np.maximum(total, 1e-300)
    g = np.minimum((frac * degree).astype(np.int64), degree - 1)
    # groups left empty (fewer keys than groups) go last, as Magi appends idle stages: renumber the
    # non-empty ones 0, 1, ... per device
    used, at = np.unique(pdev * degree + g, return_inverse=True)
    used_dev = used // degree
    group[idx] = (np.arange(used.size) - np.searchsorted(used_dev, used_dev, side="left"))[at][inv]
    return group


def staged_schedule(layout: BlockLayout, tiles: TileSet, home: np.ndarray, tile_device: np.ndarray,
                    key: np.ndarray, degree: int, gpus_per_node: int | None = None) -> tuple[np.ndarray, Routes]:
    """Stages and routes of a Magi plan: inputs straight from home, partials straight home, remote work in
    ``degree`` groups ordered by ``key`` (group g's inputs arrive in round g+1; a tile runs once its last
    input is there, so at stage <= g+1). ``degree=0``: every input in round 1 and every tile in stage >= 1
    (a tile whose inputs are all home has no partial to send, so lifting it changes no route).
    ``gpus_per_node``: inter-node deduplication (``direct_schedule``'s hierarchical mode: a block enters a
    remote node once and is relayed inside, one round later)."""
    dev = np.asarray(tile_device, dtype=np.int64)
    remote = (home[tiles.q_tb] != dev) | (home[tiles.kv_tb] != dev)
    group = remote_groups(dev, key, tiles.unmasked, remote, max(degree, 1))
    want = np.maximum(group, 0) + 1
    stage, routes = direct_schedule(layout, tiles, home, dev, want, want, gpus_per_node=gpus_per_node)
    if degree == 0:
        stage = np.maximum(stage, 1)
    return stage, routes


def stage_notes(planner: str, degree: int) -> tuple[str, ...]:
    """The plan note of the no-overlap mode (empty otherwise)."""
    if degree == 0:
        return (f"{planner}: degree=0 (no overlap): all remote KV arrives in round 1, all tiles run in stage 1",)
    return ()


# ------------------------------------------------------------------------------------------ planner
class SolvedPlanner(Planner):
    """Both Magi planners: ``_solve(spec, cluster) -> (StaticParts, meta)`` places and schedules; the plan
    carries the knobs and the solver's figures in ``meta``."""

    def _solve(self, spec: BatchSpec, cluster: Cluster) -> tuple[StaticParts, dict]:
        raise NotImplementedError

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        parts, meta = self._solve(spec, cluster)
        plan = assemble_static(spec, cluster, parts, self.name, started)
        plan.meta.update(self.knobs(), **meta)
        return plan

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        return self._solve(spec, cluster)[0]

    def _stage_key(self, layout: BlockLayout, tiles: TileSet) -> np.ndarray:
        """The order in which a rank's remote tiles are cut into overlap groups (``remote_groups``)."""
        raise NotImplementedError

    def _dedup_gpus(self, cluster: Cluster) -> int | None:
        return None

    def schedule_variants(self, spec: BatchSpec, cluster: Cluster, parts: StaticParts) -> tuple[StaticParts, ...]:
        """``parts`` restaged at the other overlap degrees of ``VARIANT_DEGREES`` and, on several nodes, with
        the other ``hierarchical`` setting of a planner that has one (placement unchanged; both are schedule
        knobs): the planner at ``(degree, hierarchical)`` for every such pair but its own, own setting first."""
        own = self._dedup_gpus(cluster)
        flips = cluster.nodes > 1 and isinstance(getattr(self, "hierarchical", None), bool)
        dedups = (own, None if own else cluster.gpus_per_node) if flips else (own,)
        out = []
        for dedup in dedups:
            for degree in dict.fromkeys((self.degree, *VARIANT_DEGREES)):
                if (degree, dedup) == (self.degree, own):
                    continue
                stage, routes = staged_schedule(parts.layout, parts.tiles, parts.home, parts.tile_device,
                                                self._stage_key(parts.layout, parts.tiles), degree, dedup)
                out.append(parts._replace(tile_stage=stage, routes=routes))
        return tuple(out)



@dataclass(frozen=True)
class MagiPlanner(SolvedPlanner):
    """MagiAttention v1.1, static solver: ``chunk_size``-token chunks of the packed stream dispatched to
    ranks by the min-heap greedy on mask area (equal chunk counts), tiles on their q chunk's rank, KV
    multicast from home and dKV reduced straight home, remote KV in ``degree`` overlap stages (module
    docstring).

    ``chunk_size``: tokens per dispatch chunk (None: ``ceil(total / (k * P))`` with ``k = chunks_per_rank``,
    8 when None: Magi v1.1.1's default). ``degree``: remote overlap stages (1; 0 = no overlap).
    ``hierarchical``: Magi's inter-node deduplication (a KV block crosses into a remote node once and is
    forwarded inside it; Magi needs IBGDA-capable NICs for it, so it is off by default).
    ``chunks_per_rank``: v1.1.1's ``MAGI_ATTENTION_MIN_CHUNKS_PER_RANK`` (exclusive with ``chunk_size``):
    every rank then gets k chunks of one size, so resident tokens stay within a chunk of the mean.
    Tuning grid: (chunk_size in {512, 1024, 1536, 2048, 4096}, or chunks_per_rank in {2, 3, 4, 6}) x degree
    in {1, 2, 3, 4} (x hierarchical on several nodes), dropping chunk sizes that give fewer chunks than
    devices (when every size does, the grid is this planner alone)."""

    chunk_size: int | None = None
    degree: int = 1
    hierarchical: bool = False
    chunks_per_rank: int | None = None
    name = "magi"

    def __post_init__(self):
        check_chunk_size(self.chunk_size)
        check_chunks_per_rank(self.chunks_per_rank, self.chunk_size)
        check_degree(self.degree)
        if not isinstance(self.hierarchical, bool):
            raise InvalidConfigError(f"hierarchical must be True or False, got {self.hierarchical!r}")

    def _solve(self, spec: BatchSpec, cluster: Cluster) -> tuple[StaticParts, dict]:
        p = cluster.n_devices
        size = resolve_chunk_size(self.chunk_size, spec.total_tokens, p, self.chunks_per_rank)
        n = n_chunks(spec.total_tokens, size)
        if n < p:
            raise InvalidConfigError(
                f"magi: {spec.total_tokens} tokens make {n} chunks of chunk_size={size}, fewer than the {p} "
                "devices (Magi requires at least one chunk per rank)"
                + ("; use a smaller chunk_size" if size > 1 else ""))
        layout, chunk = chunk_layout(spec, size)
        tiles = enumerate_tiles(spec, layout)
        # a chunk's area: the attended pairs of its queries (its pieces' q-side tile areas)
        block_area = np.bincount(tiles.q_tb, weights=tiles.unmasked, minlength=layout.n_token_blocks)
        chunk_area = np.bincount(chunk, weights=block_area, minlength=n)
        chunk_rank = min_heap_dispatch(chunk_area, p)
        home = chunk_rank[chunk]
        tile_device = home[tiles.q_tb]
        tile_stage, routes = staged_schedule(layout, tiles, home, tile_device, self._stage_key(layout, tiles),
                                             self.degree, self._dedup_gpus(cluster))
        rank_area = np.bincount(chunk_rank, weights=chunk_area, minlength=p)
        per_rank = np.bincount(chunk_rank, minlength=p)
        imbalance = float(rank_area.max() / max(rank_area.mean(), 1e-300))
        notes = (f"magi: {n} chunks of {size} tokens, {per_rank.min()}-{per_rank.max()} per rank; "
                 f"largest rank area {imbalance:.3f}x the mean",) + stage_notes(self.name, self.degree)
        meta = {"chunk_tokens": size, "n_chunks": n, "area_imbalance": imbalance, "chunk_rank": chunk_rank.tolist()}
        return StaticParts(layout, tiles, home, tile_device, tile_stage, routes, notes), meta

    def _stage_key(self, layout: BlockLayout, tiles: TileSet) -> np.ndarray:
        return tiles.kv_tb.astype(np.int64)  # remote KV blocks in token order

    def _dedup_gpus(self, cluster: Cluster) -> int | None:
        return cluster.gpus_per_node if self.hierarchical else None

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        size = resolve_chunk_size(self.chunk_size, spec.total_tokens, cluster.n_devices, self.chunks_per_rank)
        cuts = global_cuts(spec, np.arange(0, spec.total_tokens, size))
        return causal_bound(blocks_per_seq(spec, cuts))

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        sizes = [c for c in CHUNK_GRID if n_chunks(spec.total_tokens, c) >= cluster.n_devices]
        dedup = (False, True) if cluster.nodes > 1 else (False,)
        grid = tuple(MagiPlanner(c, d, h) for c in sizes for d in DEGREE_GRID for h in dedup)
        grid += tuple(MagiPlanner(None, d, h, k) for k in CHUNKS_PER_RANK_GRID for d in DEGREE_GRID for h in dedup
                      if spec.total_tokens >= k * cluster.n_devices)
        return grid or (self,)
