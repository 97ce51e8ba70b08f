"""dcp.memory: resident tokens and per-direction peak transient buffer bytes of a plan."""
from __future__ import annotations

import json
import warnings
from dataclasses import replace

import numpy as np
import pytest

import dcp
from dcp.baselines import BASELINES, RingPlanner
from dcp.ir.memory import memory_report, received_bytes, resident_input_bytes, resident_tokens, transient_peak_bytes
from dcp.ir.program import DST, HB, KIND, SRC, TB, Program, unit_rows
from dcp.layout.units import INPUT_KINDS, OUTPUT_KINDS, Q_SIDE, Kind, unit_bytes

DIRECTIONS = ("forward", "backward")


def _tiny():
    spec = dcp.BatchSpec([512], dcp.masks.CausalMask(), num_heads=2, num_kv_heads=1, head_dim=16, dtype="float32")
    return RingPlanner().plan(spec, dcp.Cluster(nodes=1, gpus_per_node=2))


def test_tiny_ring_by_hand():
    plan = _tiny()
    # two blocks of 256 tokens (block b homed on device b); tiles (q, kv): (0, 0) on 0 at stage 0,
    # (1, 0) on 1 at stage 1, (1, 1) on 1 at stage 0, one head block (2 q heads, 1 kv head, D = 16, fp32)
    assert plan.layout.tb_len.tolist() == [256, 256] and plan.home.tolist() == [0, 1]
    assert plan.tiles.q_tb.tolist() == [0, 1, 1] and plan.tiles.kv_tb.tolist() == [0, 0, 1]
    assert plan.tile_device.tolist() == [0, 1, 1]
    fwd, bwd = plan.forward, plan.backward
    assert fwd.tile_stage.tolist() == [0, 1, 0] and bwd.tile_stage.tolist() == [0, 1, 0]
    assert fwd.transfers.tolist() == [[Kind.KV, 0, 0, 0, 1, 1]] and fwd.merges.size == 0
    assert bwd.transfers.tolist() == [[Kind.KV, 0, 0, 0, 1, 1], [Kind.DKV, 0, 0, 1, 0, 3]]
    assert bwd.merges.tolist() == [[Kind.DKV, 0, 0, 1, 0, 3]]
    kv = dkv = 256 * 2 * 1 * 16 * 4  # 32768: K and V of one kv head; dK and dV the same
    # forward: device 1 holds KV[0] from round 1 through iteration 2 (tile (1, 0) runs at stage 1);
    # device 0 receives nothing and holds no foreign accumulator
    m = memory_report(plan)
    assert m["peak_transient_bytes_forward"].tolist() == [0, kv]
    # backward: device 1 holds KV[0] in iterations 1..2 and its DKV[0] accumulator (block 0 is homed on
    # device 0) from iteration 2 (stage 1) through round 3, when it sends it: 2 * 32768 in iteration 2;
    # device 0 holds the received DKV[0] partial in iteration 3 only
    assert m["peak_transient_bytes_backward"].tolist() == [dkv, kv + dkv]
    assert m["received_bytes_forward"].tolist() == [0, kv]
    assert m["received_bytes_backward"].tolist() == [dkv, kv]
    assert m["resident_tokens"].tolist() == [256, 256]
    assert m["resident_input_bytes"].tolist() == [256 * (2 + 2 * 1) * 16 * 4] * 2
    s = plan.stats()
    assert (s.max_resident_tokens, s.mean_resident_tokens) == (256, 256.0)
    assert (s.peak_transient_bytes_forward, s.peak_transient_bytes_backward) == (kv, kv + dkv)
    assert s.peak_transient_per_device_backward == (dkv, kv + dkv)


def test_relay_and_foreign_accumulator_by_hand():
    """Hand-made forward programs on the tiny plan's blocks: a relay keeps an input alive, and a foreign
    O accumulator lives from its first stage through its send."""
    plan = _tiny()
    spec, lay = plan.spec, plan.layout
    kv, q, o = (int(unit_bytes(spec, lay, k, 0)) for k in (Kind.KV, Kind.Q, Kind.O))
    # device 1 gets KV[0] in round 1, reads it at stage 1 and relays it to device 2 in round 4
    prog = Program("forward", np.array([0, 1, 0], np.int32),
                   unit_rows(Kind.KV, 0, 0, [0, 1], [1, 2], [1, 4]), unit_rows(0, 0, 0, 0, 0, np.zeros(0)))
    got = transient_peak_bytes(spec, lay, prog, plan.tile_device, plan.home, 3, plan.tiles)
    assert got.tolist() == [0, kv, kv]
    # tile (1, 0) moved to device 0: it gets Q[1] in round 1 (alive 1..2), accumulates O[1] from stage 1
    # (iteration 2) and sends it home in round 3 (alive 2..3); device 1 holds the partial in iteration 3
    rows = unit_rows([Kind.Q, Kind.O], 1, 0, [1, 0], [0, 1], [1, 3])
    prog = Program("forward", np.array([0, 1, 0], np.int32), rows, rows[1:])
    got = transient_peak_bytes(spec, lay, prog, np.array([0, 0, 1], np.int32), plan.home, 2, plan.tiles)
    assert got.tolist() == [q + o, o]


