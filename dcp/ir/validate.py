"""The plan validator: proves that a plan computes its batch's attention, and runs without deadlock.

First the static checks (``dcp.ir.validate_arrays``): the layout covers the batch, the tiles are exactly
those the masks give (which pairs, which masked area, which are full), every field of the program tables
is in range. Then, per direction, the program's tables (``dcp.ir.program``) are checked with sorts,
group-bys and searches, so validation is linear in the plan (up to the sorts' log factor):

- every tile runs exactly once, on its assigned device: by construction (one stage per tile);
- every send has a matching receive of the same unit between the same devices in the same round, and
  every device launches and waits the same rounds in order: by construction (a transfer row is both;
  the canonical streams launch every round);
- inputs before use: every tile's q-side and kv-side inputs are held by its device by its stage (home
  there, or received in a round <= the stage), and a device only sends an input it holds (home, or
  received in an earlier round): relays forward only what has arrived;
- partials: a device sends its partial of a unit at most once, only with something in it (a tile or a
  merge), and after everything that adds to it (tiles of stages <= round - 2, merges of rounds <= round
  - 1), so a partial never changes after it left; every partial sent is merged exactly once by its
  receiver, no earlier than the round it arrives in; and following the sends from the accumulator every
  tile adds to ends at that unit's home. Each accumulator sends at most once, so the sends form a forest
  whose roots hold everything sent into them: each home ends up with every tile of its output units,
  each once, and no partial is left on another device;
- no dependency cycle (deadlock): by construction, as ``dcp.ir.program`` proves for the canonical streams.

``dcp.ir.validate_reference`` checks the same properties by simulating the instruction view one instruction
at a time; tests demand both give the same verdict.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcp import setops
from dcp.ir.program import DST, HB, KIND, ROUND, SRC, TB
from dcp.ir.validate_arrays import Problems, _first, check_arrays
from dcp.layout.units import INPUT_KINDS, Kind

if TYPE_CHECKING:
    from dcp.ir.plan import Plan

_N_KINDS = len(Kind)
_NEVER = np.iinfo(np.int64).max
#: output kinds of each direction with the tile side that keys them (0: q block, 1: kv block)
_OUTPUTS = {"forward": ((Kind.O, 0),), "backward": ((Kind.DQ, 0), (Kind.DKV, 1))}


def validate(plan: Plan) -> None:
    """Raise ``PlanValidationError`` listing the first problems found; return None for a valid plan. A
    ``dcp.ir.layered.LayeredPlan`` is valid when every kind's plan is and they share the tokens' homes."""
    kind_plans = getattr(plan, "plans", None)  # a LayeredPlan (not imported: it stands on this module)
    if kind_plans is not None:
        from dcp.errors import InvalidPlanError, PlanValidationError

        try:
            plan.check()
        except InvalidPlanError as err:
            raise PlanValidationError(str(err)) from None
        for kind, p in zip(plan.kinds, kind_plans):
            try:
                validate(p)
            except PlanValidationError as err:
                raise PlanValidationError(f"layer kind {kind!r}: {err}") from None
        return
    pb = Problems()
    check_arrays(plan, pb)
    pb.raise_if_any()
    for direction in ("forward", "backward"):
        _Check(plan, direction, pb).run()
        pb.raise_if_any()


def _group_min(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique keys, the smallest value of each)."""
    order = np.lexsort((values, keys))
    k = keys[order]
    first = np.r_[True, k[1:] != k[:-1]] if k.size else np.zeros(0, dtype=bool)
    return k[first], values[order][first]


def _repeated(keys: np.ndarray) -> np.ndarray:
    """Positions (into ``keys``) of every occurrence after the first of a repeated key."""
    order = np.argsort(keys, kind="stable")
    k = keys[order]
    return order[1:][k[1:] == k[:-1]]


