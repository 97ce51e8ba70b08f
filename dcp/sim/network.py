"""A fluid network: flows share capacitated resources at max-min fair rates, recomputed per event.

Every flow crosses a fixed set of resources (a GPU's egress or ingress port, a node's NIC egress or
ingress, ...). At any moment the flows' rates are the max-min fair allocation over the resources'
capacities (progressive filling: raise every unfrozen flow's rate together until some resource is full,
freeze the flows through it, repeat). Rates only change when a flow starts or ends, so time advances
from event to event: between events every flow drains its remaining bytes at a constant rate.

Units are whatever the caller uses consistently (the simulator: bytes and bytes/s, seconds).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

_REL = 1e-12
_TIE = 1e-9  # shares within this relative distance are one level


def max_min_rates(resources: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Max-min fair rate of every flow.

    ``resources``: int ``[F, K]``, the resources each flow crosses (pad with an index whose capacity is
    ``inf``; a resource repeated within a row counts once per occurrence); ``capacity``: float ``[R]``
    (``inf``: no limit). A flow through unlimited resources only gets rate ``inf``.

    Progressive filling, many bottlenecks per pass: a resource's fair share (remaining capacity / its
    unfrozen flows) never decreases as flows elsewhere freeze, so a resource whose share is no larger than
    the share of any resource one of its flows crosses ("locally minimal") saturates at exactly that share
    -- its flows are frozen there. Every pass freezes all locally minimal resources' flows (the global
    minimum is one of them); passes are few even with many distinct levels.
    """
    res = np.asarray(resources, dtype=np.int64)
    n_flows = res.shape[0]
    rate = np.full(n_flows, np.inf)
    if n_flows == 0:
        return rate
    if res.ndim != 2:
        raise ValueError("resources must be [flows, K]")
    cap = np.asarray(capacity, dtype=float).copy()
    n_res, k = cap.size, res.shape[1]
    idx = np.arange(n_flows)
    while idx.size:
        flat = res.ravel()
        cnt = np.bincount(flat, minlength=n_res)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(cnt > 0, np.maximum(cap, 0.0) / np.maximum(cnt, 1), np.inf)
        fs = share[res]
        fmin = fs.min(axis=1)
        finite = np.isfinite(fmin)
        if not finite.any():
            break  # the rest cross only unlimited resources
        smaller = (fmin[:, None] < fs * (1 - _TIE)).ravel()  # (flow, resource) where the flow is held lower
        held = np.bincount(flat[smaller], minlength=n_res) > 0
        local_min = ~held & np.isfinite(share)
        hit = local_min[res].any(axis=1) & finite
        rate[idx[hit]] = fmin[hit]
        cap -= np.bincount(res[hit].ravel(), weights=np.repeat(fmin[hit], k), minlength=n_res)
        keep = ~hit
        res, idx = res[keep], idx[keep]
    return rate


