"""A roofline-style cost model with a tile-size efficiency curve.

Tile time = overhead + FLOPs / (rate * eff(q_len) * eff(kv_len) * partial_penalty), where
``eff(n) = n / (n + half)`` models that small tiles run far below the large-tile rate. Transfers cost
``latency + bytes / bandwidth`` with NVLink inside a node and the node's NIC bandwidth shared by its GPUs
across nodes. The profile constants are data files that cite their sources (``profiles/*.json``).
"""
from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields, replace
from importlib import resources
from typing import NamedTuple

import numpy as np

from dcp import setops
from dcp.errors import InvalidConfigError


@dataclass(frozen=True)
class GPUProfile:
    name: str
    peak_tflops: float
    attn_fwd_tflops: float
    attn_bwd_tflops: float
    half_rows: float
    half_cols: float
    partial_tile_efficiency: float
    kernel_overhead_us: float
    hbm_gbps: float
    nvlink_gbps: float
    nic_gbps_per_node: float
    link_latency_us: float
    # optional fields: their defaults keep the model of profiles that do not name them exactly as before
    memory_overhead_us: float | None = None
    """fixed cost of one memory-bound kernel (merge, sum, delta); None: ``kernel_overhead_us``."""
    round_overhead_us: float = 0.0
    """host-side cost, on a device's stream, of each round in which it sends or receives: packing,
    posting and unpacking its messages (0: hidden, as on a GPU whose copies run on a side stream)."""
    program_overhead_us: float = 0.0
    """fixed cost of running one device's program once (input checks, set-up, assembling the result)."""
    partial_waste_keys: float | None = None
    """None: a partial (masked) tile runs its attended pairs at ``partial_tile_efficiency``. A number
    (host kernels that compute whole key sub-blocks): each row of a partial tile costs as if it attended
    this many keys more than it does, at the full-tile rate, at most the whole tile -- so a narrow band or
    a few sink keys cost far more than their pairs, a large causal tile little more (needs the tiles'
    attended pairs: ``fused_call_s(..., unmasked=)``; other callers fall back to the efficiency)."""
    efficiency_group: str = "sequence"
    """which tiles' extents set a kernel call's efficiency: "sequence" -- each (sequence, head block) group
    of a call runs at its merged q and kv extents (a fused varlen launch on a GPU, whatever the tiling);
    "q_block" -- each q token block's tiles run as one segment, at that block's rows and the keys its
    tiles cover together (the native CPU kernel, which walks the tile table segment by segment)."""
    host_program_us: float = 0.0
    """Host time of the executor per program run before its first instruction is issued (set-up and
    finishing the previous one: ``dcp bench overhead``'s setup + finish). The ``host_*`` fields model an
    asynchronous device (a GPU): its host issues the instructions in program order, each costing the
    host this much, never waiting for the device; an instruction cannot start on the device before the
    host has issued it, so a host slower than the device's work leaves the device idle. 0 (the default):
    the host is never the bottleneck. Host-side executors (the CPU) charge their host work on the
    device's own stream instead (``round_overhead_us``, ``program_overhead_us``)."""
    host_launch_us: float = 0.0
    """host time per ``CommLaunch`` in which the device sends or receives (posting the round)."""
    host_message_us: float = 0.0
    """host time per message of a launch (one per peer and round, as the simulator coalesces flows:
    packing and posting it), charged with the launch."""
    host_wait_us: float = 0.0
    """host time per ``CommWait`` of a round with transfers (the wait and unpacking what arrived)."""
    host_compute_us: float = 0.0
    """host time per ``Compute`` (tables, argument checks, the kernel launch)."""
    host_reduce_us: float = 0.0
    """host time per ``Reduce`` (merged unit); a round's merges are issued together, then run."""
    host_reduce_step_us: float = 0.0
    """host time per round in which the device merges anything (the executor's reduce step: its views
    made in one batch, one grouped sum per layer), on top of ``host_reduce_us`` per unit."""
    nics_per_node: int | None = None
    """NICs a node's inter-node bandwidth is split over, each reached only by its own GPUs (GPU g of a
    node uses NIC ``g // ceil(gpus_per_node / nics_per_node)``; p4d: 4 NICs, 2 GPUs each); None: one pool
    of ``nic_gbps_per_node`` that any GPU of the node can use whole."""

    def __post_init__(self):
        for name in HOST_FIELDS:
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise InvalidConfigError(f"GPU profile {self.name!r}: {name} must be a finite number >= 0 "
                                         f"(microseconds), got {v!r}")

    def without_host(self) -> "GPUProfile":
        """This profile with a host that keeps ahead of the device (every ``host_*`` field 0)."""
        return replace(self, **dict.fromkeys(HOST_FIELDS, 0.0))


