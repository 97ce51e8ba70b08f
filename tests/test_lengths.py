"""Tests for dcp.data.lengths: distributions, paper-style batching, length files and CLI parsing."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dcp.data import (
    DEFAULT_TOKENS_PER_BATCH,
    DISTRIBUTIONS,
    PAPER_SCALES,
    BatchFormationError,
    LengthDistribution,
    LogNormalComponent,
    get_distribution,
    load_length_batches,
    lognormal,
    make_batches,
    parse_lengths_arg,
)
from dcp.errors import DcpError, InvalidBatchError

N_SAMPLES = 200_000


# ---------------------------------------------------------------------------------------- distributions

@pytest.fixture(scope="module")
def samples():
    return {name: d.sample(N_SAMPLES, np.random.default_rng(123)) for name, d in DISTRIBUTIONS.items()}


def test_registry_names():
    assert set(DISTRIBUTIONS) == {"longalign", "ldc", "megatron_mock"}
    for name, dist in DISTRIBUTIONS.items():
        assert get_distribution(name) is dist
        assert get_distribution(dist) is dist


def test_unknown_distribution_lists_valid_names():
    with pytest.raises(InvalidBatchError) as info:
        get_distribution("longalgn")
    for name in DISTRIBUTIONS:
        assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_sample_dtype_bounds_and_determinism(name, samples):
    dist = DISTRIBUTIONS[name]
    x = samples[name]
    assert x.dtype == np.int64 and x.shape == (N_SAMPLES,)
    assert x.min() >= dist.min_len and x.max() <= dist.max_len
    again = dist.sample(1000, np.random.default_rng(7))
    np.testing.assert_array_equal(again, dist.sample(1000, np.random.default_rng(7)))
    np.testing.assert_array_equal(again, dist.sample(1000, 7))  # int seed convenience
    assert not np.array_equal(again, dist.sample(1000, np.random.default_rng(8)))
    assert dist.sample(0, np.random.default_rng(0)).shape == (0,)


def test_longalign_shape(samples):
    x = samples["longalign"]
    assert 8192 <= np.median(x) <= 32768
    assert 0.8 <= np.mean((x >= 8192) & (x <= 65536)) <= 0.97  # most mass 8K-64K
    assert x.min() >= 2048 and np.mean(x < 8192) > 0.02  # some shorter ones down to ~2K


def test_ldc_shape(samples):
    x = samples["ldc"]
    assert np.median(x) < 4096
    assert 0.01 < np.mean(x > 32768) < 0.1  # heavy tail of long documents
    assert x.max() > 100_000
    assert np.mean(x < 1024) > 0.2  # many short documents


def test_megatron_mock_shape(samples):
    x = samples["megatron_mock"]
    assert x.min() == 128 and x.max() == 8192  # clipped, with point masses on both bounds
    assert 800 <= x.mean() <= 1024  # untruncated mean is 1024; clipping the upper tail lowers it
    comp = DISTRIBUTIONS["megatron_mock"].components[0]
    assert comp.mu == pytest.approx(math.log(1024) - 1.5 ** 2 / 2)
    assert comp.untruncated_mean == pytest.approx(1024)
    assert comp.sigma == 1.5


def test_general_lognormal_mean():
    dist = lognormal(2000, 0.5, 1, 10**9)
    x = dist.sample(N_SAMPLES, np.random.default_rng(0))
    assert x.mean() == pytest.approx(2000, rel=0.02)
    resampled = lognormal(2000, 1.0, 500, 4000, bounds="resample")
    y = resampled.sample(10_000, np.random.default_rng(0))
    assert y.min() >= 500 and y.max() <= 4000
    assert np.mean(y == 500) < 0.01  # truncation, no point mass on the bound


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_describe_is_json_and_says_synthetic(name):
    dist = DISTRIBUTIONS[name]
    desc = dist.describe()
    assert json.loads(json.dumps(desc)) == desc
    assert desc["name"] == name and desc["synthetic"] is True
    assert desc["components"] and all({"weight", "median", "mu", "sigma", "min_len", "max_len"}
                                      <= set(c) for c in desc["components"])
    assert name in dist.summary()
    if name in ("longalign", "ldc"):
        assert "SYNTHETIC" in desc["note"]


@pytest.mark.parametrize("kwargs", [
    dict(weight=0.0, median=10, sigma=1, min_len=1, max_len=2),
    dict(weight=1, median=-1, sigma=1, min_len=1, max_len=2),
    dict(weight=1, median=10, sigma=float("nan"), min_len=1, max_len=2),
    dict(weight=1, median=10, sigma=1, min_len=0, max_len=2),
    dict(weight=1, median=10, sigma=1, min_len=5, max_len=2),
])
def test_bad_component_raises(kwargs):
    with pytest.raises(InvalidBatchError):
        LogNormalComponent(**kwargs)


def test_bad_distribution_and_sample_args():
    comp = LogNormalComponent(1, 10, 1, 1, 100)
    with pytest.raises(InvalidBatchError):
        LengthDistribution("x", (comp,), bounds="wrap")
    with pytest.raises(InvalidBatchError):
        LengthDistribution("x", ())
    dist = LengthDistribution("x", (comp,))
    with pytest.raises(InvalidBatchError):
        dist.sample(-1, np.random.default_rng(0))
    with pytest.raises(InvalidBatchError):
        dist.sample(3, "seed")


# ---------------------------------------------------------------------------------------------- batches

def _check_batches(batches, num, budget, min_fill, cap):
    assert len(batches) == num
    for b in batches:
        assert b.dtype == np.int64 and b.ndim == 1 and b.size >= 1
        assert b.min() >= 1 and b.max() <= cap
        assert b.sum() <= budget
        assert b.sum() >= math.ceil(min_fill * budget - 1e-9)


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
@pytest.mark.parametrize("scale", PAPER_SCALES)
def test_paper_batches(name, scale):
    batches = make_batches(name, scale, num_batches=8, seed=3)
    _check_batches(batches, 8, DEFAULT_TOKENS_PER_BATCH, 0.75, DEFAULT_TOKENS_PER_BATCH)


def test_batches_deterministic_by_seed():
    a = make_batches("ldc", 1.0, num_batches=5, seed=11)
    b = make_batches("ldc", 1.0, num_batches=5, seed=11)
    c = make_batches("ldc", 1.0, num_batches=5, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, c))
    # asking for more batches extends the same stream
    longer = make_batches("ldc", 1.0, num_batches=7, seed=11)
    assert all(np.array_equal(x, y) for x, y in zip(a, longer[:5]))


def test_scale_applied():
    """With a budget no draw can exceed, scaled batches hold exactly the scaled stream's lengths."""
    const = lognormal(1000, 1e-9, 1, 10**6)  # every draw is 1000
    for scale, expect in [(0.5, 500), (1.0, 1000), (2.0, 2000), (4.0, 4000), (0.0001, 1)]:
        batches = make_batches(const, scale, tokens_per_batch=8000, num_batches=3, seed=0, min_fill=0.0)
        for b in batches:
            assert set(b.tolist()) == {expect}
    base = make_batches("longalign", 1.0, tokens_per_batch=10**8, num_batches=1, seed=5)[0]
    doubled = make_batches("longalign", 2.0, tokens_per_batch=10**8, num_batches=1, seed=5)[0]
    n = min(base.size, doubled.size)
    np.testing.assert_array_equal(doubled[:n], 2 * base[:n])


