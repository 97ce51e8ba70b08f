"""Refinement of a packing: move whole sequences off the critical device while the estimated time drops.

A packing balances modelled work, but what a device pays also depends on how its stages split its
fused calls and on the transfers it waits for, which only the schedule reveals. ``refine_packing``
takes the schedule's per-device estimated finish times (forward + backward), and tries to move a whole
(unsplit) sequence from the device that finishes last to one that finishes early: the sequence whose
modelled time is nearest half the gap first, to the earliest devices first, within the memory cap.
A move is kept only if the re-scheduled plan's estimated forward + backward time (plus the
non-attention work of the device with the most tokens, when the search counts it) drops. The number of
re-evaluations is bounded (not the wall time), so the result is deterministic.
"""
from __future__ import annotations

import numpy as np

from dcp.cluster import Cluster
from dcp.cost import CostModel
from dcp.planner.candidates import Candidate, evaluate
from dcp.spec import BatchSpec


def refine_packing(cand: Candidate, groups: tuple[tuple[int, ...], ...], seq_weight: np.ndarray, spec: BatchSpec,
                   cluster: Cluster, cost: CostModel, two_phase: bool, token_cap: float,
                   max_evaluations: int = 12, tries_per_step: int = 3, token_time_s: float = 0.0) -> Candidate:
    """The refined candidate (``cand`` itself when no move helps). ``groups``: the packing's device
    group per sequence; ``seq_weight``: modelled work per sequence; ``token_cap``: most tokens a device
    may hold after a move (a move never raises the largest device's tokens beyond it)."""
    if cand.forward_ends is None or cand.backward_ends is None:
        return cand
    lay = cand.layout
    whole = np.array([len(g) == 1 for g in groups])
    seq_tokens = np.asarray(spec.seqlens, dtype=float)
    best, evaluations = cand, 0
    # a moved placement is scheduled by dcp (a static plan's own schedule, stage count 0, no longer fits it)
    stages = tuple(s if s > 0 else 4 for s in cand.stages)
    while evaluations < max_evaluations:
        ends = best.forward_ends + best.backward_ends
        seq_dev = best.home[lay.seq_tb_ptr[:-1]]
        hot = int(np.argmax(ends))
        mine = np.flatnonzero(whole & (seq_dev == hot))
        if mine.size == 0:
            break
        tokens = np.bincount(best.home, weights=lay.tb_len, minlength=cluster.n_devices)
        cool = [int(d) for d in np.lexsort((np.arange(ends.size), ends)) if d != hot][:2]
        # a sequence's share of the hot device's time, in proportion to the whole sequences' work there
        share = seq_weight[mine] / max(float(seq_weight[mine].sum()), 1e-300) * ends[hot]
        improved = False
        for d in cool:
            gap = ends[hot] - ends[d]
            for s in mine[np.lexsort((mine, np.abs(share - gap / 2)))][:tries_per_step].tolist():
                if tokens[d] + seq_tokens[s] > token_cap:
                    continue
                home = best.home.copy()
                home[lay.seq_tb_ptr[s]:lay.seq_tb_ptr[s + 1]] = d
                trial = evaluate(best.label, spec, cluster, lay, best.tiles, home, home[best.tiles.q_tb], cost, (),
                                 two_phase, best.notes, per_direction=stages)
                evaluations += 1
                if trial.step_s(token_time_s) < best.step_s(token_time_s) * (1 - 1e-9):
                    best, improved = trial, True
                    break
                if evaluations >= max_evaluations:
                    break
            if improved or evaluations >= max_evaluations:
                break
        if not improved:
            break
    return best
