"""The best tuned baseline of a batch: every static planner at every point of its tuning grid.

A reviewer's first question of a speedup is whether the opponents were tuned. Here each static planner's
``tuning_grid(spec, cluster)`` (its knobs, stated in its docstring: Megatron's ``max_seqlen_per_rank`` and
scheduler version, TE's and LoongTrain's head-parallel degrees and rings, Magi's ``chunk_size`` x
``degree``, torch CP's balancers) is tried per batch, and the fastest point by simulated forward +
backward time is that planner's tuned result; the fastest tuned planner is the batch's *best tuned
baseline* — an oracle tuning no real user gets for free (they would have to run every configuration).

To stay affordable, every grid point's placement and own schedule (``static_parts``) is scored by the
makespan estimate dcp's search uses (``dcp.cost.estimate``) and only the ``simulate_top`` best points of
each planner, plus its default configuration, are simulated with the discrete-event simulator; the
reported times are always simulated. A point the planner cannot serve (``InvalidConfigError``, e.g.
Ulysses with more devices than heads) is skipped and counted.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from dcp.cluster import Cluster
from dcp.errors import DcpError
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static
from dcp.spec import BatchSpec


def label(planner: Planner) -> str:
    """``name(knob=value, ...)`` with the knobs that are set (``shards`` and None values left out)."""
    knobs = {k: v for k, v in planner.knobs().items() if v is not None and k != "shards"}
    return planner.name + ("(" + ", ".join(f"{k}={v}" for k, v in knobs.items()) + ")" if knobs else "")


@dataclass(frozen=True, eq=False)
class Tuned:
    """One planner's (or the best of all planners') tuned result for one batch and profile."""

    planner: Planner
    label: str
    plan: Plan
    fwd: object  # dcp.sim.SimResult
    bwd: object
    points: int  # grid points planned (static parts built)
    simulated: int  # grid points simulated
    skipped: tuple[str, ...] = field(default=())

    extra_s: float = 0.0  # the score's time besides attention (``tune``'s ``extra_s``)

    @property
    def total_s(self) -> float:
        return self.fwd.makespan_s + self.bwd.makespan_s + self.extra_s


def _estimate_s(spec: BatchSpec, cluster: Cluster, parts: StaticParts, cost, extra_s=None) -> float:
    """Estimated forward + backward makespan of a static plan's own schedule (inf for grouped layouts, whose
    pieces the estimate does not model: they are always simulated)."""
    from dcp.cost.estimate import estimate_device_ends_s
    from dcp.schedule.stages import Schedule

    if parts.layout.grouped:
        return float("inf")
    total = extra_s(parts.layout, parts.home) if extra_s is not None else 0.0
    for direction in ("forward", "backward"):
        sched = Schedule(direction, parts.tile_stage, parts.routes)
        total += float(estimate_device_ends_s(spec, cluster, parts.layout, parts.tiles, parts.home,
                                              parts.tile_device, sched, cost).max(initial=0.0))
    return total


def tune(spec: BatchSpec, cluster: Cluster, planners: Sequence[Planner], costs: Mapping[str, object],
         simulate_top: int = 2, defaults: Mapping[str, tuple] | None = None,
         extra_s=None) -> dict[str, dict[str, Tuned]]:
    """``{profile: {planner name: Tuned}}`` for every planner in ``planners`` (its own configuration is the
    default point, always simulated) over its tuning grid, and ``"best_tuned"``: the fastest of them.
    ``costs``: ``{profile: CostModel}``; ``defaults``: ``{name: (plan, {profile: (fwd, bwd)})}`` of default
    points planned and simulated already (not redone); ``extra_s(layout, home) -> seconds``: time a plan
    costs besides attention (e.g. the linear layers of the device with the most tokens), added to the score
    that picks the best point. Planners that serve no point are left out."""
    from dcp.sim import simulate_both

    out: dict[str, dict[str, Tuned]] = {p: {} for p in costs}
    for base in planners:
        grid = list(dict.fromkeys([base, *base.tuning_grid(spec, cluster)]))
        parts, plans, skipped = {}, {}, []
        sims: dict[tuple[int, str], tuple] = {}
        known = (defaults or {}).get(base.name)
        if known is not None:
            plans[0] = known[0]
            sims.update({(0, profile): pair for profile, pair in known[1].items()})
        for i, point in enumerate(grid):
            started = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    parts[i] = (point.static_parts(spec, cluster), started)
            except (DcpError, ValueError) as err:
                skipped.append(f"{label(point)}: {err}")
        if not parts:
            continue
        for profile, cost in costs.items():
            est = {i: _estimate_s(spec, cluster, p, cost, extra_s) for i, (p, _) in parts.items()}
            ranked = sorted(est, key=lambda i: (est[i], i))
            chosen = sorted(set(ranked[:simulate_top]) | ({0} if 0 in parts else set()))
            for i in chosen:
                if (i, profile) in sims:
                    continue
                if i not in plans:
                    p, started = parts[i]
                    plans[i] = assemble_static(spec, cluster, p, base.name, started)
                    plans[i].meta.update(knobs=label(grid[i]))
                sims[(i, profile)] = simulate_both(plans[i], cost, record_events=False)
            plus = (lambda i: extra_s(plans[i].layout, plans[i].home)) if extra_s is not None else (lambda i: 0.0)
            best = min(chosen, key=lambda i: (sum(r.makespan_s for r in sims[(i, profile)]) + plus(i), i))
            fwd, bwd = sims[(best, profile)]
            out[profile][base.name] = Tuned(grid[best], label(grid[best]), plans[best], fwd, bwd, len(parts),
                                            len(chosen), tuple(skipped), plus(best))
    for profile, results in out.items():
        if results:
            winner = min(results.values(), key=lambda t: t.total_s)
            results["best_tuned"] = winner
    return out


def tuned_row(cell: dict, results: Mapping[str, Tuned], common: dict) -> dict:
    """The ``best_tuned`` CSV row of one batch and profile: the winner's times and plan statistics, its
    label in ``chosen``, and every planner's tuned result in ``candidates``."""
    from dcp.bench.common import sim_fields, stat_fields

    best = results["best_tuned"]
    each = "; ".join(f"{t.label}: {t.fwd.makespan_s * 1e3:.4f}+{t.bwd.makespan_s * 1e3:.4f} ms "
                     f"({t.simulated}/{t.points} simulated)" for name, t in results.items() if name != "best_tuned")
    planning = sum(t.plan.planning_time_s for name, t in results.items() if name != "best_tuned")
    return dict(cell, planner="best_tuned", chosen=best.label, block_size="", planning_time_s=round(planning, 4),
                **sim_fields(best.fwd, best.bwd), **stat_fields(best.plan), candidates=each, warnings=0, **common)


__all__ = ["Tuned", "tune", "tuned_row", "label"]
