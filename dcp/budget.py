"""The memory budget every candidate of dcp's search is held to.

Two quantities per device decide whether a plan fits where static context parallelism fits:

- **resident tokens** (the home token blocks): every non-attention layer stores activations for them, so
  a plan may hold at most ``PlannerConfig.token_budget`` (``(1 + epsilon_memory) x`` the mean, or an
  explicit ``max_tokens_per_device``) on one device;
- **transient buffers** (received inputs and partial outputs alive at once, per direction;
  ``dcp.memory.transient_peak_bytes``): at most ``PlannerConfig.transient_budget x`` the bytes of the
  attention activations (q, k, v and o) of the budget's tokens.

``choose_within`` keeps the candidates within both budgets (resident tokens first: it filters, transient
buffers are checked lazily from the fastest candidate down, since they need the programs). When no
candidate fits, the one holding the fewest tokens (then the smallest buffers) stands, with a
``RuntimeWarning`` naming the device and its figures, or ``MemoryBudgetError`` under ``strict_memory``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from dcp.errors import MemoryBudgetError

#: how many of the fastest candidates the transient-buffer check builds programs for before giving up
TRANSIENT_CHECKS = 4


@dataclass(frozen=True)
class MemoryBudget:
    """Per-device limits: resident tokens, and transient bytes per direction (None: unlimited)."""

    tokens: float
    transient_bytes: float | None
    strict: bool = False

    @classmethod
    def of(cls, spec, cluster, cfg) -> "MemoryBudget":
        tokens = cfg.token_budget(spec.total_tokens, cluster.n_devices)
        transient = None
        if cfg.transient_budget is not None:
            per_token = (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim * spec.element_bytes
            transient = cfg.transient_budget * tokens * per_token
        return cls(tokens, transient, cfg.strict_memory)


def device_tokens(cand, n_devices: int) -> np.ndarray:
    """Resident tokens per device of a candidate."""
    return np.bincount(cand.home, weights=cand.layout.tb_len, minlength=n_devices)


def candidate_transient(cand, spec, n_devices: int) -> np.ndarray:
    """Peak transient bytes per device, the larger of the two directions (``dcp.memory``)."""
    from dcp.build import build_program
    from dcp.memory import transient_peak_bytes

    peaks = [transient_peak_bytes(spec, cand.layout, build_program(d, s.tile_stage, s.routes), cand.tile_device,
                                  cand.home, n_devices, cand.tiles)
             for d, s in (("forward", cand.forward), ("backward", cand.backward))]
    return np.maximum(*peaks)


def within_tokens(cands: list, budget: MemoryBudget) -> tuple[list, bool]:
    """(the candidates within the token budget, True) or, when none is, (those holding the fewest
    tokens on their busiest device, within 1 %, False)."""
    fits = [c for c in cands if c.max_tokens <= budget.tokens * (1 + 1e-9)]
    if fits:
        return fits, True
    least = min(c.max_tokens for c in cands)
    return [c for c in cands if c.max_tokens <= least * 1.01], False


def choose_within(ranked: list, budget: MemoryBudget, spec, n_devices: int) -> tuple[object, list[str]]:
    """The first of ``ranked`` (fastest first, all within the token budget or the least over it) whose
    transient peak fits, checking at most ``TRANSIENT_CHECKS``; else the one of those with the smallest
    peak. Returns it and the notes to report."""
    if budget.transient_bytes is None:
        return ranked[0], []
    checked = []
    for cand in ranked[:TRANSIENT_CHECKS]:
        peak = candidate_transient(cand, spec, n_devices)
        if peak.max(initial=0) <= budget.transient_bytes * (1 + 1e-9):
            return cand, []
        checked.append((int(peak.max()), int(np.argmax(peak)), cand))
    peak, dev, cand = min(checked, key=lambda c: c[0])
    return cand, [f"memory budget: no plan keeps transient buffers within {budget.transient_bytes / 2**20:.1f} MiB "
                  f"per device; device {dev} holds {peak / 2**20:.1f} MiB at once ({cand.label})"]


def token_note(cand, budget: MemoryBudget, n_devices: int) -> str:
    tokens = device_tokens(cand, n_devices)
    dev = int(np.argmax(tokens))
    return (f"memory budget: no plan keeps resident tokens within {budget.tokens:.6g} per device; device {dev} "
            f"holds {int(tokens[dev])} tokens ({tokens[dev] / tokens.mean():.2f}x the mean; {cand.label}) - a "
            "token block larger than the budget, or too few blocks for the devices: lower block_size, raise "
            "epsilon_memory / max_tokens_per_device, or use fewer devices")


def report(notes: list[str], budget: MemoryBudget) -> None:
    """Warn about (or, under ``strict``, refuse) a plan outside the budget."""
    if not notes:
        return
    if budget.strict:
        raise MemoryBudgetError("; ".join(notes))
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=4)
