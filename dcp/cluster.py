"""The cluster: nodes of GPUs. Link speeds live in the cost model's GPU/network profile."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcp.errors import InvalidClusterError


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines with ``gpus_per_node`` devices each; device ``d`` lives on node ``d // gpus_per_node``."""

    nodes: int = 1
    gpus_per_node: int = 1

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
                raise InvalidClusterError(f"{name} must be a positive int, got {v!r}")

    @property
    def n_devices(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, device):
        """Node index of a device (int or int array)."""
        return np.asarray(device) // self.gpus_per_node if not isinstance(device, int) else device // self.gpus_per_node

    def devices_of(self, node: int) -> range:
        return range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node)

    def topology(self):
        """networkx graph: devices joined by 'nvlink' edges inside a node and 'network' edges across nodes."""
        import networkx as nx

        g = nx.Graph()
        for d in range(self.n_devices):
            g.add_node(d, node=self.node_of(d))
        for a in range(self.n_devices):
            for b in range(a + 1, self.n_devices):
                g.add_edge(a, b, link="nvlink" if self.node_of(a) == self.node_of(b) else "network")
        return g
