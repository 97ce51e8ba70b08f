"""Megatron-Core's dynamic context parallelism: a CP group size per sequence.

Each sequence needs ``cp = next power of two >= ceil(len / max_seqlen_per_rank)`` (capped at the largest
power of two <= P). CP groups are aligned device ranges ``[k*cp, (k+1)*cp)``. Sequences are packed longest
first onto the group whose devices have the smallest current maximum load (attention cost len²/cp per
device), preferring groups whose devices stay within ``max_seqlen_per_rank`` resident tokens. Inside its
group a sequence runs zigzag ring attention (2·cp chunks); cp = 1 keeps it on one device with no
communication.

Two versions of the scheduler (public Megatron-LM code, 2026; reproduced from its behaviour, not its code):
- ``version="2026.01"`` (the January-2026 release): every sequence takes its minimum group size.
- ``version="dev"`` (default; the mid-2026 development scheduler): a sequence takes a larger group than
  the minimum when that lowers the projected maximum per-device load, i.e. when at its minimum size it
  would push some device above 1.05 × the balanced load (the larger of the mean load and the load of
  the tallest sequence spread over the largest group); then ``fill_empty_gpus``: while a device holds
  nothing, the sequence with the highest per-device load whose buddy group (the aligned group of the same
  size next to its own) is empty doubles its group onto it, so no rank idles.
Not modelled: padding every sequence to a multiple of 2·DP·CP, and leftover sequences deferred to the
next micro-batch (a dcp batch is one micro-batch: every sequence is placed).
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


VERSIONS = ("dev", "2026.01")
TUNING_MAX_SEQLEN = (512, 768, 1024, 1536, 2048, 3072, 4096)


def cp_size(seqlen: int, max_seqlen_per_rank: int, n_devices: int) -> int:
    """Power-of-two CP group size of one sequence (capped at the largest power of two <= n_devices)."""
    need = -(-seqlen // max_seqlen_per_rank)
    cap = 1 << (n_devices.bit_length() - 1)
    return min(1 << max(need - 1, 0).bit_length(), cap)


def pack_groups(seqlens, max_seqlen_per_rank: int, n_devices: int,
                version: str = "dev") -> tuple[np.ndarray, np.ndarray]:
    """(first device, cp size) of every sequence's CP group, packed longest first (module docstring)."""
    lens = np.asarray(seqlens, dtype=np.int64)
    load = np.zeros(n_devices)
    tokens = np.zeros(n_devices)
    base = np.zeros(lens.size, dtype=np.int64)
    cps = np.array([cp_size(int(n), max_seqlen_per_rank, n_devices) for n in lens], dtype=np.int64)
    cap = 1 << (n_devices.bit_length() - 1)
    work = lens.astype(float) ** 2
    # the balanced per-device load: the mean, or the tallest sequence spread over the largest group
    balanced = max(work.sum() / n_devices, work.max(initial=0.0) / cap)

    def best_group(n: int, cp: int) -> tuple[int, float]:
        """(first device, that group's maximum load after adding the sequence) of the best group."""
        groups = np.arange(n_devices // cp) * cp
        idx = groups[:, None] + np.arange(cp)[None, :]
        max_load = load[idx].max(axis=1)
        fits = tokens[idx].max(axis=1) + math.ceil(n / cp) <= max_seqlen_per_rank
        # feasible groups first, then the smallest current maximum load, then the fewest tokens
        best = int(np.lexsort((tokens[idx].max(axis=1), max_load, ~fits))[0])
        return int(groups[best]), float(max_load[best]) + float(n) * n / cp

    for s in np.argsort(-lens, kind="stable").tolist():
        n, cp = int(lens[s]), int(cps[s])
        b, peak = best_group(n, cp)
        if version == "dev":
            limit = 1.05 * max(balanced, float(load.max(initial=0.0)))
            wide = cp
            while peak > limit and wide < cap:  # a larger group while it lowers the projected maximum
                wide *= 2
                b2, peak2 = best_group(n, wide)
                if peak2 < peak:
                    cp, b, peak = wide, b2, peak2
        base[s], cps[s] = b, cp
        load[b:b + cp] += float(n) * n / cp
        tokens[b:b + cp] += n / cp
    if version == "dev":
        _fill_empty(lens, base, cps, load, tokens, cap)
    return base, cps


def _fill_empty(lens: np.ndarray, base: np.ndarray, cps: np.ndarray, load: np.ndarray, tokens: np.ndarray,
                cap: int) -> None:
    """Megatron's ``fill_empty_gpus``: while a device holds nothing, double the group of the sequence with
    the highest per-device load whose buddy group is empty (in place)."""
    while (tokens == 0).any():
        per_device = lens.astype(float) ** 2 / cps
        moved = False
        for s in np.argsort(-per_device, kind="stable").tolist():
            cp, b = int(cps[s]), int(base[s])
            if cp >= cap:
                continue
            buddy = b ^ cp  # the aligned group of the same size beside it (same group of size 2·cp)
            if buddy + cp > tokens.size or tokens[buddy:buddy + cp].any():
                continue
            n = float(lens[s])
            load[b:b + cp] -= n * n / cp
            tokens[b:b + cp] -= n / cp
            base[s], cps[s] = min(b, buddy), 2 * cp
            load[base[s]:base[s] + 2 * cp] += n * n / (2 * cp)
            tokens[base[s]:base[s] + 2 * cp] += n / (2 * cp)
            moved = True
            break
        if not moved:
            return


@dataclass(frozen=True)
class MegatronDynCPPlanner(Planner):
    """Dynamic CP: per-sequence power-of-two CP groups packed by load, zigzag ring inside each group.

    ``max_seqlen_per_rank``: tokens one device may hold of a sequence (None: ceil(total tokens / P));
    ``version``: "dev" (default) or "2026.01", the scheduler reproduced (module docstring).
    Tuning grid: ``max_seqlen_per_rank`` in {512, 768, 1024, 1536, 2048, 3072, 4096} and None (the mean
    tokens per device), each version: a cap below the mean cannot hold everywhere, and the packer then
    places the sequences that fit no group on the least loaded one (the simulation decides)."""

    max_seqlen_per_rank: int | None = None
    version: str = "dev"
    name = "megatron_dyncp"

    def __post_init__(self):
        m = self.max_seqlen_per_rank
        if m is not None and (not isinstance(m, (int, np.integer)) or isinstance(m, bool) or m <= 0):
            raise InvalidConfigError(f"max_seqlen_per_rank must be a positive int or None, got {m!r}")
        if self.version not in VERSIONS:
            raise InvalidConfigError(f"version must be one of {VERSIONS}, got {self.version!r}")

    def tuning_grid(self, spec: BatchSpec, cluster: Cluster) -> tuple[Planner, ...]:
        values = [*TUNING_MAX_SEQLEN, None]
        return tuple(MegatronDynCPPlanner(m, v) for v in VERSIONS for m in values)

    def plan(self, spec: BatchSpec, cluster: Cluster) -> Plan:
        started = time.perf_counter()
        check_inputs(spec, cluster)
        plan = assemble_static(spec, cluster, self.static_parts(spec, cluster), self.name, started)
        base, cps = self._groups(spec, cluster)
        plan.meta.update(cp_size=cps.tolist(), cp_base=base.tolist(), version=self.version,
                         max_seqlen_per_rank=self.max_seqlen_per_rank)
        return plan

    def _groups(self, spec: BatchSpec, cluster: Cluster) -> tuple[np.ndarray, np.ndarray]:
        """(first device, CP size) of every sequence's group."""
        p = cluster.n_devices
        return pack_groups(spec.seqlens, self.max_seqlen_per_rank or -(-spec.total_tokens // p), p, self.version)

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
