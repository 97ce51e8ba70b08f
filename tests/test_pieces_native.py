"""The grouped-layout pair counts (dcp.pieces): the reference against a brute-force count over the dense
mask on tiny batches, and the C++ path (dcp._C.grouped_pair_counts) against the reference, all seven
arrays exactly, over masks (causal, full, sliding window, lambda, shared question, causal blockwise, random
multi-range), sequence lengths (some shorter than the number of chunks) and groupings (ring, zigzag,
random maps across sequences, one block)."""
from __future__ import annotations

import numpy as np
import pytest

from dcp.baselines.common import near_equal_chunks, zigzag_device
from dcp.errors import InvalidBatchError, InvalidConfigError
from dcp.layout.blocks import make_layout
from dcp.layout.pieces import grouped_pair_counts, grouped_pair_counts_reference
from dcp.masks import (CausalBlockwiseMask, CausalMask, FullMask, LambdaMask, RangesMask, SharedQuestionMask,
                       SlidingWindowMask, dense_to_ranges, ranges_to_dense)
from dcp.spec import BatchSpec

try:
    from dcp import _C  # type: ignore[attr-defined]

    HAVE_NATIVE = hasattr(_C, "grouped_pair_counts")
except ImportError:
    _C, HAVE_NATIVE = None, False

native = pytest.mark.skipif(not HAVE_NATIVE, reason="dcp._C lacks grouped_pair_counts (extension not built)")

FIELDS = ("q_block", "kv_block", "unmasked", "area", "sub_n", "sub_wq", "sub_wk", "sub_wqk")


def random_ranges_mask(rng, n: int) -> RangesMask:
    """Several KV runs per query token (a random dense pattern, sparse enough to give R > 1)."""
    dense = rng.random((n, n)) < rng.uniform(0.05, 0.6)
    dense[rng.random(n) < 0.2] = False  # some query tokens attend to nothing
    return RangesMask(dense_to_ranges(dense))


def make_mask(rng, kind: str, n: int):
    if kind == "causal":
        return CausalMask()
    if kind == "full":
        return FullMask()
    if kind == "sliding":
        return SlidingWindowMask(int(rng.integers(1, 40)))
    if kind == "lambda":
        return LambdaMask(sink=int(rng.integers(1, 8)), window=int(rng.integers(1, 50)))
    if kind == "shared_question":
        return SharedQuestionMask(float(rng.uniform(0.1, 0.5)), int(rng.integers(1, 4)))
    if kind == "blockwise":
        return CausalBlockwiseMask(int(rng.integers(1, 20)), int(rng.integers(0, 3)))
    if kind == "ranges":
        return random_ranges_mask(rng, n)
    raise AssertionError(kind)


MASK_KINDS = ("causal", "full", "sliding", "lambda", "shared_question", "blockwise", "ranges")


def random_spec(rng, lens, kinds=MASK_KINDS) -> BatchSpec:
    masks = [make_mask(rng, str(rng.choice(kinds)), int(n)) for n in lens]
    return BatchSpec([int(n) for n in lens], masks, 4, 2, 8, "float32")


def compact(raw) -> np.ndarray:
    """Block ids renumbered 0..n-1 in order of value (every block then holds a piece)."""
    return np.unique(np.asarray(raw), return_inverse=True)[1].reshape(-1).astype(np.int64)


def grouping(rng, spec: BatchSpec, style: str, k: int):
    """(pieces layout, piece_block) of one grouping style."""
    bounds, raw = [], []
    for n in spec.seqlens:
        if style in ("ring", "zigzag"):
            chunks = k if style == "ring" else 2 * k
            start, idx = near_equal_chunks(n, chunks)
            bounds.append(np.append(start, n))
            raw.append(idx if style == "ring" else zigzag_device(idx, k))
        else:  # random cuts
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 12))), replace=False))
            bounds.append(np.concatenate([[0], cuts, [n]]))
            raw.append(np.zeros(cuts.size + 1, dtype=np.int64))
    pieces = make_layout(spec, bounds, None)
    if style == "random":  # pieces of several sequences per block, a non-monotone map
        raw = [rng.integers(0, max(1, k), size=b.size - 1) for b in bounds]
    elif style == "one":
        raw = [np.zeros(b.size - 1, dtype=np.int64) for b in bounds]
    return pieces, compact(np.concatenate(raw))


