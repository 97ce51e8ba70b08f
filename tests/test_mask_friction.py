"""Issue 23, item 2 (masks): a strided mask builds and plans fast and exactly, reports progress, draws
its density, a head-independent mask_mod over per-head tables is accepted, and a DocumentMask that does
not fit its sequence is refused when the batch is described."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import dcp
from dcp.errors import InvalidMaskError
from dcp.layout import blocks as layout_blocks
from dcp.masks import (CausalMask, DocumentMask, MaskModMask, RangesMask, dense_to_ranges, from_mask_mod,
                       ranges_to_dense, validate_ranges)
from dcp.masks import base as mask_base
from dcp.masks import box_counts as bc
from dcp.masks import mask_mod as mm
from dcp.masks import progress as mask_progress
from dcp.masks.render import density_ranges, draw_ranges

HEADS = dict(num_heads=4, num_kv_heads=4, head_dim=16)


def strided(b, h, q_idx, kv_idx):
    """Issue 23's mask: causal ∧ (window 512 ∨ first 64 keys ∨ every 8th key)."""
    return (q_idx >= kv_idx) & (((q_idx - kv_idx) < 512) | (kv_idx < 64) | ((kv_idx % 8) == 0))


def brute_force_counts(ranges, q_bounds, kv_bounds):
    dense = ranges_to_dense(ranges, ranges.shape[0]).astype(np.int64)
    rows = np.add.reduceat(dense, np.asarray(q_bounds[:-1]), axis=0)
    return np.add.reduceat(rows, np.asarray(kv_bounds[:-1]), axis=1)


def _random_ranges(rng, n):
    """A random mask (runs of random density, some columns striped) as read-only ranges."""
    allowed = rng.random((n, n)) < rng.random()
    if rng.random() < 0.5:
        allowed |= (np.arange(n) % int(rng.integers(2, 9)) == 0)[None, :] & (rng.random((n, 1)) < 0.7)
    if rng.random() < 0.3:
        allowed[:, int(rng.integers(0, n)):] = rng.random() < 0.5  # long runs crossing 64-key words
    ranges = dense_to_ranges(allowed)
    ranges.setflags(write=False)
    return ranges


def _bounds(rng, n):
    return np.unique(np.r_[0, rng.integers(0, n + 1, int(rng.integers(0, n))), n])


# ----------------------------------------------------------------------------------------------------
# 1. pair counts: exact on any number of ranges, by either method
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_box_counts_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 260))
    ranges = _random_ranges(rng, n)
    q_bounds, kv_bounds = _bounds(rng, n), _bounds(rng, n)
    expect = brute_force_counts(ranges, q_bounds, kv_bounds)
    for method in ("direct", "index", "auto"):
        np.testing.assert_array_equal(bc.box_counts(ranges, q_bounds, kv_bounds, method=method), expect)
    # the direct pass's numpy reference too (box_counts runs its C++ loop when the extension is built)
    qb, kb = (np.asarray(b, dtype=np.int64) for b in (q_bounds, kv_bounds))
    np.testing.assert_array_equal(bc._direct_counts_reference(ranges, qb, kb), expect)
    np.testing.assert_array_equal(layout_blocks.pair_counts(ranges, q_bounds), brute_force_counts(ranges, q_bounds,
                                                                                                   q_bounds))


@pytest.mark.skipif(not bc._NATIVE, reason="dcp._C without box_counts_direct (extension not built)")
def test_native_direct_counts_refuse_bad_arrays():
    import torch

    ranges = torch.tensor([[[0, 1]], [[0, 2]]], dtype=torch.int32)
    b = torch.tensor([0, 1, 2])
    assert bc._C.box_counts_direct(ranges, b, b).tolist() == [[1, 0], [1, 1]]
    with pytest.raises(RuntimeError, match=r"query 1 has KV range \[0, 3\) outside 0..2"):
        bc._C.box_counts_direct(torch.tensor([[[0, 1]], [[0, 3]]], dtype=torch.int32), b, b)
    with pytest.raises(RuntimeError, match="kv_bounds must increase strictly from 0 to 2"):
        bc._C.box_counts_direct(ranges, b, torch.tensor([0, 2, 2]))
    with pytest.raises(RuntimeError, match="ranges must be a contiguous int32"):
        bc._C.box_counts_direct(ranges.long(), b, b)


