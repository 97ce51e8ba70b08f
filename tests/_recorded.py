"""Recorded batches: executed outputs of every planner's plan, kept to prove that a change of the plan IR
changes nothing an executor computes.

``tests/data/recorded_outputs.npz`` was written by ``python tests/_recorded.py`` with the object IR
(per-device instruction lists, commit 7aac190), before the columnar IR replaced it; ``test_recorded``
re-plans the same batches with today's code, runs the reference executor on the same fp64 inputs and
compares. Outputs are stored as sketches: ``SKETCH`` fixed Gaussian projections of every output tensor
(o, lse, dq, dk, dv) plus its sum and largest magnitude, so a difference in any element shows (with
probability 1) at a few kilobytes per run instead of the whole tensors.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

RECORDED = Path(__file__).resolve().parent / "data" / "recorded_outputs.npz"
SKETCH = 24
PLANNERS = ("dcp", "ring", "zigzag", "te_a2a_p2p", "loongtrain", "megatron_dyncp")


def batches():
    """(name, spec, cluster) of every recorded batch."""
    import dcp
    from dcp.masks import CausalBlockwiseMask, CausalMask, DocumentMask, LambdaMask, SharedQuestionMask

    return [
        ("causal_3seq", dcp.BatchSpec([300, 120, 57], CausalMask(), 4, 2, 8, "float64"), dcp.Cluster(2, 2)),
        ("lambda_2seq", dcp.BatchSpec([200, 181], LambdaMask(sink=4, window=40), 4, 2, 8, "float64"),
         dcp.Cluster(1, 4)),
        ("mixed_4seq", dcp.BatchSpec([150, 96, 64, 33], [SharedQuestionMask(0.3, 3), CausalBlockwiseMask(8, 1),
                                                         DocumentMask((20, 30, 14), CausalMask()), CausalMask()],
                                     8, 2, 8, "float64"), dcp.Cluster(2, 4)),
    ]


def make_planner(name: str):
    from dcp.baselines import BASELINES
    from dcp.config import PlannerConfig
    from dcp.partition import GreedyPartitioner
    from dcp.planner import DCPPlanner

    if name == "dcp":
        return DCPPlanner(PlannerConfig(block_size=16, partitioner=GreedyPartitioner(), time_budget_s=None))
    return BASELINES[name]()


def _inputs(spec, seed: int):
    g = torch.Generator().manual_seed(seed)
    t, hq, hkv, d = spec.total_tokens, spec.num_heads, spec.num_kv_heads, spec.head_dim
    return [torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def executed_outputs(plan, seed: int = 0) -> dict[str, np.ndarray]:
    """o, lse, dq, dk, dv of the reference executor on fp64 inputs drawn from ``seed``."""
    from dcp.execute import ReferenceExecutor

    ex = ReferenceExecutor(kernels="auto")
    q, k, v, do = _inputs(plan.spec, seed)
    o, lse = ex.run_forward(plan, q, k, v)
    dq, dk, dv = ex.run_backward(plan, q, k, v, o, lse, do)
    return {n: t.detach().to(torch.float64).numpy() for n, t in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, dq, dk, dv))}


def sketch(x: np.ndarray) -> np.ndarray:
    """float64 ``[SKETCH + 2]``: fixed Gaussian projections of ``x``'s elements, their sum and max |x|."""
    flat = np.asarray(x, dtype=np.float64).ravel()
    proj = np.random.default_rng(flat.size).standard_normal((SKETCH, flat.size))
    return np.concatenate([proj @ flat, [flat.sum(), np.abs(flat).max(initial=0.0)]])


def record(path: Path = RECORDED) -> None:
    out = {}
    torch.set_num_threads(1)
    for name, spec, cluster in batches():
        for planner in PLANNERS:
            plan = make_planner(planner).plan(spec, cluster)
            for key, x in executed_outputs(plan).items():
                out[f"{name}/{planner}/{key}"] = sketch(x)
            print(name, planner, plan.tiles.n_tiles, "tiles")
    path.parent.mkdir(exist_ok=True)
    np.savez_compressed(path, **out)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    record()
