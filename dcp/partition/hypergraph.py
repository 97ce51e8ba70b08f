"""A weighted hypergraph in CSR form, and the km1 objective."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Hypergraph:
    """``vertex_weight`` int64 ``[n]``; net ``e`` has pins ``net_pins[net_ptr[e]:net_ptr[e+1]]`` and
    weight ``net_weight[e]`` (int64). Weights must fit the partitioners' int32 after ``scaled()``."""

    vertex_weight: np.ndarray
    net_ptr: np.ndarray
    net_pins: np.ndarray
    net_weight: np.ndarray

    @property
    def n_vertices(self) -> int:
        return int(self.vertex_weight.size)

    @property
    def n_nets(self) -> int:
        return int(self.net_weight.size)

    def net_of_pin(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_nets), np.diff(self.net_ptr))

    def connectivity(self, parts: np.ndarray) -> np.ndarray:
        """λ(e): number of distinct parts among each net's pins, int64 ``[n_nets]``."""
        k = int(parts.max()) + 1 if parts.size else 1
        key = np.unique(self.net_of_pin() * k + parts[self.net_pins])
        return np.bincount(key // k, minlength=self.n_nets)

    def km1(self, parts: np.ndarray) -> int:
        """Σ_e w(e)·(λ(e) − 1): with net weights in bytes, exactly the bytes multicast."""
        lam = self.connectivity(parts)
        return int((self.net_weight * np.maximum(lam - 1, 0)).sum())

    def block_weights(self, parts: np.ndarray, k: int, weights: np.ndarray | None = None) -> np.ndarray:
        w = self.vertex_weight if weights is None else weights
        return np.bincount(parts, weights=w, minlength=k)

    def sub(self, keep: np.ndarray) -> tuple["Hypergraph", np.ndarray]:
        """Induced sub-hypergraph on vertices ``keep`` (bool mask); nets keep only their pins inside and
        are dropped below two pins. Returns it and the old ids of its vertices."""
        old_ids = np.flatnonzero(keep)
        new_id = np.full(self.n_vertices, -1, dtype=np.int64)
        new_id[old_ids] = np.arange(old_ids.size)
        pin_new = new_id[self.net_pins]
        inside = pin_new >= 0
        net = self.net_of_pin()[inside]
        sizes = np.bincount(net, minlength=self.n_nets)
        keep_net = sizes >= 2
        sel = keep_net[net]
        pins = pin_new[inside][sel]
        sizes = sizes[keep_net]
        ptr = np.concatenate([[0], np.cumsum(sizes)])
        return Hypergraph(self.vertex_weight[old_ids], ptr, pins.astype(np.int32),
                          self.net_weight[keep_net]), old_ids


def scale_to_int32(values: np.ndarray, total_cap: int = 1 << 29) -> np.ndarray:
    """Positive int64 weights whose sum stays below ``total_cap`` (partitioners use int32),
    each at least 1 so no vertex or net becomes free."""
    values = np.asarray(values, dtype=np.float64)
    total = float(values.sum())
    factor = min(1.0, total_cap / total) if total > 0 else 1.0
    return np.maximum(np.rint(values * factor), 1).astype(np.int64)
