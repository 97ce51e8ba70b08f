"""Example budgets for randomized suites: ``n_examples(fast, slow)`` picks by the ``--slow`` option."""
from hypothesis import settings


def is_slow() -> bool:
    return settings.get_current_profile_name() == "dcp-slow"


def n_examples(fast: int, slow: int) -> int:
    return slow if is_slow() else fast
