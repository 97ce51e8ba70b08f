"""Magi's dynamic solver with its greedy placement in C++ (``dcp._C.magi_place``, csrc/magi_place.cpp)
against the same solver placing in Python: identical tries, thresholds and tile ranks on random inputs
(feasible, infeasible and unplaceable thresholds, up to 64 ranks) and on real micro-benchmark batches;
bad arrays refused by name."""
import numpy as np
import pytest
import torch

import dcp
import dcp.baselines.magi_dynamic as MD
from dcp.errors import InvalidConfigError

pytestmark = pytest.mark.skipif(not MD._NATIVE_PLACE, reason="dcp._C without magi_place")


def random_problem(rng):
    """``solve``'s arguments: token blocks with homes and copy costs, tiles between them with areas (some
    duplicated areas and blocks sharing a home, so ties and fixed tiles occur)."""
    p = int(rng.choice([1, 2, 3, 7, 8, 32, 64]))
    n_units = int(rng.integers(1, 40))
    home = np.sort(rng.integers(0, p, n_units)).astype(np.int64)
    n_tiles = int(rng.integers(1, 300))
    q_unit, kv_unit = rng.integers(0, n_units, n_tiles), rng.integers(0, n_units, n_tiles)
    area = rng.choice([64.0, 1024.0, 4096.0, 16384.0], n_tiles) * rng.integers(1, 3, n_tiles)
    length = rng.choice([256.0, 1024.0, 2048.0], n_units)
    mu = float(rng.choice([1.0, 1.05, 1.2, 2.0]))
    return q_unit, kv_unit, area, home, length * 8, length * 2, p, mu


@pytest.mark.parametrize("seed", range(60))
def test_native_placement_solves_exactly_like_python(seed):
    args = random_problem(np.random.default_rng(seed))
    trace_py, trace_c = [], []
    py = MD.solve(*args, trace=trace_py, native=False)
    c = MD.solve(*args, trace=trace_c, native=True)
    assert np.array_equal(py.rank, c.rank)
    assert (py.feasible, py.threshold, py.tries) == (c.feasible, c.threshold, c.tries)
    assert trace_py == trace_c


@pytest.mark.parametrize("case", [("longalign", 4.0, "causal", 2048, 1.2), ("ldc", 0.5, "shared_question", 1024, 1.05),
                                  ("ldc", 1.0, "lambda", None, 1.1)])
def test_native_placement_on_micro_batches(case, monkeypatch):
    from dcp.bench.micro import make_mask
    from dcp.data import make_batches

    dataset, scale, mask, chunk, mu = case
    spec = dcp.BatchSpec(make_batches(dataset, scale, tokens_per_batch=131072, num_batches=1, seed=0)[0],
                         make_mask(mask), 8, 2, 128, "bfloat16")
    cluster = dcp.Cluster(4, 8)
    planner = MD.MagiDynamicPlanner(chunk, 4, mu)
    native = planner.static_parts(spec, cluster)
    monkeypatch.setattr(MD, "_NATIVE_PLACE", False)
    python = planner.static_parts(spec, cluster)
    assert np.array_equal(native.tile_device, python.tile_device)
    assert np.array_equal(native.tile_stage, python.tile_stage)


def test_native_placement_needs_at_most_64_ranks():
    args = list(random_problem(np.random.default_rng(0)))
    args[6] = 65
    args[3] = np.minimum(args[3], 64)
    with pytest.raises(InvalidConfigError, match="64 ranks"):
        MD.solve(*args, native=True)
    assert MD.solve(*args).rank.size == args[0].size  # None: Python beyond 64 ranks


def _call(**over):
    t = torch.tensor
    f64 = torch.float64
    kw = dict(mask=t([0b011, 0b110], dtype=torch.int64), degree=t([2, 2]), home=t([0, 1]),
              area=t([1.0, 2.0], dtype=f64), free_order=t([1, 0]), movable_order=t([0, 1]), rank=t([-1, -1]),
              load=t([0.0, 0.0, 0.0], dtype=f64), avg=1.0, cap=2.0, refine_passes=5)
    kw.update(over)
    return MD._C.magi_place(*kw.values())


def test_native_placement_places_and_refuses_bad_arrays_by_name():
    t = torch.tensor
    ok, rank, load = _call()  # each tile at its q block's home (both below the mean then)
    assert ok and rank.tolist() == [0, 1] and load.tolist() == [1.0, 2.0, 0.0]
    ok, rank, load = _call(home=t([1, 1]))  # tile 1 first fills rank 1; tile 0 takes the emptier rank 0
    assert ok and rank.tolist() == [0, 1] and load.tolist() == [1.0, 2.0, 0.0]
    ok, _, _ = _call(cap=1.5)  # over the cap, and no allowed rank lowers it
    assert not ok
    bad = [(dict(mask=t([0b1000, 0b110], dtype=torch.int64)), "mask must name"),
           (dict(mask=t([0, 0b110], dtype=torch.int64)), "mask must name"),
           (dict(degree=t([1, 2])), "degree"),
           (dict(home=t([0, 3])), "home"),
           (dict(free_order=t([1, 1])), "listed twice"),
           (dict(free_order=t([1, 2])), "free_order"),
           (dict(rank=t([0, -1]), free_order=t([1, 0])), "already placed"),
           (dict(free_order=t([1]), movable_order=t([0, 1])), "movable tile 0"),
           (dict(load=t([0.0] * 65, dtype=torch.float64)), "1..64 ranks"),
           (dict(area=t([1.0, 2.0], dtype=torch.float32)), "area"),
           (dict(refine_passes=-1), "refine_passes")]
    for over, match in bad:
        with pytest.raises(RuntimeError, match=match):
            _call(**over)
