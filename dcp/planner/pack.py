"""Packing placement: whole sequences where they fit, balanced splits where they must, q-stationary tiles.

The strongest static plans (Megatron-Core's dynamic CP, zigzag rings) are points of dcp's plan space:
every tile runs on its q block's home, so only KV travels (the cheaper side under GQA), and each
sequence lives on a *group* of devices. This module builds such placements without the static plans'
restrictions (power-of-two groups, aligned device ranges, 2·cp equal chunks, one ring per group):

1. **Groups** (``_assign_groups``). Sequences go in decreasing order of work (the planner gives each
   sequence's modelled compute time run whole, plus its tokens' non-attention work when it scores it).
   One that fits on a device — work within the compute cap ``(1 + epsilon) · mean`` and tokens within
   the memory cap — goes whole to the least-loaded device with room: no communication at all (when the
   caps are used up, one that would fit an empty device goes whole to the least loaded, unless the
   search scores tokens: see ``overfill_whole``). One that fits nowhere is split over the fewest devices whose room (in work, counting that a member's part
   runs slower than the whole, and in tokens) adds up to it: inside the node with the most room when
   that node suffices (NVLink only), else over the nodes with the most room; each member's *share* is
   its room. When the room runs out the sequence is water-filled over the least loaded devices. The
   slow-down makes the total work exceed the weights' sum: a first pass measures it, a second
   balances against it.
2. **Cuts** (``zigzag_cuts``). Whole sequences are cut at the configured block size. A split sequence is
   cut on its mask's exact per-token work so that each member gets its share: as zigzag pairs of
   strips where work grows along the sequence (causal), as contiguous chunks where it is about even
   (sliding windows); strips longer than the block size are cut again.
The planner builds packings at several ``epsilon`` and keeps the one whose schedule is estimated fastest.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.cluster import Cluster
from dcp.layout.blocks import BlockLayout, TileSet, make_layout, uniform_cuts
from dcp.layout.tiles import enumerate_tiles
from dcp.masks.box_counts import range_profile
from dcp.spec import BatchSpec

MIN_SPLIT_BLOCK = 256
"""Smallest token block a split sequence is cut into (tiles below this run far below peak)."""
#: more popular boundaries than this in one sequence are a periodic pattern, not edges to cut at
MAX_POPULAR = 64


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
         epsilon_memory: float, weights: np.ndarray | None = None, half_extent: float = 0.0,
         token_share: np.ndarray | None = None, overfill_whole: bool = True,
         profiles: SequenceProfiles | None = None) -> Packing:
    """The packing placement of the module docstring. ``weights``: the work of every sequence (default
    its mask's area; the planner gives its modelled compute time, in which short sequences weigh more
    than their FLOPs because small kernels run below peak). ``half_extent``: the query extent at which
    kernels run at half speed (the cost profile's ``half_rows``): a member holding a share of a split
    sequence runs its part on fewer query rows than the whole, so its load counts that slow-down.
    ``token_share[s]``: the part of sequence s's weight that scales with its tokens rather than with its
    mask's work (the non-attention layers); a split follows that mix. ``overfill_whole``: a sequence
    that would fit an empty device but finds the caps used up goes whole to the least loaded device
    (no communication; right when only attention is scored), else it is split like a long one
    (better when the device with the most tokens sets the step's non-attention time). ``profiles``: a
    ``SequenceProfiles`` of this batch shared by several calls (default: a new one)."""
    n_dev = cluster.n_devices
    profiles = SequenceProfiles(spec) if profiles is None else profiles
    seq_w = sequence_areas(spec) if weights is None else np.asarray(weights, float)
    seq_t = np.asarray(spec.seqlens, float)
    cap_t = (1 + epsilon_memory) * seq_t.sum() / n_dev
    # split members run slower than the whole would, so the work to spread exceeds the sum of the
    # weights: a first pass measures it, a second balances against it
    # (the first pass counts a split member's tokens as its share; the second cuts for real)
    load = _assign_groups(spec, seq_w, seq_t, cluster, (1 + epsilon) * seq_w.sum() / n_dev, cap_t, half_extent,
                          overfill_whole, block_size, token_share, None)[3]
    total = max(load.sum(), seq_w.sum())
    groups, shares, cuts, load = _assign_groups(spec, seq_w, seq_t, cluster, (1 + epsilon) * total / n_dev, cap_t,
                                                half_extent, overfill_whole, block_size, token_share, profiles)
    return _packing(spec, groups, shares, block_size, head_block_size, token_share, cuts)


def _assign_groups(spec: BatchSpec, seq_w: np.ndarray, seq_t: np.ndarray, cluster: Cluster, cap_w: float,
                   cap_t: float, half_extent: float, overfill_whole: bool = True, block_size: int = 1024,
                   token_share: np.ndarray | None = None, profiles: SequenceProfiles | None = None):
    """(group, shares, cuts) of every sequence and the device loads, greedily (module docstring, step 1).
    ``cuts[s]``: a split sequence's (block bounds, owners) from ``zigzag_cuts`` (None: whole), cut
    within the members' token room so that the device tokens it counts are the cut's own; without
    ``profiles`` (a pass that only measures the load) nothing is cut and members count their shares."""
    n_dev, gpn = cluster.n_devices, cluster.gpus_per_node
    load, tokens = np.zeros(n_dev), np.zeros(n_dev)
    groups: list[tuple[int, ...]] = [()] * spec.num_seqs
    shares: list[np.ndarray] = [np.ones(1)] * spec.num_seqs
    cuts: list = [None] * spec.num_seqs
    for s in np.lexsort((np.arange(spec.num_seqs), -seq_t, -seq_w)).tolist():
        w, t = float(seq_w[s]), float(seq_t[s])
        token_room = tokens + t <= cap_t * (1 + 1e-9)
        room = (load + w <= cap_w * (1 + 1e-9)) & token_room
        fits_empty = w <= cap_w * (1 + 1e-9) and t <= cap_t * (1 + 1e-9)
        short = spec.seqlens[s] <= 2 * MIN_SPLIT_BLOCK
        # whole where work and tokens fit; past the work cap onto a device with token room (memory is a
        # budget, work a preference) if the sequence is too short to split well or may overfill; a sequence
        # that fits no device's token room is split however short (or, a single token, goes where fewest are)
        if room.any() or (token_room.any() and (short or (overfill_whole and fits_empty))) or t < 2:
            cand = np.flatnonzero(room) if room.any() else np.flatnonzero(token_room)
            if cand.size == 0:
                cand = np.flatnonzero(tokens == tokens.min())
            d = int(cand[np.lexsort((cand, tokens[cand], load[cand]))[0]])
            groups[s] = (d,)
            load[d] += w
            tokens[d] += t
            continue
        n = float(spec.seqlens[s])

        def slow(share):  # how much slower a member runs its part than the whole would run (query extent)
            part = np.maximum(share, 1e-9) * n
            return (n / (n + half_extent)) / (part / (part + half_extent))

        # the fraction of the sequence each device can take, in work (its split part runs slower) and tokens
        # token room in whole tokens (a device with less than one token of room takes no part)
        token_left = np.floor(np.maximum(cap_t - tokens, 0.0) + 1e-9)
        room = np.minimum((cap_w - load) / (w * slow(min(1.0, cap_w / w))), token_left / t)
        members = _group(room, gpn)
        if members.size:
            share = room[members] / room[members].sum()
        else:  # not enough room left: water-fill the least loaded devices, each within its token room
            need = w * slow(min(1.0, cap_w / w))
            members, share = _capped_water_fill(load, need, token_left / t)
        groups[s], shares[s] = tuple(members.tolist()), share
        if profiles is None:  # a measuring pass: members take their shares
            load[members] += share * w * slow(share)
            tokens[members] += share * t
            continue
        tau = 0.0 if token_share is None else float(token_share[s])
        bounds, owner = cuts[s] = zigzag_cuts(None, members, share, block_size, tau, token_left[members],
                                              profiles[s])
        tokens += np.bincount(owner, weights=np.diff(bounds), minlength=n_dev)
        # the work each member got: its share unless the token room moved the cuts (the later sequences
        # are placed against what the devices really carry)
        got = _cut_shares(profiles[s][0], bounds, owner, members, tau)
        load[members] += got * w * slow(got)
    return groups, shares, cuts, load


def _cut_shares(work: np.ndarray, bounds: np.ndarray, owner: np.ndarray, members: np.ndarray,
                token_share: float = 0.0) -> np.ndarray:
    """Fraction of a split sequence's work each of ``members`` owns under the cuts (``bounds``, ``owner``
    from ``zigzag_cuts``), on the same per-token work (``token_share`` of it spread evenly over tokens)."""
    work = (1 - token_share) * work / max(float(work.sum()), 1e-300) + token_share / work.size
    cum = np.concatenate([[0.0], np.cumsum(work)])
    per_block = cum[bounds[1:]] - cum[bounds[:-1]]
    order = np.argsort(members)  # owner -> its position among the sorted members, then back to members' order
    out = np.empty(members.size)
    out[order] = np.bincount(np.searchsorted(members, owner, sorter=order), weights=per_block, minlength=members.size)
    return out / max(float(out.sum()), 1e-300)


def pack_aligned(spec: BatchSpec, cluster: Cluster, block_size: int, head_block_size: int | None,
                 weights: np.ndarray | None = None, token_share: np.ndarray | None = None) -> Packing:
    """A packing on aligned power-of-two device groups, the shape Megatron-Core's dynamic CP forms: a
    sequence of L tokens gets the next power of two of L / (mean tokens per device) devices (at most the
    largest power of two that fits the cluster), at offsets that are multiples of that size; sequences go
    longest first to the group whose busiest device carries the least work, preferring groups with token
    room. Inside a group the sequence is split like every packing (work-balanced zigzag, equal shares)
    and scheduled by dcp — a strong static shape as one of the planner's candidates, not a fallback to
    the static plan."""
    n_dev = cluster.n_devices
    seq_w = sequence_areas(spec) if weights is None else np.asarray(weights, float)
    lens = np.asarray(spec.seqlens, dtype=np.int64)
    per_dev = -(-int(lens.sum()) // n_dev)
    top = 1 << (n_dev.bit_length() - 1)
    load, tokens = np.zeros(n_dev), np.zeros(n_dev)
    groups: list[tuple[int, ...]] = [()] * spec.num_seqs
    shares: list[np.ndarray] = [np.ones(1)] * spec.num_seqs
    for s in np.lexsort((np.arange(spec.num_seqs), -seq_w, -lens)).tolist():
        need = -(-int(lens[s]) // per_dev)
        cp = min(1 << max(need - 1, 0).bit_length(), top)
        idx = (np.arange(n_dev // cp) * cp)[:, None] + np.arange(cp)[None, :]
        fits = tokens[idx].max(axis=1) + lens[s] / cp <= per_dev
        best = int(np.lexsort((np.arange(idx.shape[0]), tokens[idx].max(axis=1), load[idx].max(axis=1), ~fits))[0])
        groups[s], shares[s] = tuple(idx[best].tolist()), np.full(cp, 1.0 / cp)
        load[idx[best]] += seq_w[s] / cp
        tokens[idx[best]] += lens[s] / cp
    return _packing(spec, groups, shares, block_size, head_block_size, token_share)


def _packing(spec: BatchSpec, groups, shares, block_size: int, head_block_size: int | None,
             token_share: np.ndarray | None, cuts: list | None = None) -> Packing:
    """Layout and homes of a packing from each sequence's device group and the members' shares (or the
    split sequences' ``cuts`` when already made)."""
    bounds, homes = [], []
    for s, n in enumerate(spec.seqlens):
        if len(groups[s]) == 1:
            whole = uniform_cuts(n, block_size)
            bounds.append(whole)
            homes.append(np.full(whole.size - 1, groups[s][0], dtype=np.int64))
        elif cuts is not None and cuts[s] is not None:
            bounds.append(cuts[s][0])
            homes.append(cuts[s][1])
        else:
            tau = 0.0 if token_share is None else float(token_share[s])
            cuts_s, owner = zigzag_cuts(spec.kv_ranges(s), np.asarray(groups[s]), shares[s], block_size, tau)
            bounds.append(cuts_s)
            homes.append(owner)
    layout = make_layout(spec, bounds, head_block_size)
    return Packing(layout, enumerate_tiles(spec, layout), np.concatenate(homes), tuple(groups))


def sequence_profile(ranges_tr2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(exact attended keys per query token, ``popular_boundaries``) of one sequence: what
    ``zigzag_cuts`` reads of its mask (computed once per sequence and planning call; one pass over the
    ranges, cached with the mask's array: ``dcp.masks.box_counts.range_profile``)."""
    work, edges = range_profile(ranges_tr2)
    return work.astype(float), popular_boundaries(ranges_tr2, edges=edges)


class SequenceProfiles(dict):
    """``sequence_profile`` of each sequence of one batch, computed on first use."""

    def __init__(self, spec: BatchSpec):
        super().__init__()
        self.spec = spec

    def __missing__(self, s: int):
        self[s] = got = sequence_profile(self.spec.kv_ranges(s))
        return got


def zigzag_cuts(ranges_tr2: np.ndarray | None, members: np.ndarray, share: np.ndarray, block_size: int,
                token_share: float = 0.0, token_caps: np.ndarray | None = None,
                profile: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Block boundaries ``[0, ..., L]`` of one split sequence and the member owning each block.

    Where the mask's work grows along the sequence (causal-like: the second half holds at least 1.5x
    the first half's work), member m (in node-major order) owns the m-th *pair* of strips counted from
    both ends, ``[x_m, x_m+1)`` and ``[L − x_m+1, L − x_m)`` (the last member the middle): a zigzag, so
    each member — and each node, whose members' strips are adjacent — holds early and late tokens.
    Elsewhere (sliding windows, full masks: work about even) member m owns one contiguous chunk, so it
    needs the keys of one boundary region instead of two. Cut points are placed on the exact per-token
    work of the mask so that every member's work is its share (for causal masks a zigzag pair's work is
    proportional to its length, so tokens follow the shares too). With ``token_share`` > 0 that fraction
    of the work is spread evenly over the tokens instead. ``token_caps[m]``: most tokens member m may
    take (its room in the memory budget); cuts move to respect them where the work would place more
    tokens on a member (the first chunks of a sliding window hold less work per token). Strips longer
    than ``block_size`` are cut into blocks of at most ``block_size`` tokens. ``profile``: the sequence's
    ``sequence_profile`` when already computed (``ranges_tr2`` is then not read)."""
    work, popular = sequence_profile(ranges_tr2) if profile is None else profile
    seqlen = work.size
    half = seqlen // 2
    growing = work[half:].sum() >= 1.5 * work[:half].sum()
    work = (1 - token_share) * work / max(work.sum(), 1e-300) + token_share / seqlen
    cum = np.concatenate([[0.0], np.cumsum(work)])
    total = float(cum[-1])
    target = np.cumsum(share)[:-1] / share.sum() * total
    g = members.size
    pieces = []
    if growing:
        x = np.arange(half + 1)
        strip = cum[x] + (total - cum[seqlen - x])  # work of [0, x) and [L - x, L)
        xs = np.maximum.accumulate(np.concatenate([[0], np.searchsorted(strip, target), [half]]).clip(0, half))
        if token_caps is not None:  # member m < g-1 takes 2 (x_m+1 - x_m) tokens, the last L - 2 x_g-1
            xs = _clamp_cuts(xs, np.asarray(token_caps, float), seqlen, 2, strip, share)
        for m in range(g):
            if m < g - 1:
                strips = ((xs[m], xs[m + 1]), (seqlen - xs[m + 1], seqlen - xs[m]))
            else:
                strips = ((xs[m], seqlen - xs[m]),)
            pieces += [(int(a), int(b), int(members[m])) for a, b in strips if b > a]
    else:
        xs = np.maximum.accumulate(np.concatenate([[0], np.searchsorted(cum, target), [seqlen]]).clip(0, seqlen))
        if token_caps is not None:
            xs = _clamp_cuts(xs, np.asarray(token_caps, float), seqlen, 1, cum, share)
        pieces = [(int(xs[m]), int(xs[m + 1]), int(members[m])) for m in range(g) if xs[m + 1] > xs[m]]
    pieces.sort()
    cuts, owner = [0], []
    for a, b, d in pieces:
        inner = popular[(popular > a) & (popular < b)]  # keys many queries read start a block of their own
        edges = np.concatenate([[a], inner, [b]])
        for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist()):
            k = -(-(hi - lo) // block_size)
            cuts += (lo + (np.arange(1, k + 1) * (hi - lo)) // k).tolist()
            owner += [d] * k
    return np.asarray(cuts, dtype=np.int64), np.asarray(owner, dtype=np.int64)


def _clamp_cuts(xs: np.ndarray, caps: np.ndarray, seqlen: int, per_step: int, work_at: np.ndarray | None = None,
                share: np.ndarray | None = None) -> np.ndarray:
    """Cut positions ``xs`` (``[g + 1]``, first 0) moved so that member m's tokens, ``per_step x (x_m+1 -
    x_m)`` (the last member: all that remains), stay within ``caps[m]`` where the caps allow: each cut at
    most ``caps[m] / per_step`` past the previous one and far enough that the members after it can hold
    the rest. When the caps add up to less than the sequence, the rest stays on the last member.

    ``work_at[x]`` (the work up to cut position x, non-decreasing) and the members' ``share``: once a cut
    has moved, each later member's cut is placed anew at its share of the work that remains, so the work a
    capped member could not take is spread over all the members after it instead of landing on the next
    one (which would then carry its own share plus that shortfall: a shared-question sequence whose cheap
    question tokens fill the first member's room). Cuts before the first move are kept as given."""
    xs = xs.astype(np.int64).copy()
    g = caps.size
    # whole tokens a member can take: a multiple of per_step, except the last member's remainder
    caps = np.append(per_step * np.floor(caps[:-1] / per_step), np.floor(caps[-1:]))
    after = np.concatenate([np.cumsum(caps[::-1])[::-1][1:], [0.0]])  # caps of the members after m
    moved = False
    for m in range(g - 1):
        if moved and work_at is not None and share is not None:
            done, total = float(work_at[xs[m]]), float(work_at[-1])
            target = done + (total - done) * float(share[m]) / max(float(np.sum(share[m:])), 1e-300)
            xs[m + 1] = max(int(xs[m]), min(int(np.searchsorted(work_at, target)), work_at.size - 1))
        hi = xs[m] + int(caps[m] // per_step)
        lo = int(np.ceil((seqlen - after[m]) / per_step))
        cut = max(xs[m], min(max(int(xs[m + 1]), lo), hi))
        moved |= cut != xs[m + 1]
        xs[m + 1] = cut
    limit = xs[-1]
    xs[:-1] = np.minimum(xs[:-1], limit)
    return xs


def popular_boundaries(ranges_tr2: np.ndarray, min_share: float = 0.25, edges: np.ndarray | None = None) -> np.ndarray:
    """Key positions where the ranges of at least ``min_share`` of the queries start or end (the end of
    a lambda mask's sink, a shared question's end): cutting a block there keeps the keys every query
    reads in a small unit of their own, instead of inside a full block that would travel with them.
    More than ``MAX_POPULAR`` such positions are a periodic pattern (e.g. every 8th key), not edges worth
    a cut: none are returned (cutting at each would make blocks of a few tokens). ``edges``: the ranges
    starting or ending at each key, when known (``range_profile``)."""
    seqlen = ranges_tr2.shape[0]
    count = range_profile(ranges_tr2)[1] if edges is None else edges
    pos = np.flatnonzero(count >= min_share * seqlen)
    pos = pos[(pos > 0) & (pos < seqlen)]
    return pos if pos.size <= MAX_POPULAR else pos[:0]


def _capped_water_fill(load: np.ndarray, amount: float, cap_share: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(members, shares summing to 1) that pour ``amount`` of work onto the least loaded devices up to
    one common level, device d taking at most ``cap_share[d]`` of the whole (its token room). When the
    token room of all devices does not add up to the whole, the caps are dropped (the memory budget
    cannot be met; the planner reports it)."""
    n_dev = load.size
    if cap_share.sum() < 1 - 1e-9:
        level = _water_level(load, amount)
        members = np.flatnonzero(load < level - 1e-12 * max(level, 1.0))
        if members.size < 2:
            members = np.sort(np.lexsort((np.arange(n_dev), load))[:2])
        share = np.maximum(level - load[members], 1e-12)
        return members, share / share.sum()
    take = lambda level: np.minimum(np.maximum(level - load, 0.0) / amount, cap_share)  # noqa: E731
    lo, hi = float(load.min()), float(load.max()) + amount
    for _ in range(60):  # bisection on the level: the taken shares grow monotonically with it
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if take(mid).sum() < 1 else (lo, mid)
    share = take(hi)
    members = np.flatnonzero(share > 1e-9)
    if members.size < 2:
        members = np.sort(np.lexsort((np.arange(n_dev), -share))[:2])
    share = np.maximum(share[members], 1e-12)
    return members, share / share.sum()


def _water_level(load: np.ndarray, amount: float) -> float:
    """The level λ with ``sum(max(0, λ - load)) == amount``: pouring ``amount`` of work onto the least
    loaded devices raises them all to λ."""
    lv = np.sort(load)
    filled = np.cumsum(lv)
    for k in range(1, lv.size + 1):
        level = (amount + filled[k - 1]) / k
        if k == lv.size or level <= lv[k]:
            return float(level)
    return float(lv[-1])


def _group(room: np.ndarray, gpn: int) -> np.ndarray:
    """Devices a sequence is split over, given ``room[d]``: the fraction of the sequence device d can
    still take (in work and in tokens). The fewest devices whose room adds up to the whole, inside the
    node with the most room if it suffices, else over the nodes with the most room; empty when all the
    room in the cluster does not add up to the whole."""
    room = np.maximum(room, 0.0)
    if room.sum() < 1 - 1e-9:
        return np.zeros(0, dtype=np.int64)
    node_room = room.reshape(-1, gpn).sum(axis=1)
    chosen: list[int] = []
    need = 1.0
    for nd in np.lexsort((np.arange(node_room.size), -node_room)).tolist():
        devs = nd * gpn + np.arange(gpn)
        devs = devs[np.lexsort((devs, -room[devs]))]
        devs = devs[room[devs] > 0]
        if node_room[nd] >= need * (1 - 1e-9):  # this node finishes it: its fewest devices that suffice
            take = int(np.searchsorted(np.cumsum(room[devs]), need * (1 - 1e-9))) + 1
            chosen += devs[:take].tolist()
            break
        chosen += devs.tolist()
        need -= node_room[nd]
    return np.asarray(sorted(chosen), dtype=np.int64)
