"""The simulator's event loop over a columnar program: device streams, flow starts and finishes.

Each device's canonical stream (``dcp.ir.program``) is, per round r: post round r, compute stage r-1,
wait for round r, merge what round r brought. Only the rounds in which a device posts flows, computes or
merges matter, so the streams are compiled into *steps*: one per (device, round) that holds any of them,
sorted by device then round, with the step's compute and merge durations precomputed (``simulate``) and
the flows it posts as an index range. A device runs its steps until one waits for an unfinished flow;
the last flow of that step to finish resumes it. Events cost time in what they touch: a flow start
posts to two steps, a finish decrements two counters and may resume the device(s) it blocked.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from dcp import setops
from dcp.cost import CostModel
from dcp.ir.plan import Plan
from dcp.ir.program import DST, HB, KIND, ROUND, SRC, TB, Program
from dcp.layout.units import Kind, unit_bytes
from dcp.sim.events import SimEvent, _resource_table
from dcp.sim.flows import ComponentNetwork

try:  # the C++ event loop (csrc/sim.cpp), when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE = hasattr(_C, "simulate_streams")
except ImportError:
    _C, _NATIVE = None, False


def host_tables(cost: CostModel, busy: np.ndarray, has_delta: np.ndarray, step_flows: np.ndarray,
                step_comp: np.ndarray, step_merges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(host0 [n_devices], host [n_steps, 4])``: the host time (``GPUProfile.host_*``, seconds) before a
    device's first step (its program, and issuing the backward's delta), and per step what the host spends
    before posting its round (launch + messages), issuing its compute, its wait, and its merges."""
    hc = cost.host_s()
    host0 = np.where(busy, hc.program, 0.0) + np.where(has_delta, hc.compute, 0.0)
    moves = step_flows > 0
    host = np.stack([np.where(moves, hc.launch + hc.message * step_flows, 0.0), np.where(step_comp > 0, hc.compute, 0.0),
                     np.where(moves, hc.wait, 0.0), hc.merges_s(step_merges)], axis=1).astype(float)
    return host0.astype(float), np.ascontiguousarray(host)