def test_long_sequences_dropped():
    # LongAlign has lengths up to 64K; at scale 4 everything above 32K must disappear
    batches = make_batches("longalign", 4.0, num_batches=20, seed=0)
    lengths = np.concatenate(batches)
    assert lengths.max() <= DEFAULT_TOKENS_PER_BATCH
    # the un-dropped stream would hold sequences > budget: check that some were in fact dropped
    raw = DISTRIBUTIONS["longalign"].sample(4096, np.random.default_rng(0)) * 4
    assert (raw > DEFAULT_TOKENS_PER_BATCH).any()
    # max_seqlen drops more
    capped = make_batches("longalign", 1.0, num_batches=10, seed=0, max_seqlen=20_000)
    assert np.concatenate(capped).max() <= 20_000


def test_batch_greedy_arrival_order():
    """Reproduce the packing by hand from the same stream."""
    budget, min_fill, scale = 50_000, 0.75, 1.0
    batches = make_batches("longalign", scale, tokens_per_batch=budget, num_batches=4, seed=9,
                           min_fill=min_fill)
    stream = DISTRIBUTIONS["longalign"].sample(4096, np.random.default_rng(9))
    stream = stream[stream <= budget].tolist()
    expect, cur = [], []
    for x in stream:
        if sum(cur) + x <= budget:
            cur.append(x)
        else:
            if sum(cur) >= min_fill * budget:
                expect.append(cur)
            cur = [x]
        if len(expect) == 4:
            break
    assert [b.tolist() for b in batches] == expect