def test_index_is_cached_for_read_only_arrays_only():
    rng = np.random.default_rng(7)
    ranges = _random_ranges(rng, 200)
    assert bc.cached_index(ranges) is bc.cached_index(ranges)  # read-only: built once
    writable = ranges.copy()
    assert bc.cached_index(writable) is not bc.cached_index(writable)  # could change: never cached
    view = writable[:]
    view.setflags(write=False)  # read-only, but its data can still change through ``writable``
    assert not bc.cacheable(view) and bc.cached_index(view) is not bc.cached_index(view)
    with pytest.raises(InvalidMaskError, match="read-only"):
        bc.register_index(writable, bc.build_index(writable))
    with pytest.raises(InvalidMaskError, match="bounds"):
        bc.box_counts(ranges, [0, 5], [0, 200])


def test_strided_mask_builds_blockwise_with_its_index():
    """The strided mask's coarse blocks far from the diagonal are column patterns: no pair there is
    evaluated, the result equals the dense reference, and the pair-count index comes with it."""
    n = 3000
    ranges, stats = mm.evaluate_mask_mod(strided, n, method="blocks")
    reference, _ = mm.evaluate_mask_mod(strided, n, method="dense")
    np.testing.assert_array_equal(ranges, reference)
    assert stats.pattern_blocks > 0 and stats.exact_fraction < 0.1
    shared = mm.shared_ranges(strided, n, cache=False)
    assert not shared.flags.writeable
    registered = bc._entry(shared)[2]  # registered by the build, not built from the ranges
    assert registered is not None
    fresh = bc.build_index(shared)
    np.testing.assert_array_equal(registered.bits, fresh.bits)
    np.testing.assert_array_equal(registered.below, fresh.below)
    assert registered.used_ranges == fresh.used_ranges == int((shared[:, :, 1] > shared[:, :, 0]).sum())


def test_planning_a_strided_mask_counts_tiles_from_the_index(monkeypatch):
    """Planning never builds an index from the ranges of a from_mask_mod mask, nor passes over them per
    layout, and its tile counts are exact."""
    n = 2048
    mask = from_mask_mod(strided, n, cache=False)
    spec = dcp.BatchSpec([n], mask, **HEADS)
    ranges = spec.kv_ranges(0)
    assert ranges is mask.ranges  # neither copied nor validated again

    bounds = np.r_[np.arange(0, n, 128), n]
    expect = brute_force_counts(ranges, bounds, bounds)

    def no_build(*args, **kwargs):
        raise AssertionError("the index should come with the mask")

    monkeypatch.setattr(bc, "build_index", no_build)
    monkeypatch.setattr(bc, "_direct_counts", no_build)
    np.testing.assert_array_equal(layout_blocks.pair_counts(ranges, bounds), expect)


def test_ranges_mask_construction_keeps_contracts():
    rng = np.random.default_rng(3)
    given = dense_to_ranges(rng.random((50, 50)) < 0.3)
    mask = RangesMask(given)
    given[:] = 0  # the caller's array is never the mask's
    assert int(mask.ranges.sum()) > 0 and not mask.ranges.flags.writeable
    assert mask.kv_ranges(50).flags.writeable and mask.validated_ranges(50) is mask.ranges
    trusted = RangesMask.from_valid(np.array(mask.ranges))
    assert trusted == mask and hash(trusted) == hash(mask)
    with pytest.raises(InvalidMaskError):
        RangesMask.from_valid(mask.ranges.astype(np.int64))


def test_validate_ranges_names_the_token_in_a_later_chunk(monkeypatch):
    monkeypatch.setattr(mask_base, "VALIDATE_CHUNK", 8)
    arr = CausalMask().kv_ranges(40)
    arr[33, 0] = (5, 2)
    with pytest.raises(InvalidMaskError, match="query token 33:"):
        validate_ranges(arr, 40)


def test_mask_mod_ranges_is_a_private_copy():
    fn = lambda q, kv: (q >= kv) & (kv % 3 == 0)  # noqa: E731
    first = mm.mask_mod_ranges(fn, 64)
    first[:] = 0
    again = mm.mask_mod_ranges(fn, 64)
    assert again.flags.writeable and int(again.sum()) > 0
    assert mm.shared_ranges(fn, 64) is mm.shared_ranges(fn, 64)


# ----------------------------------------------------------------------------------------------------
# progress: the Python API reports long steps as the command line does, and tests need no sleeping
# ----------------------------------------------------------------------------------------------------

def test_progress_callback_sees_the_fraction_done():
    seen = []
    from_mask_mod(strided, 4096, cache=False, progress=seen.append)
    assert seen and seen[-1] == 1.0 and seen == sorted(seen) and 0 < seen[0] < 1


def test_default_progress_is_quiet_then_reports_on_stderr(monkeypatch, capsys):
    from_mask_mod(strided, 2048, cache=False)  # quick: nothing said
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(mask_progress, "PROGRESS_AFTER_S", 0.0)
    from_mask_mod(strided, 4096, cache=False)
    err = capsys.readouterr().err.splitlines()
    assert any("%" in line and "4,096 tokens" in line for line in err) and "done in" in err[-1]
    from_mask_mod(strided, 4096, cache=False, progress=False)
    assert capsys.readouterr().err == ""


