"""Export simulated timelines as Chrome trace / Perfetto JSON (open in chrome://tracing or ui.perfetto.dev).

Each device is a process (``pid``); thread 0 is its compute stream (compute, reduce, wait, delta
slices), threads 1, 2, ... are its transfer lanes: every transfer appears twice, as a "send" slice on
its sender and a "recv" slice on its receiver, packed greedily into lanes so slices on one thread never
overlap. Times are microseconds. Several results (e.g. forward and backward, or several planners) go
into one file as separate process groups: result ``i`` uses ``pid = i * PID_STRIDE + device``.
"""
from __future__ import annotations

import heapq
import json
from typing import Sequence, Union

from dcp.sim.events import SimResult

PID_STRIDE = 1000
STREAM_KINDS = ("compute", "reduce", "wait", "delta")


def _lanes(intervals: list[tuple[float, float, int]]) -> dict[int, int]:
    """Greedy interval partitioning: index -> lane (0-based) with no overlap within a lane."""
    free: list[tuple[float, int]] = []  # (end time, lane)
    n_lanes = 0
    lane_of = {}
    for start, end, i in sorted(intervals):
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane, n_lanes = n_lanes, n_lanes + 1
        lane_of[i] = lane
        heapq.heappush(free, (end, lane))
    return lane_of


def trace_events(result: SimResult, pid_offset: int = 0, name: str | None = None) -> list[dict]:
    """traceEvents of one result: ``ph: "X"`` slices plus ``ph: "M"`` process/thread names."""
    us = 1e6
    name = name or f"{result.planner} {result.direction}"
    out: list[dict] = []
    per_dev: dict[int, list[tuple[float, float, int]]] = {}
    slices = []
    for i, ev in enumerate(result.events):
        if ev.kind in STREAM_KINDS:
            out.append({"name": ev.label, "cat": ev.kind, "ph": "X", "pid": pid_offset + ev.device, "tid": 0,
                        "ts": ev.start_s * us, "dur": max(ev.end_s - ev.start_s, 0.0) * us,
                        "args": {"simulated": True}})
        elif ev.kind == "transfer":
            for side, dev in (("send", ev.src), ("recv", ev.dst)):
                k = len(slices)
                slices.append((side, dev, ev))
                per_dev.setdefault(dev, []).append((ev.start_s, ev.end_s, k))
    lane = {}
    for dev, iv in per_dev.items():
        lane.update(_lanes(iv))
    n_lanes: dict[int, int] = {}
    for k, (side, dev, ev) in enumerate(slices):
        peer = ev.dst if side == "send" else ev.src
        arrow = "->" if side == "send" else "<-"
        n_lanes[dev] = max(n_lanes.get(dev, 0), lane[k] + 1)
        out.append({"name": f"{side} r{ev.round} {arrow} {peer}", "cat": "transfer", "ph": "X",
                    "pid": pid_offset + dev, "tid": 1 + lane[k], "ts": ev.start_s * us,
                    "dur": max(ev.end_s - ev.start_s, 0.0) * us,
                    "args": {"simulated": True, "src": ev.src, "dst": ev.dst, "bytes": ev.bytes,
                             "round": ev.round, "units": ev.units}})
    for d in range(result.n_devices):
        pid = pid_offset + d
        out.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"{name} device {d}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "compute stream"}})
        for lane_i in range(n_lanes.get(d, 0)):
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1 + lane_i,
                        "args": {"name": f"transfers {lane_i}" if lane_i else "transfers"}})
    return out


def to_chrome_trace(result_or_results: Union[SimResult, Sequence[SimResult]], path: str,
                    names: Sequence[str] | None = None) -> dict:
    """Write one or several simulated results to ``path`` as Chrome trace JSON; returns the document.

    ``names``: optional process-group name per result (default "<planner> <direction>")."""
    results = [result_or_results] if isinstance(result_or_results, SimResult) else list(result_or_results)
    events: list[dict] = []
    for i, res in enumerate(results):
        events.extend(trace_events(res, i * PID_STRIDE, names[i] if names else None))
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"note": "simulated timelines (dcp.sim), not measurements",
                         "results": [r.summary() for r in results]}}
    with open(path, "w") as fh:
        json.dump(doc, fh)
    return doc
