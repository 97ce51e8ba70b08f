"""A plan that decodes and validates computes its batch's attention: edited plans are refused or harmless.

Every case edits ONE element of a valid plan's bytes (an array entry or a header field), recomputes the
checksum so the bytes still look intact, and then demands one of two outcomes: ``Plan.from_bytes`` /
``dcp.validate`` refuse it with ``SerializationError`` / ``PlanValidationError``, or the plan executes
(forward and backward, reference executor, fp64) to dense attention's result. Running silently wrong
is the failure this file exists to catch.
"""
from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from _budget import n_examples

import dcp
from dcp.execute import ReferenceExecutor, reference_attention
from dcp.ir.serialize import MAGIC, VERSION
from dcp.masks import CausalMask, LambdaMask, SharedQuestionMask

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

N_ARRAY_EDITS = n_examples(150, 3000)


@pytest.fixture(scope="module")
def case():
    spec = dcp.BatchSpec([23, 9, 14], [CausalMask(), LambdaMask(sink=2, window=4), SharedQuestionMask(0.3, 2)],
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype="float64")
    # no warm starts: the static plans' layouts keep all heads in one block, and the header edits below need
    # the two head blocks this configuration asks of dcp's own candidates
    config = dcp.PlannerConfig(block_size=4, head_block_size=2, partitioner=dcp.GreedyPartitioner(), time_budget_s=None,
                               search=dcp.SearchConfig(warm_starts=()))
    plan = dcp.plan(spec, dcp.Cluster(2, 2), config)
    g = torch.Generator().manual_seed(0)
    t = spec.total_tokens
    q, k, v, do = (torch.randn(t, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = reference_attention(*leaves, spec, return_lse=True)
    grads = torch.autograd.grad(o, leaves, do)
    return plan.to_bytes(), (q, k, v, do), (o.detach(), lse.detach(), *grads)


def _split(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    head_len = struct.unpack("<Q", blob[len(MAGIC) + 4:len(MAGIC) + 12])[0]
    pos = len(MAGIC) + 12
    header = json.loads(blob[pos:pos + head_len])
    pos += head_len
    arrays = {}
    for name, dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        arrays[name] = np.frombuffer(blob, dtype=dt, count=int(np.prod(shape)), offset=pos).copy()
        pos += arrays[name].nbytes
    return header, arrays


def _join(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """Bytes with a valid checksum, whatever they hold."""
    head = json.dumps(header, separators=(",", ":")).encode()
    blob = MAGIC + struct.pack("<IQ", VERSION, len(head)) + head + b"".join(a.tobytes() for a in arrays.values())
    return blob + struct.pack("<I", zlib.crc32(blob))


def _outcome(blob: bytes, inputs, truth) -> str:
    """'refused' or 'correct'; anything else is a silently wrong plan (or an unnamed error)."""
    try:
        plan = dcp.Plan.from_bytes(blob)
        dcp.validate(plan)
    except (dcp.SerializationError, dcp.PlanValidationError):
        return "refused"
    q, k, v, do = inputs
    ex = ReferenceExecutor(validate=False)
    o, lse = ex.run_forward(plan, q, k, v)
    dq, dk, dv = ex.run_backward(plan, q, k, v, o, lse, do)
    for got, want in zip((o, lse, dq, dk, dv), truth):
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True):
            return "WRONG"
    return "correct"


def _new_value(rng: np.random.Generator, a: np.ndarray, i: int):
    old = a[i]
    if a.dtype.kind == "b":
        return not old
    if a.dtype.kind == "f":
        return rng.choice([old * 2, old + 1.0, 0.0, old / 2])
    hi = int(a.max()) + 2
    return rng.choice([int(old) + 1, int(old) - 1, 0, -1, int(rng.integers(-1, hi + 1))])


def test_single_element_array_edits_are_refused_or_harmless(case):
    blob, inputs, truth = case
    assert _outcome(blob, inputs, truth) == "correct"
    header, arrays = _split(blob)
    names = sorted(arrays)
    rng = np.random.default_rng(13)
    tally: dict[str, int] = {}
    wrong = []
    done = 0
    while done < N_ARRAY_EDITS:
        name = names[rng.integers(len(names))]
        a = arrays[name]
        if a.size == 0:
            continue
        i = int(rng.integers(a.size))
        value = _new_value(rng, a, i)
        if value == a[i]:
            continue
        edited = dict(arrays)
        edited[name] = a.copy()
        edited[name][i] = value
        result = _outcome(_join(header, edited), inputs, truth)
        tally[result] = tally.get(result, 0) + 1
        if result == "WRONG":
            wrong.append((name, i, a[i], value))
        done += 1
    assert not wrong, f"silently wrong plans after editing (array, index, old, new): {wrong[:10]}; {tally}"
    assert tally.get("refused", 0) > N_ARRAY_EDITS // 2, tally  # the edits do reach the checks


def _header_edits(header: dict) -> dict:
    """Named single-field edits of the JSON header."""
    spec = header["spec"]

    def at(path, value):
        def edit(h):
            node = h
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        return edit

    first_mask = spec["masks"][0]
    edits = {
        "num_heads": at(("spec", "num_heads"), spec["num_heads"] * 2),
        "num_heads_half": at(("spec", "num_heads"), spec["num_heads"] // 2),
        "num_kv_heads": at(("spec", "num_kv_heads"), 1),
        "num_kv_heads_more": at(("spec", "num_kv_heads"), 4),
        "head_dim": at(("spec", "head_dim"), 16),
        "seqlen_longer": at(("spec", "seqlens", 0), spec["seqlens"][0] + 1),
        "seqlen_shorter": at(("spec", "seqlens", 1), spec["seqlens"][1] - 1),
        "seqlens_swapped": at(("spec", "seqlens"), spec["seqlens"][::-1]),
        "seqlens_dropped": at(("spec", "seqlens"), spec["seqlens"][:-1]),
        "mask_index": at(("spec", "mask_index", 0), 1),
        "mask_family": at(("spec", "masks", 0), {"name": "full"}),
        "mask_param": at(("spec", "masks", 1), {**spec["masks"][1], "window": 5}),
        "mask_unknown": at(("spec", "masks", 0), {**first_mask, "name": "zz"}),
        "cluster_nodes": at(("cluster", "nodes"), 1),
        "cluster_gpus": at(("cluster", "gpus_per_node"), 4),
        "head_block_size": at(("layout", "head_block_size"), 4),
        "n_head_blocks": at(("layout", "n_head_blocks"), 1),
        "kv_heads_per_block": at(("layout", "kv_heads_per_block"), 2),
        "group_size": at(("layout", "group_size"), 1),
        "array_dtype": at(("arrays", 0, 1), "<zz"),
        "array_shape": at(("arrays", 0, 2), [-1]),
        "arrays_missing": lambda h: h.pop("arrays"),
        "planner_name": at(("planner",), "someone else"),
        "dtype": at(("spec", "dtype"), "float32"),
    }
    return edits


def test_header_edits_are_refused_or_harmless(case):
    blob, inputs, truth = case
    header, arrays = _split(blob)
    results = {}
    for name, edit in _header_edits(header).items():
        h = json.loads(json.dumps(header))
        edit(h)
        results[name] = _outcome(_join(h, arrays), inputs, truth)
    wrong = [k for k, v in results.items() if v not in ("refused", "correct")]
    assert not wrong, results
    # the edits that change what is computed are all refused; more GPUs per node only adds idle devices
    # (a plan may leave devices idle, and the columnar program names devices, not how many there are)
    harmless = {"planner_name", "dtype", "cluster_gpus"}
    assert all(v == "refused" for k, v in results.items() if k not in harmless), results


@pytest.mark.parametrize("edit", ["full", "tb_start", "kv_tb", "num_heads"])
def test_the_issue_examples_are_refused(case, edit):
    """The four edits of the report: every tile marked full, a shifted block start, a swapped kv block, a
    spec whose head count differs from the layout."""
    import dataclasses

    plan = dcp.Plan.from_bytes(case[0])
    if edit == "full":
        plan.tiles.full[:] = True
    elif edit == "tb_start":
        plan.layout.tb_start[1] += 1
    elif edit == "kv_tb":
        t = int(np.flatnonzero(plan.tiles.q_tb != plan.tiles.kv_tb)[0])
        plan.tiles.kv_tb[t], plan.tiles.q_tb[t] = plan.tiles.q_tb[t], plan.tiles.kv_tb[t]
    else:
        s = plan.spec
        plan = dataclasses.replace(plan, spec=dcp.BatchSpec(s.seqlens, s.masks, 8, s.num_kv_heads, s.head_dim, s.dtype))
    with pytest.raises(dcp.PlanValidationError):
        dcp.validate(plan)


def test_malformed_bytes_raise_serialization_error(case):
    blob = case[0]
    header, arrays = _split(blob)
    bad = {
        "no arrays key": {k: v for k, v in header.items() if k != "arrays"},
        "bad dtype": {**header, "arrays": [[n, "<zz", s] for n, _, s in header["arrays"]]},
        "header not an object": [1, 2],
        "spec not a batch": {**header, "spec": {"seqlens": "abc"}},
        "cluster unknown field": {**header, "cluster": {"racks": 2}},
    }
    for what, h in bad.items():
        with pytest.raises(dcp.SerializationError):
            dcp.Plan.from_bytes(_join(h, arrays))
    with pytest.raises(dcp.SerializationError):
        dcp.Plan.from_bytes(_join(header, arrays)[:-5] + b"\0" * 5)
    trailing = _join(header, {**arrays, "backward.transfers": np.append(arrays["backward.transfers"], 0)})
    with pytest.raises(dcp.SerializationError):
        dcp.Plan.from_bytes(trailing)
