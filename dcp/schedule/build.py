"""Turn a placement's stages and routes into a columnar ``Program`` (``dcp.ir.program``).

Route rows (``dcp.schedule.stages.ROUTE_COLUMNS``: side, tb, hb, src, dst, round) name the side of a unit (0:
q side, 1: kv side); the program names its kind, which depends on the direction: inputs are Q/KV
forward and QG/KV backward, partial outputs O forward (q side only) and DQ/DKV backward. Every partial a
device receives is merged right after the wait of the round it arrives in, so each output route is one
transfer row and one merge row.
"""
from __future__ import annotations

import numpy as np

from dcp.ir.program import MERGE_ORDER, TRANSFER_ORDER, Program, sort_rows, unit_rows
from dcp.layout.units import Kind
from dcp.schedule.stages import Routes

IN_KIND = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUT_KIND = {"forward": (Kind.O, -1), "backward": (Kind.DQ, Kind.DKV)}  # -1: the forward has no kv-side output


def build_program(direction: str, tile_stage: np.ndarray, routes: Routes) -> Program:
    """The ``direction`` program of a schedule: its tile stages and its input and output routes."""
    in_kind = np.array([int(k) for k in IN_KIND[direction]], dtype=np.int64)
    out_kind = np.array([int(k) for k in OUT_KIND[direction]], dtype=np.int64)
    ins, outs = np.asarray(routes.inputs, dtype=np.int64), np.asarray(routes.outputs, dtype=np.int64)
    outs = outs[out_kind[outs[:, 0]] >= 0] if outs.size else outs.reshape(-1, 6)
    ins = ins.reshape(-1, 6)
    rows = [unit_rows(in_kind[ins[:, 0]], *ins[:, 1:].T), unit_rows(out_kind[outs[:, 0]], *outs[:, 1:].T)]
    transfers = sort_rows(np.concatenate(rows), TRANSFER_ORDER)
    merges = sort_rows(rows[1], MERGE_ORDER)
    return Program(direction, np.ascontiguousarray(tile_stage, dtype=np.int32), transfers, merges)