class _Check:
    """One direction's dynamic checks (module docstring). Keys: a *node* is (device, kind, unit), an
    accumulator or a held input, encoded ``(device * n_kinds + kind) * n_units + unit`` with unit =
    ``tb * n_head_blocks + hb``."""

    def __init__(self, plan: Plan, direction: str, pb: Problems):
        self.plan, self.direction, self.pb = plan, direction, pb
        self.nhb = plan.layout.n_head_blocks
        self.n_units = plan.layout.n_token_blocks * self.nhb
        self.home = plan.home.astype(np.int64)
        prog = plan.columns(direction)
        self.stage = prog.tile_stage.astype(np.int64)
        self.tr = prog.transfers.astype(np.int64)
        self.mg = prog.merges.astype(np.int64)
        self.is_input = np.isin(self.tr[:, KIND], [int(k) for k in INPUT_KINDS[direction]])

    def node(self, device, kind, unit) -> np.ndarray:
        return (np.asarray(device, np.int64) * _N_KINDS + kind) * self.n_units + unit

    def unit(self, rows: np.ndarray) -> np.ndarray:
        return rows[:, TB] * self.nhb + rows[:, HB]

    def name(self, kind: int, unit: int) -> str:
        return f"{Kind(int(kind)).name}[{int(unit) // self.nhb},{int(unit) % self.nhb}]"

    def run(self) -> None:
        self.inputs()
        self.partials()

    # -- inputs: held before use, relayed only once held
    def inputs(self) -> None:
        d, tiles, pb = self.direction, self.plan.tiles, self.pb
        rows = self.tr[self.is_input]
        unit = self.unit(rows)
        keys, first = _group_min(self.node(rows[:, DST], rows[:, KIND], unit), rows[:, ROUND])

        def held_since(device, kind, unit_):
            """Round after which ``device`` holds the input (0: home; _NEVER: never)."""
            since = setops.lookup(keys, first, self.node(device, kind, unit_), _NEVER)
            return np.where(self.home[unit_ // self.nhb] == device, 0, since)

        bad = held_since(rows[:, SRC], rows[:, KIND], unit) >= rows[:, ROUND]
        if bad.any():
            i = _first(bad)
            pb.add(f"{d} device {int(rows[i, SRC])} round {int(rows[i, ROUND])}: sends "
                   f"{self.name(rows[i, KIND], unit[i])} it does not hold")
        dev = self.plan.tile_device.astype(np.int64)
        hb = tiles.hb.astype(np.int64)
        for kind, blocks in zip(INPUT_KINDS[d], (tiles.q_tb, tiles.kv_tb)):
            u = blocks.astype(np.int64) * self.nhb + hb
            # consecutive tiles reading one input on one device (the q side: tiles come by q block and head
            # block) are checked once, at their earliest stage
            run0 = np.flatnonzero(np.r_[True, (u[1:] != u[:-1]) | (dev[1:] != dev[:-1])]) if u.size \
                else np.zeros(0, np.int64)
            earliest = np.minimum.reduceat(self.stage, run0) if run0.size else np.zeros(0, np.int64)
            held = held_since(dev[run0], int(kind), u[run0])
            late_run = held > earliest
            if late_run.any():
                i = _first(late_run)
                t = int(run0[i]) + _first(self.stage[run0[i]:] < held[i])  # the run's first late tile
                pb.add(f"{d} device {int(dev[t])} stage {int(self.stage[t])}: tile {t} needs "
                       f"{self.name(kind, u[t])}, not yet there")

    # -- partials: sent once, complete, merged once, reaching home
    def partials(self) -> None:
        d, pb, tiles = self.direction, self.pb, self.plan.tiles
        dev, hb = self.plan.tile_device.astype(np.int64), tiles.hb.astype(np.int64)
        tile_node = np.concatenate([self.node(dev, int(k), (tiles.kv_tb if side else tiles.q_tb).astype(np.int64)
                                              * self.nhb + hb) for k, side in _OUTPUTS[d]])
        # consecutive tiles adding to one accumulator (tiles come by q block and head block) collapse into
        # one entry at their latest stage: the checks below depend on the accumulator and that stage only.
        # ``first_tile[i]`` is entry i's first (tile, output kind) position, for the messages
        first_tile = np.flatnonzero(np.r_[True, tile_node[1:] != tile_node[:-1]]) if tile_node.size \
            else np.zeros(0, np.int64)
        tile_stage = np.maximum.reduceat(np.tile(self.stage, len(_OUTPUTS[d])), first_tile) if first_tile.size \
            else np.zeros(0, np.int64)
        tile_node = tile_node[first_tile]
        sends = self.tr[~self.is_input]
        s_unit = self.unit(sends)
        s_node = self.node(sends[:, SRC], sends[:, KIND], s_unit)
        r_node = self.node(sends[:, DST], sends[:, KIND], s_unit)
        s_round = sends[:, ROUND]
        m_unit = self.unit(self.mg)
        m_node = self.node(self.mg[:, DST], self.mg[:, KIND], m_unit)
        m_round = self.mg[:, ROUND]
        twice = _repeated(s_node)
        if twice.size:
            i = int(twice[0])
            pb.add(f"{d} device {int(sends[i, SRC])}: sends partial {self.name(sends[i, KIND], s_unit[i])} twice")
            return
        # every partial sent is merged exactly once by its receiver, not before it arrives
        n_dev = self.plan.n_devices
        t_pair, m_pair = r_node * n_dev + sends[:, SRC], m_node * n_dev + self.mg[:, SRC]
        order = np.argsort(t_pair)
        t_keys, t_rounds = t_pair[order], s_round[order]
        again = _repeated(m_pair)
        if again.size:
            i = int(again[0])
            pb.add(f"{d} device {int(self.mg[i, DST])}: merges {self.name(self.mg[i, KIND], m_unit[i])} from "
                   f"device {int(self.mg[i, SRC])} twice")
        arrived = setops.lookup(t_keys, t_rounds, m_pair, _NEVER)
        early = arrived > m_round
        if early.any():
            i = _first(early)
            what = "which it never received" if arrived[i] == _NEVER else f"before it arrives in round {int(arrived[i])}"
            pb.add(f"{d} device {int(self.mg[i, DST])} round {int(m_round[i])}: merges "
                   f"{self.name(self.mg[i, KIND], m_unit[i])} from device {int(self.mg[i, SRC])}, {what}")
        lost = ~setops.isin(t_pair, m_pair)
        if lost.any():
            i = _first(lost)
            pb.add(f"{d} device {int(sends[i, DST])}: partial {self.name(sends[i, KIND], s_unit[i])} from device "
                   f"{int(sends[i, SRC])} is never merged")
        # a partial is sent after everything that adds to it, and not empty
        order = np.argsort(s_node)
        s_keys, s_rounds = s_node[order], s_round[order]
        sent_in = setops.lookup(s_keys, s_rounds, tile_node, _NEVER)
        late = tile_stage > sent_in - 2
        if late.any():
            i = _first(late)
            run = np.tile(self.stage, len(_OUTPUTS[d]))[first_tile[i]:]
            j = _first(run > sent_in[i] - 2)  # the run's first late tile
            t = (first_tile[i] + j) % self.stage.size
            pb.add(f"{d} device {int(dev[t])}: tile {t} (stage {int(run[j])}) adds to partial "
                   f"{self.name(tile_node[i] // self.n_units % _N_KINDS, tile_node[i] % self.n_units)} after it "
                   f"was sent in round {int(sent_in[i])}")
        sent_in = setops.lookup(s_keys, s_rounds, m_node, _NEVER)
        late = m_round >= sent_in
        if late.any():
            i = _first(late)
            pb.add(f"{d} device {int(self.mg[i, DST])}: merges into {self.name(self.mg[i, KIND], m_unit[i])} in "
                   f"round {int(m_round[i])}, after sending it in round {int(sent_in[i])}")
        empty = ~(setops.isin(s_node, tile_node) | setops.isin(s_node, m_node))
        if empty.any():
            i = _first(empty)
            pb.add(f"{d} device {int(sends[i, SRC])} round {int(s_round[i])}: sends an empty partial "
                   f"{self.name(sends[i, KIND], s_unit[i])}")
        if not pb.items:
            self.roots(tile_node, first_tile, s_node, r_node)

    def roots(self, tile_node: np.ndarray, first_tile: np.ndarray, s_node: np.ndarray, r_node: np.ndarray) -> None:
        """Follow the sends from every tile's accumulator (pointer jumping); each must end at its unit's
        home. Sends go to strictly later rounds (checked above), so the chains end. ``first_tile``: a
        (tile, output kind) position of each ``tile_node`` entry, for the message."""
        nodes = setops.unique(np.concatenate([tile_node, s_node, r_node]))
        nxt = np.arange(nodes.size)
        nxt[np.searchsorted(nodes, s_node)] = np.searchsorted(nodes, r_node)
        for _ in range(max(1, int(nodes.size).bit_length()) + 1):
            jumped = nxt[nxt]
            if np.array_equal(jumped, nxt):
                break
            nxt = jumped
        else:
            self.pb.add(f"{self.direction}: partials are sent around in a cycle")
            return
        end = nodes[nxt[np.searchsorted(nodes, tile_node)]]
        unit, end_dev = end % self.n_units, end // (_N_KINDS * self.n_units)
        stray = end_dev != self.home[unit // self.nhb]
        if stray.any():
            i = _first(stray)
            t = int(first_tile[i]) % self.stage.size
            kind = end[i] // self.n_units % _N_KINDS
            self.pb.add(f"{self.direction}: partial {self.name(kind, unit[i])} of tile {t} ends on device "
                        f"{int(end_dev[i])}, never sent home to device {int(self.home[unit[i] // self.nhb])}")
