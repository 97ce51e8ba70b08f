"""Plans made today execute to the outputs recorded with the object IR (``tests/_recorded.py``).

The columnar IR changed how plans are held, validated and simulated, not what they compute: every
planner's plan of each recorded batch, run by the reference executor on the same fp64 inputs, gives the
recorded o, lse, dq, dk, dv (compared through fixed random projections of every element)."""
import numpy as np
import pytest
from _recorded import PLANNERS, RECORDED, batches, executed_outputs, make_planner, sketch

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def recorded():
    with np.load(RECORDED) as data:
        return dict(data)


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("batch", [b[0] for b in batches()])
def test_outputs_match_the_recording(recorded, batch, planner):
    _, spec, cluster = next(b for b in batches() if b[0] == batch)
    plan = make_planner(planner).plan(spec, cluster)
    for name, out in executed_outputs(plan).items():
        want = recorded[f"{batch}/{planner}/{name}"]
        np.testing.assert_allclose(sketch(out), want, rtol=1e-12, atol=1e-12, err_msg=f"{batch} {planner} {name}")
