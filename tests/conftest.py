"""Shared pytest options: ``--slow`` raises the randomized suites' example counts (CI runs without it).

The option selects a hypothesis profile before test modules are imported, so a suite sizes itself with
``n_examples(fast, slow)`` from ``tests/_budget.py`` at import time.
"""
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dcp-ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dcp-slow", deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="run the randomized suites with many more examples (e.g. >= 2000 executor cases)")


def pytest_configure(config):
    settings.load_profile("dcp-slow" if config.getoption("--slow") else "dcp-ci")


@pytest.fixture(scope="session")
def slow(request) -> bool:
    return bool(request.config.getoption("--slow"))


@pytest.fixture(scope="module")
def one_intra_op_thread():
    """Tiny tensors: intra-op threads only contend (badly so on a shared 2-core machine). Use as
    ``pytestmark = pytest.mark.usefixtures("one_intra_op_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