def test_reporter_waits_then_throttles():
    now = [0.0]
    out = io.StringIO()
    report = mask_progress.Reporter("step", out=out, after_s=3.0, every_s=5.0, clock=lambda: now[0])
    for t, fraction in ((1.0, 0.1), (3.5, 0.3), (4.0, 0.4), (9.0, 0.8)):
        now[0] = t
        report(fraction)
    now[0] = 10.0
    report.close()
    assert out.getvalue().splitlines() == ["step: 30% after 3.5 s", "step: 80% after 9.0 s", "step: done in 10.0 s"]
    with pytest.raises(InvalidMaskError):
        mask_progress.reporter("yes", "x")


# ----------------------------------------------------------------------------------------------------
# 2. drawing shows density
# ----------------------------------------------------------------------------------------------------

def _png_pixels(path):
    import struct
    import zlib

    data = path.read_bytes()
    pos, idat, size = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos: pos + 8])
        body = data[pos + 8: pos + 8 + length]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height = size
    return np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, width + 1)[:, 1:]


def test_drawing_shows_the_density_of_a_strided_mask(tmp_path):
    n, pixels = 4096, 64
    strided_ranges = mm.mask_mod_ranges(strided, n)
    causal_ranges = CausalMask().kv_ranges(n)
    density = density_ranges(strided_ranges, n, pixels)
    deep = np.tril(np.ones((pixels, pixels), dtype=bool), -16)  # far below the window: only the stride
    deep[:, 0] = False  # the sink's column
    np.testing.assert_allclose(density[deep], 1 / 8)
    assert (density_ranges(causal_ranges, n, pixels)[deep] == 1).all()
    for name, ranges in (("strided", strided_ranges), ("causal", causal_ranges)):
        draw_ranges(ranges, n, str(tmp_path / f"{name}.png"), max_pixels=pixels, backend="png")
    strided_px, causal_px = _png_pixels(tmp_path / "strided.png"), _png_pixels(tmp_path / "causal.png")
    scale = strided_px.shape[0] // pixels
    strided_px, causal_px = strided_px[::scale, ::scale], causal_px[::scale, ::scale]
    assert (causal_px[deep] == 0).all()  # dense: saturated
    assert (strided_px[deep] > 0).all() and (strided_px[deep] < 255).all()  # strided: grey, not black
    assert (strided_px[np.triu(np.ones_like(deep), 1)] == 255).all()  # nothing attended: white
    draw_ranges(strided_ranges, n, str(tmp_path / "plot.png"), max_pixels=pixels, backend="auto")


# ----------------------------------------------------------------------------------------------------
# 3. head-independent mask_mods over per-head tables
# ----------------------------------------------------------------------------------------------------

def _vsa_tables(n_blocks, same_for_every_head=True):
    """attention-gym style: a block map per (batch, head), batch 1, 4 heads."""
    rng = np.random.default_rng(5)
    maps = torch.from_numpy(rng.random((4 if not same_for_every_head else 1, n_blocks, n_blocks)) < 0.4)
    maps |= torch.eye(n_blocks, dtype=torch.bool)
    return maps[None].expand(1, 4, n_blocks, n_blocks) if same_for_every_head else maps[None]


