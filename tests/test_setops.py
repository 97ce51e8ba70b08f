"""dcp.setops (sort-based unique / isin) against NumPy's."""
import numpy as np
import pytest

from dcp import setops


@pytest.mark.parametrize("seed", range(6))
def test_unique_and_isin_match_numpy(seed):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(0, 2000)), int(rng.integers(0, 2000))
    hi = int(rng.choice([3, 100, 1 << 40]))
    x = rng.integers(-hi, hi, n) * int(rng.choice([1, 4096]))
    t = rng.integers(-hi, hi, m) * int(rng.choice([1, 4096]))
    np.testing.assert_array_equal(setops.unique(x), np.unique(x))
    np.testing.assert_array_equal(setops.isin(x, t), np.isin(x, t))
    np.testing.assert_array_equal(setops.isin(x.reshape(-1, 1) if n else x, t), np.isin(x.reshape(-1, 1) if n else x, t))
