"""The simulator's C++ event loop (``dcp._C.simulate_streams``, csrc/sim.cpp) against its Python reference
(``dcp.sim.streams.Streams.run`` with ``dcp.sim.flows.ComponentNetwork``): every baseline and dcp's planner,
several masks, clusters, cost profiles and NIC models, both directions, field by field (the port mirrors
the Python operations, so the times agree to the last bit in practice; the tests allow 1e-9 relative)."""
import numpy as np
import pytest

import dcp
from dcp import _C
from dcp.baselines import BASELINES
from dcp.cost import CostModel
from dcp.cost.estimate import stage_compute_s
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask
from dcp.partition import GreedyPartitioner
from dcp.sim import flows as sim_flows
from dcp.sim import max_min_rates, simulate
from dcp.sim.flows import _max_min_small
from dcp.sim.simulator import _delta_s, _flow_table
from dcp.sim.streams import Streams

pytestmark = pytest.mark.skipif(not hasattr(_C, "simulate_streams"), reason="dcp._C lacks simulate_streams")

PLANNERS = {name: cls() for name, cls in BASELINES.items()}
PLANNERS.update({f"{name}_shards": BASELINES[name](shards=True)
                 for name in ("ring", "zigzag", "te_a2a_p2p", "loongtrain")})
PLANNERS["dcp"] = dcp.DCPPlanner(dcp.PlannerConfig(block_size=8, partitioner=GreedyPartitioner(),
                                                   time_budget_s=None))
MASKS = [CausalMask(), LambdaMask(sink=3, window=9), SharedQuestionMask(0.3, 3)]
# (profile, nic): GPU profiles, a NIC split per GPU pair (nics_per_node), a host profile with per-program
# and per-round overheads, and the forced NIC models
PROFILES = [("a100", None), ("h100", None), ("a100_paper", None), ("cpu_amd_epyc_2c", None), ("h100", "rail"),
            ("a100_paper", "node")]
FIELDS = ("end_s", "compute_s", "reduce_s", "wait_s", "comm_bytes")


def _streams(plan, cost, direction, nic, native) -> Streams:
    """The simulator's streams of one direction (as ``simulate`` builds them), run."""
    n_dev = plan.n_devices
    prog = plan.columns(direction)
    comp = stage_compute_s(plan.layout, plan.tiles, np.asarray(plan.tile_device), prog.tile_stage, cost,
                           direction, n_dev)
    t0 = _delta_s(plan, cost) if direction == "backward" else np.zeros(n_dev)
    st = Streams(plan, prog, _flow_table(plan, direction, True), comp, t0, cost, nic, False, native)
    st.run(direction)
    return st


def _close(a, b) -> bool:
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=1e-15, equal_nan=True))


def _compare(plan, cost, nic, label):
    for direction in ("forward", "backward"):
        py = simulate(plan, cost, direction, nic=nic, record_events=False, native=False)
        nat = simulate(plan, cost, direction, nic=nic, record_events=False, native=True)
        where = f"{label} {direction}"
        assert nat.makespan_s == pytest.approx(py.makespan_s, rel=1e-9, abs=1e-15), where
        for k in FIELDS:
            assert _close(getattr(nat, k), getattr(py, k)), f"{where}: {k}"
        assert (nat.n_flows, nat.n_transfers) == (py.n_flows, py.n_transfers)
        s_py, s_nat = _streams(plan, cost, direction, nic, False), _streams(plan, cost, direction, nic, True)
        assert s_nat.native and not s_py.native
        assert _close(s_nat.f_start, s_py.f_start), f"{where}: flow starts"
        assert _close(s_nat.f_end, s_py.f_end), f"{where}: flow ends"


@pytest.fixture(scope="module")
def large_fills():
    """Counts the Python path's large-component fills (``max_min_rates``) over the module."""
    calls = [0]
    orig = sim_flows.max_min_rates

    def counting(*args):
        calls[0] += 1
        return orig(*args)

    sim_flows.max_min_rates = counting
    yield calls
    sim_flows.max_min_rates = orig


