"""The static baselines' plans run through the same executor as dcp's and give dense attention's
outputs and gradients: the proof that every comparison between them is fair."""
import numpy as np
import pytest
import torch

import dcp
from dcp.baselines import BASELINES
from dcp.execute import ReferenceExecutor, reference_attention
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask
from dcp.partition import GreedyPartitioner

EXECUTOR = ReferenceExecutor(kernels="auto")
PLANNERS = {name: cls() for name, cls in BASELINES.items()}
# grouped plans (each device's chunks of every sequence as one token block, dcp.pieces) run expanded
PLANNERS.update({f"{name}_shards": BASELINES[name](shards=True)
                 for name in ("ring", "zigzag", "te_a2a_p2p", "loongtrain")})
PLANNERS["dcp"] = dcp.DCPPlanner(dcp.PlannerConfig(block_size=8, partitioner=GreedyPartitioner(),
                                                   time_budget_s=None))


@pytest.mark.parametrize("cluster", [(1, 3), (2, 2)], ids=lambda c: f"{c[0]}x{c[1]}")
@pytest.mark.parametrize("mask", [CausalMask(), LambdaMask(sink=3, window=9), SharedQuestionMask(0.3, 3)],
                         ids=lambda m: m.name)
@pytest.mark.parametrize("name", sorted(PLANNERS))
def test_every_planner_computes_the_same_attention(name, mask, cluster):
    torch.set_num_threads(1)
    spec = dcp.BatchSpec([37, 5, 21, 2], mask, 4, 2, 8, dtype="float64")
    try:
        plan = PLANNERS[name].plan(spec, dcp.Cluster(*cluster))
    except dcp.InvalidConfigError as err:  # Ulysses: 4 heads over 3 devices; covered by its own tests
        assert name == "ulysses", err
        pytest.skip(f"{name} cannot serve this cluster: {err}")
    g = torch.Generator().manual_seed(7)
    t = spec.total_tokens
    q = torch.randn(t, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(t, 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(t, 2, 8, generator=g, dtype=torch.float64)
    do = torch.randn(t, 4, 8, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = reference_attention(*leaves, spec)
    grads_ref = torch.autograd.grad(o_ref, leaves, do)
    o, lse = EXECUTOR.run_forward(plan, q, k, v)
    grads = EXECUTOR.run_backward(plan, q, k, v, o, lse, do)
    assert float((o - o_ref.detach()).abs().max()) < 1e-10
    for got, want in zip(grads, grads_ref):
        assert float((got - want).abs().max()) < 1e-10
    assert np.isfinite(plan.stats().comm_bytes_total)
