"""Megatron-Core's dynamic context parallelism: a CP group size per sequence.

Each sequence gets ``cp = next power of two >= ceil(len / max_seqlen_per_rank)``, capped at the largest
power of two <= P. CP groups are aligned device ranges ``[k*cp, (k+1)*cp)``. Sequences are packed longest
first onto the group whose devices have the smallest current maximum load (attention cost len²/cp per
device), preferring groups whose devices stay within ``max_seqlen_per_rank`` resident tokens. Inside its
group a sequence runs zigzag ring attention (2·cp chunks); cp = 1 keeps it on one device with no
communication.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from dcp.baselines.common import BlockBuilder, plan_ring
from dcp.baselines.zigzag import add_zigzag
from dcp.cluster import Cluster
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.schedule.assemble import Planner, StaticParts, assemble_static, check_inputs
from dcp.spec import BatchSpec


def cp_size(seqlen: int, max_seqlen_per_rank: int, n_devices: int) -> int:
    """Power-of-two CP group size of one sequence (capped at the largest power of two <= n_devices)."""
    need = -(-seqlen // max_seqlen_per_rank)
    cap = 1 << (n_devices.bit_length() - 1)
    return min(1 << max(need - 1, 0).bit_length(), cap)


def pack_groups(seqlens, max_seqlen_per_rank: int, n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(first device, cp size) of every sequence's CP group, packed longest first."""
    lens = np.asarray(seqlens, dtype=np.int64)
    load = np.zeros(n_devices)
    tokens = np.zeros(n_devices)
    base = np.zeros(lens.size, dtype=np.int64)
    cps = np.array([cp_size(int(n), max_seqlen_per_rank, n_devices) for n in lens], dtype=np.int64)
    for s in np.argsort(-lens, kind="stable").tolist():
        cp, n = int(cps[s]), int(lens[s])
        groups = np.arange(n_devices // cp) * cp
        idx = groups[:, None] + np.arange(cp)[None, :]
        max_load = load[idx].max(axis=1)
        fits = tokens[idx].max(axis=1) + math.ceil(n / cp) <= max_seqlen_per_rank
        # feasible groups first, then the smallest current maximum load, then the fewest tokens
        best = int(np.lexsort((tokens[idx].max(axis=1), max_load, ~fits))[0])
        base[s] = groups[best]
        load[idx[best]] += float(n) * n / cp
        tokens[idx[best]] += n / cp
    return base, cps


@dataclass(frozen=True)
class MegatronDynCPPlanner(Planner):
    """Dynamic CP: per-sequence power-of-two CP groups packed by load, zigzag ring inside each group.

    ``max_seqlen_per_rank``: tokens one device may hold of a sequence (None: ceil(total tokens / P))."""

    max_seqlen_per_rank: int | None = None
    name = "megatron_dyncp"

    def __post_init__(self):
        m = self.max_seqlen_per_rank
        if m is not None and (not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m <= 0):
            raise InvalidConfigError(f"max_seqlen_per_rank must be a positive int or None, got {m!r}")

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        base, cps = self._groups(spec, cluster)
        plan.meta.update(cp_size=cps.tolist(), cp_base=base.tolist())
        return plan

    def _groups(self, spec: BatchSpec, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """(first device, CP size) of every sequence's group."""
        p = cluster.n_devices
        return pack_groups(spec.seqlens, self.max_seqlen_per_rank or -(-spec.total_tokens // p), p)

    def static_parts(self, spec: BatchSpec, cluster: Cluster) -> StaticParts:
        p = cluster.n_devices
        base, cps = self._groups(spec, cluster)
        builder = BlockBuilder(spec)
        for n, b, cp in zip(spec.seqlens, base.tolist(), cps.tolist()):
            add_zigzag(builder, n, b, cp)
        parts = plan_ring(spec, builder)
        sizes, counts = np.unique(cps, return_counts=True)
        notes = [f"megatron_dyncp: sequences per cp size {dict(zip(sizes.tolist(), counts.tolist()))}"]
        if p & (p - 1):
            notes.append(f"megatron_dyncp: {p} devices is not a power of two; CP groups are capped at "
                         f"{1 << (p.bit_length() - 1)}")
        return StaticParts(*parts, tuple(notes))

    def estimated_tiles(self, spec: BatchSpec, cluster: Cluster) -> int:
        nb = np.minimum(np.asarray(spec.seqlens, dtype=np.int64), 2 * self._groups(spec, cluster)[1])
        return int((nb * (nb + 1) // 2).sum())
