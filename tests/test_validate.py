"""The vectorized validator against its reference: the same verdict on valid plans and on every edit.

``dcp.validate`` checks the columnar program with sorts and searches; ``dcp.ir.validate_reference`` simulates
the instruction view one instruction at a time. Both must accept and refuse exactly the same plans: the
plans every planner makes, and those plans after one random edit of a program table, a placement or a
home (most edits break something; some are harmless, and both must then accept).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _breakers import with_program
from _budget import n_examples

import dcp
from dcp import masks as M
from dcp.baselines import BASELINES
from dcp.errors import PlanValidationError
from dcp.ir.program import COLUMNS
from dcp.ir.validate_reference import validate_reference

N_EDITS = n_examples(120, 2000)
GREEDY = dict(partitioner=dcp.GreedyPartitioner(), time_budget_s=None)


def _verdict(fn, plan) -> bool:
    try:
        fn(plan)
        return True
    except PlanValidationError:
        return False


@pytest.fixture(scope="module")
def plans():
    spec = dcp.BatchSpec([70, 33, 21], [M.CausalMask(), M.LambdaMask(sink=2, window=9), M.SharedQuestionMask(0.3, 2)],
                         4, 2, 8, dtype="float32")
    cluster = dcp.Cluster(2, 2)
    out = {"dcp": dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=8, head_block_size=2, **GREEDY))}
    for name, cls in sorted(BASELINES.items()):
        out[name] = cls().plan(spec, cluster)
    return out


def test_both_accept_every_planners_plan(plans):
    for name, plan in plans.items():
        assert _verdict(dcp.validate, plan) and _verdict(validate_reference, plan), name


def _edit(rng: np.random.Generator, plan):
    """One random edit: a field of a transfer or merge row, a tile's stage, device or a block's home, a
    dropped or duplicated row."""
    direction = ("forward", "backward")[int(rng.integers(2))]
    prog = plan.columns(direction)
    what = rng.choice(["transfers", "merges", "tile_stage", "tile_device", "home", "drop", "duplicate"])
    if what in ("transfers", "merges"):
        rows = getattr(prog, what).copy()
        if not rows.shape[0]:
            return None
        i, c = int(rng.integers(rows.shape[0])), int(rng.integers(len(COLUMNS)))
        rows[i, c] = max(0, rows[i, c] + int(rng.choice([-2, -1, 1, 2])))
        return with_program(plan, direction, **{what: rows})
    if what in ("drop", "duplicate"):
        table = "transfers" if rng.random() < 0.6 else "merges"
        rows = getattr(prog, table)
        if not rows.shape[0]:
            return None
        i = int(rng.integers(rows.shape[0]))
        rows = np.delete(rows, i, axis=0) if what == "drop" else np.insert(rows, i, rows[i], axis=0)
        return with_program(plan, direction, **{table: rows})
    if what == "tile_stage":
        stage = prog.tile_stage.copy()
        i = int(rng.integers(stage.size))
        stage[i] = max(0, stage[i] + int(rng.choice([-2, -1, 1, 2])))
        return with_program(plan, direction, tile_stage=stage)
    arr = getattr(plan, what).copy()
    i = int(rng.integers(arr.size))
    arr[i] = int(rng.integers(plan.n_devices))
    return dataclasses.replace(plan, **{what: arr})


def test_same_verdict_after_random_edits(plans):
    rng = np.random.default_rng(2024)
    names = sorted(plans)
    tally = {True: 0, False: 0}
    done = 0
    while done < N_EDITS:
        name = names[done % len(names)]
        edited = _edit(rng, plans[name])
        if edited is None:
            continue
        fast, ref = _verdict(dcp.validate, edited), _verdict(validate_reference, edited)
        assert fast == ref, (name, "fast accepts" if fast else "reference accepts")
        tally[fast] += 1
        done += 1
    assert tally[False] > N_EDITS // 2 and tally[True] > 0, tally  # both outcomes are exercised


def test_problems_name_what_is_wrong(plans):
    plan = plans["ring"]
    prog = plan.backward
    rows = prog.merges.copy()
    with pytest.raises(PlanValidationError, match="never merged"):
        dcp.validate(with_program(plan, "backward", merges=rows[1:]))
    stage = prog.tile_stage.copy()
    stage[int(np.argmax(stage))] = 0
    with pytest.raises(PlanValidationError, match="not yet there"):
        dcp.validate(with_program(plan, "backward", tile_stage=stage))
    bad = prog.transfers.copy()
    bad[0, 3] = bad[0, 4]  # a device sending to itself
    with pytest.raises(PlanValidationError, match="sending to itself"):
        dcp.validate(with_program(plan, "backward", transfers=bad))


@pytest.mark.parametrize("name", ["ring", "te_a2a_p2p", "dcp"])
def test_a_tile_run_before_its_input_arrives_is_named(plans, name):
    """Tiles that read one input on one device are checked as a run; the message still names the tile."""
    plan = plans[name]
    for direction in ("forward", "backward"):
        prog = plan.columns(direction)
        named = 0
        for t in np.flatnonzero(prog.tile_stage > 0)[::7][:6].tolist():
            stage = prog.tile_stage.copy()
            stage[t] = 0
            try:
                dcp.validate(with_program(plan, direction, tile_stage=stage))
            except PlanValidationError as err:
                if "not yet there" in str(err):
                    assert f"tile {t} needs" in str(err), (t, str(err))
                    named += 1
        assert named > 0 or name == "dcp"
