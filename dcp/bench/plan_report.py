"""What ``dcp plan`` says about a plan beyond its statistics: the simulated time (what dcp optimizes),
the speedup over the fastest baseline, why dcp's search chose what it chose, and a Chrome trace.

Times come from the discrete-event simulator (``dcp.sim``) under the cost-model profile, as in
``dcp demo``; the search's own numbers are estimates (``dcp.cost.estimate``) recorded in ``plan.meta``
by ``DCPPlanner`` (``search_*``, ``est_*_ms``) and by ``AutoPlanner`` (``chosen``, ``candidates``).
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Callable, Sequence, TextIO

from dcp.bench.args import plural
from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.cost import CostModel
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.report import STAT_COLUMNS, print_table, progress
from dcp.spec import BatchSpec

DCP_PLANNERS = ("dcp", "dcp_auto")


def simulate_fields(plan: Plan, cost: CostModel, trace: str | None = None) -> dict:
    """``sim_forward_ms``, ``sim_backward_ms``, ``sim_fwd_bwd_ms`` of one attention layer under ``cost``
    (and, with ``trace``, the two timelines written there as Chrome trace JSON)."""
    from dcp.sim import simulate_both, to_chrome_trace

    fwd, bwd = simulate_both(plan, cost, record_events=trace is not None)
    if trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        to_chrome_trace([fwd, bwd], trace, names=[f"{plan.planner} forward", f"{plan.planner} backward"])
    return dict(profile=cost.profile.name, sim_forward_ms=round(fwd.makespan_s * 1e3, 4),
                sim_backward_ms=round(bwd.makespan_s * 1e3, 4),
                sim_fwd_bwd_ms=round((fwd.makespan_s + bwd.makespan_s) * 1e3, 4))


def add_speedups(rows: list[dict]) -> None:
    """On dcp's rows: ``best_baseline`` (the fastest static planner by simulated forward + backward) and
    ``speedup_vs_best_baseline`` (its time over dcp's; > 1: dcp is faster)."""
    def ours(r) -> bool:
        return r["planner"].split("[")[0] in DCP_PLANNERS  # "dcp[sliding]": a layer kind's row

    bases = [r for r in rows if not ours(r) and "sim_fwd_bwd_ms" in r]
    if not bases:
        return
    best = min(bases, key=lambda r: r["sim_fwd_bwd_ms"])
    for r in rows:
        if ours(r) and r.get("sim_fwd_bwd_ms"):
            r["best_baseline"] = best["planner"]
            r["speedup_vs_best_baseline"] = round(best["sim_fwd_bwd_ms"] / r["sim_fwd_bwd_ms"], 4)


def search_fields(plan: Plan) -> dict | None:
    """What the planner recorded about its choice, as plain JSON (None for a static planner). For
    ``dcp_auto`` choosing a dcp plan, ``dcp`` holds that plan's own search."""
    meta = plan.meta
    dcp_search = None
    if "search_chosen" in meta:  # DCPPlanner (also inside AutoPlanner's meta when it kept a dcp plan)
        dcp_search = dict(objective=meta.get("search_objective"), chosen=meta["search_chosen"],
                          est_forward_ms=meta.get("est_forward_ms"), est_backward_ms=meta.get("est_backward_ms"),
                          token_budget=meta.get("token_budget"),
                          warm_starts=[w for w in str(meta.get("search_warm_starts", "")).split(",") if w],
                          skipped=[s for s in str(meta.get("search_skipped", "")).split("; ") if s],
                          candidates=json.loads(meta.get("search_candidates") or "{}"))
    if "chosen" in meta and isinstance(meta.get("candidates"), dict):  # AutoPlanner
        auto = dict(objective="simulated time", chosen=meta["chosen"],
                    candidates={k: None if v is None else {"sim_forward_ms": round(v["forward_s"] * 1e3, 4),
                                                           "sim_backward_ms": round(v["backward_s"] * 1e3, 4)}
                                for k, v in meta["candidates"].items()})
        return {**auto, "dcp": dcp_search} if dcp_search else auto
    return dcp_search


#: what the search's label suffixes mean (``dcp.planner.dcp_planner``)
SUFFIXES = (("/staged", "/staged: rescheduled at every stage count"),
            ("@B", "@B<n>: the packing rebuilt at block size n"),
            ("+refined", "+refined: whole sequences moved off the device estimated to finish last"))


def _ms(fwd, bwd) -> str:
    return f"{fwd:.2f} + {bwd:.2f} ms"


def explain(planner: str, search: dict | None) -> str | None:
    """One or two sentences: which candidate the search kept, by what numbers, and what came next."""
    if not search:
        return None
    cands = search["candidates"]
    if "token_budget" not in search:  # AutoPlanner: simulated times of its candidates
        scored = {k: v for k, v in cands.items() if v}
        others = sorted((v["sim_forward_ms"] + v["sim_backward_ms"], k) for k, v in scored.items()
                        if k != search["chosen"])
        failed = sorted(k for k, v in cands.items() if not v)
        mine = scored.get(search["chosen"])
        text = (f"{planner} kept {search['chosen']}, the fastest of {plural(len(cands), 'candidate')} by simulated "
                f"forward + backward" + (f" ({_ms(mine['sim_forward_ms'], mine['sim_backward_ms'])})" if mine else ""))
        if others:
            text += "; next: " + ", ".join(f"{k} {t:.2f} ms" for t, k in others[:3])
        text += f"; could not plan: {', '.join(failed)}" if failed else ""
        return text + (f". Inside it, {explain('dcp', search['dcp'])}" if search.get("dcp") else "")
    chosen, budget = search["chosen"], search.get("token_budget")
    by_time = search.get("objective") == "time"
    fits = {k: c for k, c in cands.items() if budget is None or c["max_tokens"] <= budget + 1e-9}
    over = sorted(set(cands) - set(fits))
    steps = [what for mark, what in SUFFIXES if mark in chosen]
    text = (f"{planner} chose {chosen}" + (f" ({'; '.join(steps)})" if steps else "") +
            f": estimated {_ms(search['est_forward_ms'], search['est_backward_ms'])} forward + backward "
            f"(dcp.cost.estimate), out of {plural(len(cands), 'candidate')}, {len(fits)} within the memory budget"
            + (f" of {budget:,.0f} resident tokens per device" if budget is not None else ""))
    if by_time:
        text += ("; the fastest few by estimate (SearchConfig.simulate_top) ran through the simulator and the "
                 "fastest simulated was kept")
        others = sorted((c["forward_ms"] + c["backward_ms"], k) for k, c in fits.items() if k != chosen)
        if others:
            text += "; next by estimate: " + ", ".join(
                f"{k} {_ms(fits[k]['forward_ms'], fits[k]['backward_ms'])}" for _, k in others[:3])
    else:
        text += ("; objective bytes (the paper's): the fewest bytes within the compute tolerance, and of those "
                 "within 3% of the fewest the better balanced")
        others = sorted((c["comm_bytes"], k) for k, c in fits.items() if k != chosen)
        if others:
            text += "; next by bytes: " + ", ".join(f"{k} {b / 1e9:.2f} GB" for b, k in others[:3])
    if over:
        more = f" and {len(over) - 3} more" if len(over) > 3 else ""
        text += f"; over the token budget: {', '.join(over[:3])}{more}"
    if search.get("skipped"):
        text += "; skipped: " + "; ".join(search["skipped"])
    return text


def batch_path(path: str, index: int, several: bool) -> str:
    """``plan.bin`` for one batch; ``plan.<index>.bin`` per batch when a command plans several."""
    if not several:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{index}{p.suffix}"))


def plan_rows(index: int, spec: BatchSpec, cluster: Cluster, config: PlannerConfig, names: Sequence[str], args,
              make_planner: Callable, several: bool, out: TextIO) -> list[dict]:
    """Plan one batch with every planner of ``names``; one row each (statistics, simulated times, the
    search's choice). The first planner's plan goes to ``args.output`` / ``args.trace`` when given."""
    rows: list[dict] = []
    files = out if not args.json else sys.stderr  # stdout stays JSON
    for name in names:
        label = (f"planning {plural(spec.num_seqs, 'sequence')} ({spec.total_tokens:,} tokens) for "
                 f"{plural(cluster.n_devices, 'device')} with {name}" +
                 (f" (partitioner time budget {config.time_budget_s:g} s)"
                  if name.startswith("dcp") and config.time_budget_s else ""))
        with progress(label), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                whole, kinds = _plan_kinds(make_planner(name, config), spec, cluster)
            except InvalidConfigError as err:
                if len(names) == 1:
                    raise
                print(f"{name}: not applicable to this batch and cluster ({err})", file=sys.stderr)
                continue
        for kind, plan in kinds.items():
            rows.append(_row(index, spec, config, name, kind, plan, [str(w.message) for w in caught], args,
                             several, not rows, files, whole))
    for kind in dict.fromkeys(r.get("layer_kind") for r in rows):
        add_speedups([r for r in rows if r.get("layer_kind") == kind])
    return rows


def _plan_kinds(planner, spec: BatchSpec, cluster: Cluster) -> tuple[object, dict]:
    """(what ``args.output`` gets, ``{layer kind or None: Plan}``): a layered batch planned by dcp gives its
    ``LayeredPlan`` and its kinds; a static planner plans each kind on its own (its kinds' homes may then
    differ, which no model could run: the report is for comparison)."""
    if not spec.layered:
        plan = planner.plan(spec, cluster)
        return plan, {None: plan}
    if getattr(planner, "name", "") == "dcp":
        plan = planner.plan(spec, cluster)
        return plan, {k: plan.kind(k) for k in spec.kinds}
    kinds = {k: planner.plan(spec.for_kind(k), cluster) for k in spec.kinds}
    return kinds[spec.kinds[0]], kinds


def _row(index: int, spec: BatchSpec, config: PlannerConfig, name: str, kind, plan: Plan, caught: list, args,
         several: bool, first: bool, files, whole) -> dict:
    """One plan's report row (a layer kind's plan: ``layer_kind``, ``layers``)."""
    stats = plan.stats()
    row = {"batch_index": index, **stats.to_dict()}
    if kind is not None:
        row.update(planner=f"{name}[{kind}]", layer_kind=kind, layers=spec.layers[spec.kinds.index(kind)])
    row.update(num_seqs=spec.num_seqs, total_tokens=spec.total_tokens, mask=plan.spec.masks[0].name,
               block_size=config.block_size if name == "dcp" else None,
               warnings=caught + list(stats.warnings), notes=list(plan.notes))
    trace = batch_path(args.trace, index, several) if args.trace and first else None
    with progress(f"simulating {row['planner']}'s plan"):
        row.update(simulate_fields(plan, config.cost_model, trace))
    search = search_fields(plan)
    if search is not None:
        row.update(search=search, why=explain(name, search))
    if trace:
        print(f"wrote {trace}: {row['planner']}'s simulated forward and backward as a Chrome trace (open it "
              f"in ui.perfetto.dev or chrome://tracing)", file=files)
    if args.output and first:
        path = batch_path(args.output, index, several)
        blob = whole.to_bytes()
        Path(path).write_bytes(blob)
        reader = "dcp.LayeredPlan.from_bytes" if spec.layered and name == "dcp" else "dcp.Plan.from_bytes"
        print(f"wrote {path}: {name}'s plan ({len(blob):,} bytes; {reader} reads it)", file=files)
    return row


def print_batch(rows: list[dict], spec: BatchSpec, cluster: Cluster, index: int, count: int,
                out: TextIO) -> None:
    """One batch's report block: the table, simulated times, speedups, the search's reasons, notes."""
    head = f"batch {index}" + (f" ({index + 1} of {count} planned)" if count > 1 else "")
    print(f"{head}: {plural(spec.num_seqs, 'sequence')}, {spec.total_tokens:,} tokens, mask {spec.masks[0].name}; "
          f"cluster {cluster.nodes} x {cluster.gpus_per_node}", file=out)
    print_table(rows, STAT_COLUMNS + ("sim_forward_ms", "sim_backward_ms"), out=out)
    if rows:
        print(f"(sim_*_ms: SIMULATED time of one attention layer, dcp.sim under cost-model profile "
              f"'{rows[0]['profile']}' - what dcp minimizes; the profile's constants are assumptions, not "
              f"measurements. Every other column is exact.)", file=out)
    _print_steps(rows, spec, out)
    for r in rows:
        if "speedup_vs_best_baseline" in r:
            best = next(b for b in rows if b["planner"] == r["best_baseline"])
            print(f"speedup ({r['planner']}): {r['speedup_vs_best_baseline']:.2f}x the fastest baseline "
                  f"({best['planner']}, {best['sim_fwd_bwd_ms']:.2f} ms vs {r['sim_fwd_bwd_ms']:.2f} ms forward + "
                  f"backward, simulated)", file=out)
        if r.get("why"):
            print(f"why ({r['planner']}): {r['why']}", file=out)
        for note in r["notes"]:
            print(f"note ({r['planner']}): {note}", file=out)
        for w in r["warnings"]:
            print(f"warning ({r['planner']}): {w}", file=out)


def _print_steps(rows: list[dict], spec: BatchSpec, out: TextIO) -> None:
    """A layered batch: every planner's attention time per step, Σ kinds × layers × forward + backward."""
    if not spec.layered:
        return
    steps: dict[str, float] = {}
    for r in rows:
        if "layer_kind" in r and "sim_fwd_bwd_ms" in r:
            name = r["planner"].split("[")[0]
            steps[name] = steps.get(name, 0.0) + r["layers"] * r["sim_fwd_bwd_ms"]
    layers = " + ".join(f"{n} {k}" for k, n in zip(spec.kinds, spec.layers))
    print(f"attention per step ({layers} layers, simulated): " +
          ", ".join(f"{name} {ms:.2f} ms" for name, ms in steps.items()) +
          " (static planners plan each kind alone: their kinds' homes may differ, which no model can run)",
          file=out)


def plan_batches(specs: Sequence[tuple[int, BatchSpec]], cluster: Cluster, config: PlannerConfig,
                 names: Sequence[str], args, make_planner: Callable, out: TextIO | None = None) -> int:
    """``dcp plan``: every batch with every planner; a report block per batch, or JSON (one object per
    plan; a list when there are several)."""
    out = out or sys.stdout
    several = len(specs) > 1
    rows: list[dict] = []
    for n, (index, spec) in enumerate(specs):
        got = plan_rows(index, spec, cluster, config, names, args, make_planner, several, out)
        rows.extend(got)
        if not args.json:
            if n:
                print(file=out)
            print_batch(got, spec, cluster, index, len(specs), out)
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2), file=out)
    return 0


__all__ = ["plan_batches", "plan_rows", "print_batch", "simulate_fields", "add_speedups", "search_fields", "explain",
           "batch_path", "DCP_PLANNERS"]