def test_zero_batches():
    assert make_batches("ldc", 1.0, num_batches=0, seed=0) == []


def test_impossible_batches_raise_named_error():
    with pytest.raises(BatchFormationError) as info:
        make_batches("longalign", 1.0, num_batches=2, seed=0, max_seqlen=100, max_samples=50_000)
    assert isinstance(info.value, InvalidBatchError) and isinstance(info.value, DcpError)
    assert isinstance(info.value, ValueError)
    with pytest.raises(BatchFormationError):  # every sequence longer than the budget
        make_batches("megatron_mock", 2000.0, num_batches=1, seed=0, max_samples=20_000)
    with pytest.raises(BatchFormationError):  # 2 x 1000-token sequences can never fill 75% of 2999
        make_batches(lognormal(1000, 1e-9, 1, 10**6), 1.0, tokens_per_batch=2999, num_batches=1,
                     seed=0, max_samples=20_000)


@pytest.mark.parametrize("kwargs", [
    dict(scale=0), dict(scale=-1), dict(scale=float("inf")), dict(tokens_per_batch=0),
    dict(num_batches=-1), dict(seed=-1), dict(seed=1.5), dict(min_fill=1.5), dict(min_fill=-0.1),
    dict(max_seqlen=0), dict(dist_or_name="nope"),
])
def test_bad_make_batches_args(kwargs):
    args = dict(dist_or_name="ldc", scale=1.0, num_batches=1, seed=0) | kwargs
    with pytest.raises(InvalidBatchError):
        make_batches(**args)


def _reachable(values: np.ndarray, hi: int) -> np.ndarray:
    """bool ``[hi + 1]``: which totals 0..hi a sum of ``values`` (each any number of times) makes."""
    reach = np.zeros(hi + 1, dtype=bool)
    reach[0] = True
    for v in values.tolist():  # per residue class mod v, a total is reachable once a smaller one is
        padded = np.concatenate([reach, np.zeros(-(hi + 1) % v, dtype=bool)]).reshape(-1, v)
        reach = np.logical_or.accumulate(padded, axis=0).reshape(-1)[:hi + 1]
    return reach


def test_reachable_totals():
    assert np.flatnonzero(_reachable(np.array([256]), 600)).tolist() == [0, 256, 512]
    assert np.flatnonzero(_reachable(np.array([3, 5]), 12)).tolist() == [0, 3, 5, 6, 8, 9, 10, 11, 12]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(DISTRIBUTIONS)),
       scale=st.floats(0.05, 8.0),
       budget=st.integers(512, 300_000),
       min_fill=st.floats(0.0, 0.9),
       num=st.integers(1, 4),
       seed=st.integers(0, 2**32),
       max_seqlen=st.one_of(st.none(), st.integers(256, 200_000)))
