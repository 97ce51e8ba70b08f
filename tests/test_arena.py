"""The message arena (``dcp.execute.arena``): every send and receive buffer of a device's program at a fixed
offset of one allocation, reused by every step. Buffers alive at the same time must never share bytes, and
no step may read a buffer after the last step its lifetime names (else the next buffer placed there
corrupts it): checked geometrically on every device's program, and by running plans whose arenas are
poisoned the moment each buffer's lifetime ends."""
import pytest
import torch
from _dense import assert_matches_dense

import dcp
from dcp.baselines import BASELINES
from dcp.execute.arena import plan_arena
from dcp.execute.compile import Dtypes
from dcp.execute.local import DeviceRunner
from dcp.execute.tables import plan_tables
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask
from dcp.partition import GreedyPartitioner

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SPEC = dict(seqlens=[37, 5, 21, 2], heads=4, kv_heads=2, head_dim=8)
MASKS = {"causal": CausalMask(), "lambda": LambdaMask(sink=3, window=9), "shared_question": SharedQuestionMask(0.3, 3)}


def _plan(planner: str, mask: str, cluster=(2, 2)):
    spec = dcp.BatchSpec(SPEC["seqlens"], MASKS[mask], SPEC["heads"], SPEC["kv_heads"], SPEC["head_dim"],
                         dtype="float64")
    if planner == "dcp":
        p = dcp.DCPPlanner(dcp.PlannerConfig(block_size=4, head_block_size=2, partitioner=GreedyPartitioner(),
                                             time_budget_s=None))
    else:
        p = BASELINES[planner]()
    return p.plan(spec, dcp.Cluster(*cluster))


PLANS = [("dcp", "causal"), ("dcp", "lambda"), ("dcp", "shared_question"), ("ring", "causal"),
         ("zigzag", "lambda"), ("magi", "causal"), ("te_a2a_p2p", "causal")]


def _arenas(plan):
    tab = plan_tables(plan)
    for direction in ("forward", "backward"):
        for d in range(plan.n_devices):
            comp = tab.compiled(direction, d, Dtypes.of(torch.float64))
            yield direction, d, comp, plan_arena(comp)


