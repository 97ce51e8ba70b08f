"""A roofline-style cost model with a tile-size efficiency curve.

Tile time = overhead + FLOPs / (rate * eff(q_len) * eff(kv_len) * partial_penalty), where
``eff(n) = n / (n + half)`` models that small tiles run far below the large-tile rate. Transfers cost
``latency + bytes / bandwidth`` with NVLink inside a node and the node's NIC bandwidth shared by its GPUs
across nodes. The profile constants are data files that cite their sources (``profiles/*.json``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources

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
    missing = names - raw.keys()
    if missing:
        raise InvalidConfigError(f"GPU profile {name_or_path!r} lacks {sorted(missing)}")
    return GPUProfile(**{k: raw[k] for k in names})


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

    def tile_forward_s(self, flops, q_len, kv_len, full):
        p = self.profile
        eff = self._efficiency(np.asarray(q_len, float), np.asarray(kv_len, float), np.asarray(full))
        return p.kernel_overhead_us * 1e-6 + np.asarray(flops, float) / (p.attn_fwd_tflops * 1e12 * eff)

    def tile_backward_s(self, flops, q_len, kv_len, full):
        p = self.profile
        eff = self._efficiency(np.asarray(q_len, float), np.asarray(kv_len, float), np.asarray(full))
        return p.kernel_overhead_us * 1e-6 + np.asarray(flops, float) / (p.attn_bwd_tflops * 1e12 * eff)

    def transfer_s(self, nbytes, inter_node, gpus_per_node: int = 1):
        """One point-to-point transfer; across nodes a GPU gets 1/gpus_per_node of the node's NIC."""
        p = self.profile
        bw = np.where(inter_node, p.nic_gbps_per_node / max(gpus_per_node, 1), p.nvlink_gbps) * 1e9
        return p.link_latency_us * 1e-6 + np.asarray(nbytes, float) / bw

    def fused_call_s(self, flops, full, q_tb, kv_tb, group, tb_len, backward: bool = False) -> float:
        """One kernel call over a set of tiles (how executors run a ``Compute`` instruction: a single
        varlen launch). The launch overhead is paid once; each (sequence, head block) group of tiles
        runs at the efficiency of its merged extents -- the q rows and kv columns it covers -- so a plan
        is not charged for how finely its tiles happen to be cut.

        Args: per-tile arrays ``flops``, ``full``, ``q_tb``, ``kv_tb``, ``group`` (any int key per
        (sequence, head block)); ``tb_len``: tokens per token block.
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
        eff = self._efficiency(q_ext, kv_ext, np.asarray(full))
        rate = (p.attn_bwd_tflops if backward else p.attn_fwd_tflops) * 1e12
        return float(p.kernel_overhead_us * 1e-6 + (flops / (rate * eff)).sum())

    def fused_calls_s(self, flops, full, q_tb, kv_tb, group, tb_len, cell, n_cells: int,
                      backward: bool = False) -> np.ndarray:
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
        ext = []
        for blocks in (q_tb, kv_tb):
            pair = setops.unique(g_inv.astype(np.int64) * n_tb + np.asarray(blocks, np.int64))
            ext.append(np.bincount(pair // n_tb, weights=tb_len[pair % n_tb], minlength=ug.size)[g_inv])
        rate = (p.attn_bwd_tflops if backward else p.attn_fwd_tflops) * 1e12
        eff = self._efficiency(ext[0], ext[1], np.asarray(full))
        busy = np.bincount(cell, weights=np.asarray(flops, float) / (rate * eff), minlength=n_cells)
        used = np.bincount(cell, minlength=n_cells) > 0
        return busy + used * p.kernel_overhead_us * 1e-6

    def memory_bound_s(self, nbytes):
        """A kernel streaming ``nbytes`` through HBM (merge, sum, gather)."""
        return self.profile.kernel_overhead_us * 1e-6 + np.asarray(nbytes, float) / (self.profile.hbm_gbps * 1e9)
