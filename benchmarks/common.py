"""Shared helpers for the benchmark scripts: machine description, git revision, CSV writing.

They are the ones ``dcp bench`` uses (``dcp.bench.common``); scripts here may import dcp, never the
reverse."""
from __future__ import annotations

from dcp.bench.common import RESULTS, git_revision, machine, write_csv

__all__ = ["RESULTS", "git_revision", "machine", "write_csv"]
