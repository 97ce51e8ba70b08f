"""Static context-parallel baselines as typed planners emitting plans in dcp's IR.

``RingPlanner`` ("ring"), ``ZigzagPlanner`` ("zigzag"), ``TEA2AP2PPlanner`` ("te_a2a_p2p", Transformer
Engine's hierarchical all-to-all + p2p), ``MegatronDynCPPlanner`` ("megatron_dyncp", Megatron-Core's
dynamic CP groups) and ``LoongTrainPlanner`` ("loongtrain", 2-D head x context parallelism with a double
ring). ``BASELINES`` maps names to classes; every class builds with defaults: ``BASELINES[name]()``.
"""
from dcp.baselines.loongtrain import LoongTrainPlanner
from dcp.baselines.megatron_dyncp import MegatronDynCPPlanner
from dcp.baselines.ring import RingPlanner
from dcp.baselines.te_a2a_p2p import TEA2AP2PPlanner
from dcp.baselines.zigzag import ZigzagPlanner

BASELINES: dict[str, type] = {
    cls.name: cls for cls in (RingPlanner, ZigzagPlanner, TEA2AP2PPlanner, MegatronDynCPPlanner, LoongTrainPlanner)
}

__all__ = ["BASELINES", "LoongTrainPlanner", "MegatronDynCPPlanner", "RingPlanner", "TEA2AP2PPlanner",
           "ZigzagPlanner"]
