"""dcp: dynamic context parallelism for long-context training.

Plan a batch: ``dcp.plan(dcp.BatchSpec(...), dcp.Cluster(...), dcp.PlannerConfig(...)) -> dcp.Plan``;
check it with ``dcp.validate(plan)``; ship it with ``plan.to_bytes()`` / ``dcp.Plan.from_bytes()``.
Run it with ``dcp.attention(q_local, k_local, v_local, plan)`` (see ``dcp.execute``) on every rank, with
the same plan (``dcp.broadcast_plan`` ships one rank's plan to the others; the executor checks that the
ranks agree before any transfer). A model whose layers differ (sliding-window and full layers) plans a
layered batch (``BatchSpec(..., masks={"full": ..., "sliding": ...}, layers={...})``) into a
``dcp.LayeredPlan``: one placement, one plan per layer kind (``dcp.attention(..., kind="sliding")``).

One folder per pipeline stage, each standing only on those before it: the inputs (``spec``, ``cluster``,
``config``, ``masks``, ``data``) → ``layout`` (blocks, tiles) → ``planner`` (placement; ``partition`` its
hypergraph backend) → ``schedule`` (stages, rounds, programs) → ``ir`` (the plan value) → ``execute``;
``cost`` and ``sim`` model a plan's time, ``baselines`` are the static planners.
"""
from dcp.cluster import Cluster
from dcp.config import PlannerConfig, SearchConfig
from dcp.errors import (DcpError, ExecutionError, InvalidBatchError, InvalidClusterError, InvalidConfigError,
                        InvalidMaskError, InvalidPlanError, MemoryBudgetError, PartitionerError, PlanMismatchError,
                        PlanValidationError, SerializationError, TooFewBlocksError)
from dcp.ir.layered import LayeredPlan
from dcp.ir.plan import Plan
from dcp.ir.validate import validate
from dcp.partition import GreedyPartitioner, KaHyParPartitioner, MtKaHyParPartitioner
from dcp.planner.dcp_planner import DCPPlanner, plan
from dcp.schedule.assemble import Planner
from dcp.spec import BatchSpec

__version__ = "0.1.0"

_LAZY = {
    "attention": ("dcp.execute", "attention"),
    "dispatch": ("dcp.execute", "dispatch"),
    "undispatch": ("dcp.execute", "undispatch"),
    "reference_attention": ("dcp.execute", "reference_attention"),
    "broadcast_plan": ("dcp.integration.broadcast", "broadcast_plan"),
    "ReferenceExecutor": ("dcp.execute", "ReferenceExecutor"),
    "DCPLoader": ("dcp.integration", "DCPLoader"),
    "DCPAttention": ("dcp.integration", "DCPAttention"),
    "SampleRejectedError": ("dcp.integration", "SampleRejectedError"),
    "varlen_attention": ("dcp.integration.varlen", "varlen_attention"),
    "varlen_plan": ("dcp.integration.varlen", "varlen_plan"),
}


#: subpackages reachable as ``dcp.<name>`` after a plain ``import dcp``
_SUBPACKAGES = ("masks", "data", "layout", "ir", "schedule", "cost", "sim", "partition", "baselines", "planner",
                "kernels", "execute", "integration", "bench")


def __getattr__(name):
    # executors import torch; keep ``import dcp`` light for planner-only processes
    import importlib

    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"dcp.{name}")
    raise AttributeError(f"module 'dcp' has no attribute {name!r}")


__all__ = ["BatchSpec", "Cluster", "PlannerConfig", "SearchConfig", "Plan", "LayeredPlan", "Planner", "DCPPlanner", "plan", "validate",
           "GreedyPartitioner", "KaHyParPartitioner", "MtKaHyParPartitioner", "DcpError", "ExecutionError",
           "InvalidBatchError", "InvalidClusterError", "InvalidConfigError", "InvalidMaskError",
           "InvalidPlanError", "MemoryBudgetError", "PartitionerError", "PlanMismatchError", "PlanValidationError", "SerializationError", "TooFewBlocksError",
           *_LAZY]