@example(name="megatron_mock", scale=2.0, budget=586, min_fill=0.875, num=1, seed=0, max_seqlen=256)
def test_make_batches_invariants(name, scale, budget, min_fill, num, seed, max_seqlen):
    cap = budget if max_seqlen is None else min(budget, max_seqlen)
    try:
        batches = make_batches(name, scale, tokens_per_batch=budget, num_batches=num, seed=seed,
                               min_fill=min_fill, max_seqlen=max_seqlen, max_samples=100_000)
    except BatchFormationError:
        # acceptable only when (almost) every scaled length is above the cap, or when no sum of the lengths
        # within it fills a batch (a clipped distribution's point mass: megatron_mock x2 gives 256s only,
        # and no multiple of 256 lies in [513, 586])
        draws = np.maximum(np.rint(DISTRIBUTIONS[name].sample(20_000, seed) * scale), 1)
        fits = np.unique(draws[draws <= cap]).astype(np.int64)
        lo = int(np.ceil(min_fill * budget))
        assert np.mean(draws <= cap) < 0.01 or (fits.size <= 64 and not _reachable(fits, budget)[lo:].any())
        return
    _check_batches(batches, num, budget, min_fill, cap)


# ------------------------------------------------------------------------------------------ CLI parsing

def test_parse_lengths_arg():
    np.testing.assert_array_equal(parse_lengths_arg("8192,4096,1000"), [8192, 4096, 1000])
    np.testing.assert_array_equal(parse_lengths_arg(" 8192, 4096 ,1000 "), [8192, 4096, 1000])
    np.testing.assert_array_equal(parse_lengths_arg("7"), [7])
    assert parse_lengths_arg("1 2\t3").dtype == np.int64


@pytest.mark.parametrize("text,needle", [
    ("", "no sequence lengths"), (" , ", "no sequence lengths"), ("8192,abc", "entry 1"),
    ("8192,0", "entry 1"), ("-5", "entry 0"), ("1.5,2", "entry 0"), ("99999999999999999999", "int64"),
    ("4096,,5", "entry 1 is empty"), ("4096,", "entry 1 is empty"), (",4096", "entry 0 is empty"),
    ("1 2,3", "entry 0"),
])
def test_parse_lengths_arg_errors(text, needle):
    with pytest.raises(InvalidBatchError) as info:
        parse_lengths_arg(text)
    assert needle in str(info.value)


def test_parse_lengths_arg_not_a_string():
    with pytest.raises(InvalidBatchError):
        parse_lengths_arg([1, 2])


# ------------------------------------------------------------------------------------------ length files

def _batches(result):
    return [b.tolist() for b in result]


def test_npy_round_trip(tmp_path):
    p = tmp_path / "lengths.npy"
    np.save(p, np.array([8192, 4096, 17], dtype=np.int32))
    out = load_length_batches(p)
    assert _batches(out) == [[8192, 4096, 17]] and out[0].dtype == np.int64
    p2 = tmp_path / "rows.NPY"
    with open(p2, "wb") as f:  # np.save(path) would append ".npy" to an upper-case suffix
        np.save(f, np.array([[1, 2], [3, 4]], dtype=np.int64))
    assert _batches(load_length_batches(str(p2))) == [[1, 2], [3, 4]]