def _batches():
    return [dcp.BatchSpec([512], "causal", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32"),
            dcp.BatchSpec([300, 700, 129], "causal", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32"),
            dcp.BatchSpec([1000, 200], "full", num_heads=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")]


def _plans():
    planners = [("dcp", lambda s, c: dcp.plan(s, c, dcp.PlannerConfig(block_size=128)))]
    planners += [(name, lambda s, c, cls=cls: cls().plan(s, c)) for name, cls in BASELINES.items()]
    planners += [("ring_shards", lambda s, c: RingPlanner(shards=True).plan(s, c))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for spec in _batches():
            for cluster in (dcp.Cluster(1, 4), dcp.Cluster(2, 2)):
                for name, make in planners:
                    yield name, make(spec, cluster)


PLANS = None


def plans():
    global PLANS
    if PLANS is None:
        PLANS = list(_plans())
    return PLANS


def _foreign_accumulator_bytes(plan, direction: str) -> np.ndarray:
    """Bytes of every accumulator a device holds for a unit homed elsewhere (from tiles or partials)."""
    prog, n = plan.columns(direction), plan.n_devices
    t = plan.tiles
    units = set()
    for k in OUTPUT_KINDS[direction]:
        tb = t.q_tb if k in Q_SIDE else t.kv_tb
        units |= set(zip(plan.tile_device.tolist(), [int(k)] * tb.size, tb.tolist(), t.hb.tolist()))
    part = prog.transfers[prog.is_partial()]
    units |= set(map(tuple, part[:, [DST, KIND, TB, HB]].tolist()))
    out = np.zeros(n, np.int64)
    for d, k, tb, _ in units:
        if plan.home[tb] != d:
            out[d] += int(unit_bytes(plan.spec, plan.layout, k, tb))
    return out


def test_invariants_and_stats():
    for name, plan in plans():
        m = memory_report(plan)
        s = plan.stats()
        n = plan.n_devices
        assert np.array_equal(m["resident_tokens"], resident_tokens(plan))
        assert m["resident_tokens"].sum() == plan.spec.total_tokens
        assert s.max_resident_tokens == m["resident_tokens"].max()
        assert s.mean_resident_tokens == pytest.approx(plan.spec.total_tokens / n)
        assert s.resident_tokens_per_device == tuple(m["resident_tokens"].tolist())
        for direction in DIRECTIONS:
            peak = m[f"peak_transient_bytes_{direction}"]
            prog = plan.columns(direction)
            recv = received_bytes(plan.spec, plan.layout, prog, n)
            assert peak.dtype == np.int64 and peak.shape == (n,)
            assert np.array_equal(recv, m[f"received_bytes_{direction}"])
            assert recv.sum() == sum(int(unit_bytes(plan.spec, plan.layout, r[KIND], r[TB])) for r in prog.transfers)
            assert (peak >= 0).all() and (peak <= recv + _foreign_accumulator_bytes(plan, direction)).all(), name
            quiet = np.ones(n, bool)
            quiet[prog.transfers[:, DST]] = False
            quiet[prog.transfers[prog.is_partial(), SRC]] = False
            assert (peak[quiet] == 0).all(), (name, direction)
            assert getattr(s, f"peak_transient_bytes_{direction}") == peak.max()
            assert getattr(s, f"peak_transient_per_device_{direction}") == tuple(peak.tolist())
        row = s.to_dict()
        json.dumps(row)
        assert row["peak_transient_per_device_forward"] == s.peak_transient_per_device_forward


def _reference_peak(plan, direction: str) -> list[int]:
    """The model of ``dcp.ir.memory`` written out with dicts: per device, per iteration, sum what is alive."""
    prog, n = plan.columns(direction), plan.n_devices
    last = max(prog.n_rounds, prog.n_stages)
    t = plan.tiles
    ins, outs = {int(k) for k in INPUT_KINDS[direction]}, {int(k) for k in OUTPUT_KINDS[direction]}

    def nbytes(k, tb):
        return int(unit_bytes(plan.spec, plan.layout, k, tb))

    peaks = []
    for d in range(n):
        recv_in, use_end, acc_start, acc_end, partials = {}, {}, {}, {}, []
        for i in range(t.n_tiles):
            if plan.tile_device[i] != d:
                continue
            s = int(prog.tile_stage[i])
            for k in list(INPUT_KINDS[direction]) + list(OUTPUT_KINDS[direction]):
                u = (int(k), int(t.q_tb[i] if k in Q_SIDE else t.kv_tb[i]), int(t.hb[i]))
                if int(k) in ins:
                    use_end[u] = max(use_end.get(u, 0), s + 1)
                else:
                    acc_start[u] = min(acc_start.get(u, 10**9), s + 1)
        for k, tb, hb, src, dst, r in prog.transfers.tolist():
            u = (k, tb, hb)
            if k in ins and dst == d:
                recv_in[u] = min(recv_in.get(u, 10**9), r)
            if k in ins and src == d:
                use_end[u] = max(use_end.get(u, 0), r)
            if k in outs and dst == d:
                acc_start[u] = min(acc_start.get(u, 10**9), r)
                partials.append((r, r, nbytes(k, tb)))
            if k in outs and src == d:
                acc_end[u] = max(acc_end.get(u, 0), r)
        live = [(r0, max(r0, use_end.get(u, 0)), nbytes(u[0], u[1])) for u, r0 in recv_in.items()]
        live += [(a0, max(a0, acc_end.get(u, last)), nbytes(u[0], u[1]))
                 for u, a0 in acc_start.items() if plan.home[u[1]] != d]
        live += partials
        peaks.append(max([sum(b for a, e, b in live if a <= r <= e) for r in range(1, last + 1)], default=0))
    return peaks


def _random_plans():
    rng = np.random.default_rng(7)
    masks = ["causal", "full", dcp.masks.PrefixLMMask(0.3), dcp.masks.CausalBlockwiseMask(block=96, num_prev=1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(4):
            lens = rng.integers(40, 900, size=int(rng.integers(1, 5))).tolist()
            spec = dcp.BatchSpec(lens, masks[i % len(masks)], num_heads=4, num_kv_heads=int(rng.choice([1, 2, 4])),
                                 head_dim=8, dtype="float32")
            cluster = dcp.Cluster(int(rng.integers(1, 3)), int(rng.integers(2, 4)))
            yield dcp.plan(spec, cluster, dcp.PlannerConfig(block_size=int(rng.choice([64, 128]))))
            yield list(BASELINES.values())[i % len(BASELINES)]().plan(spec, cluster)


def test_matches_reference():
    for plan in list(_random_plans()) + [p for name, p in plans() if name in ("ring_shards", "te_a2a_p2p")][:3]:
        m = memory_report(plan)
        for direction in DIRECTIONS:
            assert m[f"peak_transient_bytes_{direction}"].tolist() == _reference_peak(plan, direction), \
                (plan.planner, direction)


def test_moved_tiles_match_reference():
    """A plan whose tiles and transfers are shuffled is no longer valid, but the model still applies."""
    plan = _tiny()
    rng = np.random.default_rng(3)
    for _ in range(3):
        dev = rng.integers(0, 2, plan.tiles.n_tiles).astype(np.int32)
        progs = {}
        for direction in DIRECTIONS:
            prog = plan.columns(direction)
            kinds = list(INPUT_KINDS[direction]) + list(OUTPUT_KINDS[direction])
            k = rng.integers(0, len(kinds), 6)
            rows = unit_rows(np.array(kinds)[k], rng.integers(0, 2, 6), 0, rng.integers(0, 2, 6),
                             rng.integers(0, 2, 6), rng.integers(1, 5, 6))
            progs[direction] = Program(direction, rng.integers(0, 4, plan.tiles.n_tiles).astype(np.int32), rows,
                                       prog.merges)
        moved = replace(plan, tile_device=dev, **progs)
        m = memory_report(moved)
        for direction in DIRECTIONS:
            assert m[f"peak_transient_bytes_{direction}"].tolist() == _reference_peak(moved, direction)


def test_resident_input_bytes():
    spec = dcp.BatchSpec([64], "causal", num_heads=8, num_kv_heads=2, head_dim=128, dtype="bfloat16")
    assert resident_input_bytes(spec, None, np.array([0, 10])).tolist() == [0, 10 * (8 + 4) * 128 * 2]