@pytest.mark.parametrize("cluster", [(1, 4), (2, 2), (2, 4), (4, 8)], ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_native_matches_python(name, cluster, large_fills):
    lens = [37, 5, 21, 2] if cluster[0] * cluster[1] <= 8 else [301, 45, 170, 96, 12]
    for mask in MASKS:
        spec = dcp.BatchSpec(lens, mask, 4, 2, 8, dtype="float64")
        try:
            plan = PLANNERS[name].plan(spec, dcp.Cluster(*cluster))
        except dcp.InvalidConfigError as err:  # Ulysses: 4 heads over more devices than that
            assert name == "ulysses", err
            pytest.skip(str(err))
        for prof, nic in PROFILES:
            _compare(plan, CostModel.named(prof), nic, f"{name} {cluster} {mask.name} {prof}/{nic}")


def test_large_components_were_exercised(large_fills):
    """The comparisons above include components beyond the small-fill size (the numpy/C++ large fill)."""
    if large_fills[0] == 0:  # run alone: make one
        plan = PLANNERS["loongtrain"].plan(dcp.BatchSpec([301, 45, 170, 96, 12], CausalMask(), 4, 2, 8),
                                           dcp.Cluster(4, 8))
        _compare(plan, CostModel.named("a100_paper"), None, "loongtrain 4x8")
    assert large_fills[0] > 0


def test_default_uses_native_unless_recording():
    plan = PLANNERS["ring"].plan(dcp.BatchSpec([37, 5, 21, 2], CausalMask(), 4, 2, 8), dcp.Cluster(2, 2))
    cost = CostModel.named("h100")
    fast = simulate(plan, cost, "backward", record_events=False)
    slow = simulate(plan, cost, "backward", record_events=True, native=True)  # events: the Python loop
    assert fast.events == () and slow.events
    assert fast.makespan_s == slow.makespan_s
    for k in FIELDS:
        np.testing.assert_array_equal(getattr(fast, k), getattr(slow, k))


@pytest.mark.parametrize("native", [False, True])
def test_stuck_simulation_names_blocked_devices(native):
    plan = PLANNERS["ring"].plan(dcp.BatchSpec([37, 5, 21, 2], CausalMask(), 4, 2, 8), dcp.Cluster(1, 4))
    cost = CostModel.named("h100")
    prog = plan.columns("forward")
    comp = stage_compute_s(plan.layout, plan.tiles, np.asarray(plan.tile_device), prog.tile_stage, cost,
                           "forward", plan.n_devices)
    st = Streams(plan, prog, _flow_table(plan, "forward", True), comp, np.zeros(plan.n_devices), cost, None,
                 False, native)
    k = int(np.flatnonzero(np.asarray(st._tables["pending"] if native else st.pending) > 0)[0])
    if native:  # a flow endpoint nobody ever delivers
        st._tables["pending"] = st._tables["pending"].copy()
        st._tables["pending"][k] += 1
    else:
        st.pending[k] += 1
    with pytest.raises(ValueError, match=r"forward: simulation cannot finish; devices blocked \(device, round\): "
                                         r"\[\(0, 1\)\]"):
        st.run("forward")


def test_native_tables_are_checked():
    with pytest.raises(RuntimeError, match="dcp._C.simulate_streams: f_bytes must have dtype Double"):
        import torch
        z = torch.zeros(0, dtype=torch.long)
        _C.simulate_streams(torch.zeros(2, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                            torch.zeros(2, dtype=torch.long), z, torch.zeros(1, dtype=torch.long),
                            torch.zeros(1, dtype=torch.double), torch.zeros(1, dtype=torch.double),
                            torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 4, dtype=torch.long),
                            torch.zeros(0, dtype=torch.long), torch.ones(2, dtype=torch.double),
                            torch.zeros(1, dtype=torch.double), torch.zeros(1, dtype=torch.double),
                            torch.zeros(1, 4, dtype=torch.double), torch.zeros(1, dtype=torch.double), 0.0, 0.0)


def test_native_is_bitwise_on_a_busy_network(monkeypatch):
    """Magi's plan of 4 sequences over 4x8 GPUs: thousands of flows whose large components are refreshed
    again and again, so the C++ loop drops stale heap entries (``Sim::compact``) and heaps a refresh's
    entries in bulk many times. Its live entries must still pop in the reference's order: every flow starts
    and ends at exactly the Python loop's times, not merely within 1e-9."""
    plan = BASELINES["magi"]().plan(dcp.BatchSpec([4096, 1024, 2048, 512], CausalMask(), 8, 2, 8, dtype="float64"),
                                    dcp.Cluster(4, 8))
    cost = CostModel.named("h100")
    pushes = [0]
    orig = sim_flows.ComponentNetwork._set_rate

    def counting(self, f, r, t):
        pushes[0] += 1
        return orig(self, f, r, t)

    monkeypatch.setattr(sim_flows.ComponentNetwork, "_set_rate", counting)
    for direction in ("forward", "backward"):
        py, nat = (_streams(plan, cost, direction, None, native) for native in (False, True))
        np.testing.assert_array_equal(nat.f_start, np.asarray(py.f_start, dtype=float))
        np.testing.assert_array_equal(nat.f_end, np.asarray(py.f_end, dtype=float))
        np.testing.assert_array_equal(nat.clock, np.asarray(py.clock, dtype=float))
        assert nat.n_rate_updates == py.net.n_rate_updates
    assert pushes[0] > 20_000  # far past the 1,024 entries at which the C++ heap first compacts


# ----------------------------------------------------------------------------------------- the fill alone

@pytest.mark.parametrize("seed", range(40))
def test_native_fill_matches_python(seed):
    import torch

    rng = np.random.default_rng(seed)
    n_res = int(rng.integers(2, 12))
    cap = rng.choice([1.0, 2.5, 3.0, 10.0, 7.25, np.inf], size=n_res, p=[.2, .2, .2, .2, .15, .05])
    if seed % 3 == 0:  # many equal capacities: ties between levels
        cap = np.where(np.isinf(cap), cap, 4.0)
    n = int(rng.integers(1, 60))
    width = int(rng.integers(1, 5))
    lens = rng.integers(1, width + 1, size=n)
    res = np.full((n, width), -1, dtype=np.int64)
    for i, k in enumerate(lens):
        res[i, :k] = rng.integers(0, n_res, size=k)  # repeats allowed: they count per occurrence
    rows = [tuple(int(x) for x in r[r >= 0]) for r in res]
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt))  # noqa: E731
    small = np.asarray(_max_min_small(rows, cap.tolist()))
    got = _C.max_min_fill(t(res, np.int64), t(cap, np.float64), True).numpy()
    np.testing.assert_array_equal(got, small)
    padded = np.where(res >= 0, res, n_res)
    large = max_min_rates(padded, np.append(cap, np.inf))
    got = _C.max_min_fill(t(res, np.int64), t(cap, np.float64), False).numpy()
    np.testing.assert_array_equal(got, large)