def test_txt_round_trip(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("# my batch\n8192, 4096\n1000 2000  # trailing comment\n\n3000,\n")
    assert _batches(load_length_batches(p)) == [[8192, 4096, 1000, 2000, 3000]]
    p.write_text("1 2\n---\n3\n--- # next\n4,5\n")
    assert _batches(load_length_batches(p)) == [[1, 2], [3], [4, 5]]


def test_json_round_trip(tmp_path):
    p = tmp_path / "lengths.json"
    for data, expect in [
        ([8192, 4096], [[8192, 4096]]),
        ({"lengths": [5, 6]}, [[5, 6]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ({"batches": [[1], [2, 3]]}, [[1], [2, 3]]),
        ({"lengths": [[7, 8]]}, [[7, 8]]),
    ]:
        p.write_text(json.dumps(data))
        assert _batches(load_length_batches(p)) == expect


def test_round_trip_of_generated_batches(tmp_path):
    batches = make_batches("ldc", 1.0, num_batches=3, seed=0)
    p = tmp_path / "gen.json"
    p.write_text(json.dumps({"batches": [b.tolist() for b in batches]}))
    assert _batches(load_length_batches(p)) == _batches(batches)
    t = tmp_path / "gen.txt"
    t.write_text("\n---\n".join(" ".join(map(str, b.tolist())) for b in batches))
    assert _batches(load_length_batches(t)) == _batches(batches)


def test_missing_and_unknown_extension(tmp_path):
    with pytest.raises(InvalidBatchError, match="not found"):
        load_length_batches(tmp_path / "nope.json")
    with pytest.raises(InvalidBatchError, match="not found"):
        load_length_batches(tmp_path)  # a directory
    p = tmp_path / "lengths.csv"
    p.write_text("1,2,3")
    with pytest.raises(InvalidBatchError, match="extension") as info:
        load_length_batches(p)
    assert str(p) in str(info.value)
    q = tmp_path / "noext"
    q.write_text("1")
    with pytest.raises(InvalidBatchError, match="extension"):
        load_length_batches(q)


@pytest.mark.parametrize("content,needle", [
    ("", "no sequence lengths"),
    ("# only a comment\n\n", "no sequence lengths"),
    ("8192\nabc\n", "line 2, entry 0"),
    ("1 2 0\n", "line 1, entry 2"),
    ("1\n-4\n", "line 2, entry 0"),
    ("1.5\n", "line 1, entry 0"),
    ("---\n1\n", "line 1"),
    ("1\n---\n", "last batch"),
    ("1\n---\n---\n2\n", "line 3"),
])
def test_bad_txt(tmp_path, content, needle):
    p = tmp_path / "bad.txt"
    p.write_text(content)
    with pytest.raises(InvalidBatchError) as info:
        load_length_batches(p)
    assert needle in str(info.value) and str(p) in str(info.value)


@pytest.mark.parametrize("data,needle", [
    ([], "no sequence lengths"),
    ({"lengths": []}, "no sequence lengths"),
    ([1, 2.5], "entry 1"),
    ([1, 8192.0], "entry 1"),
    ([1, True], "entry 1"),
    ([1, "2"], "entry 1"),
    ([1, 0], "entry 1"),
    ([-3], "entry 0"),
    ([[1, 2], [3, -1]], "batch 1, entry 1"),
    ([[1], []], "batch 1 is empty"),
    ([[1], 2], "entry 1"),
    ({"lens": [1]}, "'lengths' or 'batches'"),
    ({"lengths": [1], "batches": [[1]]}, "'lengths' or 'batches'"),
    ("8192", "expected a JSON list"),
    ({"lengths": 5}, "expected a JSON list"),
    ([[1, None]], "batch 0, entry 1"),
])
def test_bad_json(tmp_path, data, needle):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(InvalidBatchError) as info:
        load_length_batches(p)
    assert needle in str(info.value) and str(p) in str(info.value)


def test_bad_json_syntax(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("[1, 2,")
    with pytest.raises(InvalidBatchError, match="cannot parse JSON"):
        load_length_batches(p)


@pytest.mark.parametrize("arr,needle", [
    (np.array([1.0, 2.0]), "not an integer type"),
    (np.array([True, False]), "not an integer type"),
    (np.array([5, 0, 3]), "entry 1"),
    (np.array([[1, 2], [3, -1]]), "batch 1, entry 1"),
    (np.zeros((1, 1, 1), dtype=np.int64), "shape"),
    (np.array([], dtype=np.int64), "batch 0 is empty"),
    (np.array([[], []], dtype=np.int64), "batch 0 is empty"),
    (np.array([2**63 + 5], dtype=np.uint64), "int64"),
])
def test_bad_npy(tmp_path, arr, needle):
    p = tmp_path / "bad.npy"
    np.save(p, arr)
    with pytest.raises(InvalidBatchError) as info:
        load_length_batches(p)
    assert needle in str(info.value) and str(p) in str(info.value)


def test_npy_object_and_corrupt(tmp_path):
    p = tmp_path / "obj.npy"
    np.save(p, np.array([[1, 2], [3]], dtype=object), allow_pickle=True)
    with pytest.raises(InvalidBatchError, match="cannot read"):
        load_length_batches(p)
    q = tmp_path / "corrupt.npy"
    q.write_bytes(b"not a numpy file")
    with pytest.raises(InvalidBatchError, match="cannot read"):
        load_length_batches(q)
