"""The message arena: every send and receive buffer of one device's program at a fixed offset of ONE
allocation, planned once per plan, and the compiled steps bound to views of it once per workspace.

Without it, each step of every layer allocates a send buffer per round and a receive buffer per message,
and makes a typed view of every piece it copies and every region it keeps (a few PyTorch calls per
piece): most of the executor's host time on a step (``dcp bench overhead``). With it, a ``Launch`` is one
grouped copy into views made once, and a ``Wait`` hands the kept regions out of a table.

Lifetimes, in step indices of the compiled program (``dcp.execute.compile``):
- a round's send buffer lives from its ``Launch`` to its ``Wait`` (the transport is done with it then:
  ``Comm.wait`` returns after every transfer of the round, sends included);
- a received message lives from its ``Launch`` (the receive is posted into it) to its ``Wait`` — or, when
  some of its regions are kept (relayed inputs, partials that become accumulators), to the last step that
  reads one of those regions; a region the local results read lives to the end (they copy it out: the
  arena is overwritten by the next layer, and a result that would be a region itself is refused).
Buffers whose lifetimes overlap never share bytes: ``plan_arena`` places them greedily, largest first, at
the lowest offset free during their lifetime (offsets multiples of 8 bytes, as message regions are), so
the arena is close to the peak of bytes in flight, which a step without it allocated too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from dcp.errors import ExecutionError

_ALIGN = 8


@dataclass(frozen=True)
class Arena:
    nbytes: int
    send: dict         # launch step index -> byte offset of its round's send buffer
    recv: dict         # (launch step index, message index) -> byte offset of the received message
    kept: frozenset    # spaces that are regions of received messages (views of the arena)
    blocks: tuple      # ((key, byte offset, nbytes, first step, last step), ...): key ("send", i) | ("recv", i, j)


class BoundLaunch(NamedTuple):
    code: str
    n_ir: int
    round: int
    msgs: tuple        # ((peer, send view, (piece dst views), (piece src Specs), alias (Spec, dtype) | None), ...)
    recvs: tuple       # ((peer, receive view), ...)
    srcs: object = None  # the piece sources of every message, batched (``dcp.execute.local.ViewBatch``)


class BoundWait(NamedTuple):
    code: str
    n_ir: int
    round: int
    n_msgs: int
    regions: tuple     # ((space, view), ...): received regions kept as they are
    dsts: list         # slot views the received pieces are copied into
    srcs: list         # the pieces, as views of the arena


def _specs(st) -> list:
    """Every ``Spec`` a compiled step reads (kernel outputs and slot destinations are written, not read)."""
    if st.code == "launch":
        out = [s for _, _, _, pieces, _ in st.msgs for _, s in pieces]
        out += [alias[0] for *_, alias in st.msgs if alias is not None]
        return out
    if st.code == "compute":
        out = [s for qs, kvs, _, _ in st.calls for s in qs + kvs]
        merges = st.merges
    elif st.code == "reduce":
        out, merges = [], st.merges
    else:
        return []
    _, o_merges, layers = merges
    out += [s for p in o_merges for s in p]
    out += [s for dsts, srcs in layers for s in dsts + srcs]
    return out


def last_reads(comp) -> dict:
    """``{space: index of the last step that reads it}`` (``len(comp.steps)``: the local results read it)."""
    last: dict = {}
    for i, st in enumerate(comp.steps):
        for s in _specs(st):
            last[s.space] = i
        if st.code in ("compute", "reduce"):
            for s in st.merges[0]:  # widened: its old tensor is read once more
                last[s] = i
    end = len(comp.steps)
    for recipe in comp.results:
        for r in recipe:
            if r[0] == "whole":
                last[r[1]] = end
            else:
                for _, s in r[4]:
                    last[s.space] = end
    return last


def plan_arena(comp) -> Arena:
    """Offsets of every send and receive buffer of ``comp`` (a ``dcp.execute.compile.Compiled``)."""
    last = last_reads(comp)
    launch_at = {st.round: i for i, st in enumerate(comp.steps) if st.code == "launch"}
    wait_at = {st.round: i for i, st in enumerate(comp.steps) if st.code == "wait"}
    blocks, kept = [], set()   # (nbytes, first step, last step, key)
    for r, i in launch_at.items():
        st, w = comp.steps[i], wait_at[r]
        if st.msgs:
            blocks.append((st.nbytes, i, w, ("send", i)))
        for j, ((_, (nb,), _), (_, _, _, regions, _)) in enumerate(zip(st.recvs, comp.steps[w].msgs)):
            spaces = [space for space, _ in regions]
            kept.update(spaces)
            blocks.append((nb, i, max([w] + [last.get(s, w) for s in spaces]), ("recv", i, j)))
    whole = {r[1] for recipe in comp.results for r in recipe if r[0] == "whole"}
    if whole & kept:  # the compiler adopts only kernel outputs whole; results never alias the arena
        raise ExecutionError(f"a local result would be a view of the message arena (spaces {sorted(whole & kept)})")
    placed: list = []   # (offset, end offset, first, last)
    out: list = []
    top = 0
    for nb, a, b, key in sorted(blocks, key=lambda x: (-x[0], x[1], x[3])):
        size = -(-nb // _ALIGN) * _ALIGN
        off = 0
        busy = [p for p in placed if p[2] <= b and a <= p[3]]
        busy.sort()
        for lo, hi, _, _ in busy:
            if off + size <= lo:
                break
            if hi > off:
                off = hi
        placed.append((off, off + size, a, b))
        out.append((key, off, nb, a, b))
        top = max(top, off + size)
    send = {k[1]: off for k, off, *_ in out if k[0] == "send"}
    recv = {k[1:]: off for k, off, *_ in out if k[0] == "recv"}
    return Arena(top, send, recv, frozenset(kept), tuple(sorted(out)))


def bind_arena(comp, arena: Arena, device: torch.device, bind) -> tuple:
    """(the arena tensor, the steps with every Launch / Wait bound to views of it); ``bind(spec)`` binds
    the ``Spec`` of a persistent slot view (others pass through)."""
    buf = torch.empty(arena.nbytes, dtype=torch.uint8, device=device)
    typed: dict = {}
    as_strided = torch.as_strided

    def views(geometries, base: int) -> list:
        out = []
        for dt, size, stride, off in geometries:
            t = typed.get(dt)
            if t is None:
                t = typed[dt] = buf.view(dt)
            out.append(as_strided(t, size, stride, base // dt.itemsize + off))
        return out

    steps, recv_at = [], {}
    for i, st in enumerate(comp.steps):
        if st.code == "launch":
            base = arena.send.get(i, 0)
            msgs = tuple((peer, buf[base + off:base + off + nb], tuple(views([g for g, _ in pieces], base)),
                          tuple([bind(s) for _, s in pieces]), alias)
                         for peer, off, nb, pieces, alias in st.msgs)
            recvs = []
            for j, (peer, (nb,), _) in enumerate(st.recvs):
                at = arena.recv[i, j]
                recvs.append((peer, buf[at:at + nb]))
            recv_at[st.round] = [arena.recv[i, j] for j in range(len(st.recvs))]
            steps.append(BoundLaunch("launch", st.n_ir, st.round, msgs, tuple(recvs)))
        elif st.code == "wait":
            bases = recv_at[st.round]
            regions, dsts, srcs = [], [], []
            for (_, _, _, regs, pieces), base in zip(st.msgs, bases):
                regions += zip([space for space, _ in regs], views([g for _, g in regs], base))
                dsts += [bind(dst) for dst, _ in pieces]
                srcs += views([g for _, g in pieces], base)
            steps.append(BoundWait("wait", st.n_ir, st.round, len(st.msgs), tuple(regions), dsts, srcs))
        else:
            steps.append(st)
    return buf, steps


__all__ = ["Arena", "BoundLaunch", "BoundWait", "plan_arena", "bind_arena", "last_reads"]