#: the host costs of an asynchronous device, in the order ``CostModel.host_s`` returns them
HOST_FIELDS = ("host_program_us", "host_launch_us", "host_message_us", "host_wait_us", "host_compute_us",
               "host_reduce_us", "host_reduce_step_us")


def available_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("dcp.cost").joinpath("profiles").iterdir()
                  if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> GPUProfile:
    """Load a bundled profile by name ("a100", "h100", "h200") or a JSON file by path."""
    if name_or_path.endswith(".json"):
        text = open(name_or_path).read()
    else:
        res = resources.files("dcp.cost").joinpath("profiles", f"{name_or_path.lower()}.json")
        if not res.is_file():
            raise InvalidConfigError(
                f"unknown GPU profile {name_or_path!r}; bundled: {available_profiles()} or a path to a .json")
        text = res.read_text()
    raw = json.loads(text)
    names = {f.name for f in fields(GPUProfile)}
    required = {f.name for f in fields(GPUProfile) if f.default is MISSING}
    missing = required - raw.keys()
    if missing:
        raise InvalidConfigError(f"GPU profile {name_or_path!r} lacks {sorted(missing)}")
    return GPUProfile(**{k: raw[k] for k in names if k in raw})


@dataclass(frozen=True)
class CostModel:
    """Times in seconds. Vectorized over numpy arrays of tiles."""

    profile: GPUProfile

    @staticmethod
    def named(name: str = "h100") -> "CostModel":
        return CostModel(load_profile(name))

    def _efficiency(self, q_len, kv_len, full):
        p = self.profile
        eff = (q_len / (q_len + p.half_rows)) * (kv_len / (kv_len + p.half_cols))
        return eff * np.where(full, 1.0, p.partial_tile_efficiency)

    def tile_groups(self, layout, tiles) -> np.ndarray:
        """int64 key per tile of the group whose merged extents set its efficiency in a fused call
        (``efficiency_group``): (sequence, head block) or (q token block, head block)."""
        mode = self.profile.efficiency_group
        if layout.grouped:  # a grouped tile is charged by its own per-sequence extents (``shapes``)
            owner = tiles.q_tb
        elif mode == "sequence":
            owner = layout.tb_seq[tiles.q_tb]
        elif mode == "q_block":
            owner = tiles.q_tb
        else:
            raise InvalidConfigError(f"profile {self.profile.name}: efficiency_group must be 'sequence' or "
                                     f"'q_block', got {mode!r}")
        return np.asarray(owner, np.int64) * layout.n_head_blocks + tiles.hb

    def tile_forward_s(self, flops, q_len, kv_len, full):
        p = self.profile
        eff = self._efficiency(np.asarray(q_len, float), np.asarray(kv_len, float), np.asarray(full))
        return p.kernel_overhead_us * 1e-6 + np.asarray(flops, float) / (p.attn_fwd_tflops * 1e12 * eff)

    def tile_backward_s(self, flops, q_len, kv_len, full):
        p = self.profile
        eff = self._efficiency(np.asarray(q_len, float), np.asarray(kv_len, float), np.asarray(full))
        return p.kernel_overhead_us * 1e-6 + np.asarray(flops, float) / (p.attn_bwd_tflops * 1e12 * eff)

    def nic_groups(self, gpus_per_node: int) -> tuple[int, float]:
        """``(GPUs per NIC, bytes/s of one NIC per direction)`` under ``nics_per_node`` (one NIC of the
        node's whole bandwidth per node when it is None)."""
        p = self.profile
        if p.nics_per_node is None:
            return gpus_per_node, p.nic_gbps_per_node * 1e9
        if p.nics_per_node < 1:
            raise InvalidConfigError(f"profile {p.name}: nics_per_node must be >= 1, got {p.nics_per_node}")
        per_nic = -(-gpus_per_node // p.nics_per_node)
        return per_nic, p.nic_gbps_per_node * 1e9 / p.nics_per_node

    def nic_layout(self, gpus_per_node: int, nodes: int, nic: str | None = None) -> tuple[int, int, float]:
        """``(GPUs per NIC, number of NICs, bytes/s per NIC and direction)`` for a NIC model: None = the
        profile's (``nic_groups``), "node" = one pool per node, "rail" = one NIC per GPU with
        ``1 / gpus_per_node`` of the node's bandwidth. A NIC never spans two nodes."""
        gpn = gpus_per_node
        if nic == "node":
            per_nic, cap = gpn, self.profile.nic_gbps_per_node * 1e9
        elif nic == "rail":
            per_nic, cap = 1, self.profile.nic_gbps_per_node * 1e9 / gpn
        elif nic is None:
            per_nic, cap = self.nic_groups(gpn)
        else:
            raise InvalidConfigError(f"nic must be None, 'node' or 'rail', got {nic!r}")
        per_nic = min(per_nic, gpn)
        while gpn % per_nic:
            per_nic += 1
        return per_nic, nodes * (gpn // per_nic), cap

    def transfer_s(self, nbytes, inter_node, gpus_per_node: int = 1):
        """One point-to-point transfer; across nodes a GPU gets 1/gpus_per_node of the node's NIC."""
        p = self.profile
        bw = np.where(inter_node, p.nic_gbps_per_node / max(gpus_per_node, 1), p.nvlink_gbps) * 1e9
        return p.link_latency_us * 1e-6 + np.asarray(nbytes, float) / bw

    @staticmethod
    def tile_shapes(tiles, idx=None):
        """Grouped tiles' moments ``(unmasked, sub_wq, sub_wk, sub_wqk)`` (``dcp.layout.pieces``; at ``idx``), or
        None for ordinary tiles: the ``shapes`` argument of ``fused_call_s`` / ``fused_calls_s``."""
        if tiles.sub_n is None:
            return None
        sel = slice(None) if idx is None else idx
        return tiles.unmasked[sel], tiles.sub_wq[sel], tiles.sub_wk[sel], tiles.sub_wqk[sel]

    def inverse_efficiency(self, shapes, full) -> np.ndarray:
        """1 / efficiency of grouped tiles: their per-sequence sub-tiles' time over their pairs' ideal
        time, sum p_s (1 + h_q/q_s)(1 + h_k/k_s) / sum p_s from the moments (``dcp.layout.pieces``); partial
        tiles (any sub-tile masked) at ``partial_tile_efficiency``."""
        p = self.profile
        pairs, wq, wk, wqk = (np.asarray(a, float) for a in shapes)
        inv = (pairs + p.half_rows * wq + p.half_cols * wk + p.half_rows * p.half_cols * wqk) / np.maximum(pairs, 1.0)
        return inv / np.where(np.asarray(full), 1.0, p.partial_tile_efficiency)

    def tile_alone_s(self, layout, tiles, direction: str) -> np.ndarray:
        """float ``[n_tiles]``: seconds of every tile run alone in ``direction`` -- its own launch, at its
        own extents (grouped tiles, ``dcp.layout.pieces``: their per-sequence sub-tiles, ``inverse_efficiency``)."""
        backward = direction == "backward"
        flops = tiles.bwd_flops if backward else tiles.fwd_flops
        if tiles.sub_n is not None:
            p = self.profile
            rate = (p.attn_bwd_tflops if backward else p.attn_fwd_tflops) * 1e12
            return p.kernel_overhead_us * 1e-6 + flops * self.inverse_efficiency(self.tile_shapes(tiles), tiles.full) / rate
        q_len, kv_len = layout.tb_len[tiles.q_tb], layout.tb_len[tiles.kv_tb]
        alone = self.tile_backward_s if backward else self.tile_forward_s
        return np.asarray(alone(flops, q_len, kv_len, tiles.full), dtype=float)

    def _tile_busy_s(self, flops, full, q_ext, kv_ext, rate, q_tb, kv_tb, tb_len, unmasked,
                     shapes=None) -> np.ndarray:
        """Seconds of each tile inside a fused call, at its group's extents (``partial_waste_keys`` with
        ``unmasked``, the tiles' attended pairs: partial tiles charged their pairs plus the waste).

        ``shapes`` (grouped tiles, ``tile_shapes``): a tile runs as one sub-tile per sequence, each at its
        own extents (``inverse_efficiency``) -- how a varlen call runs a shard; the CPU kernel's waste
        model does not apply to them."""
        full = np.asarray(full)
        if shapes is not None:
            return flops * self.inverse_efficiency(shapes, full) / rate
        waste = self.profile.partial_waste_keys
        if waste is None or unmasked is None:
            return flops / (rate * self._efficiency(q_ext, kv_ext, full))
        unmasked = np.maximum(np.asarray(unmasked, float), 1.0)
        q_len = tb_len[np.asarray(q_tb, np.int64)].astype(float)
        cells = q_len * tb_len[np.asarray(kv_tb, np.int64)]
        pairs = np.where(full, unmasked, np.minimum(unmasked + waste * q_len, cells))
        return flops / unmasked * pairs / (rate * self._efficiency(q_ext, kv_ext, True))

    def fused_call_s(self, flops, full, q_tb, kv_tb, group, tb_len, backward: bool = False,
                     unmasked=None, shapes=None) -> float:
        """One kernel call over a set of tiles (how executors run a ``Compute`` instruction: a single
        varlen launch). The launch overhead is paid once; each (sequence, head block) group of tiles
        runs at the efficiency of its merged extents -- the q rows and kv columns it covers -- so a plan
        is not charged for how finely its tiles happen to be cut.

        Args: per-tile arrays ``flops``, ``full``, ``q_tb``, ``kv_tb``, ``group`` (any int key per
        (sequence, head block)); ``tb_len``: tokens per token block; ``unmasked``: per-tile attended
        pairs (only the ``partial_waste_keys`` model reads them); ``shapes``: grouped tiles' extents
        (``tile_shapes``), which replace the merged extents.
        """
        p = self.profile
        flops = np.asarray(flops, float)
        if flops.size == 0:
            return 0.0
        group = np.asarray(group, np.int64)
        gid, g_inv = np.unique(group, return_inverse=True)
        extents = []
        for blocks in (q_tb, kv_tb):
            key = np.unique(np.stack([g_inv, np.asarray(blocks, np.int64)], axis=1), axis=0)
            extents.append(np.bincount(key[:, 0], weights=tb_len[key[:, 1]], minlength=gid.size))
        q_ext, kv_ext = extents[0][g_inv], extents[1][g_inv]
        rate = (p.attn_bwd_tflops if backward else p.attn_fwd_tflops) * 1e12
        busy = self._tile_busy_s(flops, full, q_ext, kv_ext, rate, q_tb, kv_tb, tb_len, unmasked, shapes)
        return float(p.kernel_overhead_us * 1e-6 + busy.sum())

    def fused_calls_s(self, flops, full, q_tb, kv_tb, group, tb_len, cell, n_cells: int,
                      backward: bool = False, unmasked=None, shapes=None) -> np.ndarray:
        """``fused_call_s`` of many calls at once: tile ``t`` belongs to call ``cell[t]`` (0..n_cells-1);
        returns float ``[n_cells]`` (0 for a call without tiles)."""
        p = self.profile
        cell = np.asarray(cell, np.int64)
        out = np.zeros(n_cells)
        if cell.size == 0:
            return out
        group = np.asarray(group, np.int64)
        gkey = cell * (int(group.max()) + 1) + group
        ug, g_inv = np.unique(gkey, return_inverse=True)
        n_tb = tb_len.size
        ext = [None, None]
        for i, blocks in enumerate((q_tb, kv_tb) if shapes is None else ()):
            pair = setops.unique(g_inv.astype(np.int64) * n_tb + np.asarray(blocks, np.int64))
            ext[i] = np.bincount(pair // n_tb, weights=tb_len[pair % n_tb], minlength=ug.size)[g_inv]
        rate = (p.attn_bwd_tflops if backward else p.attn_fwd_tflops) * 1e12
        t = self._tile_busy_s(np.asarray(flops, float), full, ext[0], ext[1], rate, q_tb, kv_tb, tb_len, unmasked,
                              shapes)
        busy = np.bincount(cell, weights=t, minlength=n_cells)
        used = np.bincount(cell, minlength=n_cells) > 0
        return busy + used * p.kernel_overhead_us * 1e-6

    def memory_bound_s(self, nbytes):
        """A kernel streaming ``nbytes`` through HBM (merge, sum, gather)."""
        p = self.profile
        over = p.kernel_overhead_us if p.memory_overhead_us is None else p.memory_overhead_us
        return over * 1e-6 + np.asarray(nbytes, float) / (p.hbm_gbps * 1e9)

    def merges_s(self, step: np.ndarray, is_sum: np.ndarray, n_sources: np.ndarray,
                 unit_nbytes: np.ndarray) -> np.ndarray:
        """Seconds of each merge of a device's rounds, in the order given: ``step`` (int, one id per (device,
        round)), ``is_sum`` (dQ/dK/dV partials, summed; else O/LSE, log-sum-exp merged), the partials each
        merge receives and one unit's bytes. A merge streams ``(2 + n_sources) * unit_nbytes`` (the
        accumulator read and written, each partial read). The executor runs a step's O merges one kernel
        each, but its sums as one grouped add per layer (``torch._foreach_add_``: layer k adds every unit's
        k-th partial), so a step's sums pay ``memory_bound_s``'s fixed cost once per layer -- as many as the
        most partials any of them receives -- charged to the step's first sum, not once per unit."""
        step = np.asarray(step, np.int64)
        is_sum = np.asarray(is_sum, bool)
        n_sources = np.asarray(n_sources, np.int64)
        nbytes = (2 + n_sources) * np.asarray(unit_nbytes, float)
        out = np.where(is_sum, nbytes / (self.profile.hbm_gbps * 1e9), self.memory_bound_s(nbytes)).astype(float)
        idx = np.flatnonzero(is_sum)
        if idx.size:
            ustep, first, inv = np.unique(step[idx], return_index=True, return_inverse=True)
            layers = np.zeros(ustep.size, np.int64)
            np.maximum.at(layers, inv, n_sources[idx])
            out[idx[first]] += layers * float(self.memory_bound_s(0.0))  # the fixed cost alone
        return out

    def host_s(self) -> "HostCosts":
        """The profile's ``host_*`` fields in seconds."""
        return HostCosts(*(getattr(self.profile, name) * 1e-6 for name in HOST_FIELDS))


class HostCosts(NamedTuple):
    """Seconds of host time per program, launch, message, wait, compute, reduce (merged unit) and reduce
    step (round with merges) (``GPUProfile.host_*``)."""

    program: float
    launch: float
    message: float
    wait: float
    compute: float
    reduce: float
    reduce_step: float

    def merges_s(self, n_merges):
        """Host seconds of a device's merges in one round (or per round, an array): ``reduce`` per merged unit
        and ``reduce_step`` once for a round with any (the executor merges a round's partials as one step)."""
        n = np.asarray(n_merges, dtype=float)
        return self.reduce * n + self.reduce_step * (n > 0)

    @property
    def any(self) -> bool:
        return any(x > 0 for x in self)
