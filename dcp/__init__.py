"""dcp: dynamic context parallelism for long-context training.

Plan a batch: ``dcp.plan(dcp.BatchSpec(...), dcp.Cluster(...), dcp.PlannerConfig(...)) -> dcp.Plan``;
check it with ``dcp.validate(plan)``; ship it with ``plan.to_bytes()`` / ``dcp.Plan.from_bytes()``.
Run it with ``dcp.attention(q_local, k_local, v_local, plan)`` (see ``dcp.execute``) on every rank, with
the same plan (``dcp.broadcast_plan`` ships one rank's plan to the others; the executor checks that the
ranks agree before any transfer).
"""
from dcp.cluster import Cluster
from dcp.config import PlannerConfig, SearchConfig
from dcp.errors import (DcpError, ExecutionError, InvalidBatchError, InvalidClusterError, InvalidConfigError,
                        InvalidMaskError, MemoryBudgetError, PartitionerError, PlanMismatchError, PlanValidationError,
                        SerializationError, TooFewBlocksError)
from dcp.partition import GreedyPartitioner, KaHyParPartitioner, MtKaHyParPartitioner
from dcp.plan import Plan
from dcp.planner import DCPPlanner, Planner, plan
from dcp.spec import BatchSpec
from dcp.validate import validate

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
}


def __getattr__(name):
    # executors import torch; keep ``import dcp`` light for planner-only processes
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'dcp' has no attribute {name!r}")


__all__ = ["BatchSpec", "Cluster", "PlannerConfig", "SearchConfig", "Plan", "Planner", "DCPPlanner", "plan", "validate",
           "GreedyPartitioner", "KaHyParPartitioner", "MtKaHyParPartitioner", "DcpError", "ExecutionError",
           "InvalidBatchError", "InvalidClusterError", "InvalidConfigError", "InvalidMaskError",
           "MemoryBudgetError", "PartitionerError", "PlanMismatchError", "PlanValidationError", "SerializationError", "TooFewBlocksError",
           *_LAZY]
