"""Bad inputs get named errors that say what to fix; convenient inputs (mask names) are accepted."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import dcp
from dcp.execute.local import own_storages
from dcp.masks import CausalMask, FullMask


@pytest.mark.parametrize("seqlens,fragment", [
    ([16, float("inf")], "entry 1 is inf"),
    ([16, float("nan")], "entry 1 is nan"),
    ([True, 8], "entry 0 is a bool"),
    (np.array([True, False]), "is a bool"),
    (None, "got NoneType"),
    ("4096", "got str"),
    ([4096, "x"], "entry 1 is 'x'"),
    ([[1, 2]], "shape (1, 2)"),
    ([], "shape (0,)"),
    ([3.0, 4.5], "entry 1 is 4.5"),
    ([0, 3], "sequence 0 has length 0"),
    ([2**31], "at most"),
])
def test_bad_lengths_raise_invalid_batch_error(seqlens, fragment):
    with pytest.raises(dcp.InvalidBatchError) as err:
        dcp.BatchSpec(seqlens, CausalMask(), 2)
    assert fragment in str(err.value)


def test_lengths_of_any_integer_form_are_accepted():
    assert dcp.BatchSpec((7.0, 8.0), CausalMask(), 2).seqlens == (7, 8)
    assert dcp.BatchSpec(np.array([5, 6], dtype=np.int32), CausalMask(), 2).seqlens == (5, 6)


def test_mask_names_are_masks():
    assert dcp.BatchSpec([5, 6], "causal", 2).masks == (CausalMask(), CausalMask())
    assert dcp.BatchSpec([5, 6], ["causal", FullMask()], 2).masks == (CausalMask(), FullMask())
    with pytest.raises(dcp.InvalidMaskError, match="unknown mask 'zz'"):
        dcp.BatchSpec([5], "zz", 2)
    with pytest.raises(dcp.InvalidBatchError, match="got 1 masks for 2 sequences"):
        dcp.BatchSpec([5, 6], ["causal"], 2)
    with pytest.raises(dcp.InvalidBatchError, match="not a dcp.masks.Mask or a mask name"):
        dcp.BatchSpec([5, 6], [CausalMask(), 3], 2)
    with pytest.raises(dcp.InvalidBatchError, match="got int"):
        dcp.BatchSpec([5, 6], 3, 2)


def test_a_config_that_is_not_a_planner_config_is_named():
    spec = dcp.BatchSpec([64], "causal", 2)
    with pytest.raises(dcp.InvalidConfigError, match=r"dcp.PlannerConfig\(\*\*\{'block_size': 4\}\)"):
        dcp.plan(spec, dcp.Cluster(1, 2), {"block_size": 4})


def test_results_own_their_storage_so_they_can_be_saved():
    """o (bf16) and lse (fp32) adopted from one received message are views of one uint8 buffer."""
    buf = torch.zeros(4 * 2 * 8 * 2 + 2 * 4 * 4, dtype=torch.uint8)
    o = buf[:128].view(torch.bfloat16).view(4, 2, 8)
    lse = buf[128:].view(torch.float32).view(2, 4)
    with pytest.raises(RuntimeError):
        torch.save({"o": o, "lse": lse}, io.BytesIO())
    o2, lse2 = own_storages(o, lse)
    assert o2 is o and lse2.untyped_storage().data_ptr() != o.untyped_storage().data_ptr()
    torch.save({"o": o2, "lse": lse2}, io.BytesIO())
    assert torch.equal(lse2, lse)