class FluidNetwork:
    """Flows over capacitated resources with max-min fair sharing, advanced event by event.

    Between events rates are constant, so each flow's absolute finish time is computed once per rate
    change; remaining bytes are brought up to date only when rates change.

    >>> net = FluidNetwork([100.0, 100.0])          # two resources, 100 bytes/s each
    >>> a = net.add_flow([0, 1], 100.0)             # crosses both
    >>> b = net.add_flow([0], 100.0)                # shares resource 0 with a
    >>> [(f, round(t, 6)) for f, t in net.run()]    # both at 50/s until t=2
    [(0, 2.0), (1, 2.0)]
    """

    def __init__(self, capacities: Sequence[float], now: float = 0.0):
        cap = np.asarray(capacities, dtype=float)
        if cap.ndim != 1 or (cap < 0).any() or np.isnan(cap).any():
            raise ValueError("capacities must be a 1-D array of non-negative numbers (inf allowed)")
        self._cap = np.append(cap, np.inf)  # last index: padding, unlimited
        self._pad = cap.size
        self.now = float(now)
        self._width = 1
        self._res = np.zeros((0, 1), dtype=np.int64)
        self._rem = np.zeros(0)      # remaining bytes as of self._t_rem
        self._t_rem = self.now
        self._ids = np.zeros(0, dtype=np.int64)
        self._rate = np.zeros(0)
        self._fin = np.zeros(0)      # absolute finish times at current rates
        self._dirty = False
        self._next_id = 0
        self.n_rate_updates = 0

    @property
    def n_resources(self) -> int:
        return self._pad

    @property
    def n_active(self) -> int:
        return int(self._ids.size)

    def add_flow(self, resources: Sequence[int], nbytes: float) -> int:
        """Start a flow now; returns its id (ids count up from 0)."""
        return int(self.add_flows([list(resources)], [nbytes])[0])

    def add_flows(self, resources: Sequence[Sequence[int]], nbytes: Sequence[float]) -> np.ndarray:
        """Start several flows now (rates are recomputed once, lazily); returns their ids."""
        n = len(nbytes)
        if len(resources) != n:
            raise ValueError("one resource list per flow")
        ids = np.arange(self._next_id, self._next_id + n, dtype=np.int64)
        if n == 0:
            return ids
        width = max(self._width, max(len(r) for r in resources))
        rows = np.full((n, width), self._pad, dtype=np.int64)
        for i, r in enumerate(resources):
            r = list(r)
            if any(not 0 <= x < self._pad for x in r):
                raise ValueError(f"flow resources {r} outside 0..{self._pad - 1}")
            rows[i, :len(r)] = r
        nb = np.asarray(nbytes, dtype=float)
        if (nb < 0).any() or np.isnan(nb).any():
            raise ValueError("flow sizes must be non-negative")
        self._sync()
        if width > self._width:
            pad = np.full((self._res.shape[0], width - self._width), self._pad, dtype=np.int64)
            self._res = np.concatenate([self._res, pad], axis=1)
            self._width = width
        self._res = np.concatenate([self._res, rows])
        self._rem = np.concatenate([self._rem, nb])
        self._ids = np.concatenate([self._ids, ids])
        self._rate = np.concatenate([self._rate, np.zeros(n)])
        self._fin = np.concatenate([self._fin, np.full(n, np.inf)])
        self._next_id += n
        self._dirty = True
        return ids

    def rates(self) -> dict[int, float]:
        """Current rate of every active flow, by id."""
        self._update()
        return dict(zip(self._ids.tolist(), self._rate.tolist()))

    def remaining(self) -> dict[int, float]:
        """Bytes every active flow has left, by id, as of ``now``."""
        self._sync()
        return dict(zip(self._ids.tolist(), self._rem.tolist()))

    def _sync(self) -> None:
        """Bring remaining bytes up to ``now`` at the current rates."""
        dt = self.now - self._t_rem
        if dt > 0 and self._ids.size:  # rates in effect since _t_rem (new flows: 0)
            with np.errstate(invalid="ignore"):
                moved = np.where(np.isinf(self._rate), self._rem, self._rate * dt)
            self._rem = np.maximum(self._rem - moved, 0.0)
        self._t_rem = self.now

    def _update(self) -> None:
        if not self._dirty:
            return
        self._sync()
        self._rate = max_min_rates(self._res, self._cap)
        self.n_rate_updates += 1
        with np.errstate(divide="ignore", invalid="ignore"):
            dt = self._rem / self._rate
        dt[self._rem <= 0] = 0.0
        dt[np.isnan(dt)] = np.inf
        self._fin = self.now + dt
        self._dirty = False

    def next_completion(self) -> float:
        """Time the next active flow finishes at current rates (``inf`` when none can)."""
        if self._ids.size == 0:
            return np.inf
        self._update()
        return float(self._fin.min())

    def advance(self, t: float) -> list[tuple[int, float]]:
        """Move time to ``t`` (not before ``now``), completing flows on the way; rates are recomputed
        after each completion. Returns ``(flow id, finish time)`` in finish order."""
        if t < self.now - 1e-15 * max(1.0, abs(self.now)):
            raise ValueError(f"cannot go back in time: {t} < {self.now}")
        done: list[tuple[int, float]] = []
        while self._ids.size:
            if self._dirty and self.now >= t and done:
                break  # rates are stale but nothing else can finish exactly now; recompute lazily
            tnext = self.next_completion()
            if tnext > t:
                break
            # everything finishing at tnext (within rounding) completes together
            tol = _REL * max(1.0, abs(tnext)) + 1e-18
            finished = self._fin <= tnext + tol
            self.now = max(self.now, tnext)
            self._sync()
            done.extend((int(i), tnext) for i in self._ids[finished].tolist())
            keep = ~finished
            self._res, self._rem, self._ids = self._res[keep], self._rem[keep], self._ids[keep]
            self._rate, self._fin = self._rate[keep], self._fin[keep]
            self._dirty = True
        if np.isfinite(t) and t > self.now:
            self._sync()
            self.now = t
        return done

    def run(self) -> list[tuple[int, float]]:
        """Advance until every flow finished (flows through only unlimited resources finish at once)."""
        return self.advance(np.inf) if self.n_active else []
