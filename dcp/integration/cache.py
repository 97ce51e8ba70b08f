"""An LRU cache of plans keyed by (sequence lengths, masks, head geometry, cluster, planner config).

Repeated batches (the same lengths and masks, e.g. a fixed evaluation set or a data set of fixed-length
chunks) are planned once. An entry keeps the serialized plan (what travels between ranks), its sha256
digest (what the ranks compare) and the deserialized ``Plan`` (what the executor runs).
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import InvalidConfigError
from dcp.ir.plan import Plan
from dcp.spec import BatchSpec


def digest_bytes(data: bytes) -> bytes:
    """sha256 of ``data`` (32 bytes)."""
    return hashlib.sha256(data).digest()


def batch_digest(spec: BatchSpec, with_dtype: bool = True) -> bytes:
    """sha256 (32 bytes) of a batch description: lengths, masks and head geometry (and the dtype, unless
    ``with_dtype=False``: it only weighs the cost model, so a plan made for one dtype serves another).

    Independent of process-local object identities, so two ranks that formed the same batch get the
    same digest (used to check that every rank trains on the same batch).
    """
    described = spec.describe()
    if not with_dtype:
        described.pop("dtype")
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return digest_bytes(text.encode())


def config_fingerprint(cluster: Cluster, config: PlannerConfig) -> str:
    """A string that changes with the cluster or any planner setting (``repr`` of the dataclasses)."""
    return f"{cluster!r}|{config!r}"


def plan_key(spec: BatchSpec, cluster: Cluster, config: PlannerConfig, fingerprint: str | None = None) -> bytes:
    """Cache key of a batch: sha256 over the batch digest and the cluster/config fingerprint."""
    fp = config_fingerprint(cluster, config) if fingerprint is None else fingerprint
    return digest_bytes(batch_digest(spec) + fp.encode())


@dataclass(frozen=True, eq=False)
class CachedPlan:
    """A plan in both forms: ``data`` = ``plan.to_bytes()``, ``digest`` = sha256(data), and the ``Plan`` (or
    ``LayeredPlan``)."""

    data: bytes
    digest: bytes
    plan: Plan

    @staticmethod
    def from_bytes(data: bytes, digest: bytes | None = None) -> "CachedPlan":
        from dcp.ir.layered import plan_from_bytes

        return CachedPlan(bytes(data), digest or digest_bytes(data), plan_from_bytes(bytes(data)))

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()


class PlanCache:
    """Least-recently-used map ``key -> CachedPlan`` with hit/miss counters.

    Args:
        capacity: entries kept (0 disables caching: every ``get`` misses, ``put`` stores nothing).
    """

    def __init__(self, capacity: int = 64):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise InvalidConfigError(f"cache capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, CachedPlan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def peek(self, key: bytes) -> CachedPlan | None:
        """The entry without counting a hit or changing the LRU order."""
        return self._entries.get(key)

    def get(self, key: bytes) -> CachedPlan | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: bytes, entry: CachedPlan) -> None:
        if self.capacity == 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def stats(self) -> dict:
        total = self.hits + self.misses
        return {"entries": len(self._entries), "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "hit_rate": self.hits / total if total else 0.0}


__all__ = ["PlanCache", "CachedPlan", "plan_key", "batch_digest", "config_fingerprint", "digest_bytes"]
