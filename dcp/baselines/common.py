"""Shared machinery of the static baselines: near-equal chunking, layouts from per-sequence chunk homes,
and the relay schedule every baseline reduces to.

The relay model (``relay_schedule``). Every KV-side unit ``(tb, hb)`` lives on a *ring* of devices,
``member(m) = base + m * stride`` for m in [0, size), starting at its *origin* member. If the origin
device is not the unit's home, an all-to-all hop (home → origin) delivers it in round 1 (``offset`` = 1).
A plain ring (``inner = size``): from the origin the unit travels hop by hop (o → o+1 → …, never skipping
a device) and reaches hop ``t`` in round ``offset + t``. A double ring (members grouped into inner rings
of ``inner`` consecutive members, LoongTrain): the unit travels the outer ring (same inner position, next
inner ring), outer hop ``k`` arriving in round ``offset + (k-1)*inner + 1``, and around each inner ring
it reaches, inner hop ``t`` of outer step ``k`` arriving in round ``offset + k*inner + t``. ``inner = 1``
is a plain ring hopping one member per round. Units travel only as far as the farthest device that needs
them. Every tile runs on a device of its KV unit's ring, in the first stage after both inputs arrived;
a q-side unit not homed there is delivered directly (the all-to-all) in round 1.

Outputs: a q-side partial computed away from home goes straight home (reverse all-to-all). A KV-side
(dKV) partial accumulates hop by hop in the direction the KV travelled: along each inner ring from the
first device holding a contribution to the farthest, which closes the circle on that step's spine
device (one hop); spine devices then chain outer step 1 → 2 → … → last, which closes the outer circle on
the origin; the origin sends it home if it is not the home. Every device merges what it received with
its own contribution before forwarding, and sends as soon as the partial is complete:
``max(last contributing stage + 2, last receive round + 1)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidConfigError
from dcp.layout.blocks import BlockLayout, TileSet, make_layout
from dcp.schedule.stages import Routes
from dcp.setops import lookup
from dcp.spec import BatchSpec


def near_equal_parts(lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut each of ``lengths`` into ``k`` near-equal contiguous parts (sizes differ by at most one):
    (int64 ``[m, k]`` start offset of each part, bool ``[m, k]`` the part is non-empty)."""
    b = (np.arange(k + 1, dtype=np.int64)[None, :] * np.asarray(lengths, np.int64)[:, None]) // k
    return b[:, :-1], np.diff(b, axis=1) > 0


