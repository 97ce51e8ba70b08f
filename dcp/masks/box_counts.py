"""Exact counts of the attended (query, key) pairs inside boxes of a mask, for any number of ranges.

``box_counts(ranges_tr2, q_bounds, kv_bounds)`` returns int64 ``[nq, nk]``: the pairs ``(t, k)`` with
``q_bounds[i] <= t < q_bounds[i+1]`` and ``kv_bounds[j] <= k < kv_bounds[j+1]`` that the KV ranges allow.
The planner counts the tiles of a block layout with it (``dcp.layout.blocks.pair_counts``), the renderer
the density of each pixel (``dcp.masks.render``). Two exact methods, picked per call:

- ``"direct"``: one pass over the ranges. Each range adds its overlap with every key box it spans (first
  and last boxes partially, interior boxes through a difference array) to its query box, accumulated with
  ``np.bincount`` (the same loop in C++, ``dcp._C.box_counts_direct``, when the extension is built).
  O(ranges + nq·nk); best for masks of a few ranges per query.
- ``"index"``: a ``RangesIndex`` built once per (read-only) ranges array and cached: a bitmap of the mask
  in 64-key words plus, per word, the count of attended keys before it. The keys below a bound ``x`` in
  row ``t`` are then ``below[x >> 6, t] + popcount(bits[x >> 6, t] & low_bits(x & 63))``, so a call costs
  O(queries · key bounds) whatever the number of ranges: strided or dilated masks hold thousands of
  ranges per query, and a planner counts the same mask under dozens of layouts.

``"auto"`` takes the index where it is cheaper and the array is read-only and views no writable array
(``cacheable``: ``BatchSpec`` ranges are), so that a cached index can never go stale; the index of an
array is kept while the array lives (weakly referenced, at most ``INDEX_CACHE_BYTES`` in all, least
recently used out first). ``range_profile`` — keys per query, ranges starting or ending at each key, what a
planner reads of a mask to place its cuts — is cached the same way; a mask_mod's blockwise evaluation
hands both over with its ranges (``register_index``).
"""
from __future__ import annotations

import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dcp.errors import InvalidMaskError
from dcp.masks.progress import reporter

try:  # the direct pass in C++, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE = hasattr(_C, "box_counts_direct")
except ImportError:
    _C, _NATIVE = None, False

WORD = 64
#: ONES[k]: the k lowest bits set (k = 0..64)
ONES = np.array([(1 << k) - 1 for k in range(WORD + 1)], dtype=np.uint64)
ALL_ONES = ONES[WORD]
#: elements per temporary of the index build and of an index query
CHUNK = 1 << 22
#: the index is used when the ranges number at least this share of (queries x key bounds): a range costs
#: the direct pass about 7 times what one (query, key bound) costs the index (measured at 32K tokens)
INDEX_MIN_SHARE = 0.25
#: bytes of indexes kept at once (the least recently used go first), and the least any index may take
INDEX_CACHE_BYTES = 2 << 30
INDEX_MIN_BUDGET = 256 << 20
METHODS = ("auto", "direct", "index")


@dataclass(frozen=True, eq=False)
class RangesIndex:
    """The mask of ``T`` queries over ``T`` keys as a bitmap, word-major so that one key bound reads two
    contiguous rows.

    ``bits``: uint64 ``[W, T]``, bit ``b`` of ``bits[w, t]`` set when query ``t`` attends key ``64 w + b``;
    ``below``: int32 ``[W, T]``, the keys ``< 64 w`` that query ``t`` attends. ``W = T // 64 + 1`` (the
    last word is past every key, so that the bound ``x = T`` needs no special case).
    ``used_ranges``: the number of non-empty ranges the index was built from.
    """

    bits: np.ndarray
    below: np.ndarray
    used_ranges: int

    @property
    def nbytes(self) -> int:
        return int(self.bits.nbytes + self.below.nbytes)

    def keys_below(self, x: np.ndarray) -> np.ndarray:
        """int64 ``[len(x), T]``: the keys ``< x[i]`` attended by each query (``0 <= x[i] <= T``)."""
        x = np.asarray(x, dtype=np.int64)
        w = x >> 6
        low = ONES[x & (WORD - 1)][:, None]
        return self.below[w].astype(np.int64) + np.bitwise_count(self.bits[w] & low)


