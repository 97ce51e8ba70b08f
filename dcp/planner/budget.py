"""The memory budget every candidate of dcp's search is held to.

Two quantities per device decide whether a plan fits where static context parallelism fits:

- **resident tokens** (the home token blocks): every non-attention layer stores activations for them, so
  a plan may hold at most ``PlannerConfig.token_budget`` (``(1 + epsilon_memory) x`` the mean, or an
  explicit ``max_tokens_per_device``) on one device;
- **transient buffers** (received inputs and partial outputs alive at once, per direction;
  ``dcp.ir.memory.transient_peak_bytes``): at most ``PlannerConfig.transient_budget x`` the bytes of the
  attention activations (q, k, v and o) of the budget's tokens.

``within_tokens`` keeps the candidates within the token budget; ``pick`` then checks transient buffers
lazily from the fastest candidate down (they need the programs) and makes the final, simulated choice. When no
candidate fits, the one holding the fewest tokens (then the smallest buffers) stands, with a
``RuntimeWarning`` naming the device and its figures, or ``MemoryBudgetError`` under ``strict_memory``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from dcp.errors import MemoryBudgetError


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

    def fits_transient(self, peak_bytes: float) -> bool:
        """Whether a plan whose busiest device holds ``peak_bytes`` of transient buffers is within the budget."""
        return self.transient_bytes is None or peak_bytes <= self.transient_bytes * (1 + 1e-9)


def device_tokens(cand, n_devices: int) -> np.ndarray:
    """Resident tokens per device of a candidate."""
    return np.bincount(cand.home, weights=cand.layout.tb_len, minlength=n_devices)


def candidate_programs(cand, spec, cluster):
    """The candidate as an unvalidated ``Plan`` (its forward and backward programs built)."""
    from dcp.ir.plan import Plan
    from dcp.schedule.build import build_program

    return Plan(spec, cluster, cand.layout, cand.tiles, np.asarray(cand.home, dtype=np.int32),
                np.asarray(cand.tile_device, dtype=np.int32),
                build_program("forward", cand.forward.tile_stage, cand.forward.routes),
                build_program("backward", cand.backward.tile_stage, cand.backward.routes), "candidate", 0.0, ())


def plan_transient(plan) -> np.ndarray:
    """Peak transient bytes per device of a plan, the larger of the two directions (``dcp.ir.memory``)."""
    from dcp.ir.memory import plan_transient_peaks

    return np.maximum(*plan_transient_peaks(plan).values())


def within_tokens(cands: list, budget: MemoryBudget) -> tuple[list, bool]:
    """(the candidates within the token budget, True) or, when none is, (those holding the fewest
    tokens on their busiest device, within 1 %, False)."""
    fits = [c for c in cands if c.max_tokens <= budget.tokens * (1 + 1e-9)]
    if fits:
        return fits, True
    least = min(c.max_tokens for c in cands)
    return [c for c in cands if c.max_tokens <= least * 1.01], False


#: candidates estimated more than this much slower than the fastest are not simulated (the estimate's
#: error against the simulator is a few per cent, ``dcp.cost.estimate``)
SIMULATE_WITHIN = 0.1


def pick(ranked: list, budget: MemoryBudget, spec, cluster, cost=None, simulate_top: int = 0,
         token_time_s: float = 0.0, memo: dict | None = None, keep: tuple = ()) -> tuple[object, list[str]]:
    """The final choice among ``ranked`` (best first by the search's estimate; all within the token budget
    or the least over it). Their programs are built in that order until one is within the transient
    budget; of the first ``simulate_top`` distinct plans (a twin of an earlier one, ``same_plan``, is passed
    over) those within it and estimated within ``SIMULATE_WITHIN`` of the first compete by simulated time
    (``dcp.sim``; 0 or 1: the estimate's order stands), so the plan's time is its simulated time, not an
    estimate's. When none is within the transient budget, the one with the
    smallest peak stands (with a note). ``memo``: results per
    candidate kept across calls of one planning run. ``keep``: candidates simulated wherever they rank (a
    choice made before more candidates joined, and those that joined for it: new candidates must not push an
    earlier, faster-simulated choice out of the simulated few)."""
    if budget.transient_bytes is None and simulate_top <= 1:
        return ranked[0], []
    from dcp.planner.candidates import same_plan

    memo = {} if memo is None else memo
    checked, fits = [], []
    first_s = ranked[0].step_s(token_time_s)
    kept = {id(c) for c in keep} if simulate_top > 1 else set()
    left = {id(c) for c in ranked} & kept
    seen: list = []  # (candidate, close) of the distinct plans so far: a twin of one adds nothing
    for i, cand in enumerate(ranked):
        twin = next((c for c, c_close in seen if same_plan(c, cand) and (c_close or id(cand) not in kept)), None)
        left.discard(id(cand))
        if twin is not None:  # the same plan ranked earlier: it would lose the tie, and takes no simulation
            continue
        close = len(seen) < simulate_top and cand.step_s(token_time_s) <= first_s * (1 + SIMULATE_WITHIN)
        close = close or id(cand) in kept
        seen.append((cand, close))
        if i > 0 and not close and fits:
            if not left:
                break  # a candidate within the transient budget is in hand and the rest are not close
            continue
        got = memo.get(id(cand))
        if got is None or (close and got[1] is None):
            plan = candidate_programs(cand, spec, cluster)
            per_dev = plan_transient(plan) if budget.transient_bytes is not None else np.zeros(1, dtype=np.int64)
            peak, dev = int(per_dev.max(initial=0)), int(np.argmax(per_dev))
            sim = _simulated_step_s(plan, cand, cost, token_time_s) if close and simulate_top > 1 else None
            memo[id(cand)] = got = ((peak, dev), sim, cand)
        (peak, dev), sim = got[0], got[1]
        if not budget.fits_transient(peak):
            checked.append((peak, dev, cand))
            continue
        fits.append((sim if sim is not None else float("inf"), i, cand))
        if simulate_top <= 1:
            break
    if fits:
        return min(fits, key=lambda f: f[:2])[2], []
    peak, dev, cand = min(checked, key=lambda c: c[0])
    return cand, [f"memory budget: no plan keeps transient buffers within {budget.transient_bytes / 2**20:.1f} MiB "
                  f"per device; device {dev} holds {peak / 2**20:.1f} MiB at once ({cand.label})"]


def _simulated_step_s(plan, cand, cost, token_time_s: float) -> float:
    from dcp.sim import simulate_both

    fwd, bwd = simulate_both(plan, cost, record_events=False)
    return fwd.makespan_s + bwd.makespan_s + token_time_s * cand.max_tokens


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
