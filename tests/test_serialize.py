"""Plan bytes (format version 2): bit-exact round trips of the columnar programs, compact explicit
ranges, named errors for old, truncated and corrupt bytes."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from _budget import n_examples
from hypothesis import given, settings
from hypothesis import strategies as st

import dcp
from dcp import masks as M
from dcp.baselines import BASELINES, MegatronDynCPPlanner
from dcp.ir.serialize import MAGIC, _plan_arrays, decode_ranges, encode_ranges

GREEDY = dict(partitioner=dcp.GreedyPartitioner(), time_budget_s=None)


def natten_ranges(h: int, w: int, k: int) -> np.ndarray:
    """2-D neighbourhood attention over an h x w grid of tokens (row-major): each token sees the k x k
    window around it, shifted inside the grid at the borders (NATTEN's rule): k ranges per token."""
    y, x = np.divmod(np.arange(h * w), w)
    x0, y0 = np.clip(x - k // 2, 0, w - k), np.clip(y - k // 2, 0, h - k)
    start = (y0[:, None] + np.arange(k)[None, :]) * w + x0[:, None]
    return np.stack([start, start + k], axis=-1)


@pytest.fixture(scope="module")
def plans():
    spec = dcp.BatchSpec([300, 129, 40], [M.CausalMask(), M.LambdaMask(4, 32), M.MaskModMask(lambda q, k: k <= q)],
                         4, 2, 16)
    cluster = dcp.Cluster(2, 2)
    out = [dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=32, **GREEDY))]
    out += [cls().plan(spec, cluster) for _, cls in sorted(BASELINES.items())]
    return out


def test_round_trip_is_bit_exact(plans):
    for plan in plans:
        blob = plan.to_bytes()
        back = dcp.Plan.from_bytes(blob)
        mine, theirs = _plan_arrays(plan), _plan_arrays(back)
        assert list(mine) == list(theirs)
        for name in mine:
            assert mine[name].dtype == theirs[name].dtype and mine[name].shape == theirs[name].shape, name
            assert mine[name].tobytes() == theirs[name].tobytes(), name
        assert back.to_bytes() == blob  # and it writes the same bytes again
        assert back.spec.seqlens == plan.spec.seqlens and back.planner == plan.planner
        for s in range(plan.spec.num_seqs):  # the callable mask came back as its ranges
            np.testing.assert_array_equal(back.spec.kv_ranges(s), plan.spec.kv_ranges(s))
        dcp.validate(back)


def test_old_truncated_and_corrupt_bytes_raise_named_errors(plans):
    blob = plans[0].to_bytes()
    old = bytearray(blob[:-4])
    old[len(MAGIC):len(MAGIC) + 4] = struct.pack("<I", 1)
    old = bytes(old) + struct.pack("<I", zlib.crc32(bytes(old)))
    with pytest.raises(dcp.SerializationError, match="version 1 .*plan the batch again"):
        dcp.Plan.from_bytes(old)
    for n in sorted({0, 7, 20, len(blob) // 3, len(blob) // 2, len(blob) - 5, len(blob) - 1}):
        with pytest.raises(dcp.SerializationError):
            dcp.Plan.from_bytes(blob[:n])
    flipped = bytearray(blob)
    flipped[-100] ^= 1
    with pytest.raises(dcp.SerializationError, match="checksum"):
        dcp.Plan.from_bytes(bytes(flipped))


@settings(max_examples=n_examples(50, 500))
@given(st.integers(1, 60), st.integers(1, 4), st.integers(0, 2 ** 31 - 1))
def test_range_encoding_round_trips(length, slots, seed):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, length, (length, slots))
    if rng.random() < 0.5:  # sliding: mostly equal steps
        start = np.minimum(np.arange(length)[:, None] + np.arange(slots)[None, :], length - 1)
    ranges = np.stack([start, np.minimum(start + rng.integers(0, 3, start.shape), length)], axis=-1)
    runs, run_len = encode_ranges(ranges)
    assert run_len.sum() == length and (run_len > 0).all()
    np.testing.assert_array_equal(decode_ranges(runs, run_len), ranges)


def test_neighbourhood_mask_at_131k_tokens_serializes_small():
    """131,072 tokens (a 256 x 512 grid) with 31 ranges per token: 32 MB of raw ranges, under 8 MiB of plan."""
    ranges = natten_ranges(256, 512, 31)
    spec = dcp.BatchSpec([ranges.shape[0]], M.RangesMask(ranges), 8, 2, 128)
    plan = MegatronDynCPPlanner().plan(spec, dcp.Cluster(1, 2))
    blob = plan.to_bytes()
    assert len(blob) <= 8 * 2**20 and len(blob) < ranges.nbytes / 50
    np.testing.assert_array_equal(dcp.Plan.from_bytes(blob).spec.masks[0].ranges, ranges)


def test_bytes_that_are_no_plan_are_named(plans):
    with pytest.raises(dcp.SerializationError, match="bad magic"):
        dcp.Plan.from_bytes(b"DCPPLAN1" + plans[0].to_bytes()[8:])


def test_large_plans_travel_compressed_and_bad_compressed_bytes_are_named(plans, monkeypatch):
    import struct
    import zlib

    from dcp.ir import serialize

    plan = plans[0]
    raw = plan.to_bytes()
    assert raw[:8] == serialize.MAGIC  # small plans stay raw
    packed = plan.to_bytes(compress=True)
    assert packed[:8] == serialize.ZMAGIC and len(packed) < len(raw)
    assert dcp.Plan.from_bytes(packed).to_bytes() == raw
    monkeypatch.setattr(serialize, "COMPRESS_ABOVE", 100)
    assert plan.to_bytes() == packed  # automatic above the threshold, deterministic
    with pytest.raises(dcp.SerializationError, match="checksum"):
        dcp.Plan.from_bytes(packed[:-1] + bytes([packed[-1] ^ 1]))
    with pytest.raises(dcp.SerializationError):
        dcp.Plan.from_bytes(packed[:len(packed) // 2])
    with pytest.raises(dcp.SerializationError, match="truncated"):
        dcp.Plan.from_bytes(serialize.ZMAGIC + b"\0" * 4)
    # a well-checksummed stream that inflates to more (or less) than it declares
    for declared in (len(raw) - 1, len(raw) + 1):
        body = serialize.ZMAGIC + struct.pack("<Q", declared) + zlib.compress(raw, 1)
        with pytest.raises(dcp.SerializationError, match="declared"):
            dcp.Plan.from_bytes(body + struct.pack("<I", zlib.crc32(body)))
    body = serialize.ZMAGIC + struct.pack("<Q", 10) + b"not zlib at all"
    with pytest.raises(dcp.SerializationError, match="inflate"):
        dcp.Plan.from_bytes(body + struct.pack("<I", zlib.crc32(body)))