def brute_force(spec: BatchSpec, pieces, pb: np.ndarray) -> dict:
    """{(q block, kv block): [unmasked, area, sub_n, sub_wq, sub_wk, sub_wqk]} from the dense masks."""
    out: dict = {}
    for s in range(spec.num_seqs):
        n = spec.seqlens[s]
        dense = ranges_to_dense(spec.kv_ranges(s), n)
        lo, hi = int(pieces.seq_tb_ptr[s]), int(pieces.seq_tb_ptr[s + 1])
        tok_block = np.repeat(pb[lo:hi], pieces.tb_len[lo:hi])
        blocks = np.unique(tok_block)
        for q in blocks:
            for k in blocks:
                um = int(dense[np.ix_(tok_block == q, tok_block == k)].sum())
                if um:
                    tq, tk = int((tok_block == q).sum()), int((tok_block == k).sum())
                    acc = out.setdefault((int(q), int(k)), [0, 0, 0, 0.0, 0.0, 0.0])
                    for i, v in enumerate((um, tq * tk, 1, um / tq, um / tk, um / (tq * tk))):
                        acc[i] += v
    return out


def as_dict(c) -> dict:
    return {(int(q), int(k)): [int(c.unmasked[i]), int(c.area[i]), int(c.sub_n[i]), float(c.sub_wq[i]),
                               float(c.sub_wk[i]), float(c.sub_wqk[i])]
            for i, (q, k) in enumerate(zip(c.q_block, c.kv_block))}


def assert_same(a, b):
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype, (f, x.dtype, y.dtype)
        np.testing.assert_array_equal(x, y, err_msg=f)


def check_native(spec, pieces, pb):
    ref = grouped_pair_counts_reference(spec, pieces, pb)
    assert_same(grouped_pair_counts(spec, pieces, pb, native=True), ref)
    return ref


@pytest.mark.parametrize("style", ["ring", "zigzag", "random", "one"])
@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_brute_force(style, seed):
    rng = np.random.default_rng(100 * seed + len(style))
    spec = random_spec(rng, rng.integers(1, 40, size=int(rng.integers(1, 5))))
    pieces, pb = grouping(rng, spec, style, int(rng.integers(1, 9)))
    ref = grouped_pair_counts_reference(spec, pieces, pb)
    assert as_dict(ref) == brute_force(spec, pieces, pb)
    keys = ref.q_block.astype(np.int64) * (pb.max() + 1) + ref.kv_block
    assert (np.diff(keys) > 0).all()  # sorted by (q, kv), unique


@native
@pytest.mark.parametrize("style", ["ring", "zigzag", "random", "one"])
@pytest.mark.parametrize("seed", range(10))
def test_native_matches_reference(style, seed):
    rng = np.random.default_rng(1000 * seed + len(style))
    n_seqs = int(rng.integers(1, 7))
    lens = rng.integers(1, 300, size=n_seqs)
    lens[rng.random(n_seqs) < 0.3] = rng.integers(1, 6)  # shorter than the number of chunks
    spec = random_spec(rng, lens)
    pieces, pb = grouping(rng, spec, style, int(rng.integers(1, 24)))
    ref = check_native(spec, pieces, pb)
    if seed < 3:  # small enough for the dense mask
        assert as_dict(ref) == brute_force(spec, pieces, pb)


@native
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_native_each_mask(kind):
    rng = np.random.default_rng(len(kind))
    spec = random_spec(rng, [700, 64, 3, 1, 250], kinds=(kind,))
    for style, k in (("ring", 16), ("zigzag", 8), ("random", 5), ("one", 1)):
        pieces, pb = grouping(rng, spec, style, k)
        check_native(spec, pieces, pb)


