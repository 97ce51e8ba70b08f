"""The planner's loops in C++ against their Python references: the makespan estimate
(dcp._C.estimate_rounds vs dcp.cost.estimate.rounds_end_s_reference: the same device end times) and tile
staging (dcp._C.tile_stages vs dcp.schedule.stages.tile_stages_reference: identical stages), on random
inputs and on every call of real multi-node plans. (The input-round greedy: test_rounds.py.)"""
import numpy as np
import pytest

import dcp
import dcp.cost.estimate as E
import dcp.schedule.stages as S
from dcp.cost import CostModel
from dcp.cost.model import HostCosts

pytestmark = pytest.mark.skipif(not (E._NATIVE and S._NATIVE_STAGES), reason="dcp._C without the planner loops")


def random_rounds(rng):
    """Arguments of ``rounds_end_s_reference``: a random cluster, transfers (repeated (round, src, dst)
    included, local ones too), stage compute with idle stages, merges and host costs."""
    nodes, gpn = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4, 8]))
    n = nodes * gpn
    per_nic = int(rng.choice([d for d in (1, 2, 4, 8) if gpn % d == 0]))
    n_rounds, n_stages = int(rng.integers(0, 7)), int(rng.integers(1, 7))
    m = int(rng.integers(0, 60)) if n_rounds else 0
    round_ = rng.integers(1, n_rounds + 1, m) if n_rounds else np.zeros(0, np.int64)
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    dst = np.where(rng.random(m) < 0.1, src, dst)  # some local transfers
    nbytes = rng.choice([4096.0, 65536.0, 3e6], m)
    comp = rng.uniform(1e-5, 1e-3, (n, n_stages)) * (rng.random((n, n_stages)) < 0.8)
    n_merges = rng.integers(0, 3, (n, n_rounds + 1)).astype(float)
    red = n_merges * rng.uniform(1e-6, 1e-5, (n, n_rounds + 1))
    t0, host0 = rng.uniform(0, 1e-4, n), rng.uniform(0, 1e-4, n)
    hc = HostCosts(*(rng.uniform(0, 5e-5, 7) * (rng.random() < 0.8)))
    merge_host = hc.reduce * n_merges + hc.reduce_step * (n_merges > 0)  # host seconds, as estimate_device_ends_s
    round_over = float(rng.choice([0.0, 1e-5]))
    return (round_, src, dst, nbytes, comp, red, merge_host, t0, host0, hc, round_over, 2e-6, 150e9,
            float(rng.choice([25e9, 50e9])), gpn, per_nic)


@pytest.mark.parametrize("seed", range(40))
def test_native_matches_reference_on_random_rounds(seed):
    args = random_rounds(np.random.default_rng(seed))
    ref = E.rounds_end_s_reference(*args)
    nat = E.rounds_end_s(*args)
    assert nat.shape == ref.shape and nat.dtype == np.float64
    np.testing.assert_allclose(nat, ref, rtol=1e-12, atol=0)
    assert (nat >= args[7]).all()  # no stream ends before it starts


