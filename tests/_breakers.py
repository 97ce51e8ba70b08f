"""Ways to break a valid plan, one edit of its program tables each (``dcp.ir.program``), shared by the
validator, executor and simulator tests. Each breaker takes (plan, direction) and returns a broken copy,
or None when the plan has nothing it could break that way."""
from __future__ import annotations

import dataclasses

import numpy as np

from dcp.ir.program import DST, HB, KIND, ROUND, SRC, TB


def with_program(plan, direction: str, **arrays):
    """A copy of ``plan`` whose ``direction`` program has ``arrays`` (tile_stage, transfers, merges) replaced."""
    prog = dataclasses.replace(plan.columns(direction), **arrays)
    return dataclasses.replace(plan, **{direction: prog})


def _drop(rows: np.ndarray, i: int) -> np.ndarray:
    return np.delete(rows, i, axis=0)


def drop_input(plan, direction):
    """The first input transfer that some tile reads goes missing."""
    prog = plan.columns(direction)
    tr = prog.transfers
    inputs = np.flatnonzero(~prog.is_partial())
    return with_program(plan, direction, transfers=_drop(tr, int(inputs[0]))) if inputs.size else None


def drop_partial(plan, direction):
    """A partial output is never sent (its merge row stays: a merge of nothing received)."""
    prog = plan.columns(direction)
    sends = np.flatnonzero(prog.is_partial())
    return with_program(plan, direction, transfers=_drop(prog.transfers, int(sends[0]))) if sends.size else None


def drop_merge(plan, direction):
    """A received partial is never merged."""
    mg = plan.columns(direction).merges
    return with_program(plan, direction, merges=_drop(mg, 0)) if mg.shape[0] else None


def compute_before_data(plan, direction):
    """The tile whose input arrives last runs in stage 0, before it is there."""
    prog = plan.columns(direction)
    stage = prog.tile_stage
    if stage.size == 0 or stage.max() == 0 or not (~prog.is_partial()).any():
        return None
    late = stage.copy()
    late[int(np.argmax(stage))] = 0
    return with_program(plan, direction, tile_stage=late)


def add_after_send(plan, direction):
    """A tile of a partial that leaves its device runs after the partial was sent."""
    prog = plan.columns(direction)
    sends = prog.transfers[prog.is_partial()]
    if not sends.shape[0]:
        return None
    tiles = plan.tiles
    side = tiles.kv_tb if sends[0, KIND] == 5 else tiles.q_tb  # DKV is keyed by the kv block
    mine = np.flatnonzero((plan.tile_device == sends[0, SRC]) & (side == sends[0, TB]) & (tiles.hb == sends[0, HB]))
    if not mine.size:
        return None
    stage = prog.tile_stage.copy()
    stage[mine[0]] = sends[0, ROUND] - 1
    return with_program(plan, direction, tile_stage=stage)


def send_partial_twice(plan, direction):
    """A partial is sent again one round later (and merged again)."""
    prog = plan.columns(direction)
    i = np.flatnonzero(prog.is_partial())
    if not i.size:
        return None
    row = prog.transfers[i[0]].copy()
    row[ROUND] += 1
    return with_program(plan, direction, transfers=np.vstack([prog.transfers, row]),
                        merges=np.vstack([prog.merges, row]))


def relay_before_arrival(plan, direction):
    """A device relays an input in the round it receives it (not an earlier one)."""
    prog = plan.columns(direction)
    tr = prog.transfers
    inputs = tr[~prog.is_partial()]
    home = plan.home
    relays = np.flatnonzero(home[inputs[:, TB]] != inputs[:, SRC])
    if not relays.size:
        return None
    row = inputs[relays[0]]
    fed = np.flatnonzero((inputs[:, DST] == row[SRC]) & (inputs[:, KIND] == row[KIND]) & (inputs[:, TB] == row[TB])
                         & (inputs[:, HB] == row[HB]))
    moved = tr.copy()
    j = np.flatnonzero((tr == row).all(axis=1))[0]
    moved[j, ROUND] = inputs[fed, ROUND].min()
    return with_program(plan, direction, transfers=moved)


BREAKERS = (drop_input, drop_partial, drop_merge, compute_before_data, add_after_send, send_partial_twice,
            relay_before_arrival)
