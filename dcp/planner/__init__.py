"""Stage 2, dcp's planner: ``BatchSpec`` + ``Cluster`` + ``PlannerConfig`` → a validated ``Plan``.

- ``dcp_planner``: ``DCPPlanner`` and ``plan`` — candidate placements, each scheduled (``dcp.schedule``)
  and scored by the estimated makespan (``dcp.cost.estimate``), under the memory budget;
- ``pack``: packings of whole or split sequences onto devices; ``assign``: the two-level hypergraph
  partition (``dcp.partition`` is its backend); ``refine``: local moves on a chosen packing;
- ``warm``: the static baselines' placements as starting points; ``budget``: the memory budget;
  ``candidates``: a candidate's evaluation; ``search``: ``AutoPlanner``, dcp against the baselines by simulation.
"""
from dcp.planner.dcp_planner import DCPPlanner, plan
from dcp.planner.search import AutoPlanner
from dcp.schedule.assemble import Planner

__all__ = ["DCPPlanner", "plan", "Planner", "AutoPlanner"]