@native
def test_native_many_blocks_token_pieces():
    """One-token pieces, two per block, mostly of different sequences; blocks rows are sparse."""
    rng = np.random.default_rng(7)
    spec = random_spec(rng, [180, 90, 40])
    bounds = [np.arange(n + 1) for n in spec.seqlens]
    pieces = make_layout(spec, bounds, None)
    pb = compact(rng.permutation(pieces.n_token_blocks) // 2)  # pairs of tokens, mostly across sequences
    check_native(spec, pieces, pb)


@native
def test_native_sequences_without_pairs():
    """Sequences that attend nothing add nothing (not even sub_n); the rest are counted."""
    rng = np.random.default_rng(3)
    empty = RangesMask(np.zeros((50, 2, 2), dtype=np.int32))
    spec = BatchSpec([50, 80, 50], [empty, CausalMask(), empty], 4, 2, 8, "float32")
    pieces, pb = grouping(rng, spec, "ring", 4)
    ref = check_native(spec, pieces, pb)
    assert ref.sub_n.max() == 1


@pytest.mark.parametrize("use_native", [False, pytest.param(True, marks=native)])
def test_nothing_attended_is_a_batch_error(use_native):
    empty = RangesMask(np.zeros((20, 1, 2), dtype=np.int32))
    spec = BatchSpec([20, 20], empty, 4, 2, 8, "float32")
    pieces, pb = grouping(np.random.default_rng(0), spec, "ring", 3)
    with pytest.raises(InvalidBatchError, match="no \\(query, key\\) pair"):
        grouped_pair_counts(spec, pieces, pb, native=use_native)


@pytest.mark.parametrize("use_native", [False, pytest.param(True, marks=native)])
def test_bad_grouping_is_a_config_error(use_native):
    spec = BatchSpec([20, 20], CausalMask(), 4, 2, 8, "float32")
    pieces, pb = grouping(np.random.default_rng(0), spec, "ring", 3)
    with pytest.raises(InvalidConfigError):
        grouped_pair_counts(spec, pieces, pb + 1, native=use_native)  # block 0 holds nothing


@native
def test_native_rejects_bad_input():
    import torch

    t = lambda a, dt=torch.int64: torch.tensor(a, dtype=dt)  # noqa: E731
    ptr, start, length, block = t([0, 2]), t([0, 2]), t([2, 2]), t([0, 1])
    ranges = t([[0, 1]] * 4, torch.int32)
    ok = _C.grouped_pair_counts(ptr, start, length, block, 2, ranges, t([0, 4]), t([1]))
    assert [c.tolist() for c in ok[:3]] == [[0, 1], [0, 0], [2, 2]]
    with pytest.raises(RuntimeError, match="sequence 0: range \\[3, 5\\) lies outside"):
        _C.grouped_pair_counts(ptr, start, length, block, 2, t([[0, 1]] * 3 + [[3, 5]], torch.int32), t([0, 4]),
                               t([1]))
    with pytest.raises(RuntimeError, match="reversed"):
        _C.grouped_pair_counts(ptr, start, length, block, 2, t([[2, 1]] * 4, torch.int32), t([0, 4]), t([1]))
    with pytest.raises(RuntimeError, match="not contiguous"):
        _C.grouped_pair_counts(ptr, t([0, 3]), length, block, 2, ranges, t([0, 4]), t([1]))
    with pytest.raises(RuntimeError, match="rows of ranges"):
        _C.grouped_pair_counts(ptr, start, length, block, 2, ranges, t([0, 4]), t([2]))
    with pytest.raises(RuntimeError, match="piece_block must name blocks"):
        _C.grouped_pair_counts(ptr, start, length, t([0, 2]), 2, ranges, t([0, 4]), t([1]))
    with pytest.raises(RuntimeError, match="piece_len must have dtype"):
        _C.grouped_pair_counts(ptr, start, length.int(), block, 2, ranges, t([0, 4]), t([1]))


@native
def test_grouped_tiles_native_and_reference(monkeypatch):
    """enumerate_tiles over a grouped layout gives the same tiles on both paths."""
    import dcp.layout.pieces
    from dcp.layout.pieces import group_layout
    from dcp.layout.tiles import enumerate_tiles

    rng = np.random.default_rng(11)
    spec = random_spec(rng, [120, 7, 64])
    pieces, pb = grouping(rng, spec, "zigzag", 4)
    layout = group_layout(pieces, pb)
    tiles = enumerate_tiles(spec, layout)
    monkeypatch.setattr(dcp.layout.pieces, "_NATIVE", False)
    ref = enumerate_tiles(spec, layout)
    for f in ("q_tb", "kv_tb", "hb", "unmasked", "full", "fwd_flops", "bwd_flops", "sub_n", "sub_wq", "sub_wk",
              "sub_wqk"):
        np.testing.assert_array_equal(getattr(tiles, f), getattr(ref, f), err_msg=f)
