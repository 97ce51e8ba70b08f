"""``dcp.bench.tuned``: every baseline over its tuning grid, the best tuned baseline of a batch."""
import numpy as np

import dcp
from dcp.baselines import BASELINES, MegatronDynCPPlanner, UlyssesPlanner
from dcp.bench.tuned import label, tune
from dcp.cost import CostModel
from dcp.masks import CausalMask
from dcp.sim import simulate_both

COSTS = {"a100": CostModel.named("a100"), "h100": CostModel.named("h100")}


def _spec():
    return dcp.BatchSpec([3000, 1800, 700, 350, 90], CausalMask(), 8, 2, 64)


def test_best_tuned_is_never_slower_than_any_default():
    spec, cluster = _spec(), dcp.Cluster(2, 4)
    planners = [cls() for cls in BASELINES.values()]
    got = tune(spec, cluster, planners, COSTS, simulate_top=1)
    for profile, cost in COSTS.items():
        results = got[profile]
        assert "best_tuned" in results and "ulysses" in results  # 8 heads over 8 devices
        best = results["best_tuned"].total_s
        for name, t in results.items():
            assert best <= t.total_s + 1e-12
            if name == "best_tuned":
                continue
            f, b = simulate_both(BASELINES[name]().plan(spec, cluster), cost, record_events=False)
            assert t.total_s <= f.makespan_s + b.makespan_s + 1e-12  # the default point is always in
            assert t.label.startswith(name) and 1 <= t.simulated <= t.points


def test_inapplicable_points_are_skipped_and_named():
    spec = dcp.BatchSpec([300, 200], CausalMask(), 4, 2, 16)  # 4 heads over 8 devices: no Ulysses
    got = tune(spec, dcp.Cluster(2, 4), [UlyssesPlanner(), MegatronDynCPPlanner()], {"a100": COSTS["a100"]})
    assert set(got["a100"]) == {"megatron_dyncp", "best_tuned"}


def test_extra_time_decides_between_points():
    """A penalty on resident tokens (the e2e model's linear layers) moves the choice to a point that
    holds fewer tokens on its fullest device."""
    spec, cluster = _spec(), dcp.Cluster(1, 4)

    def heavy(layout, home):  # 1 s per token on the fullest device: memory balance is all that counts
        return float(np.bincount(home, weights=layout.tb_len, minlength=4).max())

    plain = tune(spec, cluster, [MegatronDynCPPlanner()], {"a100": COSTS["a100"]})["a100"]["megatron_dyncp"]
    weighted = tune(spec, cluster, [MegatronDynCPPlanner()], {"a100": COSTS["a100"]}, simulate_top=20,
                    extra_s=heavy)["a100"]["megatron_dyncp"]
    tokens = lambda t: np.bincount(t.plan.home, weights=t.plan.layout.tb_len, minlength=4).max()  # noqa: E731
    assert tokens(weighted) <= tokens(plain)
    assert weighted.extra_s == tokens(weighted) and weighted.total_s > weighted.fwd.makespan_s


def test_label_shows_set_knobs():
    assert label(MegatronDynCPPlanner(1536, "2026.01")) == "megatron_dyncp(max_seqlen_per_rank=1536, version=2026.01)"
    assert label(BASELINES["ring"]()) == "ring"
