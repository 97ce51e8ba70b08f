"""Megatron-Core's static context parallelism: DP groups of a fixed CP size.

The classical DP x CP layout: the P devices form P / cp aligned groups ``[k*cp, (k+1)*cp)``; the batch's
sequences are dealt to the groups longest first, each to the group holding the fewest tokens (ties: the
lowest group), and every sequence runs zigzag ring attention inside its group (2·cp chunks, device i of
the group homes chunks i and 2·cp-1-i). cp = P is zigzag over all devices; cp = 1 keeps every sequence
whole on one device (pure data parallelism). ``dcp bench e2e`` simulates the same layout per group
(``megatron_cp<size>`` rows); as a planner it is one plan over the whole cluster, so dcp's search can
start from it and the tuned comparisons can pick its best size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import BlockBuilder, causal_tiles, plan_ring
from dcp.baselines.zigzag import add_zigzag
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def token_groups(seqlens, n_groups: int) -> np.ndarray:
    """int64 ``[n_seqs]``: the group of every sequence, longest first onto the group with the fewest tokens
    (ties: the lowest group; equal lengths in input order)."""
    lens = np.asarray(seqlens, dtype=np.int64)
    group = np.zeros(lens.size, dtype=np.int64)
    load = [0] * n_groups
    for s in np.argsort(-lens, kind="stable").tolist():
        g = min(range(n_groups), key=lambda i: (load[i], i))
        group[s] = g
        load[g] += int(lens[s])
    return group


@dataclass(frozen=True)
class MegatronCPPlanner(Planner):
    """Static CP: ``cp_size`` devices per group (it must divide the device count; None: all devices),
    sequences balanced over the groups by tokens, zigzag ring inside each group (module docstring).
    Tuning grid: every power of two that divides the device count, and the device count. As dcp's warm
    start (``cp_size=None``) every size below the device count whose groups fit dcp's memory budget."""

    cp_size: int | None = None
    name = "megatron_cp"

    def __post_init__(self):
        c = self.cp_size
        if c is not None and (not isinstance(c, (int, np.integer)) or isinstance(c, bool) or c <= 0):
            raise InvalidConfigError(f"cp_size must be a positive int or None, got {c!r}")

    def _size(self, cluster: Cluster) -> int:
        p = cluster.n_devices
        c = p if self.cp_size is None else int(self.cp_size)
        if p % c:
            raise InvalidConfigError(f"megatron_cp: cp_size {c} does not divide the {p} devices")
        return c

    def warm_points(self, spec: BatchSpec, cluster: Cluster, token_budget: float) -> tuple[Planner, ...]:
        """``cp_size=None``: every power-of-two size below the device count that divides it and whose
        groups stay within ``token_budget`` tokens per device (group tokens / size; all devices is zigzag,
        a warm start of its own); a set size: this planner."""
        if self.cp_size is not None:
            return (self,)
        p = cluster.n_devices
        out = []
        for c in (1 << k for k in range(p.bit_length())):
            if c >= p or p % c:
                continue
            group = token_groups(spec.seqlens, p // c)
            if np.bincount(group, weights=spec.seqlens, minlength=p // c).max() / c <= token_budget:
                out.append(MegatronCPPlanner(c))
        return tuple(out)

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        p = cluster.n_devices
        sizes = sorted({1 << k for k in range(p.bit_length()) if p % (1 << k) == 0} | {p})
        return tuple(MegatronCPPlanner(c) for c in sizes)

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        plan.meta.update(cp_size=self._size(cluster))
        return plan

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        c = self._size(cluster)
        group = token_groups(spec.seqlens, cluster.n_devices // c)
        builder = BlockBuilder(spec)
        for n, g in zip(spec.seqlens, group.tolist()):
            add_zigzag(builder, n, g * c, c)
        notes = (f"megatron_cp: {cluster.n_devices // c} groups of {c} devices",)
        return StaticParts(*plan_ring(spec, builder), notes)

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        return causal_tiles(spec.seqlens, 2 * self._size(cluster))