class Streams:
    """Steps of every device (module docstring) and their execution against a ``ComponentNetwork``.

    After ``run``: ``clock[d]`` (when device d's stream ended), ``compute_s``/``reduce_s``/``wait_s``
    (float ``[n_devices]``), ``f_start``/``f_end`` (per flow), ``events`` (when recorded).

    ``native``: run the loop in C++ (``dcp._C.simulate_streams``, the same operations; lists become numpy
    arrays) -- True forces it, False forbids it, None uses it when built. Recorded events always run here."""

    def __init__(self, plan: Plan, prog: Program, flows: dict, comp: np.ndarray, t0: np.ndarray,
                 cost: CostModel, nic: str | None, record_events: bool, native: bool | None = None):
        n, gpn, nodes = plan.n_devices, plan.cluster.gpus_per_node, plan.cluster.nodes
        self.n, self.record = n, record_events
        self.native = (_NATIVE if native is None else bool(native)) and not record_events
        if self.native and not _NATIVE:
            raise RuntimeError("native simulation requested but dcp._C.simulate_streams is not built")
        p = cost.profile
        self.latency = p.link_latency_us * 1e-6
        f_src, f_dst, f_round = flows["src"], flows["dst"], flows["round"]
        n_flows = f_src.size
        # merges per (device, round, unit) over (2 + sources) units: O one kernel each, sums grouped per layer
        mg = prog.merges.astype(np.int64)
        mg = mg[np.lexsort((mg[:, SRC], mg[:, HB], mg[:, TB], mg[:, KIND], mg[:, ROUND], mg[:, DST]))]
        g_first = np.flatnonzero(np.r_[True, (mg[1:][:, [DST, ROUND, KIND, TB, HB]]
                                              != mg[:-1][:, [DST, ROUND, KIND, TB, HB]]).any(axis=1)]) \
            if mg.shape[0] else np.zeros(0, dtype=np.int64)
        g_rows = mg[g_first]
        g_n = np.diff(np.r_[g_first, mg.shape[0]])
        g_dur = cost.merges_s(g_rows[:, DST] * (int(g_rows[:, ROUND].max(initial=0)) + 1) + g_rows[:, ROUND],
                              g_rows[:, KIND] != int(Kind.O), g_n,
                              unit_bytes(plan.spec, plan.layout, g_rows[:, KIND], g_rows[:, TB])).reshape(-1)
        # steps: (device, round) keys of flow endpoints, compute cells (stage s -> round s + 1), merges
        cd, cs = np.nonzero(comp > 0) if comp.size else (np.zeros(0, np.int64),) * 2
        width = int(max(f_round.max(initial=0), comp.shape[1], g_rows[:, ROUND].max(initial=0))) + 2
        remote = f_src != f_dst
        ends_dev = np.concatenate([f_src, f_dst[remote]])
        ends_flow = np.concatenate([np.arange(n_flows), np.flatnonzero(remote)])
        ends_key = ends_dev * width + np.concatenate([f_round, f_round[remote]])
        keys = setops.unique(np.concatenate([ends_key, cd * width + cs + 1, g_rows[:, DST] * width + g_rows[:, ROUND]]))
        n_steps = keys.size
        at = np.searchsorted(keys, ends_key)
        order = np.argsort(at, kind="stable")
        cell_step = np.searchsorted(keys, cd * width + cs + 1)
        comp_step = np.zeros(n_steps)
        comp_step[cell_step] = comp[cd, cs]
        g_step = np.searchsorted(keys, g_rows[:, DST] * width + g_rows[:, ROUND])  # non-decreasing
        self.round_over = p.round_overhead_us * 1e-6
        steps = {"ptr": np.searchsorted(keys // width, np.arange(n + 1)), "step_dev": keys // width,
                 "flow_ptr": np.searchsorted(at[order], np.arange(n_steps + 1)), "step_flows": ends_flow[order],
                 "pending": np.bincount(at, minlength=n_steps), "comp": comp_step,
                 "red": np.bincount(g_step, weights=g_dur, minlength=n_steps)}
        # network: each flow's resources and their capacities; devices: the per-program cost first (host-side
        # executors), then the delta
        per_nic, n_nics, nic_cap = cost.nic_layout(gpn, nodes, nic)
        f_res = _resource_table(f_src, f_dst, gpn, n, n_nics, per_nic)
        caps = np.array([p.nvlink_gbps * 1e9] * (2 * n) + [nic_cap] * (2 * n_nics), dtype=float)
        has_delta = np.asarray(t0) > 0
        busy = (np.diff(steps["ptr"]) > 0) | has_delta
        self.t_prog = np.where(busy, p.program_overhead_us * 1e-6, 0.0)
        host0, steps["host"] = host_tables(cost, busy, has_delta, np.diff(steps["flow_ptr"]), comp_step,
                                           np.bincount(g_step, minlength=n_steps))
        start0 = self.t_prog + host0 * has_delta  # the delta waits for the host to issue it
        if self.native:
            self._native_tables(steps, keys % width, at, remote, flows, f_res, caps, t0, start0, host0)
            return
        self.step_round = (keys % width).tolist()
        self.ptr, self.step_dev, self.flow_ptr, self.step_flows, self.pending, self.comp, self.red = (
            steps[k].tolist() for k in ("ptr", "step_dev", "flow_ptr", "step_flows", "pending", "comp", "red"))
        self.h_post, self.h_comp, self.h_wait, self.h_red = (steps["host"][:, i].tolist() for i in range(4))
        self.host = [float(x) for x in host0]  # when each device's host has issued its last instruction
        self.f_steps = [[] for _ in range(n_flows)]
        for f, k in zip(ends_flow.tolist(), at.tolist()):
            self.f_steps[f].append(k)
        if record_events:  # labels: tiles per compute cell, the merges of each step
            dev, stage = np.asarray(plan.tile_device, np.int64), prog.tile_stage.astype(np.int64)
            cnt = np.bincount(dev * comp.shape[1] + stage, minlength=comp.size)[cd * comp.shape[1] + cs]
            self.cells = dict(zip(cell_step.tolist(), zip(cs.tolist(), cnt.tolist())))
            self.groups = (np.searchsorted(g_step, np.arange(n_steps + 1)).tolist(), g_rows, g_first, g_n, g_dur, mg)
        # flows
        self.f_src, self.f_dst, self.f_round = f_src.tolist(), f_dst.tolist(), f_round.tolist()
        self.f_bytes, self.f_units = flows["bytes"].tolist(), flows["units"].tolist()
        self.f_res = [tuple(r[:2]) if r[2] < 0 else tuple(r) for r in f_res.tolist()]
        self.net = ComponentNetwork(caps, n_flows)
        self.f_need = [2 if r else 1 for r in remote.tolist()]
        self.f_posted = [0] * n_flows
        self.f_post = [0.0] * n_flows
        self.f_start = [math.nan] * n_flows
        self.f_end = [math.nan] * n_flows
        self.starts: list[tuple[float, int]] = []
        self.clock = [float(x) for x in start0 + t0]
        self.pos = self.ptr[:-1]
        self.blocked = [-1] * n       # the step a device waits in
        self.since = [0.0] * n
        # plain lists: the event loop adds to them one float at a time (numpy scalars cost ~10x more)
        self.compute_s, self.reduce_s, self.wait_s = [0.0] * n, [float(x) for x in t0], [0.0] * n
        self.events: list[SimEvent] = []
        if record_events:
            self.events += [SimEvent(d, "delta", "delta (home rows)", float(start0[d]), float(start0[d] + t))
                            for d, t in enumerate(t0) if t > 0]

    def _native_tables(self, steps: dict, step_round: np.ndarray, at: np.ndarray, remote: np.ndarray, flows: dict,
                       f_res: np.ndarray, caps: np.ndarray, t0: np.ndarray, start0: np.ndarray,
                       host0: np.ndarray) -> None:
        """The same tables as numpy arrays, for ``dcp._C.simulate_streams``."""
        f_src, f_dst = flows["src"].astype(np.int64), flows["dst"].astype(np.int64)
        n_flows = f_src.size
        f_step = np.full((n_flows, 2), -1, dtype=np.int64)
        f_step[:, 0] = at[:n_flows]
        f_step[remote, 1] = at[n_flows:]
        self._tables = dict(steps, f_step=f_step, f_res=f_res, f_bytes=np.asarray(flows["bytes"], dtype=float),
                            cap=caps, clock0=start0 + t0, reduce0=np.asarray(t0, dtype=float), host0=host0)
        self.step_round = step_round
        self.f_src, self.f_dst = f_src, f_dst
        self.events: list[SimEvent] = []

    def _run_native(self, direction: str) -> None:
        import torch

        tb = self._tables
        dt = {"comp": np.float64, "red": np.float64, "f_bytes": np.float64, "cap": np.float64,
              "clock0": np.float64, "reduce0": np.float64, "host": np.float64, "host0": np.float64}
        arg = lambda k: torch.from_numpy(np.ascontiguousarray(tb[k], dtype=dt.get(k, np.int64)))  # noqa: E731
        out = _C.simulate_streams(*(arg(k) for k in ("ptr", "step_dev", "flow_ptr", "step_flows", "pending", "comp",
                                                     "red", "f_step", "f_res", "f_bytes", "cap", "clock0",
                                                     "reduce0", "host", "host0")), float(self.latency),
                                float(self.round_over))
        clock, comp_s, red_s, wait_s, f_start, f_end, blocked, pos = (x.numpy() for x in out[:8])
        self.n_rate_updates = int(out[8])
        self.clock, self.compute_s, self.reduce_s, self.wait_s = clock, comp_s, red_s, wait_s
        self.f_start, self.f_end = f_start, f_end
        self._check_finished(direction, blocked.tolist(), bool((pos < tb["ptr"][1:]).any()))

    def _check_finished(self, direction: str, blocked: list, unfinished: bool) -> None:
        """Raise ``ValueError`` naming the blocked devices when a stream did not run to its end."""
        stuck = [(d, int(self.step_round[k])) for d, k in enumerate(blocked) if k >= 0]
        if stuck or unfinished:
            raise ValueError(f"{direction}: simulation cannot finish; devices blocked (device, round): {stuck[:4]}"
                             " — a transfer whose peer never posts that round, or a deadlock")

    def last_end(self) -> float:
        """When the last flow finished (0.0 without flows)."""
        if self.native:
            return float(self.f_end.max()) if self.f_end.size else 0.0
        return max(self.f_end, default=0.0)

    # -- device streams
    def _advance(self, d: int) -> None:
        """Run device d's steps from ``pos[d]`` until one waits or the stream ends."""
        k, end, t, h = self.pos[d], self.ptr[d + 1], self.clock[d], self.host[d]
        pending, comp = self.pending, self.comp
        while k < end:
            a, b = self.flow_ptr[k], self.flow_ptr[k + 1]
            if b > a:
                t += self.round_over  # packing and posting this round's messages (host-side executors)
                h += self.h_post[k]  # an asynchronous device's host posts them (host_launch_us, host_message_us)
                self._post(a, b, h if h > t else t)
            c = comp[k]
            if c > 0:
                h += self.h_comp[k]
                if h > t:
                    t = h
                self.compute_s[d] += c
                if self.record:
                    s, n_t = self.cells[k]
                    self.events.append(SimEvent(d, "compute", f"stage {s} ({n_t} tiles)", t, t + c))
                t += c
            if b > a:
                h += self.h_wait[k]
                if h > t:
                    t = h
            self.host[d] = h
            if pending[k] > 0:
                self.blocked[d], self.since[d], self.pos[d], self.clock[d] = k, t, k, t
                return
            t = self._merge(d, k, t)
            h = self.host[d]
            k += 1
        self.pos[d], self.clock[d] = k, t

    def _merge(self, d: int, k: int, t: float) -> float:
        r = self.red[k]
        if r <= 0:
            return t
        h = self.host[d] + self.h_red[k]  # the round's merges are issued together, then run
        self.host[d] = h
        if h > t:
            t = h
        self.reduce_s[d] += r
        if self.record:  # one event per merged unit; the clock moves by their sum either way
            ptr, rows, first, n_src, dur, mg = self.groups
            at = t
            for g in range(ptr[k], ptr[k + 1]):
                kind, tb, hb = (int(x) for x in rows[g, [KIND, TB, HB]])
                srcs = mg[first[g]:first[g] + n_src[g], SRC].tolist()
                self.events.append(SimEvent(d, "reduce", f"reduce {Kind(kind).name}[{tb},{hb}] <- {srcs}", at,
                                            at + float(dur[g])))
                at += float(dur[g])
        return t + r

    def _post(self, a: int, b: int, t: float) -> None:
        for f in self.step_flows[a:b]:
            self.f_posted[f] += 1
            if t > self.f_post[f]:
                self.f_post[f] = t
            if self.f_posted[f] == self.f_need[f]:
                s = self.f_post[f]
                self.f_start[f] = s
                heapq.heappush(self.starts, (s + (self.latency if self.f_need[f] == 2 else 0.0), f))

    def _finish(self, f: int, t: float) -> None:
        self.f_end[f] = t
        for k in self.f_steps[f]:
            self.pending[k] -= 1
            d = self.step_dev[k]
            if self.pending[k] == 0 and self.blocked[d] == k:
                since = self.since[d]
                resume = max(t, since)
                if resume > since:
                    self.wait_s[d] += resume - since
                    if self.record:
                        r = self.step_round[k]
                        self.events.append(SimEvent(d, "wait", f"wait r{r}", since, resume, round=r))
                self.blocked[d] = -1
                self.clock[d] = self._merge(d, k, resume)
                self.pos[d] = k + 1
                self._advance(d)

    # -- the event loop
    def run(self, direction: str) -> None:
        if self.native:
            self._run_native(direction)
            return
        for d in range(self.n):
            self._advance(d)
        net, starts = self.net, self.starts
        while True:
            t_start = starts[0][0] if starts else math.inf
            t_done = net.next_finish()
            if t_start == math.inf and t_done == math.inf:
                break
            if t_done <= t_start:
                for f, t in net.pop_finished():
                    self._finish(f, t)
                continue
            batch = []
            while starts and starts[0][0] <= t_start:
                batch.append(heapq.heappop(starts)[1])
            remote = [f for f in batch if self.f_need[f] == 2]
            if remote:
                net.add(remote, [self.f_res[f] for f in remote], [self.f_bytes[f] for f in remote], t_start)
            for f in batch:
                if self.f_need[f] == 1:
                    self._finish(f, t_start)
        self._check_finished(direction, self.blocked, any(self.pos[d] < self.ptr[d + 1] for d in range(self.n)))
        if self.record:
            for f in range(len(self.f_src)):
                s, d, r = self.f_src[f], self.f_dst[f], self.f_round[f]
                self.events.append(SimEvent(s, "transfer", f"r{r} {s}->{d} ({self.f_units[f]} units)",
                                            self.f_start[f], self.f_end[f], s, d, self.f_bytes[f], r,
                                            self.f_units[f]))
