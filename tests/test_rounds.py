"""The input-round greedy in C++ (dcp._C.input_rounds) against its Python reference: identical arrival
rounds and sources on random demand sets and on the demands of real plans."""
import numpy as np
import pytest

import dcp
import dcp.schedule.rounds as R
from dcp.cost import CostModel
from dcp.schedule.stages import Demands

pytestmark = pytest.mark.skipif(not R._NATIVE, reason="dcp._C without input_rounds (extension not built)")


def random_demands(rng, n_dev, n_tb, n_hb, n):
    """``n`` distinct (device, side, token block, head block) demands, a unit's home never its consumer."""
    home = rng.integers(0, n_dev, n_tb)
    rows = set()
    while len(rows) < n:
        d, s, tb, hb = int(rng.integers(n_dev)), int(rng.integers(2)), int(rng.integers(n_tb)), int(rng.integers(n_hb))
        if home[tb] != d:
            rows.add((d, s, tb, hb))
    dev, side, tb, hb = (np.array(c, dtype=np.int64) for c in zip(*sorted(rows)))
    # few distinct sizes and values, so ties in priority and in capacities happen
    nbytes = rng.choice([4096.0, 8192.0, 65536.0], n)
    value = rng.choice([1e-6, 2e-6, 5e-6], n) * rng.integers(1, 4, n)
    empty = np.zeros(0, dtype=np.int64)
    return Demands(dev, side, tb, hb, nbytes, value, empty, empty), home


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("relay", [True, False])
def test_native_matches_reference_on_random_demands(seed, relay):
    rng = np.random.default_rng(seed)
    nodes, gpn = int(rng.integers(1, 5)), int(rng.integers(1, 9))
    cluster = dcp.Cluster(nodes, gpn)
    n_dev, n_tb, n_hb = cluster.n_devices, int(rng.integers(2, 30)), int(rng.integers(1, 3))
    if n_dev == 1:
        return  # no remote demands on one device
    n = int(rng.integers(1, min(400, (n_dev - 1) * n_tb * n_hb) + 1))
    dm, home = random_demands(rng, n_dev, n_tb, n_hb, n)
    key = (dm.side * n_tb + dm.tb) * n_hb + dm.hb
    # budgets from "nothing fits beyond the first transfer" to "everything fits in round 1"
    scale = 10.0 ** rng.uniform(-9, -3)
    budget_first, budget = rng.uniform(0, 2, n_dev) * scale, rng.uniform(0.5, 2, n_dev) * scale
    args = (dm, key, home, cluster, CostModel.named("a100"), budget_first, budget, int(rng.integers(1, 9)), relay)
    ref = R.input_rounds_reference(*args)
    nat = R.input_rounds(*args, native=True)
    np.testing.assert_array_equal(nat[0], ref[0])
    np.testing.assert_array_equal(nat[1], ref[1])
    assert (ref[0] >= 1).all() and (ref[1] >= 0).all()  # the last round takes whatever is left


def test_native_matches_reference_on_planner_schedules(monkeypatch):
    """Every input_rounds call of a multi-node dcp plan gives the reference's answer."""
    calls = []

    def both(*args, **kwargs):
        ref = R.input_rounds_reference(*args, **kwargs)
        nat = R.input_rounds(*args, native=True, **kwargs)
        calls.append(all(np.array_equal(a, b) for a, b in zip(ref, nat)))
        return ref

    monkeypatch.setattr("dcp.schedule.stages.input_rounds", both)
    spec = dcp.BatchSpec([3000, 1500, 700, 200], dcp.masks.CausalMask(), 4, 2, 16)
    cfg = dcp.PlannerConfig(block_size=128)
    plan = dcp.DCPPlanner(cfg).plan(spec, dcp.Cluster(2, 4))
    assert plan.stats().valid
    assert calls and all(calls)


def test_native_rejects_bad_arrays():
    import torch

    z = torch.zeros(3, dtype=torch.long)
    f = torch.zeros(3, dtype=torch.double)
    good = (torch.tensor([2, 0, 1]), z, z, z, f, torch.ones(2, dtype=torch.double),
            torch.ones(2, dtype=torch.double), 2, 1, 4, True, 1e9, 1e9)
    R._C.input_rounds(*good)
    with pytest.raises(RuntimeError, match="order must be a permutation"):
        R._C.input_rounds(torch.tensor([0, 0, 1]), *good[1:])
    with pytest.raises(RuntimeError, match="devices"):
        R._C.input_rounds(*good[:7], 3, 1, *good[9:])
    with pytest.raises(RuntimeError, match="nbytes must have dtype"):
        R._C.input_rounds(*good[:4], z, *good[5:])