def near_equal_chunks(n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ``n`` tokens into ``k`` near-equal contiguous chunks (sizes differ by at most one), dropping
    empty ones (``n < k``). Returns (start of each non-empty chunk, its chunk index), both int64."""
    start, keep = near_equal_parts(np.array([n]), k)
    idx = np.flatnonzero(keep[0])
    return start[0, idx], idx


def zigzag_device(chunk: np.ndarray, k: int) -> np.ndarray:
    """Ring member holding zigzag chunk ``chunk`` of ``2k`` chunks: member m holds chunks m and 2k-1-m."""
    chunk = np.asarray(chunk)
    return np.where(chunk < k, chunk, 2 * k - 1 - chunk)


@dataclass
class BlockBuilder:
    """Accumulates token blocks sequence by sequence (in token order) with their home device and the
    ring their KV travels on (``ring_base``, ``ring_size``; stride 1: contiguous device rings)."""

    spec: BatchSpec

    def __post_init__(self):
        self.bounds, self.home, self.ring_base, self.ring_size = [], [], [], []

    def add(self, starts: np.ndarray, homes: np.ndarray, ring_base: int = 0, ring_size: int = 1) -> None:
        """Blocks of the next sequence: their start offsets (increasing, first 0) and home devices."""
        seq = len(self.bounds)
        self.bounds.append(np.append(np.asarray(starts, dtype=np.int64), self.spec.seqlens[seq]))
        self.home.append(np.asarray(homes, dtype=np.int64))
        self.ring_base.append(np.full(len(homes), ring_base, dtype=np.int64))
        self.ring_size.append(np.full(len(homes), ring_size, dtype=np.int64))

    def layout(self, head_block_size: int | None) -> BlockLayout:
        return make_layout(self.spec, self.bounds, head_block_size)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(home, ring_base, ring_size) per token block."""
        return tuple(np.concatenate(a) for a in (self.home, self.ring_base, self.ring_size))

    def estimated_tiles(self, n_head_blocks: int) -> int:
        """Tiles of the per-sequence layout if every block saw itself and every earlier block of its
        sequence (a causal mask; the static baselines' cut): decides ``shards="auto"``."""
        nb = np.array([b.size - 1 for b in self.bounds], dtype=np.int64)
        return int((nb * (nb + 1) // 2).sum()) * n_head_blocks

    def parts(self, head_block_size: int | None, shards: bool | None):
        """(layout, home, ring_base, ring_size) per token block: the blocks as added, or (``use_shards``)
        each device's blocks of every sequence grouped into one token block (``dcp.layout.pieces``): its shard, as
        ring attention holds and sends it."""
        from dcp.layout.blocks import head_blocking
        from dcp.layout.pieces import group_layout

        home, base, size = self.arrays()
        if not use_shards(shards, self, head_blocking(self.spec, head_block_size)[1]):
            return self.layout(head_block_size), home, base, size
        used, first, piece_block = np.unique(home, return_index=True, return_inverse=True)
        if (base != base[first][piece_block]).any() or (size != size[first][piece_block]).any():
            raise ValueError("the blocks homed on one device must share one ring to be grouped")
        return group_layout(self.layout(head_block_size), piece_block), used, base[first], size[first]


def causal_tiles(seqlens, chunks: int, parts: int = 1) -> int:
    """Tiles of a layout cutting each sequence into ``chunks`` chunks of ``parts`` blocks each (at most one
    block per token) if every block saw itself and every earlier block of its sequence (a causal mask):
    the static baselines' size, known before their blocks are built."""
    nb = np.minimum(np.asarray(seqlens, dtype=np.int64), chunks * parts)
    return int((nb * (nb + 1) // 2).sum())


#: ``shards=None`` (auto) groups a static baseline's blocks per device above this many estimated tiles
SHARD_TILES = 4_000_000


def check_shards(shards) -> None:
    if shards is not None and not isinstance(shards, bool):
        raise InvalidConfigError(f"shards must be True, False or None (automatic), got {shards!r}")


def use_shards(shards: bool | None, builder: BlockBuilder, n_head_blocks: int) -> bool:
    """Group per device (``shards=True``), keep per-sequence blocks (False), or decide by size (None:
    group when the per-sequence layout would have more than ``SHARD_TILES`` tiles)."""
    return builder.estimated_tiles(n_head_blocks) > SHARD_TILES if shards is None else shards


def shard_note(planner: str, layout: BlockLayout) -> tuple[str, ...]:
    """The plan note of a grouped static baseline (empty for per-sequence blocks)."""
    if not layout.grouped:
        return ()
    return (f"{planner}: each device's chunks of every sequence form one token block ({layout.n_token_blocks} "
            f"blocks of {layout.pieces.n_token_blocks} pieces), as ring attention sends and computes them; "
            "each tile is charged as its per-sequence sub-tiles",)


def relay_schedule(layout: BlockLayout, tiles: TileSet, home: np.ndarray, tile_device: np.ndarray,
                   kv_base: np.ndarray, kv_stride: np.ndarray, kv_size: np.ndarray, kv_origin: np.ndarray,
                   offset: int = 0, kv_inner: np.ndarray | None = None) -> tuple[np.ndarray, Routes]:
    """Tile stages and routes of the relay model (module docstring).

    ``kv_base/kv_stride/kv_size/kv_origin``: int arrays per KV unit ``tb * n_head_blocks + hb``: its ring
    and origin member. ``offset``: rounds taken before the ring starts (1 when an all-to-all hop
    precedes it). ``kv_inner``: inner-ring size per unit for a double ring (None: a single ring)."""
    nhb = layout.n_head_blocks
    home = np.asarray(home, dtype=np.int64)
    dev = np.asarray(tile_device, dtype=np.int64)
    hb = tiles.hb.astype(np.int64)
    n_units = layout.n_token_blocks * nhb
    q_tb, kv_tb = tiles.q_tb.astype(np.int64), tiles.kv_tb.astype(np.int64)
    kv_key, q_key = kv_tb * nhb + hb, q_tb * nhb + hb
    unit_tb, unit_hb = np.arange(n_units) // nhb, np.arange(n_units) % nhb
    base, stride, size, origin = (np.asarray(a, dtype=np.int64) for a in (kv_base, kv_stride, kv_size, kv_origin))
    inner = size.copy() if kv_inner is None else np.asarray(kv_inner, dtype=np.int64)
    if ((size % inner) != 0).any():
        raise ValueError("an inner ring size must divide its ring size")
    ring = Ring(base, stride, size, inner, origin)
    a2a = ring.device(0, 0) != home[unit_tb]
    if offset < 1 and a2a.any():
        raise ValueError("an all-to-all hop needs offset >= 1")
    # --- KV side: position (outer step k, inner step t) of every tile's device on its unit's ring
    rel = dev - base[kv_key]
    member = rel // stride[kv_key]
    if ((rel % stride[kv_key]) != 0).any() or (member < 0).any() or (member >= size[kv_key]).any():
        raise ValueError("a tile runs on a device outside its KV unit's ring")
    w, o = inner[kv_key], size[kv_key] // inner[kv_key]
    k = (member // w - origin[kv_key] // w) % o
    t = (member % w - origin[kv_key] % w) % w
    kv_arrival = np.where(t > 0, offset + k * w + t, np.where(k > 0, offset + (k - 1) * w + 1, a2a[kv_key]))
    # --- q side: direct delivery to the (single) device running the unit's tiles
    q_dev = np.full(n_units, -1, dtype=np.int64)
    q_dev[q_key] = dev
    if (q_dev[q_key] != dev).any():
        raise ValueError("all tiles of a q-side unit must run on one device")
    q_moves = (q_dev >= 0) & (q_dev != home[unit_tb])
    tile_stage = np.maximum(q_moves[q_key].astype(np.int64), kv_arrival)
    # --- input rows: q all-to-all, KV all-to-all, outer (spine) hops, inner hops
    row = lambda side, u, src, dst, rnd: np.stack(  # noqa: E731
        [np.full_like(u, side), unit_tb[u], unit_hb[u], src, dst, rnd + np.zeros_like(u)], 1)
    u = np.flatnonzero(q_moves)
    rows = [row(0, u, home[unit_tb[u]], q_dev[u], 1)]
    u = np.flatnonzero(a2a & (np.bincount(kv_key, minlength=n_units) > 0))
    rows.append(row(1, u, home[unit_tb[u]], ring.device(0, 0)[u], 1))
    k_max = np.zeros(n_units, dtype=np.int64)
    np.maximum.at(k_max, kv_key, k)
    uu, kk = _expand(np.arange(n_units), k_max)
    rows.append(row(1, uu, ring.device(kk - 1, 0, uu), ring.device(kk, 0, uu), offset + (kk - 1) * inner[uu] + 1))
    width = int(size.max()) + 1
    steps, inv = np.unique(kv_key * width + k, return_inverse=True)
    t_max = np.zeros(steps.size, dtype=np.int64)
    np.maximum.at(t_max, inv, t)
    ss, tt = _expand(np.arange(steps.size), t_max)
    uu, kk = steps[ss] // width, steps[ss] % width
    rows.append(row(1, uu, ring.device(kk, tt - 1, uu), ring.device(kk, tt, uu), offset + kk * inner[uu] + tt))
    inputs = np.concatenate(rows).astype(np.int64)
    # --- q-side outputs: straight home one round after their last stage completes
    last_q = np.full(n_units, -1, dtype=np.int64)
    np.maximum.at(last_q, q_key, tile_stage)
    u = np.flatnonzero(q_moves)
    out_rows = [row(0, u, q_dev[u], home[unit_tb[u]], last_q[u] + 2)]
    out_rows.append(_dkv_trees(kv_key, k, t, tile_stage, k_max, ring, home, unit_tb, nhb))
    return tile_stage, Routes(inputs, np.concatenate(out_rows).astype(np.int64))


@dataclass(frozen=True)
class Ring:
    """Per-KV-unit (double) rings: member m = k_outer * inner + t_inner sits on device base + m * stride."""

    base: np.ndarray
    stride: np.ndarray
    size: np.ndarray
    inner: np.ndarray
    origin: np.ndarray

    def device(self, k, t, units=slice(None)):
        """Device at outer step ``k``, inner step ``t`` from each unit's origin."""
        w, o0 = self.inner[units], self.origin[units]
        o = self.size[units] // w
        m = ((o0 // w + k) % o) * w + (o0 % w + t) % w
        return self.base[units] + m * self.stride[units]


def _expand(ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Repeat each id ``counts`` times, paired with 1..count."""
    rep = np.repeat(ids, counts)
    return rep, np.arange(rep.size) - np.repeat(np.cumsum(counts) - counts, counts) + 1


def _chain_rounds(seg: np.ndarray, pos: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Send rounds along chains: ``seg`` (non-decreasing) names each position's chain, ``pos`` its
    place in it (increasing within a chain), ``first`` the earliest round it could send on its own
    (< 0: nothing of its own). A position forwards one round after its predecessor sent, so
    ``round[i] = max(first[i], round[i-1] + 1)`` = ``pos[i] + max over j <= i in the chain of
    (first[j] - pos[j])``; -1 where nothing reached the position yet (it sends nothing)."""
    if seg.size == 0:
        return np.zeros(0, dtype=np.int64)
    has = first >= 0
    lift = int(pos.max()) + 1  # first - pos + lift > 0 wherever first >= 0
    val = np.where(has, first - pos + lift, 0)
    span = int(val.max()) + 1
    ranks = np.concatenate([[0], np.cumsum(seg[1:] != seg[:-1])])  # 0, 1, ... per chain
    best = np.maximum.accumulate(ranks * span + val) - ranks * span  # running max within the chain
    return np.where(best > 0, best - lift + pos, -1)


def _dkv_trees(kv_key, k, t, tile_stage, k_max, ring: Ring, home, unit_tb, nhb) -> np.ndarray:
    """dKV accumulation (module docstring), as array operations; ``_dkv_trees_reference`` is the same
    walk unit by unit in Python and defines the rows (the programs sort them, so row order is free).

    Per outer step an inner chain runs over inner steps 1 .. the last contributing one, closing on the
    step's spine device (step, 0); the spine runs over outer steps 1 .. k_max, closing on the origin
    (0, 0), which sends home if it is not the home. A position sends once it has anything (its own
    tiles two rounds after their last stage, or a partial it received one round after)."""
    width = int(ring.size.max()) + 1
    pos_key = (kv_key * width + k) * width + t
    ukey, inv = np.unique(pos_key, return_inverse=True)
    last = np.full(ukey.size, -1, dtype=np.int64)
    np.maximum.at(last, inv, tile_stage)
    own = lambda u, kq, tq: lookup(ukey, last + 2, (u * width + kq) * width + tq)  # noqa: E731
    units, kk, tt = ukey // width // width, ukey // width % width, ukey % width
    rows = []
    row = lambda u, src, dst, rnd: np.stack(  # noqa: E731
        [np.ones_like(u), u // nhb, u % nhb, src, dst, rnd], 1)
    # inner chains: one per (unit, outer step) over inner steps 1 .. last contributing step
    step, step_at = np.unique(units * width + kk, return_index=True)
    t_last = np.maximum.reduceat(tt, step_at) if step.size else np.zeros(0, dtype=np.int64)
    ss, tq = _expand(np.arange(step.size), t_last)
    su, sk = step[ss] // width, step[ss] % width
    rnd = _chain_rounds(ss, tq, own(su, sk, tq))
    at_end = tq == t_last[ss]
    dst = np.where(at_end, ring.device(sk, 0, su), ring.device(sk, tq + 1, su))
    sent = rnd >= 0
    rows.append(row(su[sent], ring.device(sk, tq, su)[sent], dst[sent], rnd[sent]))
    inner_in = np.full(step.size, -1, dtype=np.int64)  # round the chain's partial reaches (step, 0)
    inner_in[ss[at_end]] = rnd[at_end]
    # spine: per unit, outer steps 1 .. k_max, closing on the origin
    n_units = k_max.size
    uu, kq = _expand(np.arange(n_units), k_max)
    chain_in = lookup(step, inner_in, uu * width + kq)
    first = np.maximum(own(uu, kq, 0), np.where(chain_in >= 0, chain_in + 1, -1))
    rnd = _chain_rounds(uu, kq, first)
    at_end = kq == k_max[uu]
    dst = np.where(at_end, ring.device(0, 0, uu), ring.device(kq + 1, 0, uu))
    sent = rnd >= 0
    rows.append(row(uu[sent], ring.device(kq, 0, uu)[sent], dst[sent], rnd[sent]))
    # the origin sends home what it gathered (from step 0's inner chain, the spine, its own tiles)
    got = np.full(n_units, -1, dtype=np.int64)
    got[uu[at_end]] = rnd[at_end]
    got = np.maximum(got, lookup(step, inner_in, np.arange(n_units) * width))
    first = np.maximum(lookup(ukey, last + 2, np.arange(n_units) * width * width), np.where(got >= 0, got + 1, -1))
    origin = ring.device(0, 0)
    u = np.flatnonzero((first >= 0) & (origin != home[unit_tb]))
    rows.append(row(u, origin[u], home[unit_tb[u]], first[u]))
    return np.concatenate(rows).astype(np.int64).reshape(-1, 6)


def _dkv_trees_reference(kv_key, k, t, tile_stage, k_max, ring: Ring, home, unit_tb, nhb) -> np.ndarray:
    """dKV accumulation (module docstring): per outer step, an inner chain from the first contributing
    inner step to the last, closing on the step's spine device; spine devices chain outer step 1 → 2 → …
    → last, closing on the origin, which sends home if it is not the home. Python pass per unit."""
    width = int(ring.size.max()) + 1
    key = (kv_key * width + k) * width + t
    ukey, inv = np.unique(key, return_inverse=True)
    last = np.full(ukey.size, -1, dtype=np.int64)
    np.maximum.at(last, inv, tile_stage)
    units, kk, tt = ukey // width // width, ukey // width % width, ukey % width
    cuts = np.flatnonzero(np.r_[True, units[1:] != units[:-1], True])
    rows = []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        u = int(units[a])
        contrib = dict(zip(zip(kk[a:b].tolist(), tt[a:b].tolist()), last[a:b].tolist()))
        base, stride, w, o0 = int(ring.base[u]), int(ring.stride[u]), int(ring.inner[u]), int(ring.origin[u])
        o = int(ring.size[u]) // w
        dev = lambda kq, tq: base + (((o0 // w + kq) % o) * w + (o0 % w + tq) % w) * stride  # noqa: E731
        recv = {}  # (k, t) -> last round a partial arrived there

        def send(pos, dst_pos, dst_dev):
            st, rc = contrib.get(pos), recv.get(pos)
            if st is None and rc is None:
                return  # nothing accumulated here
            rnd = max(st + 2 if st is not None else 0, rc + 1 if rc is not None else 0)
            rows.append((1, u // nhb, u % nhb, dev(*pos), dst_dev, rnd))
            recv[dst_pos] = max(recv.get(dst_pos, 0), rnd)

        by_step = {}
        for kq, tq in contrib:
            by_step[kq] = max(by_step.get(kq, 0), tq)
        for kq in list(range(1, int(k_max[u]) + 1)) + [0]:
            t_last = by_step.get(kq, 0)
            for tq in range(1, t_last + 1):  # inner chain, closing on the spine device (kq, 0)
                nxt = (kq, tq + 1) if tq < t_last else (kq, 0)
                send((kq, tq), nxt, dev(*nxt))
            if kq > 0:  # spine chain, closing on the origin
                nxt = (kq + 1, 0) if kq < k_max[u] else (0, 0)
                send((kq, 0), nxt, dev(*nxt))
        h = int(home[unit_tb[u]])
        if dev(0, 0) != h:
            send((0, 0), None, h)
    return np.asarray(rows, dtype=np.int64).reshape(-1, 6)


def ring_of_blocks(layout: BlockLayout, home: np.ndarray, ring_base: np.ndarray,
                   ring_size: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per-KV-unit ring arrays for contiguous rings whose origin is the block's home (ring, zigzag,
    Megatron dynamic CP): (base, stride, size, origin member)."""
    nhb = layout.n_head_blocks
    base, size = np.repeat(ring_base, nhb), np.repeat(ring_size, nhb)
    return base, np.ones_like(base), size, np.repeat(home, nhb) - base


def plan_ring(spec: BatchSpec, builder: BlockBuilder, head_block_size: int | None = None,
              shards: bool | None = False):
    """Layout, tiles, home, tile device (the q block's home), stages and routes of a ring-style plan
    (``shards``: group each device's blocks, ``use_shards``)."""
    from dcp.layout.tiles import enumerate_tiles

    layout, home, ring_base, ring_size = builder.parts(head_block_size, shards)
    tiles = enumerate_tiles(spec, layout)
    tile_device = home[tiles.q_tb]
    ring = ring_of_blocks(layout, home, ring_base, ring_size)
    tile_stage, routes = relay_schedule(layout, tiles, home, tile_device, *ring)
    return layout, tiles, home, tile_device, tile_stage, routes


def direct_schedule(layout: BlockLayout, tiles: TileSet, home: np.ndarray, tile_device: np.ndarray,
                    q_round: np.ndarray | int, kv_round: np.ndarray | int,
                    extra_inputs: np.ndarray | None = None,
                    gpus_per_node: int | None = None) -> tuple[np.ndarray, Routes]:
    """Tile stages and routes of a plan whose inputs travel straight from their home to every device that
    runs a tile on them (all-to-all, all-gather, multicast: no rings), and whose partial outputs go
    straight home (reverse all-to-all, reduce-scatter).

    ``q_round``/``kv_round``: per tile (or one int for all), the round by which the tile's q-side/kv-side
    input must be on its device when it is not home there (>= 1). A (unit, device) pair is delivered once,
    in the earliest round any of its tiles asks; a tile runs in the stage its last input arrives (0 when
    both are home). ``extra_inputs``: int64 ``[n, 4]`` rows (side, tb, hb, dst) delivered in round 1
    although no tile there needs them (an all-gather sends every unit everywhere). A partial leaves its
    device for home two rounds after the unit's last tile there ran (``dcp.schedule.build``'s rule).

    ``gpus_per_node``: hierarchical collectives, as NCCL runs them across nodes: a unit crosses into a
    remote node once, to the GPU there with its home's local index (the *entry*), in the earliest round
    any GPU of that node needs it, and the entry relays it to the node's other consumers one round later;
    partials of a unit from several GPUs of a remote node merge on the entry before one transfer home.
    None: every transfer is direct. Returns (int64 tile stage per tile, ``Routes``)."""
    nhb = layout.n_head_blocks
    home = np.asarray(home, dtype=np.int64)
    dev = np.asarray(tile_device, dtype=np.int64)
    n = tiles.n_tiles
    unit_of = {0: tiles.q_tb.astype(np.int64) * nhb + tiles.hb, 1: tiles.kv_tb.astype(np.int64) * nhb + tiles.hb}
    wants = {0: np.broadcast_to(np.asarray(q_round, dtype=np.int64), (n,)),
             1: np.broadcast_to(np.asarray(kv_round, dtype=np.int64), (n,))}
    ex = np.zeros((0, 4), dtype=np.int64) if extra_inputs is None else np.asarray(extra_inputs, np.int64).reshape(-1, 4)
    # keys (side, unit, device) need a width above every device that appears (homes, all-gather receivers)
    # and, hierarchical, every entry GPU of their nodes (a whole node's devices: a placement may leave the
    # last GPUs of the last node without tiles while one of them is the entry of a unit from elsewhere)
    width = max(int(dev.max(initial=0)), int(home.max(initial=0)), int(ex[:, 3].max(initial=0))) + 1
    if gpus_per_node:
        width = -(-width // int(gpus_per_node)) * int(gpus_per_node)
    n_units = layout.n_token_blocks * nhb
    key_of = lambda side, unit, d: (side * n_units + unit) * width + d  # noqa: E731
    # --- deliveries (side, unit, dst) at the earliest round asked
    parts_key, parts_round = [], []
    for side in (0, 1):
        remote = home[unit_of[side] // nhb] != dev
        if (wants[side][remote] < 1).any():
            raise ValueError("a remote input must arrive in round 1 or later")
        parts_key.append(key_of(side, unit_of[side][remote], dev[remote]))
        parts_round.append(wants[side][remote])
    ex = ex[home[ex[:, 1]] != ex[:, 3]]
    parts_key.append(key_of(ex[:, 0], ex[:, 1] * nhb + ex[:, 2], ex[:, 3]))
    parts_round.append(np.ones(len(ex), dtype=np.int64))
    uniq, inv = np.unique(np.concatenate(parts_key), return_inverse=True)
    first = np.full(uniq.size, np.iinfo(np.int64).max)
    np.minimum.at(first, inv, np.concatenate(parts_round))
    side, unit, dst = uniq // width // n_units, uniq // width % n_units, uniq % width
    src = home[unit // nhb]
    row = lambda sd, u, a, b, r: np.stack([sd, u // nhb, u % nhb, a, b, r], 1)  # noqa: E731
    arrive = first.copy()
    if gpus_per_node:
        g = int(gpus_per_node)
        far = src // g != dst // g
        entry = dst // g * g + src % g
        node_key = (side * n_units + unit) * (width // g + 1) + dst // g
        nk, ninv = np.unique(node_key[far], return_inverse=True)
        node_round = np.full(nk.size, np.iinfo(np.int64).max)
        np.minimum.at(node_round, ninv, first[far])
        arrive[far] = node_round[ninv] + (dst[far] != entry[far])
        at = np.flatnonzero(far)[np.unique(ninv, return_index=True)[1]]  # one delivery per (unit, node), nk order
        relayed = far & (dst != entry)
        rows = [row(side[~far], unit[~far], src[~far], dst[~far], first[~far]),
                row(side[at], unit[at], src[at], entry[at], node_round),
                row(side[relayed], unit[relayed], entry[relayed], dst[relayed], arrive[relayed])]
    else:
        rows = [row(side, unit, src, dst, first)]
    # --- tiles run once both inputs are there
    tile_stage = np.zeros(n, dtype=np.int64)
    for sd in (0, 1):
        remote = home[unit_of[sd] // nhb] != dev
        got = lookup(uniq, arrive, key_of(sd, unit_of[sd][remote], dev[remote]))
        tile_stage[remote] = np.maximum(tile_stage[remote], got)
    # --- partials home (through the entry GPU of their node when hierarchical)
    outputs = []
    for sd in (0, 1):
        away = home[unit_of[sd] // nhb] != dev
        okey, oinv = np.unique(key_of(sd, unit_of[sd][away], dev[away]), return_inverse=True)
        last = np.full(okey.size, -1, dtype=np.int64)
        np.maximum.at(last, oinv, tile_stage[away])
        ou, osrc = okey // width % n_units, okey % width
        ohome = home[ou // nhb]
        send = last + 2
        if not gpus_per_node:
            outputs.append(row(np.full_like(ou, sd), ou, osrc, ohome, send))
            continue
        g = int(gpus_per_node)
        oentry = osrc // g * g + ohome % g
        member = (osrc // g != ohome // g) & (osrc != oentry)
        outputs.append(row(np.full_like(ou, sd)[member], ou[member], osrc[member], oentry[member], send[member]))
        # the entry forwards its merged partial home once it has its own tiles' and every member's
        ekey = np.where(member, ou * width + oentry, ou * width + osrc)
        goes = (osrc // g != ohome // g)
        ek, einv = np.unique(ekey[goes], return_inverse=True)
        ready = np.full(ek.size, -1, dtype=np.int64)
        np.maximum.at(ready, einv, np.where(member[goes], send[goes] + 1, send[goes]))
        eu, esrc = ek // width, ek % width
        outputs.append(row(np.full_like(eu, sd), eu, esrc, home[eu // nhb], ready))
        near = ~goes
        outputs.append(row(np.full_like(ou, sd)[near], ou[near], osrc[near], ohome[near], send[near]))
    return tile_stage, Routes(np.concatenate(rows).reshape(-1, 6), np.concatenate(outputs).reshape(-1, 6))