def index_bytes(seqlen: int) -> int:
    """Bytes of the ``RangesIndex`` of a ``seqlen``-token mask (12 per query and 64-key word)."""
    return 12 * (seqlen // WORD + 1) * seqlen


def build_index(ranges_tr2: np.ndarray, progress: Callable[[float], None] | None = None) -> RangesIndex:
    """The ``RangesIndex`` of valid KV ranges ``[T, R, 2]`` (rows in chunks; O(ranges + T²/64)).
    ``progress``: called with the fraction of rows done (``dcp.masks.progress``), if given."""
    n_tok, n_slots = ranges_tr2.shape[:2]
    bits = np.zeros((n_tok // WORD + 1, n_tok), dtype=np.uint64)
    used_total = 0
    step = max(1, CHUNK // n_slots)
    for t0 in range(0, n_tok, step):
        part = ranges_tr2[t0: t0 + step]
        used = part[:, :, 1] > part[:, :, 0]
        row = t0 + np.nonzero(used)[0]  # row-major: each row's ranges in order
        s = part[:, :, 0][used].astype(np.int64)
        e = part[:, :, 1][used].astype(np.int64)
        used_total += int(s.size)
        paint_bits(bits, row, s, e)
        if progress is not None:
            progress(min(1.0, (t0 + step) / n_tok))
    return RangesIndex(bits, keys_before_words(bits), used_total)


def keys_before_words(bits: np.ndarray) -> np.ndarray:
    """``RangesIndex.below`` of a word-major bitmap ``[W, T]``: int32 running popcounts over the words."""
    below = np.zeros(bits.shape, dtype=np.int32)
    for w in range(1, bits.shape[0]):  # W vector steps: faster than cumsum over axis 0 with a cast
        np.add(below[w - 1], np.bitwise_count(bits[w - 1]), out=below[w])
    return below


def paint_bits(bits: np.ndarray, row: np.ndarray, s: np.ndarray, e: np.ndarray) -> None:
    """OR the bits of the ranges ``[s, e)`` (int64 ``[n]``) of rows ``row`` into the word-major bitmap
    ``bits`` uint64 ``[W, T]``. The ranges must be sorted by (row, start) and must not overlap."""
    n_words, n_tok = bits.shape
    if row.size == 0:
        return
    ws, we = s >> 6, (e - 1) >> 6
    single = ws == we
    first = ONES[np.where(single, ((e - 1) & (WORD - 1)) + 1, WORD)] & ~ONES[s & (WORD - 1)]
    # partial words: each range's first word, then (if it spans more) its last one; ranges of a row are
    # sorted and disjoint, so the (row, word) pairs never decrease and equal ones are adjacent: OR them
    width = 2 - single
    at = np.cumsum(width) - width
    keys = np.empty(int(width.sum()), dtype=np.int64)
    vals = np.empty(keys.size, dtype=np.uint64)
    keys[at], vals[at] = row * n_words + ws, first
    multi = ~single
    keys[at[multi] + 1] = row[multi] * n_words + we[multi]
    vals[at[multi] + 1] = ONES[((e[multi] - 1) & (WORD - 1)) + 1]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    k_row, k_word = np.divmod(keys[starts], n_words)
    flat = bits.reshape(-1)
    flat[k_word * n_tok + k_row] |= np.bitwise_or.reduceat(vals, starts)
    inner = np.flatnonzero((we - ws) >= 2)  # words strictly inside one range: all ones
    if inner.size:
        count = we[inner] - ws[inner] - 1
        which = np.repeat(inner, count)
        word = ws[which] + 1 + np.arange(which.size) - np.repeat(np.cumsum(count) - count, count)
        flat[word * n_tok + row[which]] = ALL_ONES


# ----------------------------------------------------------------------------------------------------
# the index cache: by array identity, for read-only arrays only
# ----------------------------------------------------------------------------------------------------

_lock = threading.Lock()
#: id(array) -> [weak reference, non-empty ranges, index or None, profile or None]
_entries: OrderedDict[int, list] = OrderedDict()
_dead: list[int] = []  # keys of arrays that died (see _forget)


def _forget(key: int) -> None:
    # a weakref callback may run inside any allocation, even under _lock: it only records the key
    _dead.append(key)


def _purge_dead() -> None:
    """Drop the entries of arrays that died (call under _lock)."""
    while _dead:
        key = _dead.pop()
        hit = _entries.get(key)
        if hit is not None and hit[0]() is None:
            del _entries[key]


def cacheable(ranges_tr2: np.ndarray) -> bool:
    """Whether what the cache keeps of an array can never go stale: the array, and every array it views,
    are read-only (a read-only view of a writable array could still change)."""
    arr = ranges_tr2
    while isinstance(arr, np.ndarray):
        if arr.flags.writeable:
            return False
        arr = arr.base
    return True


def _entry(ranges_tr2: np.ndarray) -> list | None:
    """The cache entry of a ``cacheable`` array (made on first use: its count of non-empty ranges), or
    None for another (its contents may change under the same identity)."""
    if not cacheable(ranges_tr2):
        return None
    key = id(ranges_tr2)
    with _lock:
        _purge_dead()
        hit = _entries.get(key)
        if hit is not None and hit[0]() is ranges_tr2:
            _entries.move_to_end(key)
            return hit
    try:
        ref = weakref.ref(ranges_tr2, lambda _r, key=key: _forget(key))
    except TypeError:
        return None
    entry = [ref, used_ranges(ranges_tr2), None, None]
    with _lock:
        _entries[key] = entry
    return entry


def register_index(ranges_tr2: np.ndarray, index: RangesIndex | None, profile: tuple | None = None) -> None:
    """Cache ``index`` as the index of the read-only array ``ranges_tr2`` (built along with it, e.g. by
    ``dcp.masks.mask_mod_bands``), so that counting on it never builds one from the ranges; likewise
    its ``range_profile`` when given."""
    if not cacheable(ranges_tr2):
        raise InvalidMaskError("register_index: the ranges must be read-only, and not view a writable array "
                               "(an index of them could go stale)")
    key = id(ranges_tr2)
    ref = weakref.ref(ranges_tr2, lambda _r, key=key: _forget(key))
    used = index.used_ranges if index is not None else (
        int(profile[1].sum()) // 2 if profile is not None else used_ranges(ranges_tr2))  # 2 edges a range
    entry = [ref, used, index, profile]
    with _lock:
        _purge_dead()
        _entries[key] = entry
    _trim(entry)


def _trim(keep: list) -> None:
    """Drop the least recently used indexes (not ``keep``'s) while they take more than the budget."""
    with _lock:
        _purge_dead()
        total = sum(e[2].nbytes for e in _entries.values() if e[2] is not None)
        for e in list(_entries.values()):
            if total <= INDEX_CACHE_BYTES:
                break
            if e[2] is not None and e is not keep:
                total -= e[2].nbytes
                e[2] = None


def cached_index(ranges_tr2: np.ndarray) -> RangesIndex:
    """The ``RangesIndex`` of ``ranges_tr2``: cached for a read-only array, else built afresh."""
    entry = _entry(ranges_tr2)
    if entry is None:
        return _build_reported(ranges_tr2)
    if entry[2] is None:
        entry[2] = _build_reported(ranges_tr2)
        _trim(entry)
    return entry[2]


def _build_reported(ranges_tr2: np.ndarray) -> RangesIndex:
    """``build_index`` with the default progress report (quiet unless it runs for seconds)."""
    report = reporter(None, f"indexing a {ranges_tr2.shape[0]:,}-token mask for pair counts")
    try:
        return build_index(ranges_tr2, progress=report)
    finally:
        report.close()


def range_profile(ranges_tr2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys each query attends: int64 ``[T]``, ranges starting or ending at each key: int64 ``[T + 1]``):
    what a planner reads of a mask to place its cuts (``dcp.planner.pack.sequence_profile``). One pass
    over the ranges in row chunks, cached for a read-only array (a mask_mod's comes with it)."""
    entry = _entry(ranges_tr2)
    if entry is not None and entry[3] is not None:
        return entry[3]
    n_tok, n_slots = ranges_tr2.shape[:2]
    work = np.zeros(n_tok, dtype=np.int64)
    edges = np.zeros(n_tok + 1, dtype=np.int64)
    step = max(1, CHUNK // max(1, n_slots))
    for t0 in range(0, n_tok, step):
        part = ranges_tr2[t0: t0 + step]
        s, e = part[:, :, 0], part[:, :, 1]
        work[t0: t0 + part.shape[0]] = (e.astype(np.int64) - s).sum(axis=1)
        used = e > s
        edges += np.bincount(s[used], minlength=n_tok + 1) + np.bincount(e[used], minlength=n_tok + 1)
    profile = (work, edges)
    if entry is not None:
        entry[3] = profile
    return profile


def clear_index_cache() -> None:
    with _lock:
        _entries.clear()
        _dead.clear()


def used_ranges(ranges_tr2: np.ndarray) -> int:
    """Non-empty ranges of an array (one pass over its slots, in row chunks)."""
    step = max(1, CHUNK // max(1, ranges_tr2.shape[1]))
    return sum(int((ranges_tr2[i: i + step, :, 1] > ranges_tr2[i: i + step, :, 0]).sum())
               for i in range(0, ranges_tr2.shape[0], step))


# ----------------------------------------------------------------------------------------------------
# counting
# ----------------------------------------------------------------------------------------------------

def _check_bounds(bounds: np.ndarray, n: int, what: str) -> np.ndarray:
    b = np.asarray(bounds, dtype=np.int64)
    if b.ndim != 1 or b.size < 2 or b[0] != 0 or b[-1] != n or (np.diff(b) <= 0).any():
        raise InvalidMaskError(f"{what} bounds must increase strictly from 0 to {n}, got {bounds!r:.120}")
    return b


def box_counts(ranges_tr2: np.ndarray, q_bounds: np.ndarray, kv_bounds: np.ndarray,
               method: str = "auto") -> np.ndarray:
    """Attended pairs in each (query box, key box): int64 ``[len(q_bounds) - 1, len(kv_bounds) - 1]``.

    ``ranges_tr2``: valid KV ranges ``[T, R, 2]`` of a ``T``-token sequence; both bounds increase strictly
    from 0 to ``T``. ``method``: "auto", "direct" or "index" (module docstring); all give the same counts.
    """
    if method not in METHODS:
        raise InvalidMaskError(f"box_counts: method must be one of {METHODS}, got {method!r}")
    n_tok = ranges_tr2.shape[0]
    qb = _check_bounds(q_bounds, n_tok, "query")
    kb = _check_bounds(kv_bounds, n_tok, "key")
    if method == "auto":
        method = "index" if _index_pays(ranges_tr2, kb.size) else "direct"
    if method == "index":
        index = cached_index(ranges_tr2)
        return _index_counts(index, qb, kb)
    return _direct_counts(ranges_tr2, qb, kb)


def _index_pays(ranges_tr2: np.ndarray, n_kv_bounds: int) -> bool:
    """Whether the index is the cheaper way for this call: a ``cacheable`` array (its index is kept) of
    many ranges per query, whose index fits the budget (the array's own size or ``INDEX_MIN_BUDGET``)."""
    n_tok, n_slots = ranges_tr2.shape[:2]
    if n_slots < INDEX_MIN_SHARE * n_kv_bounds or not cacheable(ranges_tr2):
        return False  # a query never has more ranges than slots: the direct pass is cheaper
    if index_bytes(n_tok) > max(INDEX_MIN_BUDGET, ranges_tr2.nbytes):
        return False
    entry = _entry(ranges_tr2)
    return entry is not None and entry[1] >= INDEX_MIN_SHARE * n_tok * n_kv_bounds


def _index_counts(index: RangesIndex, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """Counts from the index: keys below each key bound, summed over each query box."""
    n_tok = index.bits.shape[1]
    per = max(1, CHUNK // n_tok)
    below_x = np.empty((kb.size, qb.size - 1), dtype=np.int64)  # [key bound, query box]
    for c in range(0, kb.size, per):
        below_x[c: c + per] = np.add.reduceat(index.keys_below(kb[c: c + per]), qb[:-1], axis=1)
    return np.ascontiguousarray(np.diff(below_x, axis=0).T)


def _direct_counts(ranges_tr2: np.ndarray, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """``_direct_counts_reference``'s counts, by its C++ loop (``dcp._C.box_counts_direct``) when the
    extension is built and the ranges are int32 (validated masks' are)."""
    if _NATIVE and ranges_tr2.dtype == np.int32:
        import torch

        with warnings.catch_warnings():  # BatchSpec ranges are read-only; the loop only reads them
            warnings.simplefilter("ignore", UserWarning)
            args = (torch.from_numpy(np.ascontiguousarray(ranges_tr2)), torch.from_numpy(qb), torch.from_numpy(kb))
        return _C.box_counts_direct(*args).numpy()
    return _direct_counts_reference(ranges_tr2, qb, kb)


def _direct_counts_reference(ranges_tr2: np.ndarray, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """Counts in one pass over the ranges (module docstring), in chunks of rows."""
    nq, nk = qb.size - 1, kb.size - 1
    n_tok, n_slots = ranges_tr2.shape[:2]
    counts = np.zeros(nq * nk, dtype=np.float64)  # weights are exact in float64 (counts << 2**53)
    spans = np.zeros((nq, nk + 1), dtype=np.int64)  # interior key boxes covered, as differences
    step = max(1, CHUNK // max(1, n_slots))
    for t0 in range(0, n_tok, step):
        part = ranges_tr2[t0: t0 + step]
        used = part[:, :, 1] > part[:, :, 0]
        s = part[:, :, 0][used].astype(np.int64)
        e = part[:, :, 1][used].astype(np.int64)
        if s.size == 0:
            continue
        g = np.searchsorted(qb, t0 + np.nonzero(used)[0], side="right") - 1
        js = np.searchsorted(kb, s, side="right") - 1
        je = np.searchsorted(kb, e - 1, side="right") - 1
        same = js == je
        counts += np.bincount(g * nk + js, weights=np.where(same, e - s, kb[js + 1] - s), minlength=nq * nk)
        diff = ~same
        counts += np.bincount(g[diff] * nk + je[diff], weights=(e - kb[je])[diff], minlength=nq * nk)
        inner = diff & (je > js + 1)
        if inner.any():
            gi = g[inner] * (nk + 1)
            spans += (np.bincount(gi + js[inner] + 1, minlength=nq * (nk + 1)) -
                      np.bincount(gi + je[inner], minlength=nq * (nk + 1))).reshape(nq, nk + 1)
    out = np.rint(counts).astype(np.int64).reshape(nq, nk)
    return out + np.cumsum(spans, axis=1)[:, :nk] * np.diff(kb)[None, :]
