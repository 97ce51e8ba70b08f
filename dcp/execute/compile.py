"""One device's program compiled into the steps ``DeviceRunner`` runs: all index work done once per plan.

``compile_program(tables, direction, device, dtypes)`` (cached per plan, direction, device and dtypes in
``dcp.execute.tables.PlanTables``) walks the device's op stream once, symbolically, and resolves
everything that depends on the plan alone, never on data:

- where every unit lives at every point of the step: a *location* ``(space, first row, heads)`` in one
  of the step's tensors (*spaces*): the caller's home tensors, the slot buffers (``BUF``), the typed
  regions of each received message, the outputs of each kernel call;
- which contribution to a partial output comes first (it becomes the accumulator, no copy) and which
  ones merge into it, including the adoption of a kernel output that covers every home row and head;
- every copy (packing a message, unpacking one into its slots, assembling the results) and merge as
  *pieces*: row runs that are contiguous on both sides (several units, one view pair, one copy);
- every plan inconsistency the old interpreter found at run time (an input used before it arrived, a
  partial sent twice or never merged, a round waited but never launched, ...), raised here as
  ``ExecutionError`` before anything runs.

Messages. Everything a device sends to one peer in one round is ONE contiguous uint8 buffer (a slice
of the round's one send buffer) of *regions*: the message's units in sorted order, cut into runs of
consecutive units of one kind and head block, and per run one region per tensor of the kind (q, k, v,
o, dq, dk, dv ``[sum of rows, heads, D]``; lse, delta ``[heads, sum of rows]``), each starting at a
multiple of 8 bytes. Both sides derive it from the unit list alone (``message_layout``). The steps use
the views ``Spec`` names; those into the persistent slot buffers are bound to tensors once per workspace
(``dcp.execute.local``).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import NamedTuple

import torch

from dcp.errors import ExecutionError
from dcp.execute.buffers import HOME, MSG
from dcp.ir.instructions import Unit
from dcp.layout.units import Kind

_ALIGN = 8
INPUTS = {"forward": (Kind.Q, Kind.KV), "backward": (Kind.QG, Kind.KV)}
OUTPUTS = {"forward": (Kind.O,), "backward": (Kind.DQ, Kind.DKV)}
# per kind, each tensor of a unit in message order: (2: [H, T] row statistics / 3: [T, H, D], its dtype)
ROLES = {Kind.Q: ((3, "el"),), Kind.KV: ((3, "el"), (3, "el")), Kind.O: ((3, "part"), (2, "stat")),
         Kind.QG: ((3, "el"), (3, "el"), (2, "stat"), (2, "stat")), Kind.DQ: ((3, "part"),),
         Kind.DKV: ((3, "part"), (3, "part"))}
KV_SIDE = (Kind.KV, Kind.DKV)
_O, _DQ, _DKV = Kind.O, Kind.DQ, Kind.DKV  # (an enum's class attribute is ten times slower to read than a global)
RESULTS = {Kind.O: (("el", 0.0), ("stat", float("-inf"))), Kind.DQ: (("el", 0.0),),
           Kind.DKV: (("el", 0.0), ("el", 0.0))}


@dataclass(frozen=True)
class Dtypes:
    el: torch.dtype      # q/k/v/dO
    part: torch.dtype    # partial outputs on the wire
    stat: torch.dtype    # lse, delta, accumulators

    @staticmethod
    def of(dtype: torch.dtype, partial_dtype: torch.dtype | None = None) -> "Dtypes":
        stat = torch.float64 if dtype == torch.float64 else torch.float32
        return Dtypes(dtype, partial_dtype or dtype, stat)


class Spec(NamedTuple):
    """A view of a space: rows [a, b) and ``heads`` (None: all); ``a`` None: the whole tensor. ``vid``
    numbers the distinct views of a step (a view is made once per step, at its first use; a space widened
    to the stat dtype gets new numbers from there on)."""
    space: int
    a: int | None
    b: int | None
    heads: slice | None
    dim: int
    vid: int


_tuple_new = tuple.__new__  # Spec(...) without its Python-level __new__: the compiler makes thousands


class Launch(NamedTuple):
    code: str
    n_ir: int
    round: int
    nbytes: int      # the round's send buffer: every message at its offset (one allocation per round)
    dtypes: tuple    # the dtypes its pieces are viewed in
    msgs: tuple      # ((peer, offset, nbytes, ((geometry, src Spec), ...), alias (src Spec, dtype) | None), ...)
    recvs: list      # [(peer, (nbytes,), torch.uint8), ...]


class Wait(NamedTuple):
    code: str
    n_ir: int
    round: int
    msgs: tuple      # ((peer, nbytes, dtypes, ((space, geometry), ...) live regions, ((dst Spec, geometry), ...)), ...)


class Compute(NamedTuple):
    code: str
    n_ir: int
    calls: tuple     # ((q-side Specs, (k Spec, v Spec), tile table, output spaces), ...)
    merges: tuple    # (widen spaces, O merges, sum layers)


class Reduce(NamedTuple):
    code: str
    n_ir: int
    merges: tuple


@dataclass
class Compiled:
    steps: list
    seg_starts: list
    n_spaces: int
    n_views: int           # distinct views (``Spec.vid``)
    home_q: tuple          # space ids
    home_kv: tuple
    buf_q: tuple
    buf_kv: tuple
    buf_rows: tuple        # (rows of the q-side BUF, rows of the kv-side BUF)
    zero: tuple            # Specs of BUF rows zeroed per step
    staged: tuple          # ((dst Spec, src Spec), ...) home kv rows copied into BUF per step
    results: tuple         # per output kind, per tensor: ("whole", space, dtype) | ("build", shape, dtype, ...)
    home_rows: tuple       # ((token block, local row, rows), ...) per home token block, in local order
    n_local: int


# ------------------------------------------------------------------------------------ messages
@dataclass(frozen=True)
class MessageLayout:
    nbytes: int
    regions: tuple   # ((dim, dtype, shape, element offset), ...)
    units: tuple     # per unit in message order: (its first region, first row in its run, rows)


_ROLE_DTYPES: dict = {}


def _role_dtypes(dt: Dtypes) -> dict:
    """{kind: ((dim, dtype, itemsize), ...)} of a unit's tensors in ``dt``'s dtypes (cached)."""
    got = _ROLE_DTYPES.get(dt)
    if got is None:
        got = _ROLE_DTYPES[dt] = {k: tuple((dim, getattr(dt, n), getattr(dt, n).itemsize) for dim, n in roles)
                                  for k, roles in ROLES.items()}
    return got


def message_layout(tab, units: tuple, dt: Dtypes) -> MessageLayout:
    """The regions of a message carrying ``units`` (sorted), see the module docstring."""
    return _message_layout(tab, units, _role_dtypes(dt))


def _message_layout(tab, units: tuple, roles: dict) -> MessageLayout:
    regions, where, off = [], [], 0
    tb_len, d, kvb, hqb = tab.tb_len_list, tab.d, tab.kvb, tab.hqb
    for (kind, _), run in groupby(units, _KIND_HB):
        n, first = 0, len(regions)
        for u in run:
            m = tb_len[u[1]]
            where.append((first, n, m))
            n += m
        h = kvb if kind in KV_SIDE else hqb
        for dim, dtype, size in roles[kind]:
            if dim == 3:
                regions.append((3, dtype, (n, h, d), off // size))
                off += -(-n * h * d * size // _ALIGN) * _ALIGN
            else:
                regions.append((2, dtype, (h, n), off // size))
                off += -(-n * h * size // _ALIGN) * _ALIGN
    return MessageLayout(off, tuple(regions), tuple(where))


_KIND_HB = itemgetter(0, 2)  # a message's runs: consecutive units of one kind and head block


def piece_geometry(region: tuple, a: int, m: int) -> tuple:
    """(dtype, size, stride, element offset) of rows [a, a + m) of a message region."""
    dim, dtype, shape, off = region
    if dim == 3:
        _, h, d = shape
        return dtype, (m, h, d), (h * d, d, 1), off + a * h * d
    h, n = shape
    return dtype, (h, m), (n, 1), off + a


def _runs(pieces) -> list:
    """Merge consecutive [dst (space, row, heads), src (space, row, heads), rows] pieces that are contiguous
    on both sides."""
    out: list = []
    q = None
    for d, s, n in pieces:
        if q is not None:
            qd, qs, qn = q
            if (d[1] == qd[1] + qn and s[1] == qs[1] + qn and d[0] == qd[0] and s[0] == qs[0] and d[2] == qd[2]
                    and s[2] == qs[2]):
                q[2] = qn + n
                continue
        q = [d, s, n]
        out.append(q)
    return out


def _runs_any(pieces: list) -> list:
    """``_runs`` for pieces of any number of locations (the last item: rows)."""
    out: list = []
    for p in pieces:
        if out:
            q = out[-1]
            if all(x[0] == y[0] and x[2] == y[2] and x[1] + q[-1] == y[1] for x, y in zip(q[:-1], p[:-1])):
                q[-1] += p[-1]
                continue
        out.append(list(p))
    return out


# ------------------------------------------------------------------------------------ compiler
class _Compiler:
    def __init__(self, tab, direction: str, device: int, dt: Dtypes):
        self.tab, self.direction, self.rank, self.dt = tab, direction, device, dt
        self.ops, _ = tab.program(direction, device)
        self.lay = tab.layout(direction, device)
        self.in_q, self.in_kv = INPUTS[direction]
        self.fwd = direction == "forward"
        self.home, self.tb_len, self.local_off = tab.home_list, tab.tb_len_list, tab.local_off_list
        self.n_local = int(tab.n_local[device])
        self.dims: list[int] = []
        self.rows: list[int | None] = []
        self.version: list[int] = []
        self.vids: dict = {}            # (space, version, rows, heads) -> its Spec
        q_dims = (3,) if self.fwd else (3, 3, 2, 2)
        self.home_q = tuple(self._space(d, self.n_local) for d in q_dims)
        self.home_kv = tuple(self._space(3, self.n_local) for _ in range(2))
        self.buf_q = tuple(self._space(d, self.lay.n_q) for d in q_dims)
        self.buf_kv = tuple(self._space(3, self.lay.n_kv) for _ in range(2))
        self.full: set[int] = set()       # output spaces holding exactly every home row and head
        self.arrived: set = set()
        self.relay: dict = {}             # received inputs kept in their message: unit -> locations
        self.hacc: dict = {}              # home accumulators (keyed by ``_home_key``) -> (locations, rows)
        self.acc: dict = {}               # partials of other homes, until sent
        self.touched: set = set()
        self.sent: set = set()
        self.inbox: dict = {}
        self.pending: dict = {}
        # (kind, head block) -> heads (``_heads``), and per input unit its locations, asked for again and again
        self.roles, self.messages = _role_dtypes(dt), tab.message_layouts(dt)
        self.head_of = {(k, hb): self._heads(k, hb) for k in Kind for hb in range(tab.nhb)}
        self.locs: dict = {}

    # -- helpers
    def _space(self, dim: int, rows: int | None) -> int:
        self.dims.append(dim)
        self.rows.append(rows)
        self.version.append(0)
        return len(self.dims) - 1

    def _spec(self, space: int, a: int | None, b: int | None, heads) -> Spec:
        if heads is None:
            if a == 0 and self.rows[space] == b:
                a = b = None
            key = (space, self.version[space], a, b)
        else:
            key = (space, self.version[space], a, b, heads.start, heads.stop)
        got = self.vids.get(key)  # the view's Spec, numbered at its first use
        if got is None:
            got = self.vids[key] = _tuple_new(Spec, (space, a, b, heads, self.dims[space], len(self.vids)))
        return got

    def _err(self, msg: str) -> ExecutionError:
        return ExecutionError(f"{self.direction} device {self.rank}: {msg}")

    def _layout(self, key: tuple, units: tuple) -> MessageLayout:
        """``PlanTables.message_layout`` of message ``key``."""
        got = self.messages.get(key)
        if got is None:
            got = self.messages[key] = _message_layout(self.tab, units, self.roles)
        return got

    def _is_home(self, tb: int) -> bool:
        return self.home[tb] == self.rank

    def _heads(self, kind: Kind, hb: int):
        tab = self.tab
        if kind in KV_SIDE:
            lo, n, full = tab.kv_lo[hb], tab.kvb, tab.hkv
        else:
            lo, n, full = hb * tab.hqb, tab.hqb, tab.hq
        return None if (lo == 0 and n == full) else slice(lo, lo + n)

    def _missing(self, u: Unit) -> ExecutionError:
        return self._err(f"needs input {u.kind.name}[{u.tb},{u.hb}], which it neither holds nor received")

    def _home_key(self, u: Unit):
        return (u.kind, u.tb, self.tab.kv_lo[u.hb]) if u.kind == _DKV else u

    # -- inputs
    def _input(self, u: Unit) -> tuple:
        kind, tb, hb = u
        if kind != self.in_q and kind != self.in_kv:
            raise self._err(f"{kind.name} is not an input of the {self.direction} pass")
        q_side = kind == self.in_q
        if self.home[tb] == self.rank:
            at = (True, q_side, tb, hb)
        elif u not in self.arrived:
            raise self._missing(u)
        elif u in self.relay:
            return self.relay[u]
        else:
            at = (False, q_side, tb, hb)
        got = self.locs.get(at)  # a home or slot location never changes: made once
        if got is None:
            if at[0]:
                spaces, row = (self.home_q if q_side else self.home_kv), self.local_off[tb]
            else:
                spaces = self.buf_q if q_side else self.buf_kv
                row = (self.lay.q_slot if q_side else self.lay.kv_slot)[tb]
            h = self.head_of[kind, hb]
            got = self.locs[at] = tuple((s, row, h) for s in spaces)
        return got

    def _payload(self, u: Unit) -> tuple:
        if u[0] == self.in_q or u[0] == self.in_kv:
            return self._input(u)
        if u in self.sent:
            raise self._err(f"sends partial {u.kind.name}[{u.tb},{u.hb}] twice")
        acc = self.acc.pop(u, None)
        if acc is None:
            raise self._err(f"sends partial {u.kind.name}[{u.tb},{u.hb}], which it never computed")
        self.sent.add(u)
        return acc[0]

    # -- partial outputs
    def _acc_add(self, u: Unit, locs: tuple, n: int, merges: "_Merges") -> None:
        if u in self.sent:
            raise self._err(f"adds to partial {u.kind.name}[{u.tb},{u.hb}] after sending it")
        if self._is_home(u.tb):
            store, key = self.hacc, self._home_key(u)
            self.touched.add(u.kind)
        else:
            store, key = self.acc, u
        acc = store.get(key)
        if acc is None:
            store[key] = (locs, n)
            return
        merges.add(u.kind, key, acc[0], locs, n)

    def _home_units(self, kind: Kind) -> list:
        """(key, token block, heads) of every home accumulator region of ``kind``, in local row order."""
        out, seen = [], set()
        for tb in self.lay.home_q:
            for hb in range(self.tab.nhb):
                u = Unit(kind, tb, hb)
                key = self._home_key(u)
                if key not in seen:
                    seen.add(key)
                    out.append((key, tb, self._heads(kind, hb)))
        return out

    def _adopt(self, kind: Kind, spaces: tuple) -> bool:
        """A kernel output covering every home row and head, before any other contribution, becomes every
        home accumulator of ``kind``."""
        if kind in self.touched:
            return False
        self.touched.add(kind)
        self.full.update(spaces)
        for key, tb, heads in self._home_units(kind):
            self.hacc[key] = (tuple((s, self.local_off[tb], heads) for s in spaces), self.tb_len[tb])
        return True

    # -- ops
    def compile(self) -> Compiled:
        steps, starts, i = [], [0], 0
        ops = self.ops
        while i < len(ops):
            op = ops[i]
            if op.code == "launch":
                starts.append(len(steps))
                steps.append(self._launch(op))
            elif op.code == "wait":
                steps.append(self._wait(op))
            elif op.code == "compute":
                steps.append(self._compute(op))
            else:
                merges, n = _Merges(), 0
                while i < len(ops) and ops[i].code == "reduce":
                    self._reduce(ops[i], merges)
                    i, n = i + 1, n + 1
                steps.append(Reduce("reduce", n, merges.build(self)))
                continue
            i += 1
        self._check_done()
        zero = tuple(self._spec(s, a, a + m, None) for side, runs in ((self.buf_q, self.lay.zero_q),
                                                                       (self.buf_kv, self.lay.zero_kv))
                     for a, m in runs for s in side)
        staged = tuple((self._spec(b_, b, b + n, None), self._spec(h_, h, h + n, None))
                       for h, b, n in self.lay.staged for h_, b_ in zip(self.home_kv, self.buf_kv))
        results = tuple(self._result(kind) for kind in OUTPUTS[self.direction])
        home_rows = tuple((tb, self.local_off[tb], self.tb_len[tb]) for tb in self.lay.home_q)
        return Compiled(steps, starts, len(self.dims), len(self.vids), self.home_q, self.home_kv, self.buf_q,
                        self.buf_kv, (self.lay.n_q, self.lay.n_kv), zero, staged, results, home_rows, self.n_local)

    def _launch(self, op) -> Launch:
        msgs, total, dtypes = [], 0, {}
        payload, spec, layout_of = self._payload, self._spec, self._layout
        for peer, units in op.sends:
            layout = layout_of((self.direction, op.round, self.rank, peer), units)
            # pieces: runs of a region's units whose source rows are contiguous too (one copy each)
            last: dict = {}
            runs = []
            for (first, row, m), u in zip(layout.units, units):
                for s, r, h in payload(u):
                    p = last.get(first)
                    if p is not None and p[1] == s and p[2] + p[4] == r and p[3] == h:
                        p[4] += m
                    else:
                        p = last[first] = [row, s, r, h, m]
                        runs.append((first, p))
                    first += 1
            pieces = []
            regions = layout.regions
            for reg, (a, s, r, h, m) in runs:
                dt, size, stride, off = piece_geometry(regions[reg], a, m)
                dtypes[dt] = None
                pieces.append(((dt, size, stride, off + total // dt.itemsize), spec(s, r, r + m, h)))
            alias = None
            region = regions[0] if len(regions) == 1 else None
            # a message of one tensor nobody writes any more (home input, sent partial) may go as it is
            if region is not None and len(pieces) == 1 and not any(
                    u.kind in (self.in_q, self.in_kv) and not self._is_home(u.tb) and u not in self.relay
                    for u in units):
                dtype, size = region[1], region[2]
                raw = size[0] * size[1] * (size[2] if len(size) == 3 else 1) * dtype.itemsize
                if raw == layout.nbytes:
                    alias = (pieces[0][1], dtype)
            msgs.append((peer, total, layout.nbytes, tuple(pieces), alias))
            total += layout.nbytes
        layouts = [layout_of((self.direction, op.round, peer, self.rank), units) for peer, units in op.recvs]
        recvs = [(peer, (layout.nbytes,), torch.uint8) for (peer, _), layout in zip(op.recvs, layouts)]
        if op.round in self.pending:
            raise self._err(f"launches round {op.round} twice")
        self.pending[op.round] = (op.recvs, layouts)
        return Launch("launch", 1, op.round, total, tuple(dtypes), tuple(msgs), recvs)

    def _wait(self, op) -> Wait:
        got = self.pending.pop(op.round, None)
        if got is None:
            raise self._err(f"waits for round {op.round}, which it never launched")
        msgs = []
        in_q, in_kv, home, rank = self.in_q, self.in_kv, self.home, self.rank
        q_slot, kv_slot, arrived, relay, inbox = self.lay.q_slot, self.lay.kv_slot, self.arrived, self.relay, self.inbox
        for (peer, units), layout in zip(*got):
            live: dict = {}   # region -> space
            regs = layout.regions

            def loc(r: int, row: int) -> tuple:
                space = live.get(r)
                if space is None:
                    reg = regs[r]
                    space = live[r] = self._space(reg[0], reg[2][0] if reg[0] == 3 else reg[2][1])
                return (space, row, None)

            copies: list = []
            last: dict = {}
            for u, (first, row, m) in zip(units, layout.units):
                kind, tb, hb = u
                if kind == in_q or kind == in_kv:
                    q_side = kind == in_q
                    slot = (q_slot if q_side else kv_slot).get(tb)
                    arrived.add(u)
                    if slot is None or home[tb] == rank:
                        relay[u] = tuple(loc(first + j, row) for j in range(len(ROLES[kind])))
                        continue
                    relay.pop(u, None)
                    h = self.head_of[kind, hb]
                    for s in (self.buf_q if q_side else self.buf_kv):
                        p = last.get(s)  # runs contiguous in the message and in the slots: one copy each
                        if p is not None and p[1] == first and p[0] + p[4] == slot and p[2] + p[4] == row \
                                and p[3] == h:
                            p[4] += m
                        else:
                            p = last[s] = [slot, first, row, h, m]
                            copies.append((s, p))
                        first += 1
                else:
                    if (u, peer) in inbox:
                        raise self._err(f"receives partial {kind.name}[{tb},{hb}] from {peer} twice")
                    inbox[u, peer] = (tuple(loc(first + j, row) for j in range(len(ROLES[kind]))), m)
            pieces = tuple((self._spec(s, a, a + m, h), piece_geometry(layout.regions[r], row, m))
                           for s, (a, r, row, h, m) in copies)
            regions = tuple((space, piece_geometry(layout.regions[r], 0, self.rows[space]))
                            for r, space in live.items())
            dtypes = tuple(dict.fromkeys([g[0] for _, g in regions] + [g[0] for _, g in pieces]))
            msgs.append((peer, layout.nbytes, dtypes, regions, pieces))
        return Wait("wait", 1, op.round, tuple(msgs))

    def _reduce(self, op, merges: "_Merges") -> None:
        for src in op.sources:
            got = self.inbox.pop((op.unit, src), None)
            if got is None:
                raise self._err(f"reduces {op.unit.kind.name}[{op.unit.tb},{op.unit.hb}] from device {src}, "
                                f"which never sent it")
            self._acc_add(op.unit, got[0], got[1], merges)

    def _side(self, src: int, q_side: bool, lo: int, hi: int, heads, out: tuple) -> tuple:
        if src == MSG:  # the call's one unit on this side, as it arrived
            kind = self.in_q if q_side else self.in_kv
            locs = self.relay[Unit(kind, out[0][0], out[0][1])]
            return tuple(self._spec(s, row + lo, row + hi, None) for s, row, _ in locs)
        spaces = (self.home_q if q_side else self.home_kv) if src == HOME else (self.buf_q if q_side else self.buf_kv)
        return tuple(self._spec(s, lo, hi, heads) for s in spaces)

    def _compute(self, op) -> Compute:
        merges, calls = _Merges(), []
        for c in op.calls:
            for u in c.needs:
                if u not in self.arrived:
                    raise self._missing(u)
            qs = self._side(c.q_src, True, c.q_lo, c.q_hi, c.hq, c.q_out)
            kvs = self._side(c.kv_src, False, c.kv_lo, c.kv_hi, c.hk, c.kv_out)
            nq, nk = c.q_hi - c.q_lo, c.kv_hi - c.kv_lo
            if self.fwd:
                outs = (self._space(3, nq), self._space(2, nq))
                if not (c.q_home_full and self._adopt(_O, outs)):
                    for tb, hb, a, b, hs in c.q_out:
                        self._acc_add(Unit(_O, tb, hb), ((outs[0], a, hs), (outs[1], a, hs)), b - a, merges)
            else:
                outs = (self._space(3, nq), self._space(3, nk), self._space(3, nk))
                if not (c.q_home_full and self._adopt(_DQ, outs[:1])):
                    for tb, hb, a, b, hs in c.q_out:
                        self._acc_add(Unit(_DQ, tb, hb), ((outs[0], a, hs),), b - a, merges)
                if not (c.kv_home_full and self._adopt(_DKV, outs[1:])):
                    for tb, hb, a, b, hs in c.kv_out:
                        self._acc_add(Unit(_DKV, tb, hb), ((outs[1], a, hs), (outs[2], a, hs)), b - a, merges)
            calls.append((qs, kvs, c.table, outs))
        return Compute("compute", 1, tuple(calls), merges.build(self))

    def _check_done(self) -> None:
        if self.pending:
            raise self._err(f"rounds {sorted(self.pending)} launched but never waited")
        if self.inbox:
            (u, src) = next(iter(self.inbox))
            raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] received from device {src} is never merged")
        for u in self.acc:
            raise self._err(f"partial {u.kind.name}[{u.tb},{u.hb}] is never sent to its home {self.home[u.tb]}")

    def _result(self, kind: Kind) -> tuple:
        """How each local result tensor of ``kind`` is made: a whole kernel output (every home region in
        place), or copies of the regions into a new tensor (regions nothing reached filled)."""
        tab, units = self.tab, self._home_units(kind)
        h = tab.hkv if kind in KV_SIDE else tab.hq
        out = []
        for j, ((dname, empty), (dim, _)) in enumerate(zip(RESULTS[kind], ROLES[kind])):
            dtype = getattr(self.dt, dname)
            locs = [(self.hacc[key][0][j] if key in self.hacc else None, tb, heads) for key, tb, heads in units]
            space = locs[0][0][0] if units and locs[0][0] is not None else None
            if space in self.full and all(x is not None and x == (space, self.local_off[tb], heads)
                                          for x, tb, heads in locs):
                out.append(("whole", space, dtype))
                continue
            copies, fills = [], []
            for x, tb, heads in locs:
                a, m = self.local_off[tb], self.tb_len[tb]
                if x is None:
                    fills.append((a, a + m, heads))
                else:
                    copies.append([(-1, a, heads), x, m])
            shape = (h, self.n_local) if dim == 2 else (self.n_local, h, tab.d)
            pieces = tuple(((a, a + m, hh), self._spec(s, row, row + m, sh))
                           for (_, a, hh), (s, row, sh), m in _runs(copies))
            out.append(("build", shape, dtype, dim, pieces, tuple(fills), empty))
        return tuple(out)


class _Merges:
    """The merges of one step: spaces to widen to the stat dtype first, log-sum-exp merges (O) in order, and
    sums (dQ, dK, dV) in layers that never add twice into the same rows (one grouped add per layer)."""

    def __init__(self):
        self.widen: dict = {}
        self.o: list = []
        self.layers: list = []
        self.key_layer: dict = {}

    def add(self, kind: Kind, key, dst: tuple, src: tuple, n: int) -> None:
        for s, _, _ in dst:
            self.widen.setdefault(s, None)
        if kind == _O:
            self.o.append([*dst, *src, n])
            return
        layer = self.key_layer.get(key, -1) + 1
        self.key_layer[key] = layer
        if layer == len(self.layers):
            self.layers.append([])
        self.layers[layer] += [[d, s, n] for d, s in zip(dst, src)]

    def build(self, comp: _Compiler) -> tuple:
        for s in self.widen:  # widened at the start of the step: views made from here on are new ones
            comp.version[s] += 1
        sp = comp._spec
        o = tuple(tuple(sp(s, r, r + p[-1], h) for s, r, h in p[:-1]) for p in _runs_any(self.o))
        layers = []
        for pieces in self.layers:
            runs = _runs(sorted(pieces, key=lambda p: (p[0][0], p[0][1])))
            layers.append((tuple(sp(d[0], d[1], d[1] + m, d[2]) for d, _, m in runs),
                           tuple(sp(s[0], s[1], s[1] + m, s[2]) for _, s, m in runs)))
        return tuple(self.widen), o, tuple(layers)


def compile_program(tab, direction: str, device: int, dt: Dtypes) -> Compiled:
    """The compiled steps of ``device``'s ``direction`` program (raises ``ExecutionError`` for a plan the
    device cannot run)."""
    return _Compiler(tab, direction, device, dt).compile()


__all__ = ["Dtypes", "Spec", "Compiled", "MessageLayout", "message_layout", "piece_geometry", "compile_program",
           "INPUTS", "OUTPUTS", "ROLES"]
