"""Console output shared by the command line (``dcp.cli``) and ``dcp demo`` (``dcp.demo``): the plan
statistics table, and progress lines for steps that take more than a second."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Iterator, TextIO

import numpy as np

STAT_COLUMNS = ("planner", "n_devices", "n_tiles", "planning_time_s", "comm_bytes_total", "comm_bytes_inter_node",
                "max_device_comm_bytes", "compute_imbalance", "memory_imbalance", "valid")


def fmt(v) -> str:
    """One table cell: floats to 3 decimals, counts of a million and more in millions."""
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 10**6:
        return f"{v / 1e6:.1f}M"
    return str(v)


def print_table(rows: list[dict], columns=STAT_COLUMNS, out: TextIO | None = None) -> None:
    """Right-aligned columns with a rule under the header."""
    out = out or sys.stdout
    cells = [[c for c in columns]] + [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for j, row in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@contextlib.contextmanager
def progress(label: str, out: TextIO | None = None, after_s: float = 1.0) -> Iterator[None]:
    """Say ``label ...`` once the step has run ``after_s`` seconds, and ``label: done in X s`` when it ends
    (only if it was announced): a step that takes more than a second is never silent, quick ones stay
    quiet. Lines go to ``out`` (default: stderr, so that stdout stays the result)."""
    out = out or sys.stderr
    started = time.perf_counter()
    shown = threading.Event()

    def announce() -> None:
        print(f"{label} ...", file=out, flush=True)
        shown.set()

    timer = threading.Timer(after_s, announce)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        if shown.is_set():
            print(f"{label}: done in {time.perf_counter() - started:.1f} s", file=out, flush=True)


__all__ = ["STAT_COLUMNS", "fmt", "print_table", "gigabytes", "progress"]
