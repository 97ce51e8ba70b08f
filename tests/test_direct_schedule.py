"""``dcp.baselines.common.direct_schedule``: inputs straight from home to each consumer, partials straight
home. Plans built with it validate and compute dense attention exactly; rounds and stages follow the
requested arrivals."""
import numpy as np
import pytest
import torch

import dcp
from _dense import assert_matches_dense
from dcp.baselines.common import BlockBuilder, direct_schedule, near_equal_chunks
from dcp.ir.validate import validate
from dcp.layout.tiles import enumerate_tiles
from dcp.masks import CausalMask, LambdaMask
from dcp.schedule.assemble import assemble


def _plan(spec, cluster, tile_on_kv: bool, kv_round, extra: bool, hierarchical: bool = False):
    p = cluster.n_devices
    builder = BlockBuilder(spec)
    for n in spec.seqlens:
        starts, chunk = near_equal_chunks(n, p)
        builder.add(starts, chunk)
    layout = builder.layout(None)
    home = builder.arrays()[0]
    tiles = enumerate_tiles(spec, layout)
    # tiles on their q block's home (only KV moves), or on their kv block's (Q moves, O partials return)
    tile_device = home[tiles.kv_tb if tile_on_kv else tiles.q_tb]
    ex = None
    if extra:  # all-gather: every KV unit to every device
        units = np.arange(layout.n_token_blocks * layout.n_head_blocks)
        dst = np.repeat(np.arange(p), units.size)
        u = np.tile(units, p)
        ex = np.stack([np.ones_like(u), u // layout.n_head_blocks, u % layout.n_head_blocks, dst], 1)
    kv_r = kv_round(tiles, home, tile_device) if callable(kv_round) else kv_round
    stage, routes = direct_schedule(layout, tiles, home, tile_device, 1, kv_r, extra_inputs=ex,
                                    gpus_per_node=cluster.gpus_per_node if hierarchical else None)
    return assemble(spec, cluster, layout, tiles, home, tile_device, stage, routes, "direct", 0.0), stage, routes


@pytest.mark.parametrize("tile_on_kv", [False, True])
@pytest.mark.parametrize("extra", [False, True])
def test_direct_plans_are_exact(tile_on_kv, extra):
    torch.set_num_threads(1)
    spec = dcp.BatchSpec([23, 9, 14], LambdaMask(sink=2, window=6), 4, 2, 8, dtype="float64")
    # remote KV from device d arrives in round 1 + (distance mod 2): two staged groups
    def kv_round(tiles, home, dev):
        return 1 + (np.abs(home[tiles.kv_tb] - dev) % 2)

    plan, stage, routes = _plan(spec, dcp.Cluster(1, 3), tile_on_kv, kv_round, extra)
    validate(plan)
    assert plan.stats().comm_bytes_total > 0
    ins = routes.inputs
    assert (ins[:, 3] != ins[:, 4]).all() and set(np.unique(ins[:, 5])) <= {1, 2}
    # one delivery per (side, unit, device)
    assert np.unique(ins[:, [0, 1, 2, 4]], axis=0).shape[0] == ins.shape[0]
    assert (routes.outputs[:, 4] == plan.home[routes.outputs[:, 1]]).all()  # partials go straight home
    assert_matches_dense(plan, seed=3)


def test_all_gather_charges_every_unit_everywhere():
    spec = dcp.BatchSpec([40, 8], CausalMask(), 4, 2, 8)
    cl = dcp.Cluster(1, 4)
    gathered, _, r1 = _plan(spec, cl, False, 1, True)
    needed, _, r0 = _plan(spec, cl, False, 1, False)
    nu = gathered.layout.n_token_blocks * gathered.layout.n_head_blocks
    home_units = r1.inputs[r1.inputs[:, 0] == 1]
    assert home_units.shape[0] == nu * (cl.n_devices - 1)  # every KV unit to every other device
    assert gathered.stats().comm_bytes_forward > needed.stats().comm_bytes_forward
    assert (r0.inputs[:, 5] == 1).all()


def test_remote_input_in_round_zero_is_refused():
    spec = dcp.BatchSpec([16], CausalMask(), 2, 2, 8)
    with pytest.raises(ValueError, match="round 1 or later"):
        _plan(spec, dcp.Cluster(1, 2), False, 0, False)


def test_all_gather_reaches_a_device_that_runs_no_tiles():
    """A device that computes nothing still receives the all-gather (its (unit, device) keys must not
    collide with another unit's delivery to a lower device)."""
    spec = dcp.BatchSpec([16, 8], CausalMask(), 2, 2, 8)
    layout_builder = BlockBuilder(spec)
    layout_builder.add(np.array([0, 8]), np.array([0, 1]))
    layout_builder.add(np.array([0]), np.array([1]))
    layout = layout_builder.layout(None)
    home = layout_builder.arrays()[0]
    tiles = enumerate_tiles(spec, layout)
    tile_device = home[tiles.q_tb].copy()
    tile_device[(tiles.q_tb == 1) & (tiles.kv_tb == 1)] = 0  # KV of block 1 must reach device 0
    units = np.arange(layout.n_token_blocks * layout.n_head_blocks)
    ex = np.array([[1, u // layout.n_head_blocks, u % layout.n_head_blocks, d] for d in range(3) for u in units])
    _, routes = direct_schedule(layout, tiles, home, tile_device, 1, 1, extra_inputs=ex)
    kv = routes.inputs[routes.inputs[:, 0] == 1]
    sent = {(int(tb), int(hb), int(dst)) for tb, hb, dst in kv[:, [1, 2, 4]]}
    want = {(int(u // layout.n_head_blocks), int(u % layout.n_head_blocks), d) for d in range(3) for u in units
            if home[u // layout.n_head_blocks] != d}
    assert sent == want


@pytest.mark.parametrize("tile_on_kv", [False, True])
def test_hierarchical_crosses_each_node_once_and_stays_exact(tile_on_kv):
    """With ``gpus_per_node`` a unit enters a remote node once (to the GPU with its home's local index)
    and is relayed inside; partials of a remote node merge there before going home."""
    torch.set_num_threads(1)
    spec = dcp.BatchSpec([31, 12, 20], CausalMask(), 4, 2, 8, dtype="float64")
    cluster = dcp.Cluster(2, 3)
    plan, stage, routes = _plan(spec, cluster, tile_on_kv, 1, True, hierarchical=True)
    flat, _, _ = _plan(spec, cluster, tile_on_kv, 1, True)
    validate(plan)
    g = cluster.gpus_per_node
    ins = routes.inputs
    cross = ins[ins[:, 3] // g != ins[:, 4] // g]
    node_entries = np.unique(np.c_[cross[:, :3], cross[:, 4] // g], axis=0)
    assert node_entries.shape[0] == cross.shape[0]  # one crossing per (unit, node)
    assert (cross[:, 4] % g == cross[:, 3] % g).all()  # to the entry GPU of the same local index
    assert plan.stats().comm_bytes_inter_node < flat.stats().comm_bytes_inter_node
    out = routes.outputs
    assert (out[out[:, 3] // g != out[:, 4] // g][:, 4] == plan.home[out[out[:, 3] // g != out[:, 4] // g][:, 1]]).all()
    assert_matches_dense(plan, seed=5)


@pytest.mark.parametrize("tile_on_kv", [False, True])
def test_hierarchical_entries_beyond_every_used_device(tile_on_kv):
    # a placement that uses only some GPUs of 2 x 8: a unit homed on GPU 2 enters node 1 through GPU 10, a GPU
    # with no tile and no block, and its partials return through it; keys must still tell the units apart
    # (they ran past the widest device used and mixed units up: found by dcp's direct schedules of a sparse
    # placement)
    spec = dcp.BatchSpec([256, 128], CausalMask(), 2, 1, 8, dtype="float64")
    layout = dcp.layout.blocks.uniform_layout(spec, 128, None)
    tiles = enumerate_tiles(spec, layout)
    home = np.array([2, 9, 5])
    tile_device = home[tiles.kv_tb if tile_on_kv else tiles.q_tb]
    cluster = dcp.Cluster(2, 8)
    stage, routes = direct_schedule(layout, tiles, home, tile_device, 1, 1, gpus_per_node=8)
    # through the entry GPU: 10 for KV homed on GPU 2 read on GPU 9; 1 for Q homed on 9 read on 2
    assert (routes.inputs[:, 4] == (1 if tile_on_kv else 10)).any()
    plan = assemble(spec, cluster, layout, tiles, home, tile_device, stage, routes, "direct", 0.0)
    validate(plan)
    assert_matches_dense(plan, seed=5)