def test_head_independent_per_head_tables_are_accepted_with_the_head_count():
    n, blk = 512, 64
    table = _vsa_tables(n // blk)

    def vsa(b, h, q_idx, kv_idx):
        return table[b, h, q_idx // blk, kv_idx // blk] & (q_idx >= kv_idx)

    with pytest.raises(InvalidMaskError, match=r"failed for b=0, h=7 .*num_heads="):
        from_mask_mod(vsa, n, cache=False)  # the model's head count unknown: probed at a head it lacks
    expect = torch.repeat_interleave(torch.repeat_interleave(table[0, 0], blk, 0), blk, 1).numpy()
    expect &= np.tril(np.ones((n, n), dtype=bool))
    got = from_mask_mod(vsa, n, cache=False, num_heads=4)
    np.testing.assert_array_equal(got.dense(n), expect)
    # a BatchSpec passes its own head count; a model with more heads than the tables hold is refused
    spec = dcp.BatchSpec([n], MaskModMask(vsa, cache=False), **HEADS)
    np.testing.assert_array_equal(ranges_to_dense(spec.kv_ranges(0), n), expect)
    with pytest.raises(InvalidMaskError, match="failed for b=0, h=7"):
        dcp.BatchSpec([n], MaskModMask(vsa, cache=False), num_heads=8, num_kv_heads=8).kv_ranges(0)
    # the tensor form (topk-style indices expanded over heads) likewise
    topk = torch.arange(n // blk)[:, None].expand(n // blk, 2) // 2 * 2  # two kept key blocks per query block
    per_head = topk[None, None].expand(1, 4, n // blk, 2)

    def topk_mask(b, h, q_idx, kv_idx):
        kept = per_head[b, h, q_idx // blk]
        return ((kept[..., 0] == kv_idx // blk) | (kept[..., 1] == kv_idx // blk)) & (q_idx >= kv_idx)

    from_mask_mod(topk_mask, n, cache=False, num_heads=4, method="dense")


def test_masks_that_differ_per_head_are_still_refused():
    n, blk = 512, 64
    table = _vsa_tables(n // blk, same_for_every_head=False)

    def per_head(b, h, q_idx, kv_idx):
        return table[b, h, q_idx // blk, kv_idx // blk]

    with pytest.raises(InvalidMaskError, match="depends on the head index h"):
        from_mask_mod(per_head, n, cache=False, num_heads=4)
    with pytest.raises(InvalidMaskError, match="depends on the head index h"):
        dcp.BatchSpec([n], MaskModMask(per_head, cache=False), **HEADS).kv_ranges(0)
    assert mm.probe_points(1) == ((1, 0), (2, 0)) and (0, 31) in mm.probe_points(32)


# ----------------------------------------------------------------------------------------------------
# 4. a DocumentMask that does not fit its sequence is refused by BatchSpec
# ----------------------------------------------------------------------------------------------------

def test_document_mask_longer_than_its_sequence_is_refused_on_construction():
    with pytest.raises(InvalidMaskError, match=r"sequence 1 \(length 20\): document: doc_lengths sum to 30 but "
                                               r"the sequence has 20 tokens"):
        dcp.BatchSpec([30, 20], DocumentMask((10, 20)), **HEADS)
    with pytest.raises(InvalidMaskError, match=r"sequence 0 \(length 8\).*sum to 7"):
        dcp.BatchSpec([8], [DocumentMask((3, 4))], **HEADS)
    with pytest.raises(InvalidMaskError, match=r"sequence 1 \(length 9\): ranges: this mask was given for 5"):
        dcp.BatchSpec([5, 9], RangesMask(CausalMask().kv_ranges(5)), **HEADS)
    inner = RangesMask(CausalMask().kv_ranges(4))
    with pytest.raises(InvalidMaskError, match="given for 4 tokens, cannot evaluate it for 6"):
        dcp.BatchSpec([10], DocumentMask((4, 6), inner=inner), **HEADS)
    ok = dcp.BatchSpec([30, 7], [DocumentMask((10, 20)), DocumentMask((3, 4))], **HEADS)
    assert ok.kv_ranges(0).shape[0] == 30


@pytest.mark.parametrize("fn", [strided, lambda q, kv: (q >= kv) & ((q // 7 + kv) % 5 < 2),
                                lambda q, kv: (kv <= q) & (q - kv < 40)])
def test_range_profile_of_a_mask_mod_equals_the_one_read_from_its_ranges(fn):
    shared = mm.shared_ranges(fn, 1500, cache=False)
    work, edges = bc.range_profile(shared)  # registered by the build
    fresh_work, fresh_edges = bc.range_profile(shared.copy())  # read from the ranges
    np.testing.assert_array_equal(work, fresh_work)
    np.testing.assert_array_equal(edges, fresh_edges)
    np.testing.assert_array_equal(work, ranges_to_dense(shared, 1500).sum(axis=1))


BAND_SHAPES = {  # where the rows' own ranges fall among the shared (strided) runs of a band
    "own ranges after the shared runs": strided,
    "own ranges before them": lambda q, kv: (kv >= q) & (((kv - q) < 512) | (kv % 8 == 0)),
    "own ranges in the middle": lambda q, kv: ((q - kv) * (q - kv) < 64 * 64) | (kv % 8 == 0),
    "own ranges in two places": lambda q, kv: (q >= kv) & (((q - kv) < 64) | (kv % 8 == 0) | ((q - kv - 1500) % 4096 < 64)),
    "touching the varying columns": lambda q, kv: (q >= kv) & (((q - kv) < 300) | (kv % 64 < 20)),
}


@pytest.mark.parametrize("name", sorted(BAND_SHAPES))
@pytest.mark.parametrize("n", [2500, 3000])
def test_band_assembly_equals_the_dense_reference(name, n):
    fn = BAND_SHAPES[name]
    got, stats = mm.evaluate_mask_mod(fn, n, method="blocks", progress=False)
    np.testing.assert_array_equal(got, mm.evaluate_mask_mod(fn, n, method="dense")[0])
    assert stats.pattern_blocks > 0
