"""The simulator's fluid network: max-min fair rates, recomputed only where a flow started or ended.

Same model as ``dcp.sim.network.FluidNetwork`` (flows cross capacitated resources; at every moment the
rates are the max-min fair allocation; they change only when a flow starts or ends), but built for
thousands of devices with many concurrent flows. A max-min allocation splits over the connected
components of the flow-resource graph: a flow starting or ending changes only the rates of its own
component. Components are tracked with a union-find over resources (flows joining resources merge their
components); since a union-find cannot split, it is rebuilt from the active flows once as many flows have
ended as were active at the last rebuild, so the components it gives are unions of true components
(recomputing a union of components is exact) and the rebuilds cost O(1) amortized per flow. Each event
thus costs time in its component's size, not in the network's: a ring over 1,024 GPUs is 1,024 small
components. Small components are filled in plain Python (``_max_min_small``), large ones by
``dcp.sim.network.max_min_rates``; both compute the unique max-min fair allocation.

Each flow keeps its remaining bytes as of the last time its rate changed, so flows outside a changed
component are not touched; finish times live in a heap with lazy deletion (an entry is stale when the
flow's rate changed since it was pushed).

A flow that starts on resources no active flow uses is *solo*: alone in its component, it gets its
tightest resource's share and stays out of the union-find (most flows of a ring at scale). A later flow
touching one of its resources first moves it into the union-find, then joins as usual.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from dcp.sim.network import _REL, max_min_rates

_SMALL = 24     # components with at most this many flows are filled in plain Python
_TIE = 1e-9     # shares within this relative distance are one level


def _max_min_small(rows: list[tuple[int, ...]], cap: list[float]) -> list[float]:
    """Max-min fair rates of flows crossing ``rows[i]`` (resources; a repeated one counts per occurrence),
    progressive filling one level at a time. ``inf``: a flow through unlimited resources only."""
    if len(rows) == 1:  # alone in its component (most flows of a ring): its tightest resource's share
        rs = rows[0]
        return [min((cap[r] / rs.count(r) for r in rs), default=math.inf)]
    rate = [math.inf] * len(rows)
    left: dict[int, float] = {}
    users: dict[int, list[int]] = {}
    for i, rs in enumerate(rows):
        for r in rs:
            if cap[r] != math.inf:
                left[r] = cap[r]
                users.setdefault(r, []).append(i)
    frozen = [False] * len(rows)
    while users:
        level = min(max(left[r], 0.0) / len(u) for r, u in users.items())
        hit = [i for r, u in users.items() if max(left[r], 0.0) / len(u) <= level * (1 + _TIE) for i in u]
        for i in hit:
            if frozen[i]:
                continue
            frozen[i] = True
            rate[i] = level
            for r in rows[i]:
                if r in left:
                    left[r] -= level
        for r in list(users):
            u = [i for i in users[r] if not frozen[i]]
            if u:
                users[r] = u
            else:
                del users[r]
    return rate


class ComponentNetwork:
    """Flows over capacitated resources; ``add`` and ``pop_finished`` advance it event by event.

    Flow ids are the caller's (ints below ``n_flows``); ``resources`` of a flow are resource indices
    below ``len(capacities)`` (``inf`` capacity: unlimited)."""

    def __init__(self, capacities, n_flows: int):
        self.cap = [float(c) for c in capacities]
        self.now = 0.0
        n_res = len(self.cap)
        self.parent = list(range(n_res))
        self.members: dict[int, set[int]] = {}      # union-find root -> active flows of that component
        self.res: list[tuple[int, ...]] = [()] * n_flows
        self.rem = [0.0] * n_flows                 # bytes left as of t_ref
        self.t_ref = [0.0] * n_flows
        self.rate = [0.0] * n_flows
        self.version = [0] * n_flows
        self.heap: list[tuple[float, int, int]] = []  # (finish time, version, flow)
        self.load = [0] * n_res                   # active flows on each resource
        self.solo_on = [-1] * n_res               # the solo flow holding a resource (-1: none)
        self.solo = [False] * n_flows
        self.n_active = 0
        self.ended_since_rebuild = 0
        self.active_at_rebuild = 0
        self.n_rate_updates = 0

    # -- union-find over resources
    def _find(self, r: int) -> int:
        parent = self.parent
        root = r
        while parent[root] != root:
            root = parent[root]
        while parent[r] != root:
            parent[r], r = root, parent[r]
        return root

    def _join(self, f: int) -> int:
        """Merge the components of flow f's resources (smaller flow set into larger); return the root."""
        rs = self.res[f]
        root = self._find(rs[0])
        for r in rs[1:]:
            other = self._find(r)
            if other == root:
                continue
            a, b = self.members.get(root, set()), self.members.get(other, set())
            if len(a) < len(b):
                root, other, a, b = other, root, b, a
            self.parent[other] = root
            a |= b
            self.members[root] = a
            self.members.pop(other, None)
        return root

    def _rebuild(self) -> None:
        active = set().union(*self.members.values()) if self.members else set()
        self.parent = list(range(len(self.cap)))
        self.members = {}
        for f in active:
            self.members.setdefault(self._join(f), set()).add(f)
        self.ended_since_rebuild, self.active_at_rebuild = 0, len(active)

    # -- events
    def add(self, flows: list[int], resources: list[tuple[int, ...]], nbytes: list[float], t: float) -> None:
        """Start ``flows`` at time ``t`` (not before ``now``)."""
        self.now = max(self.now, t)
        roots = set()
        load, solo_on, cap = self.load, self.solo_on, self.cap
        for f, rs, b in zip(flows, resources, nbytes):
            rs = self.res[f] = tuple(rs)
            self.rem[f], self.t_ref[f], self.rate[f] = float(b), t, 0.0
            distinct = set(rs)
            if not any(load[r] for r in distinct):  # solo: nothing else on its resources
                self.solo[f] = True
                for r in distinct:
                    load[r] += 1
                    solo_on[r] = f
                r_f = min((cap[r] / rs.count(r) for r in rs), default=math.inf)
                self._set_rate(f, r_f, t)
                continue
            for r in distinct:
                g = solo_on[r]
                if g >= 0:  # a solo flow shares a resource now: it joins the union-find first
                    self._unsolo(g)
                    roots.add(self._add_member(g))
                load[r] += 1
            roots.add(self._add_member(f))
        self.n_active += len(flows)
        if roots:
            self._refresh({self._find(r) for r in roots}, t)

    def _add_member(self, f: int) -> int:
        root = self._join(f)
        self.members.setdefault(root, set()).add(f)
        return root

    def _unsolo(self, f: int) -> None:
        self.solo[f] = False
        for r in set(self.res[f]):
            self.solo_on[r] = -1

    def _set_rate(self, f: int, r: float, t: float) -> None:
        """Flow f runs at rate r from time t (its bytes left already as of t)."""
        self.rate[f] = r
        left = self.rem[f]
        fin = t if left <= 0 or r == math.inf else (t + left / r if r > 0 else math.inf)
        self.version[f] += 1
        if fin != math.inf:
            heapq.heappush(self.heap, (fin, self.version[f], f))

    def next_finish(self) -> float:
        """Finish time of the next flow at current rates (``inf`` when none)."""
        heap, version = self.heap, self.version
        while heap and heap[0][1] != version[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def pop_finished(self) -> list[tuple[int, float]]:
        """Advance to the next finish time and end every flow finishing then (within rounding); returns
        ``(flow, time)`` pairs. The rates of their components are recomputed."""
        t = self.next_finish()
        if t == math.inf:
            return []
        self.now = max(self.now, t)
        tol = _REL * max(1.0, abs(t)) + 1e-18
        done, roots = [], set()
        heap, version = self.heap, self.version
        while heap and heap[0][0] <= t + tol:
            _, v, f = heapq.heappop(heap)
            if v != version[f]:
                continue
            version[f] += 1  # no entry of f is live any more
            for r in set(self.res[f]):
                self.load[r] -= 1
            done.append((f, t))
            if self.solo[f]:  # alone in its component: nothing else to recompute
                self._unsolo(f)
                continue
            root = self._find(self.res[f][0])
            self.members[root].discard(f)
            roots.add(root)
            self.ended_since_rebuild += 1
        self.n_active -= len(done)
        self._refresh(roots, t)
        if self.ended_since_rebuild > max(64, self.active_at_rebuild):
            self._rebuild()
        return done

    def _refresh(self, roots: set[int], t: float) -> None:
        """Recompute the rates of the flows of these components at time t."""
        flows = [f for root in roots for f in self.members.get(root, ())]
        if not flows:
            return
        self.n_rate_updates += 1
        rem, t_ref, rate = self.rem, self.t_ref, self.rate
        for f in flows:  # bytes left now, at the rate in effect since t_ref
            r = rate[f]
            if r > 0:
                rem[f] = 0.0 if r == math.inf else max(rem[f] - r * (t - t_ref[f]), 0.0)
            t_ref[f] = t
        rows = [self.res[f] for f in flows]
        if len(flows) <= _SMALL:
            new = _max_min_small(rows, self.cap)
        else:  # in flow order: the fill sums each pass's frozen rates per resource in row order
            flows.sort()
            rows = [self.res[f] for f in flows]
            width = max(len(r) for r in rows)
            pad = len(self.cap)
            arr = np.full((len(rows), width), pad, dtype=np.int64)
            for i, r in enumerate(rows):
                arr[i, :len(r)] = r
            new = max_min_rates(arr, np.append(self.cap, math.inf)).tolist()
        for f, r in zip(flows, new):
            self._set_rate(f, r, t)
