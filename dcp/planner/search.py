"""Choosing among plans with the cost model: ``AutoPlanner``.

``dcp.plan`` already chooses among its own candidate placements by estimated time (``SearchConfig``).
``AutoPlanner`` is the outer check the benchmarks report as ``dcp_auto``: it plans dcp at one or more
block sizes and, optionally, runs static planners too, simulates each candidate's forward and backward
with the discrete-event simulator (``dcp.sim``), and keeps the fastest — so a reader can see how rarely
running a static plan instead of dcp's own would help. Every candidate's simulated time is recorded in
``plan.meta["candidates"]``.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import DcpError
from dcp.ir.plan import Plan
from dcp.planner.dcp_planner import DCPPlanner
from dcp.schedule.assemble import Planner, check_inputs
from dcp.spec import BatchSpec


@dataclasses.dataclass(frozen=True)
class AutoPlanner(Planner):
    """Plan with every candidate, keep the one with the least simulated iteration time.

    Args:
        config: dcp's configuration (its cost model also scores the candidates).
        block_sizes: dcp candidates, one per block size (None: the config's).
        baselines: static planners to compete with, e.g. ``(ZigzagPlanner(), MegatronDynCPPlanner())``.
    """

    config: PlannerConfig = dataclasses.field(default_factory=PlannerConfig)
    block_sizes: tuple[int, ...] | None = None
    baselines: tuple[Planner, ...] = ()
    name = "dcp_auto"

    def candidates(self) -> list[tuple[str, Planner]]:
        sizes = self.block_sizes or (self.config.block_size,)
        out = [(f"dcp@B{b}", DCPPlanner(dataclasses.replace(self.config, block_size=b))) for b in sizes]
        return out + [(p.name, p) for p in self.baselines]

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        from dcp.sim import simulate_both

        check_inputs(spec, cluster)  # one layer kind: the candidates are compared by one plan's simulated time
        started = time.perf_counter()
        scored = []
        for label, planner in self.candidates():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # a failing candidate is simply not chosen
                    plan = planner.plan(spec, cluster)
            except DcpError as err:
                scored.append((float("inf"), label, None, str(err)))
                continue
            fwd, bwd = simulate_both(plan, self.config.cost_model, record_events=False)
            scored.append((fwd.makespan_s + bwd.makespan_s, label, plan, (fwd.makespan_s, bwd.makespan_s)))
        best = min(scored, key=lambda c: c[0])
        if best[2] is None:
            raise DcpError("no candidate could plan this batch: " + "; ".join(f"{c[1]}: {c[3]}" for c in scored))
        meta = dict(best[2].meta)
        meta["chosen"] = best[1]
        meta["candidates"] = {c[1]: (None if c[2] is None else {"forward_s": c[3][0], "backward_s": c[3][1]})
                              for c in scored}
        meta["profile"] = self.config.cost_model.profile.name
        return dataclasses.replace(best[2], planner=f"{self.name}:{best[1]}", meta=meta,
                                   planning_time_s=time.perf_counter() - started)