@pytest.mark.parametrize("seed", range(3))
def test_native_matches_reference_with_many_rounds(seed):
    """(rounds + 1) x devices^2 keys far above the transfers: the C++ coalesces by sorting, not densely."""
    rng = np.random.default_rng(seed)
    n, n_rounds, m = 24, 150, 400
    round_ = rng.integers(1, n_rounds + 1, m)
    round_[: m // 2] = round_[m // 2:]  # repeated keys, bytes added in input order
    src, dst = rng.integers(0, n, m), rng.integers(0, n, m)
    src[: m // 2], dst[: m // 2] = src[m // 2:], dst[m // 2:]
    assert (n_rounds + 1) * n * n > max(4 * m, 1 << 16)
    comp = rng.uniform(1e-5, 1e-3, (n, 5))
    n_merges = rng.integers(0, 2, (n, n_rounds + 1)).astype(float)
    args = (round_, src, dst, rng.choice([4096.0, 3e6], m), comp, n_merges * 3e-6, n_merges * 1e-5, np.zeros(n),
            np.zeros(n), HostCosts(*([1e-5] * 7)), 1e-5, 2e-6, 150e9, 25e9, 8, 8)
    np.testing.assert_allclose(E.rounds_end_s(*args), E.rounds_end_s_reference(*args), rtol=1e-12, atol=0)


def test_native_matches_reference_on_planner_estimates(monkeypatch):
    """Every estimate of a multi-node dcp plan's search (host costs charged) gives the reference's times."""
    calls = []
    native = E.rounds_end_s

    def both(*args):
        ref, nat = E.rounds_end_s_reference(*args), native(*args)
        calls.append((np.allclose(nat, ref, rtol=1e-12, atol=0), args[0].size))
        return nat

    monkeypatch.setattr(E, "rounds_end_s", both)
    spec = dcp.BatchSpec([9000, 3000, 1500, 700, 200], dcp.masks.CausalMask(), 4, 2, 16)
    cfg = dcp.PlannerConfig(block_size=256, cost_model=CostModel.named("h100"))
    plan = dcp.DCPPlanner(cfg).plan(spec, dcp.Cluster(2, 4))
    assert plan.stats().valid and plan.stats().comm_bytes_total > 0
    assert len(calls) > 5 and all(ok for ok, _ in calls)
    assert sum(m > 0 for _, m in calls) > 5  # estimates with transfers, not only local plans


def test_native_rejects_bad_arrays():
    import torch

    i = torch.tensor([1, 1], dtype=torch.long)
    f = torch.ones(2, dtype=torch.double)
    m2 = torch.zeros(2, 2, dtype=torch.double)
    good = [i, torch.tensor([0, 1]), torch.tensor([1, 0]), f, m2, m2, m2, f, f, [0.0] * 5, 0.0, 1e-6, 1e9, 1e9, 2, 1]
    assert E._C.estimate_rounds(*good).shape == (2,)
    for pos, bad, msg in ((0, torch.tensor([1, 2]), r"transfer 1 \(round 2, 1 -> 0\) is outside rounds 0..1"),
                          (1, torch.tensor([0, 2]), "and devices 0..1"),
                          (3, torch.ones(2, dtype=torch.float), "nbytes must have dtype"),
                          (5, torch.zeros(2, 3, dtype=torch.double), "red and n_merges"),
                          (9, [0.0] * 4, "host must be"),
                          (14, 3, "whole nodes")):
        args = list(good)
        args[pos] = bad
        with pytest.raises(RuntimeError, match=msg):
            E._C.estimate_rounds(*args)


def random_stage_inputs(rng):
    """Arguments of ``tile_stages_reference``: tiles on a few devices (some staged), releases up to past
    ``n_stages``, partial-output units shared by several tiles, equal tile times (ties), round durations."""
    n_dev, n = int(rng.integers(1, 6)), int(rng.integers(0, 200))
    n_stages = int(rng.integers(1, 6))
    tile_device = rng.integers(0, n_dev, n)
    release = np.where(rng.random(n) < 0.4, 0, rng.integers(0, n_stages + 3, n))
    out_unit = np.where(rng.random(n) < 0.5, -1, rng.integers(0, 12, n))
    tile_time = rng.choice([1e-5, 2e-5, 7e-5], n) * rng.integers(1, 3, n)
    staged = rng.random(n_dev) < 0.8
    round_s = rng.uniform(0, 4e-4, (n_dev, int(rng.integers(1, 9)))) if rng.random() < 0.7 else None
    return tile_device, release, out_unit, tile_time, staged, n_stages, round_s


@pytest.mark.parametrize("seed", range(60))
def test_native_stages_match_reference_on_random_tiles(seed):
    args = random_stage_inputs(np.random.default_rng(seed))
    ref = S.tile_stages_reference(*args)
    nat = S.tile_stages(*args, native=True)
    np.testing.assert_array_equal(nat, ref)
    assert nat.dtype == np.int64 and (nat >= args[1]).all()  # no tile runs before its inputs arrive


def test_native_stages_match_reference_on_planner_schedules(monkeypatch):
    """Every tile_stages call of a multi-node dcp plan's search gives the reference's stages."""
    calls = []
    native = S.tile_stages

    def both(*args, **kwargs):
        ref, nat = S.tile_stages_reference(*args, **kwargs), native(*args, native=True, **kwargs)
        calls.append((np.array_equal(ref, nat), int(np.max(ref, initial=0))))
        return nat

    monkeypatch.setattr(S, "tile_stages", both)
    spec = dcp.BatchSpec([9000, 3000, 1500, 700, 200], dcp.masks.LambdaMask(64, 2048), 4, 2, 16)
    plan = dcp.DCPPlanner(dcp.PlannerConfig(block_size=256)).plan(spec, dcp.Cluster(2, 4))
    assert plan.stats().valid and plan.stats().comm_bytes_total > 0
    assert len(calls) > 3 and all(ok for ok, _ in calls)
    assert max(st for _, st in calls) >= 2  # staged schedules, not only "everything at once"


def test_native_stages_reject_bad_arrays():
    import torch

    z = torch.zeros(2, dtype=torch.long)
    good = [z, z, torch.tensor([-1, 0]), torch.ones(2, dtype=torch.double), torch.ones(1, dtype=torch.bool), 2, None]
    assert S._C.tile_stages(*good).tolist() == [0, 1]  # stage 0 holds a third of the work: the rest waits
    for pos, bad, msg in ((0, torch.tensor([0, 1]), "tile_device must be devices 0..0"),
                          (1, torch.tensor([0, -1]), "release rounds must be >= 0"),
                          (2, torch.tensor([-2, 0]), "out_unit must be >= -1"),
                          (3, -torch.ones(2, dtype=torch.double), "tile_time must be >= 0"),
                          (4, torch.ones(1, dtype=torch.long), "staged must have dtype"),
                          (5, 0, "n_stages must be >= 1"),
                          (6, torch.ones(2, 3, dtype=torch.double), "round_s must be")):
        args = list(good)
        args[pos] = bad
        with pytest.raises(RuntimeError, match=msg):
            S._C.tile_stages(*args)
