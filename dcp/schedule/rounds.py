"""The input-round greedy of ``dcp.schedule``: which round every demand (device, remote unit) arrives
in, and from which holder.

``input_rounds`` is the planner's inner loop (a few hundred thousand demands at 1,024 devices, each
looked at once per round). It runs in C++ (``dcp._C.input_rounds``, csrc/rounds.cpp) when the extension
is built, else in Python; ``input_rounds_reference`` is the Python loop and defines the semantics, and
the C++ loop mirrors it operation for operation, so both give identical arrivals and sources (tests
compare them on random demand sets and on planners' schedules).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcp.cluster import Cluster
from dcp.cost import CostModel

if TYPE_CHECKING:
    from dcp.schedule.stages import Demands

try:  # the C++ loop, when the extension is built
    from dcp import _C  # type: ignore[attr-defined]

    _NATIVE = hasattr(_C, "input_rounds")
except ImportError:
    _C, _NATIVE = None, False


def priority_order(dm: "Demands", home: np.ndarray, n_devices: int) -> np.ndarray:
    """int64 ``[n]``: demands in the order rounds take them: by value per byte (equal within 25 %),
    then ring distance from the unit's home (nearest source first), then value per byte exactly."""
    home_dev = home[dm.tb].astype(np.int64)
    density = dm.value / np.maximum(dm.nbytes, 1)
    bucket = np.floor(np.log(np.maximum(density, 1e-300)) / np.log(1.25))  # equal within 25 %
    ring = (dm.dev - home_dev) % n_devices
    return np.lexsort((-density, ring, -bucket)).astype(np.int64)


def input_rounds(dm: "Demands", unit_key: np.ndarray, home: np.ndarray, cluster: Cluster, cost: CostModel,
                 budget_first: np.ndarray, budget: np.ndarray, max_rounds: int,
                 relay: bool = True, native: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(arrival round, source device) of every demand, as ``input_rounds_reference`` defines them;
    ``native``: force (True) or forbid (False) the C++ loop (None: use it when built)."""
    use = _NATIVE if native is None else native
    if not use or dm.n == 0:
        return input_rounds_reference(dm, unit_key, home, cluster, cost, budget_first, budget, max_rounds, relay)
    import torch

    p = cost.profile
    t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a, dtype=dt))  # noqa: E731
    arrival, source = _C.input_rounds(
        t(priority_order(dm, home, cluster.n_devices), np.int64), t(dm.dev, np.int64), t(unit_key, np.int64),
        t(home[dm.tb], np.int64), t(dm.nbytes, np.float64), t(budget_first, np.float64), t(budget, np.float64),
        cluster.gpus_per_node, cluster.nodes, int(max_rounds), bool(relay), float(p.nvlink_gbps * 1e9),
        float(p.nic_gbps_per_node * 1e9))
    return arrival.numpy(), source.numpy()


def input_rounds_reference(dm: "Demands", unit_key: np.ndarray, home: np.ndarray, cluster: Cluster,
                           cost: CostModel, budget_first: np.ndarray, budget: np.ndarray, max_rounds: int,
                           relay: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(arrival round, source device) of every demand: the capacity-limited greedy of ``dcp.schedule``'s
    docstring. A demand joins round r when every resource on its path, its bytes added, drains within
    the receiver's round budget (seconds; ``budget_first`` for round 1, which hides behind the local
    work of stage 0, ``budget`` after); the first transfer of a resource in a round always fits.
    Round ``max_rounds`` takes whatever is left. ``relay=False``: every unit comes from its home."""
    p = cost.profile
    gpn, n_dev, n_nodes = cluster.gpus_per_node, cluster.n_devices, cluster.nodes
    arrival = np.zeros(dm.n, dtype=np.int64)
    source = np.full(dm.n, -1, dtype=np.int64)
    if dm.n == 0:
        return arrival, source
    port, nic = p.nvlink_gbps * 1e9, p.nic_gbps_per_node * 1e9
    home_dev = home[dm.tb].astype(np.int64)
    pending = priority_order(dm, home, n_dev).tolist()
    dev_l, key_l, home_l = dm.dev.tolist(), unit_key.tolist(), home_dev.tolist()
    bytes_l = dm.nbytes.astype(float).tolist()
    node_of = [d // gpn for d in range(n_dev)]
    holders: dict[int, list[int]] = {}  # unit -> devices holding it (home first), from earlier rounds
    for rnd in range(1, max_rounds + 1):
        last = rnd == max_rounds
        bud = (budget_first if rnd == 1 else budget).tolist()
        used_in, used_out = [0.0] * n_dev, [0.0] * n_dev
        nic_in, nic_out = [0.0] * n_nodes, [0.0] * n_nodes
        crossing: set[tuple[int, int]] = set()
        fresh: list[tuple[int, int]] = []
        waiting: list[int] = []
        for i in pending:
            d, key, b = dev_l[i], key_l[i], bytes_l[i]
            cap_port, cap_nic = bud[d] * port, bud[d] * nic
            if not last and used_in[d] > 0 and used_in[d] + b > cap_port:
                waiting.append(i)
                continue
            nd = node_of[d]
            hs = holders.get(key)
            if hs is None:
                hs = holders[key] = [home_l[i]]
            best, best_load = -1, 0.0
            for s in hs:  # the least busy holder in the consumer's node
                if node_of[s] == nd and (best < 0 or used_out[s] < best_load):
                    best, best_load = s, used_out[s]
            cross = best < 0
            if cross:
                if relay and not last and (key, nd) in crossing:
                    waiting.append(i)  # it enters this node this round: relayed from there next round
                    continue
                best_pair = None
                for s in hs:  # the holder whose node's NIC, then port, is least busy
                    pair = (nic_out[node_of[s]], used_out[s])
                    if best_pair is None or pair < best_pair:
                        best, best_pair = s, pair
                ns = node_of[best]
                if not last and ((nic_out[ns] > 0 and nic_out[ns] + b > cap_nic) or
                                 (nic_in[nd] > 0 and nic_in[nd] + b > cap_nic)):
                    waiting.append(i)
                    continue
            if not last and used_out[best] > 0 and used_out[best] + b > cap_port:
                waiting.append(i)
                continue
            arrival[i], source[i] = rnd, best
            used_in[d] += b
            used_out[best] += b
            if cross:
                nic_out[node_of[best]] += b
                nic_in[nd] += b
                crossing.add((key, nd))
            fresh.append((key, d))
        if relay:
            for key, d in fresh:
                holders[key].append(d)
        pending = waiting
        if not pending:
            break
    return arrival, source
