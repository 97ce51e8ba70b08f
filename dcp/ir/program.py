"""The columnar plan IR: one direction's program for every device, as three tables.

A plan has a forward and a backward ``Program``. Each holds, for the plan's tiles and devices:

- ``tile_stage``: int32 ``[n_tiles]``, the compute stage of every tile (run on ``plan.tile_device[t]``);
- ``transfers``: int32 ``[n, 6]`` rows of ``COLUMNS`` = (kind, tb, hb, src, dst, round): in round
  ``round`` device ``src`` sends data unit (kind, token block tb, head block hb) to ``dst``: an input
  (Q/KV forward, QG/KV backward; a device may relay one it received in an earlier round) or a partial
  output (O forward, DQ/DKV backward: the sender's accumulator of that unit, merged partials included);
- ``merges``: int32 ``[m, 6]`` rows of the same columns: after waiting for round ``round``, device
  ``dst`` merges into its accumulator of unit (kind, tb, hb) the partial it received from ``src``.

Rows are kept in a canonical order (``TRANSFER_ORDER``, ``MERGE_ORDER``), so equal programs have equal
arrays. Every device runs the same *canonical stream* over rounds r = 1 .. max(R, S) (R: the last round
of any row, S: the number of stages): ``CommLaunch(r)`` (post this device's sends and receives of round r,
possibly none) if r <= R, ``Compute(r-1)`` (its tiles of stage r-1) if it has any, ``CommWait(r)`` if
r <= R, then one ``Reduce(unit, sources)`` per unit it merges after round r (units and sources sorted).
So an input received in round r serves stages >= r and can be relayed from round r+1 on, and a partial
sent in round r holds the tiles of stages <= r-2 and the merges of rounds <= r-1. Because every device
posts every round and waits only for that round, the streams cannot deadlock: by induction over r, every
device reaches ``CommLaunch(r)``, so every transfer of round r starts and every ``CommWait(r)`` returns.

The instruction objects of ``dcp.ir.instructions`` are a *view* of these tables (``device_plans``), for readers and
tests; executors, the validator, statistics, the serializer and the simulator read the tables, through
per-device index ranges (``DeviceIndex``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from dcp.ir.instructions import CommLaunch, CommWait, Compute, DevicePlan, Reduce, Transfer, Unit
from dcp.layout.units import INPUT_KINDS, OUTPUT_KINDS, Kind

COLUMNS = ("kind", "tb", "hb", "src", "dst", "round")
KIND, TB, HB, SRC, DST, ROUND = range(6)
#: sort keys (most significant first) of the canonical row orders
TRANSFER_ORDER = (ROUND, SRC, DST, KIND, TB, HB)
MERGE_ORDER = (DST, ROUND, KIND, TB, HB, SRC)
DIRECTIONS = ("forward", "backward")


def empty_rows() -> np.ndarray:
    return np.zeros((0, len(COLUMNS)), dtype=np.int32)


def sort_rows(rows: np.ndarray, keys: tuple[int, ...]) -> np.ndarray:
    """``rows`` (``[n, 6]``) sorted by the columns ``keys``, most significant first."""
    if rows.shape[0] < 2:
        return rows
    return rows[np.lexsort(tuple(rows[:, k] for k in reversed(keys)))]


def unit_rows(kind, tb, hb, src, dst, rnd) -> np.ndarray:
    """int32 ``[n, 6]`` rows from six broadcastable columns."""
    cols = np.broadcast_arrays(*(np.asarray(c, dtype=np.int64) for c in (kind, tb, hb, src, dst, rnd)))
    return np.stack(cols, axis=1).astype(np.int32) if cols[0].size else empty_rows()


@dataclass(frozen=True, eq=False)
class Program:
    """One direction's program for every device (module docstring): stages, transfers, merges."""

    direction: str
    tile_stage: np.ndarray
    transfers: np.ndarray
    merges: np.ndarray
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def n_rounds(self) -> int:
        """R: the last round any transfer or merge uses (every device launches and waits 1..R)."""
        got = self._derived.get("n_rounds")
        if got is None:
            got = self._derived["n_rounds"] = max(int(self.transfers[:, ROUND].max(initial=0)),
                                                  int(self.merges[:, ROUND].max(initial=0)))
        return got

    @property
    def n_stages(self) -> int:
        return int(self.tile_stage.max()) + 1 if self.tile_stage.size else 0

    @property
    def input_kinds(self) -> tuple[Kind, Kind]:
        return INPUT_KINDS[self.direction]

    @property
    def output_kinds(self) -> tuple[Kind, ...]:
        return OUTPUT_KINDS[self.direction]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        return self.direction == other.direction and all(
            np.array_equal(getattr(self, a), getattr(other, a)) for a in ("tile_stage", "transfers", "merges"))

    __hash__ = None  # mutable arrays inside: equal programs need not hash alike

    def is_partial(self) -> np.ndarray:
        """bool ``[n_transfers]``: the row moves a partial output (else an input)."""
        return np.isin(self.transfers[:, KIND], [int(k) for k in self.output_kinds])

    def index(self, tile_device: np.ndarray, n_devices: int) -> "DeviceIndex":
        """Per-device index ranges of this program (cached per ``tile_device`` array and device count)."""
        key = ("index", id(tile_device), n_devices)
        got = self._derived.get(key)
        if got is None or got.tile_device is not tile_device:
            got = self._derived[key] = DeviceIndex(self, tile_device, n_devices)
        return got