@pytest.mark.parametrize("planner,mask", PLANS)
def test_live_buffers_never_share_bytes(planner, mask):
    plan = _plan(planner, mask)
    assert plan.stats().comm_bytes_total > 0  # data crosses devices: there are buffers to place
    n_blocks = 0
    for direction, d, comp, arena in _arenas(plan):
        blocks = arena.blocks
        n_blocks += len(blocks)
        assert arena.nbytes <= sum(-(-b[2] // 8) * 8 for b in blocks)
        for key, off, nb, first, last in blocks:
            assert off % 8 == 0 and 0 <= off and off + nb <= arena.nbytes, (direction, d, key)
            assert first <= last < len(comp.steps) + 1
        for i, (k1, o1, n1, a1, b1) in enumerate(blocks):
            for k2, o2, n2, a2, b2 in blocks[i + 1:]:
                if a1 <= b2 and a2 <= b1:  # alive together
                    assert o1 + n1 <= o2 or o2 + n2 <= o1, (direction, d, k1, k2)
        # every launch's buffers are placed: its round's send buffer (if it sends) and each message it receives
        for i, st in enumerate(comp.steps):
            if st.code == "launch":
                assert (i in arena.send) == bool(st.msgs)
                assert all((i, j) in arena.recv for j in range(len(st.recvs)))
    assert n_blocks > 0


def test_the_arena_reuses_bytes():
    """Pinned: on a multi-round plan, buffers whose lifetimes do not overlap share bytes, so the arena is
    smaller than all its buffers together (it is what one step allocated at its peak, not their sum)."""
    plan = _plan("ring", "causal", (1, 4))
    reused = [(sum(b[2] for b in arena.blocks), arena.nbytes) for _, _, _, arena in _arenas(plan)]
    assert all(total >= nbytes for total, nbytes in reused)
    assert any(nbytes < total for total, nbytes in reused), reused


@pytest.mark.parametrize("planner,mask", PLANS)
def test_no_step_reads_a_buffer_after_its_lifetime(planner, mask, monkeypatch):
    """Each arena buffer is filled with NaN right after the last step of its lifetime, on every device and in
    both directions; results must still equal dense fp64 attention (and do not if a lifetime ends early)."""
    plan = _plan(planner, mask)
    step = DeviceRunner.step
    poisoned = []

    def poisoning_step(self, st):
        step(self, st)
        i = next(j for j, x in enumerate(self.steps) if x is st)
        for _, off, nb, _, last in self.ws.arena.blocks:
            if last == i:
                self.ws.arena_buf[off:off + nb].fill_(255)  # all-ones bytes: NaN in every float dtype
                poisoned.append(nb)

    monkeypatch.setattr(DeviceRunner, "step", poisoning_step)
    assert_matches_dense(plan)
    assert poisoned  # the hook ran


def test_results_survive_the_next_step():
    """The arena is overwritten by the next layer's step: nothing a step returns may be a view of it."""
    plan = _plan("dcp", "causal")
    ex = dcp.ReferenceExecutor()
    g = torch.Generator().manual_seed(1)
    t = plan.spec.total_tokens
    q, k, v = (torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    o, lse = ex.run_forward(plan, q, k, v)
    o_saved, lse_saved = o.clone(), lse.clone()
    ex.run_forward(plan, q * 2, k.flip(0), v + 1)
    assert torch.equal(o, o_saved) and torch.equal(lse, lse_saved)


def test_batched_views_are_the_views_one_by_one():
    """``batch_views``: one ``tensor_split`` per space for its disjoint row ranges must give exactly the views
    ``Spec`` by ``Spec`` would (same storage offset, shape, strides), for [T, H, D] and [H, T] spaces, ranges
    starting at row 0 and ending at the last row, overlapping and empty ranges, head slices, whole tensors,
    repeats and already bound tensors."""
    from dcp.execute.compile import Spec
    from dcp.execute.local import batch_views

    S = [torch.empty(40, 4, 8), torch.empty(4, 40), torch.empty(40, 2, 8)]
    bound = S[0][3:9]

    def check(specs):
        one = DeviceRunner.__new__(DeviceRunner)
        one.S, one.V = S, [None] * len(specs)
        want = [one._get(s) for s in specs]
        one.V = [None] * len(specs)
        vb = batch_views(specs)
        got = one._views(vb)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if w.numel() == 0:  # (an empty view's data pointer means nothing)
                assert g.shape == w.shape
                continue
            assert (g.shape, g.stride(), g.storage_offset(), g.data_ptr()) == \
                (w.shape, w.stride(), w.storage_offset(), w.data_ptr()), specs
        return vb

    rng = torch.Generator().manual_seed(0)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=rng))  # noqa: E731
    for _ in range(60):
        specs = []
        for space in range(3):  # disjoint ranges cut from a partition of the rows, then some others
            cuts = sorted({0, 40, *(draw(1, 40) for _ in range(draw(0, 6)))})
            for a, b in zip(cuts, cuts[1:]):
                if draw(0, 3):
                    specs.append((space, a, b, None))
        for _ in range(draw(0, 5)):
            space, a = draw(0, 3), draw(0, 40)
            kind = draw(0, 4)
            specs.append((space, None, None, None) if kind == 0 else "bound" if kind == 1 else
                         (space, a, draw(a, 41), slice(1, 2) if kind == 2 else None))
        order = torch.randperm(len(specs), generator=rng).tolist()
        check([bound if specs[j] == "bound" else Spec(*specs[j], S[specs[j][0]].dim(), n)
               for n, j in enumerate(order)])
    # pinned: a space with several disjoint ranges (one from row 0, one to the last row) is split once
    vb = check([Spec(0, 0, 5, None, 3, 0), Spec(0, 5, 9, None, 3, 1), Spec(0, 20, 40, None, 3, 2),
                Spec(1, 0, 10, None, 2, 3), Spec(1, 30, 40, None, 2, 4), Spec(2, 4, 9, None, 3, 5)])
    assert len(vb.groups) == 2 and [g for g, _ in vb.picks] == [0, 0, 0, 1, 1, -1]


def test_a_result_that_would_be_an_arena_region_is_refused():
    """Local results must outlive the step: the compiler adopts only kernel outputs whole, and ``plan_arena``
    refuses a program whose result would be a received region (the next layer overwrites the arena)."""
    import dataclasses

    from dcp.errors import ExecutionError

    plan = _plan("ring", "causal", (1, 4))
    for _, _, comp, arena in _arenas(plan):
        if arena.kept:
            space = sorted(arena.kept)[0]
            bad = dataclasses.replace(comp, results=((("whole", space, torch.float64),),) + tuple(comp.results[1:]))
            with pytest.raises(ExecutionError, match="view of the message arena"):
                plan_arena(bad)
            return
    pytest.fail("no program keeps a received region")
