"""``dcp bench e2e --model gpt-oss``: a model whose layers differ, end to end, SIMULATED (not measured).

The model is gpt-oss-like (the layout of OpenAI's gpt-oss-20b: 24 layers alternating 128-token
sliding-window and full causal attention, 64 query / 8 KV heads of dimension 64, hidden 2880, a
mixture of 32 experts of which 4 run per token, learned attention sinks), TP = 4, on the same 64 GPUs and
network model as ``dcp bench e2e`` (``dcp.bench.e2e``: 16 data-parallel TP groups, ``Cluster(8, 2)``,
the NIC scaled to one TP rank's share). Per TP rank attention has 16 query and 2 KV heads. The sinks'
cost (one log-sum-exp per row at the home merge) is left out, equal for every plan.

Iteration = Σ_kind layers × (simulated forward + backward attention of that kind's plan + the
non-attention work of the device with the most tokens), with that work the active parameters' FLOPs per
token (QKV, output projection, router and 4 experts' SwiGLU MLPs) at the given MFU.

Rows per (dataset, max_len):
- ``dcp``: dcp's planner on the layered batch (one placement, a program per kind; ``dcp.LayeredPlan``);
- ``dcp_full_only``: dcp planned for the full mask alone, that plan run by every layer (what dcp did
  before layer kinds: a windowed layer pays the full layers' work and communication);
- ``dcp_full_placement``: the full-mask plan's placement, with the windowed layers' own program on it
  (the layer kinds without the joint placement search);
- ``best_tuned``: every static baseline of ``dcp.baselines`` at every point of its tuning grid (taken on
  the full mask), each kind planned by the baseline for that kind's masks, scored by the iteration above;
  the best ``tune_top`` points by the estimate plus the default are simulated, the fastest wins. Tokens
  have one home in every layer: a baseline whose placement depends on the mask (Magi's dispatch) places
  them by the full mask, and its windowed layers run on that placement, tiles on the query's home and
  only keys moving (Magi's rule), scheduled by dcp (``homes_agree`` False marks such a point).

Output: ``e2e_layers_<profile><tag>.csv``.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np

from dcp.bench.common import (E2ESetting, config_fields, dcp_config, e2e_cost_model, git_revision, machine,
                              plan_quietly, progress, write_csv)
from dcp.cluster import Cluster

MAX_LENS = (16384, 32768, 65536, 131072)
DATASETS = ("longalign", "ldc")


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """A gpt-oss-like model (default: gpt-oss-20b's shape) and how it is split (TP)."""

    layers: int = 24
    sliding_layers: int = 12
    window: int = 128
    hidden: int = 2880
    heads: int = 64
    kv_groups: int = 8
    head_dim: int = 64
    experts_per_token: int = 4
    experts: int = 32
    expert_ffn: int = 2880
    tp: int = 4

    def __post_init__(self):
        if self.heads % self.tp or self.kv_groups % self.tp:
            raise ValueError(f"heads ({self.heads}) and kv_groups ({self.kv_groups}) must divide by tp ({self.tp})")
        if not 0 < self.sliding_layers < self.layers:
            raise ValueError(f"sliding_layers must be in (0, {self.layers}), got {self.sliding_layers}")

    @property
    def kind_layers(self) -> dict[str, int]:
        return {"full": self.layers - self.sliding_layers, "sliding": self.sliding_layers}

    def fwd_bwd_flops_per_token(self) -> float:
        """Non-attention forward + backward (3x forward) FLOPs per token per layer on one TP rank."""
        h, q_dim, kv_dim = self.hidden, self.heads * self.head_dim, self.kv_groups * self.head_dim
        fwd = 2.0 * (h * (q_dim + 2 * kv_dim) + q_dim * h + h * self.experts
                     + self.experts_per_token * 3 * h * self.expert_ffn)
        return 3.0 * fwd / self.tp


@dataclasses.dataclass(frozen=True)
class E2ELayersConfig(E2ESetting):
    datasets: tuple[str, ...] = DATASETS
    max_lens: tuple[int, ...] = MAX_LENS
    model: GptOssConfig = GptOssConfig()


def layered_spec(lens, m: GptOssConfig):
    from dcp.masks import CausalMask, SlidingWindowMask
    from dcp.spec import BatchSpec

    return BatchSpec(np.asarray(lens, dtype=np.int64), {"full": CausalMask(), "sliding": SlidingWindowMask(m.window)},
                     m.heads // m.tp, m.kv_groups // m.tp, m.head_dim, "bfloat16", layers=m.kind_layers)


def _iteration(kind_plans: dict, m: GptOssConfig, cost, token_s: float) -> dict:
    """Per kind simulated attention, the non-attention time of its busiest device, and the iteration (s)."""
    from dcp.planner.budget import device_tokens
    from dcp.sim import simulate_both

    out, total = {}, 0.0
    for kind, plan in kind_plans.items():
        fwd, bwd = simulate_both(plan, cost, record_events=False)
        tokens = float(device_tokens(plan, plan.n_devices).max())
        other = token_s * tokens
        out[kind] = (fwd.makespan_s, bwd.makespan_s, other, int(tokens))
        total += m.kind_layers[kind] * (fwd.makespan_s + bwd.makespan_s + other)
    out["iteration_s"] = total
    return out


def _row(cell: dict, planner: str, got: dict, **extra) -> dict:
    row = dict(cell, planner=planner)
    for kind in ("full", "sliding"):
        f, b, o, t = got[kind]
        row.update({f"{kind}_fwd_ms": round(f * 1e3, 4), f"{kind}_bwd_ms": round(b * 1e3, 4),
                    f"{kind}_other_ms": round(o * 1e3, 4), f"{kind}_max_device_tokens": t})
    row["iteration_s"] = float(f"{got['iteration_s']:.6g}")
    row.update(extra)
    return row


def _on_placement(plan, kind_spec, cluster: Cluster, config):
    """``kind_spec``'s plan on ``plan``'s placement (its blocks cut as dcp's layered planner cuts them,
    ``dcp.planner.layered.kind_layout``; tiles on their q block's home), scheduled by dcp."""
    from dcp.layout.tiles import enumerate_tiles
    from dcp.planner.candidates import evaluate
    from dcp.planner.layered import kind_layout
    from dcp.schedule.assemble import assemble

    layout, home = kind_layout(kind_spec, plan.layout, plan.home.astype(np.int64))
    tiles = enumerate_tiles(kind_spec, layout)
    cand = evaluate("placement", kind_spec, cluster, layout, tiles, home, home[tiles.q_tb], config.cost_model,
                    config.search.stage_counts, config.two_phase)
    return assemble(kind_spec, cluster, layout, tiles, home, cand.tile_device, cand.forward.tile_stage,
                    cand.forward.routes, "dcp", time.perf_counter(), backward=cand.backward)


def _best_tuned(spec, cluster: Cluster, m: GptOssConfig, cost, token_s: float, top: int, config):
    """(label, per-kind results, whether the baseline's own kinds' placements agreed) of the fastest static
    baseline point, or None. A point whose placement depends on the mask (Magi's dispatch) places the tokens
    by the full mask, as a user dispatching once would; its windowed layers then run on that placement
    (their tiles on the query's home, only keys moving: Magi's rule), scheduled by dcp."""
    from dcp.baselines import BASELINES
    from dcp.bench.common import BASELINE_NAMES
    from dcp.bench.tuned import _estimate_s, label
    from dcp.errors import DcpError
    from dcp.schedule.assemble import assemble_static

    specs = {k: spec.for_kind(k) for k in spec.kinds}
    extra = lambda layout, home: token_s * float(  # noqa: E731
        np.bincount(home, weights=layout.tb_len, minlength=cluster.n_devices).max())
    best = None
    for name in BASELINE_NAMES:
        base = BASELINES[name]()
        grid = list(dict.fromkeys([base, *base.tuning_grid(specs["full"], cluster)]))
        points = []
        for i, point in enumerate(grid):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    parts = {k: point.static_parts(s, cluster) for k, s in specs.items()}
            except (DcpError, ValueError):
                continue
            est = sum(m.kind_layers[k] * _estimate_s(specs[k], cluster, p, cost, extra) for k, p in parts.items())
            points.append((est, i, point, parts))
        points.sort(key=lambda p: (p[0], p[1]))
        chosen = points[:top] + [p for p in points[top:] if p[1] == 0]
        for _, _, point, parts in chosen:
            plans = {k: assemble_static(specs[k], cluster, p, point.name, time.perf_counter()) for k, p in parts.items()}
            agree = all(np.array_equal(plans["full"].token_device(), p.token_device()) for p in plans.values())
            if not agree:  # tokens have one home in every layer: the full layers' placement
                plans = {k: p if k == "full" else _on_placement(plans["full"], specs[k], cluster, config)
                         for k, p in plans.items()}
            got = _iteration(plans, m, cost, token_s)
            if best is None or got["iteration_s"] < best[1]["iteration_s"]:
                best = (label(point), got, agree)
    return best


def run_e2e_layers(cfg: E2ELayersConfig) -> list[dict]:
    """Run the grid; rows as the module docstring says."""
    from dcp.data import make_batches
    from dcp.planner.dcp_planner import DCPPlanner

    m = cfg.model
    cost = e2e_cost_model(cfg.profile, cfg.gpus_per_node, cfg.physical_gpus_per_node)
    token_s = m.fwd_bwd_flops_per_token() / (cfg.mfu * cost.profile.peak_tflops * 1e12)
    cluster = Cluster(cfg.nodes, cfg.gpus_per_node)
    common = dict(simulated=True, profile=cfg.profile, mfu=cfg.mfu, model="gpt-oss-like", layers=m.layers,
                  sliding_layers=m.sliding_layers, window=m.window, tp=m.tp, dp_devices=cluster.n_devices,
                  machine=machine(), revision=git_revision())
    config = dcp_config(cfg.profile, cfg.dcp, cost=cost, token_time_s=token_s)
    rows = []
    for dataset, max_len in progress([(d, L) for d in cfg.datasets for L in cfg.max_lens], desc="e2e gpt-oss"):
        lens = make_batches(dataset, 1.0, tokens_per_batch=max_len, num_batches=1, seed=cfg.seed)[0]
        spec = layered_spec(lens, m)
        cell = dict(dataset=dataset, max_len=max_len, num_seqs=len(lens), tokens=int(sum(lens)),
                    max_seqlen=int(max(lens)))
        started = time.perf_counter()
        layered, _ = plan_quietly(DCPPlanner(config), spec, cluster)
        layered_s = time.perf_counter() - started
        started = time.perf_counter()
        full, _ = plan_quietly(DCPPlanner(config), spec.for_kind("full"), cluster)
        full_s = time.perf_counter() - started
        ours = _iteration({k: layered.kind(k) for k in spec.kinds}, m, cost, token_s)
        full_only = _iteration({"full": full, "sliding": full}, m, cost, token_s)
        on_full = _iteration({"full": full, "sliding": _on_placement(full, spec.for_kind("sliding"), cluster, config)},
                             m, cost, token_s)
        cell_rows = [_row(cell, "dcp_full_only", full_only, planning_time_s=round(full_s, 3),
                          chosen=full.meta.get("search_chosen", "")),
                     _row(cell, "dcp_full_placement", on_full, chosen=full.meta.get("search_chosen", ""))]
        tuned = _best_tuned(spec, cluster, m, cost, token_s, cfg.tune_top, config) if cfg.tuned else None
        if tuned is not None:
            cell_rows.append(_row(cell, "best_tuned", tuned[1], chosen=tuned[0], homes_agree=tuned[2]))
        it = ours["iteration_s"]
        cell_rows.append(_row(
            cell, "dcp", ours, planning_time_s=round(layered_s, 3), chosen=layered.meta.get("layered_chosen", ""),
            speedup_vs_full_only=round(full_only["iteration_s"] / it, 4),
            speedup_vs_full_placement=round(on_full["iteration_s"] / it, 4),
            speedup_vs_best_tuned=round(tuned[1]["iteration_s"] / it, 4) if tuned else "",
            best_tuned=tuned[0] if tuned else "", **config_fields(config)))
        rows += [dict(r, **common) for r in cell_rows]
    return rows


def write_results(rows: list[dict], out_dir, profile: str, tag: str = ""):
    from pathlib import Path

    return write_csv(Path(out_dir) / f"e2e_layers_{profile}{tag}.csv", rows)


HEADLINE = ["dataset", "max_len", "num_seqs", "full_fwd_ms", "sliding_fwd_ms", "iteration_s", "speedup_vs_full_only",
            "speedup_vs_full_placement", "speedup_vs_best_tuned", "best_tuned"]