def _csr(sorted_keys: np.ndarray, n: int) -> np.ndarray:
    """int64 ``[n + 1]`` pointers: rows of key k are ``[ptr[k], ptr[k + 1])`` of the sorted keys."""
    return np.searchsorted(sorted_keys, np.arange(n + 1), side="left").astype(np.int64)


def _row_order(rows: np.ndarray, keys: tuple[int, ...]) -> np.ndarray:
    """Stable order of ``rows`` by the columns ``keys`` (most significant first): one argsort of the columns
    packed into one int64 key where they fit (a few times faster than ``np.lexsort`` of six columns)."""
    if rows.shape[0] < 2:
        return np.arange(rows.shape[0])
    cols = rows[:, list(keys)].astype(np.int64)
    lo, hi = cols.min(axis=0), cols.max(axis=0)
    widths = (hi - lo + 1).tolist()
    if float(np.prod(widths, dtype=np.float64)) >= 2.0 ** 62:
        return np.lexsort(tuple(rows[:, k] for k in reversed(keys)))
    key = np.zeros(rows.shape[0], dtype=np.int64)
    for j, w in enumerate(widths):
        key *= w
        key += cols[:, j] - lo[j]
    return np.argsort(key, kind="stable")


class DeviceIndex:
    """Each device's rows of a ``Program`` as index ranges (no per-row objects).

    ``send_order``/``send_ptr``: transfer row ids sorted by (src, round, dst, kind, tb, hb), device d's
    sends are ``send_order[send_ptr[d]:send_ptr[d + 1]]``; the same for receives (``recv_*``, by dst,
    round, src, ...), merges (``merge_*``, by dst, round, kind, tb, hb, src) and tiles (``tile_*``: tile
    ids by device, stage, id). Rows naming a device outside 0..n_devices-1 are left out (the validator
    refuses such plans before anything runs them)."""

    def __init__(self, program: Program, tile_device: np.ndarray, n_devices: int):
        self.program, self.tile_device, self.n_devices = program, tile_device, n_devices
        tr, mg = program.transfers, program.merges
        self.send_order, self.send_ptr = self._rows(tr, (SRC, ROUND, DST, KIND, TB, HB))
        self.recv_order, self.recv_ptr = self._rows(tr, (DST, ROUND, SRC, KIND, TB, HB))
        self.merge_order, self.merge_ptr = self._rows(mg, MERGE_ORDER)
        dev = np.asarray(tile_device, dtype=np.int64)
        stage = np.asarray(program.tile_stage, dtype=np.int64)
        ok = np.flatnonzero((dev >= 0) & (dev < n_devices)) if dev.size == stage.size else np.zeros(0, np.int64)
        # by (device, stage, id): a stable sort keeps the ids in order
        order = ok[_row_order(np.stack([dev[ok], stage[ok]], axis=1), (0, 1))]
        self.tile_order, self.tile_ptr = order, _csr(dev[order], n_devices)
        self.tile_stage = stage

    def _rows(self, rows: np.ndarray, keys: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        dev = rows[:, keys[0]].astype(np.int64)
        ok = np.flatnonzero((dev >= 0) & (dev < self.n_devices))
        order = ok[_row_order(rows[ok], keys)]
        return order, _csr(dev[order], self.n_devices)

    def sends(self, d: int) -> np.ndarray:
        """Transfer rows ``[k, 6]`` device d sends, by (round, dst, kind, tb, hb)."""
        return self.program.transfers[self.send_order[self.send_ptr[d]:self.send_ptr[d + 1]]]

    def recvs(self, d: int) -> np.ndarray:
        return self.program.transfers[self.recv_order[self.recv_ptr[d]:self.recv_ptr[d + 1]]]

    def merges(self, d: int) -> np.ndarray:
        return self.program.merges[self.merge_order[self.merge_ptr[d]:self.merge_ptr[d + 1]]]

    def tiles(self, d: int) -> np.ndarray:
        """Tile ids device d runs, by (stage, id)."""
        return self.tile_order[self.tile_ptr[d]:self.tile_ptr[d + 1]]

    def stream(self, d: int) -> Iterator[tuple]:
        """Device d's canonical stream (module docstring) as plain tuples:
        ``("launch", r, sends [k, 6], recvs [k, 6])``, ``("compute", s, tile ids)``, ``("wait", r)``,
        ``("reduce", (kind, tb, hb), sources)``."""
        p = self.program
        n_rounds = p.n_rounds
        last = max(n_rounds, p.n_stages)
        sends, recvs, merges, tiles = self.sends(d), self.recvs(d), self.merges(d), self.tiles(d)
        rounds = np.arange(1, last + 2)
        s_cut, r_cut, m_cut = (np.searchsorted(rows[:, ROUND], rounds) for rows in (sends, recvs, merges))
        t_cut = np.searchsorted(self.tile_stage[tiles], np.arange(0, last + 1), side="left")
        for r in range(1, last + 1):
            if r <= n_rounds:
                yield "launch", r, sends[s_cut[r - 1]:s_cut[r]], recvs[r_cut[r - 1]:r_cut[r]]
            a, b = t_cut[r - 1], t_cut[r]
            if b > a:
                yield "compute", r - 1, tiles[a:b]
            if r <= n_rounds:
                yield "wait", r
                rows = merges[m_cut[r - 1]:m_cut[r]]
                if rows.shape[0]:
                    new = np.flatnonzero(np.r_[True, (rows[1:, :3] != rows[:-1, :3]).any(axis=1), True])
                    for a2, b2 in zip(new[:-1].tolist(), new[1:].tolist()):
                        yield "reduce", tuple(int(x) for x in rows[a2, :3]), tuple(rows[a2:b2, SRC].tolist())


def device_plans(program: Program, tile_device: np.ndarray, n_devices: int) -> tuple:
    """The instruction view (``dcp.ir.instructions.DevicePlan`` per device) of a program."""
    def transfers(rows: np.ndarray, peer: int) -> tuple:
        return tuple(Transfer(Unit(Kind(k), tb, hb), p) for k, tb, hb, p in rows[:, [KIND, TB, HB, peer]].tolist())

    idx = program.index(tile_device, n_devices)
    out = []
    for d in range(n_devices):
        ins = []
        for op in idx.stream(d):
            if op[0] == "launch":
                ins.append(CommLaunch(op[1], tuple(sorted(transfers(op[2], DST))), tuple(sorted(transfers(op[3], SRC)))))
            elif op[0] == "compute":
                ins.append(Compute(op[1], tuple(op[2].tolist())))
            elif op[0] == "wait":
                ins.append(CommWait(op[1]))
            else:
                kind, tb, hb = op[1]
                ins.append(Reduce(Unit(Kind(kind), tb, hb), op[2]))
        out.append(DevicePlan(d, tuple(ins)))
    return tuple(out)
