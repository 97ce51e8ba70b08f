"""Tests of dcp.masks: every mask against an independent dense definition, parameter validation,
mask_mod conversion, describe/from_description round trips, the CLI helper and drawing."""
from __future__ import annotations

import json
import pickle
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.errors import InvalidMaskError
from dcp.masks import (MASKS, CausalBlockwiseMask, CausalMask, DocumentMask, FullMask, LambdaMask, Mask, MaskModMask,
                       ModalityMask, PrefixLMMask, RangesMask, SharedQuestionMask, SlidingWindowMask, dense_to_ranges,
                       from_cli, from_description, from_mask_mod, ranges_to_dense, validate_ranges)
from dcp.masks.draw import mask_main
from dcp.masks.render import density_ranges, downsample_ranges, draw_ranges

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------------------------------
# independent dense definitions (boolean [L, L], True where query q may attend key k)
# ----------------------------------------------------------------------------------------------------

def _qk(L):
    idx = np.arange(L)
    return idx[:, None], idx[None, :]


def _segments_dense(seg_q, seg_k, causal):
    return (seg_q[:, None] == seg_k[None, :]) & causal


def reference_dense(mask: Mask, L: int) -> np.ndarray:
    q, k = _qk(L)
    causal = k <= q
    if isinstance(mask, CausalMask):
        return causal
    if isinstance(mask, FullMask):
        return np.ones((L, L), dtype=bool)
    if isinstance(mask, SlidingWindowMask):
        return causal & (k > q - mask.window)
    if isinstance(mask, LambdaMask):
        return causal & ((k < mask.sink) | (k > q - mask.window))
    if isinstance(mask, SharedQuestionMask):
        qlen = min(L, max(1, round(mask.question_frac * L)))
        n = L - qlen
        num = min(mask.num_answers, n)
        seg = np.zeros(L, dtype=int)  # 0 = question, i + 1 = answer i
        pos = qlen
        for i in range(num):
            length = n // num + (1 if i < n % num else 0)
            seg[pos:pos + length] = i + 1
            pos += length
        assert pos == L
        is_answer = seg[:, None] > 0
        same = seg[:, None] == seg[None, :]
        sees_question = is_answer & (k < qlen)
        return (causal & same) | sees_question
    if isinstance(mask, CausalBlockwiseMask):
        b = mask.block
        return causal & ((k < b) | (k // b >= q // b - mask.num_prev))
    if isinstance(mask, ModalityMask):
        image_id = np.full(L, -1)
        if mask.image_spans is None:
            period = mask.text_len + mask.image_len
            t = np.arange(L)
            image_id = np.where(t % period >= mask.text_len, t // period, -1)
        else:
            for i, (s, e) in enumerate(mask.image_spans):
                image_id[s:e] = i
        same_image = (image_id[:, None] == image_id[None, :]) & (image_id[:, None] >= 0)
        return causal | same_image
    if isinstance(mask, PrefixLMMask):
        P = mask.prefix_len if mask.prefix_len is not None else round(mask.prefix_frac * L)
        P = min(L, max(1, P))
        return causal | ((q < P) & (k < P))
    if isinstance(mask, DocumentMask):
        out = np.zeros((L, L), dtype=bool)
        offset = 0
        for n in mask.doc_lengths:
            out[offset:offset + n, offset:offset + n] = reference_dense(mask.inner, n)
            offset += n
        return out
    raise AssertionError(f"no reference for {mask!r}")


# ----------------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------------

lengths = st.integers(1, 700)
small = st.integers(1, 300)
fracs = st.floats(0.001, 0.999, allow_nan=False)


def simple_masks():
    return st.one_of(
        st.just(CausalMask()),
        st.just(FullMask()),
        st.builds(SlidingWindowMask, small),
        st.builds(LambdaMask, st.integers(0, 300), small),
        st.builds(SharedQuestionMask, fracs, st.integers(1, 12)),
        st.builds(CausalBlockwiseMask, st.integers(1, 100), st.integers(0, 6)),
        st.builds(ModalityMask, st.integers(1, 200), st.integers(0, 200)),
        st.builds(ModalityMask, st.just(0), st.integers(1, 200)),
        st.builds(PrefixLMMask, st.floats(0.0, 1.0, allow_nan=False), st.one_of(st.none(), st.integers(1, 800))),
    )


@st.composite
def modality_with_spans(draw):
    L = draw(lengths)
    cuts = sorted(draw(st.lists(st.integers(0, L + 50), max_size=10, unique=True)))
    spans = tuple((cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2))
    return ModalityMask(image_spans=spans), L


@st.composite
def document_cases(draw):
    docs = tuple(draw(st.lists(st.integers(1, 120), min_size=1, max_size=12)))
    inner = draw(simple_masks())
    return DocumentMask(docs, inner), sum(docs)


def check_against_reference(mask: Mask, L: int):
    ranges = mask.kv_ranges(L)
    assert ranges.dtype == np.int32 and ranges.ndim == 3 and ranges.shape[0] == L and ranges.shape[2] == 2
    validate_ranges(ranges, L)
    np.testing.assert_array_equal(ranges_to_dense(ranges, L), reference_dense(mask, L))


# ----------------------------------------------------------------------------------------------------
# correctness against the dense definitions
# ----------------------------------------------------------------------------------------------------

@SETTINGS
@given(simple_masks(), lengths)
def test_masks_match_dense_definition(mask, L):
    check_against_reference(mask, L)


@SETTINGS
@given(modality_with_spans())
def test_modality_explicit_spans(case):
    mask, L = case
    check_against_reference(mask, L)


@SETTINGS
@given(document_cases())
def test_document_mask(case):
    mask, L = case
    check_against_reference(mask, L)


@pytest.mark.parametrize("L", [1, 2, 3, 5, 63, 64, 65, 257, 700])
def test_edge_lengths_every_family(L):
    for mask in [CausalMask(), FullMask(), SlidingWindowMask(1), SlidingWindowMask(64), LambdaMask(),
                 LambdaMask(0, 1), LambdaMask(4, 4), SharedQuestionMask(), SharedQuestionMask(0.99, 100),
                 CausalBlockwiseMask(1, 0), CausalBlockwiseMask(4, 1), ModalityMask(), ModalityMask(1, 1),
                 ModalityMask(0, 7), PrefixLMMask(), PrefixLMMask(prefix_len=1), PrefixLMMask(0.0)]:
        check_against_reference(mask, L)


def test_lambda_slots_and_merging():
    r = LambdaMask(sink=2, window=3).kv_ranges(8)
    assert r.shape == (8, 2, 2)
    assert r[0].tolist() == [[0, 1], [0, 0]]
    assert r[4].tolist() == [[0, 5], [0, 0]]  # sink [0,2) touches window [2,5): merged
    assert r[5].tolist() == [[0, 2], [3, 6]]
    # no sink: the window lives in the first slot
    assert LambdaMask(sink=0, window=2).kv_ranges(5)[4].tolist() == [[3, 5], [0, 0]]


def test_shared_question_layout():
    m = SharedQuestionMask(question_frac=0.3, num_answers=2)
    assert m.question_len(10) == 3 and m.answer_lengths(10) == [4, 3]
    r = m.kv_ranges(10)
    assert r[8].tolist() == [[0, 3], [7, 9]]
    assert r[4].tolist() == [[0, 5], [0, 0]]  # first answer touches the question
    # fewer tokens than answers
    assert SharedQuestionMask(0.5, 8).answer_lengths(4) == [1, 1]


def test_kv_ranges_rejects_bad_seqlen():
    for bad in [0, -1, 2.0, True, "3"]:
        with pytest.raises(InvalidMaskError):
            LambdaMask().kv_ranges(bad)


# ----------------------------------------------------------------------------------------------------
# parameter validation
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [
    lambda: SlidingWindowMask(0),
    lambda: SlidingWindowMask(-3),
    lambda: SlidingWindowMask(2.5),
    lambda: SlidingWindowMask(True),
    lambda: LambdaMask(sink=-1),
    lambda: LambdaMask(window=0),
    lambda: LambdaMask(window=-5),
    lambda: SharedQuestionMask(question_frac=0.0),
    lambda: SharedQuestionMask(question_frac=1.0),
    lambda: SharedQuestionMask(question_frac=1.5),
    lambda: SharedQuestionMask(question_frac=float("nan")),
    lambda: SharedQuestionMask(num_answers=0),
    lambda: CausalBlockwiseMask(block=0),
    lambda: CausalBlockwiseMask(block=-4),
    lambda: CausalBlockwiseMask(num_prev=-1),
    lambda: ModalityMask(text_len=-1),
    lambda: ModalityMask(text_len=0, image_len=0),
    lambda: ModalityMask(image_spans=((5, 3),)),
    lambda: ModalityMask(image_spans=((0, 10), (5, 20))),
    lambda: ModalityMask(image_spans=((-1, 3),)),
    lambda: ModalityMask(image_spans=(1, 2)),
    lambda: PrefixLMMask(prefix_frac=-0.1),
    lambda: PrefixLMMask(prefix_frac=1.1),
    lambda: PrefixLMMask(prefix_len=0),
    lambda: DocumentMask(()),
    lambda: DocumentMask((3, 0, 2)),
    lambda: DocumentMask((3, -2)),
    lambda: DocumentMask((3, 4), inner="causal"),
    lambda: RangesMask(np.array([[[0, 2]]])),  # outside a 1-token sequence
    lambda: RangesMask(np.array([[[0, 1]], [[-1, 1]]])),
    lambda: RangesMask(np.array([[[0, 1], [0, 1]], [[0, 1], [1, 2]]])),  # overlapping
    lambda: RangesMask(np.array([[[0, 0], [0, 1]]])),  # empty slot before a used one
    lambda: RangesMask(np.zeros((3, 2))),  # wrong shape
    lambda: MaskModMask(42),
])
def test_bad_parameters_raise(build):
    with pytest.raises(InvalidMaskError):
        build()


def test_document_lengths_must_sum_to_seqlen():
    m = DocumentMask((3, 4))
    m.kv_ranges(7)
    with pytest.raises(InvalidMaskError, match="sum to 7"):
        m.kv_ranges(8)


def test_ranges_mask_length_mismatch():
    m = RangesMask(CausalMask().kv_ranges(5))
    with pytest.raises(InvalidMaskError):
        m.kv_ranges(6)


def test_modality_spans_clipped_beyond_seqlen():
    m = ModalityMask(image_spans=[[2, 5], [8, 100]])
    assert m.image_spans == ((2, 5), (8, 100))
    r = m.kv_ranges(10)
    assert r[:, 0, 1].tolist() == [1, 2, 5, 5, 5, 6, 7, 8, 10, 10]
    assert ModalityMask(image_spans=[[20, 30]]).kv_ranges(10)[:, 0, 1].tolist() == list(range(1, 11))


# ----------------------------------------------------------------------------------------------------
# RangesMask value semantics and mask_mod conversion
# ----------------------------------------------------------------------------------------------------

def test_ranges_mask_equality_and_hashing():
    a = RangesMask(LambdaMask(2, 3).kv_ranges(20))
    b = RangesMask(LambdaMask(2, 3).kv_ranges(20).astype(np.int64))
    c = RangesMask(LambdaMask(2, 4).kv_ranges(20))
    assert a == b and hash(a) == hash(b) and a != c
    assert {a: 1}[b] == 1
    # trailing empty slots do not matter
    padded = np.zeros((5, 3, 2), dtype=np.int32)
    padded[:, :1] = CausalMask().kv_ranges(5)
    assert RangesMask(padded) == RangesMask(CausalMask().kv_ranges(5))
    assert not a.ranges.flags.writeable
    out = a.kv_ranges(20)
    out[0, 0, 1] = 7  # callers get a copy
    assert a.kv_ranges(20)[0, 0, 1] == 1
    assert pickle.loads(pickle.dumps(a)) == a


def test_from_mask_mod_round_trips():
    L = 157
    causal = from_mask_mod(lambda q, kv: q >= kv, L)
    assert isinstance(causal, RangesMask)
    np.testing.assert_array_equal(causal.kv_ranges(L), CausalMask().kv_ranges(L))
    # chunked evaluation gives the same answer, and FlexAttention's 4-argument form works
    lam = LambdaMask(sink=5, window=20)
    flex = from_mask_mod(lambda b, h, q, kv: (kv <= q) & ((kv < 5) | (q - kv < 20)), L, chunk=7)
    np.testing.assert_array_equal(flex.kv_ranges(L), lam.kv_ranges(L))
    # a broadcastable result (full mask as a scalar)
    np.testing.assert_array_equal(from_mask_mod(lambda q, kv: True, 9).kv_ranges(9), FullMask().kv_ranges(9))


def test_from_mask_mod_torch_predicate():
    torch = pytest.importorskip("torch")
    L = 64

    def torch_only(q_idx, kv_idx):
        return torch.where(q_idx >= kv_idx, torch.ones_like(q_idx - kv_idx), torch.zeros_like(kv_idx)).bool()

    m = from_mask_mod(torch_only, L)
    np.testing.assert_array_equal(m.kv_ranges(L), CausalMask().kv_ranges(L))
    m2 = from_mask_mod(lambda q, kv: (q - kv).abs() < 4, L, backend="torch")
    assert m2 == RangesMask(dense_to_ranges(np.abs(np.subtract.outer(np.arange(L), np.arange(L))) < 4))


def test_from_mask_mod_errors():
    with pytest.raises(InvalidMaskError):
        from_mask_mod(lambda q, kv: (q - kv) * 1.5, 8)  # not boolean
    with pytest.raises(InvalidMaskError):
        from_mask_mod(lambda q, kv: np.ones((3, 3), dtype=bool), 8)  # wrong shape
    with pytest.raises(InvalidMaskError):
        from_mask_mod(lambda q, kv: undefined_name, 8)  # noqa: F821
    with pytest.raises(InvalidMaskError):
        from_mask_mod(lambda q, kv: q >= kv, 8, backend="jax")


def test_head_or_batch_dependent_mask_mods_are_refused():
    """dcp masks are shared by every head: a FlexAttention mask_mod that reads h (or b) is refused with a
    message naming the index, instead of being evaluated silently at h = b = 0."""
    per_head_window = lambda b, h, q, kv: (kv <= q) & (q - kv < 4 + 8 * h)  # noqa: E731
    with pytest.raises(InvalidMaskError, match="depends on the head index h"):
        from_mask_mod(per_head_window, 60)
    with pytest.raises(InvalidMaskError, match="depends on the head index h"):
        MaskModMask(lambda b, h, q, kv: (kv <= q) & ((h == 0) | (kv > 40))).kv_ranges(61)
    with pytest.raises(InvalidMaskError, match="depends on the batch index b"):
        from_mask_mod(lambda b, h, q, kv: (kv <= q) & (q - kv < 3 + b), 33)
    with pytest.raises(InvalidMaskError, match="b=0, h=1"):
        from_mask_mod(lambda b, h, q, kv: (kv <= q) & np.array([True])[h], 20)  # fails past head 0
    # a four-argument mask_mod that ignores b and h is fine
    assert from_mask_mod(lambda b, h, q, kv: kv <= q, 25) == RangesMask(CausalMask().kv_ranges(25))


@SETTINGS
@given(simple_masks(), st.integers(1, 200))
def test_mask_mod_mask_matches(mask, L):
    dense = reference_dense(mask, L)
    mm = MaskModMask(lambda q, kv: dense[q, kv], name="lookup")
    np.testing.assert_array_equal(mm.dense(L), dense)


def test_mask_mod_mask_identity_and_description():
    fn = lambda q, kv: q >= kv  # noqa: E731
    assert MaskModMask(fn, "c") == MaskModMask(fn, "c") and MaskModMask(fn, "c") != MaskModMask(lambda q, kv: q >= kv, "c")
    d = MaskModMask(fn, "c").describe()
    assert d["name"] == "mask_mod" and d["label"] == "c"
    with pytest.raises(InvalidMaskError):
        from_description(d)


# ----------------------------------------------------------------------------------------------------
# descriptions and registry
# ----------------------------------------------------------------------------------------------------

ALL_EXAMPLES = [
    CausalMask(), FullMask(), SlidingWindowMask(128), LambdaMask(), LambdaMask(0, 7), SharedQuestionMask(0.3, 5),
    CausalBlockwiseMask(64, 3), ModalityMask(100, 300), ModalityMask(image_spans=((3, 9), (12, 40))),
    PrefixLMMask(), PrefixLMMask(prefix_len=17), DocumentMask((5, 6, 7)),
    DocumentMask((10, 20), inner=DocumentMask((4, 6), inner=LambdaMask(1, 2))),
    RangesMask(SharedQuestionMask().kv_ranges(33)),
]


@pytest.mark.parametrize("mask", ALL_EXAMPLES, ids=lambda m: m.name)
def test_describe_round_trip(mask):
    d = mask.describe()
    assert d["name"] == mask.name and MASKS[mask.name] is type(mask)
    again = from_description(json.loads(json.dumps(d)))
    assert again == mask and hash(again) == hash(mask)
    assert from_description(d) == mask


@SETTINGS
@given(simple_masks())
def test_describe_round_trip_random(mask):
    assert from_description(json.loads(json.dumps(mask.describe()))) == mask


def test_registry_names():
    assert set(MASKS) >= {"causal", "full", "sliding_window", "lambda", "shared_question", "causal_blockwise",
                          "modality", "prefix_lm", "document", "ranges", "mask_mod"}
    for name, cls in MASKS.items():
        assert cls.name == name


def test_from_description_errors():
    with pytest.raises(InvalidMaskError, match="valid names"):
        from_description({"name": "nope"})
    with pytest.raises(InvalidMaskError, match="window"):
        from_description({"name": "lambda", "windw": 3})
    with pytest.raises(InvalidMaskError):
        from_description({"name": "sliding_window"})  # missing window
    with pytest.raises(InvalidMaskError):
        from_description(["lambda"])


def test_from_cli():
    assert from_cli("lambda", sink="8", window="100") == LambdaMask(8, 100)
    assert from_cli("shared_question", question_frac="0.25") == SharedQuestionMask(0.25)
    assert from_cli("prefix_lm", prefix_len="none") == PrefixLMMask()
    assert from_cli("prefix_lm", prefix_len="12") == PrefixLMMask(prefix_len=12)
    assert from_cli("document", doc_lengths="3,4,5", inner="lambda") == DocumentMask((3, 4, 5), LambdaMask())
    assert from_cli("document", doc_lengths="[3, 4]", inner='{"name": "sliding_window", "window": 2}') == \
        DocumentMask((3, 4), SlidingWindowMask(2))
    assert from_cli("modality", image_spans="0:10,20:30") == ModalityMask(image_spans=((0, 10), (20, 30)))
    assert from_cli("causal_blockwise", block=32) == CausalBlockwiseMask(32)
    with pytest.raises(InvalidMaskError, match="causal_blockwise.*full.*lambda"):
        from_cli("lamda")
    with pytest.raises(InvalidMaskError, match="sink"):
        from_cli("lambda", sinks="3")
    with pytest.raises(InvalidMaskError, match="int"):
        from_cli("lambda", sink="three")
    with pytest.raises(InvalidMaskError):
        from_cli("sliding_window", window="-2")


# ----------------------------------------------------------------------------------------------------
# long sequences (vectorization smoke test)
# ----------------------------------------------------------------------------------------------------

def test_long_sequences_are_fast():
    L = 131072
    for mask in [CausalMask(), LambdaMask(), SharedQuestionMask(), CausalBlockwiseMask(), ModalityMask(),
                 SlidingWindowMask(4096), PrefixLMMask(), FullMask(), DocumentMask((L // 4,) * 3 + (L - 3 * (L // 4),)),
                 DocumentMask((1,) * L)]:
        r = mask.kv_ranges(L)
        validate_ranges(r, L)
        assert r.shape[0] == L


# ----------------------------------------------------------------------------------------------------
# drawing
# ----------------------------------------------------------------------------------------------------

def _read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.setdefault(kind, []).append(body)
        pos += 12 + length
    assert b"IEND" in chunks
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][0][:10])
    return width, height, depth, color, chunks


def _dense_pool(dense, n):
    L = dense.shape[0]
    member = (np.arange(L)[None, :] * n // L) == np.arange(n)[:, None]  # [n, L]
    return (member.astype(int) @ dense.astype(int) @ member.T.astype(int)) > 0


@SETTINGS
@given(simple_masks(), st.integers(1, 300), st.integers(1, 64))
def test_downsample_is_exact_max_pool(mask, L, max_pixels):
    pooled = downsample_ranges(mask.kv_ranges(L), L, max_pixels)
    n = min(L, max_pixels)
    assert pooled.shape == (n, n)
    np.testing.assert_array_equal(pooled, _dense_pool(mask.dense(L), n))


def test_draw_writes_png(tmp_path):
    path = tmp_path / "lambda.png"
    L = 5000
    draw_ranges(LambdaMask(64, 512).kv_ranges(L), L, str(path), title="lambda", max_pixels=200, backend="png")
    width, height, depth, color, chunks = _read_png(path)
    assert (width, height, depth, color) == (200, 200, 8, 0)
    raw = np.frombuffer(zlib.decompress(b"".join(chunks[b"IDAT"])), dtype=np.uint8).reshape(200, 201)
    assert (raw[:, 0] == 0).all()
    # a pixel shows iff any of its pairs is attended (the max-pool); a fully attended one is black
    np.testing.assert_array_equal(raw[:, 1:] < 255, downsample_ranges(LambdaMask(64, 512).kv_ranges(L), L, 200))
    assert (raw[:, 1:][density_ranges(LambdaMask(64, 512).kv_ranges(L), L, 200) == 1] == 0).all()
    # small masks are scaled up by an integer factor
    small_path = tmp_path / "small.png"
    CausalMask().draw(10, str(small_path), max_pixels=1024)
    width, height, *_ = _read_png(small_path)
    assert width == height and width % 10 == 0 and width >= 10


def test_draw_command_line(tmp_path):
    out = tmp_path / "cli.png"
    assert mask_main("lambda", [str(out), "--seqlen", "300", "--max-pixels", "64", "window=16"]) == 0
    assert _read_png(out)[0] > 0
    out2 = tmp_path / "doc.png"
    assert mask_main(None, ["document", str(out2), "--seqlen", "30", "doc_lengths=10,20"]) == 0
    assert out2.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_block_pair_counts_are_cached_exact_and_read_only(monkeypatch):
    """``BatchSpec.block_pair_counts`` (the planner's tile counts, cached per mask, length and bounds) equals
    the uncached count for every sequence and cut, returns the cached array on a repeat, cannot be written,
    and stops caching (still exact) once the cache holds its byte cap."""
    import dcp.spec as spec_mod
    from dcp.layout.blocks import pair_counts
    from dcp.spec import BatchSpec

    lens = [40, 40, 17, 64]
    masks = [CausalMask(), CausalMask(), LambdaMask(sink=2, window=5), SlidingWindowMask(window=9)]
    spec = BatchSpec(lens, masks, 4, 2, 8)
    rng = np.random.default_rng(0)
    for seq, n in enumerate(lens):
        for _ in range(4):
            cuts = np.unique(np.r_[0, rng.integers(1, n, size=rng.integers(0, 5)), n])
            got = spec.block_pair_counts(seq, cuts)
            np.testing.assert_array_equal(got, pair_counts(spec.kv_ranges(seq), cuts))
            assert spec.block_pair_counts(seq, cuts.tolist()) is got
            with pytest.raises(ValueError):
                got[0, 0] = 1
    # sequences 0 and 1 share mask and length: one entry serves both
    assert spec.block_pair_counts(1, np.array([0, 20, 40])) is spec.block_pair_counts(0, np.array([0, 20, 40]))
    monkeypatch.setattr(spec_mod, "PAIR_COUNTS_CACHE_BYTES", 0)
    fresh = BatchSpec(lens, masks, 4, 2, 8)
    a = fresh.block_pair_counts(3, np.array([0, 30, 64]))
    np.testing.assert_array_equal(a, pair_counts(fresh.kv_ranges(3), np.array([0, 30, 64])))
    assert fresh.block_pair_counts(3, np.array([0, 30, 64])) is not a
