"""Progress of long mask computations (a mask_mod materialized, a pair-count index built).

The command line says ``label ...`` for a step that runs past a second and ``label: done in X s`` when it
ends (``dcp.report.progress``). The Python API does the same for steps that report how far they are:
nothing for the first ``PROGRESS_AFTER_S`` seconds, so quick calls stay quiet, then a line
``label: 37% after 4.1 s`` at most every ``PROGRESS_EVERY_S`` seconds and ``label: done in X s`` at the
end, on stderr (stdout stays the program's). Every line also goes to the ``logging`` logger
``"dcp.progress"`` at INFO level, for applications that collect logs.

A function taking ``progress=`` accepts: ``None`` or ``True`` (those lines), ``False`` (silence), or a
callable ``fn(fraction)`` called with the fraction done (0 to 1) after every unit of work, from the start.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO, Union

from dcp.errors import InvalidMaskError

PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 5.0

ProgressArg = Union[None, bool, Callable[[float], None]]
log = logging.getLogger("dcp.progress")


class Reporter:
    """The default report of one step (module docstring): call it with the fraction done; ``close()``
    at the end. ``clock`` is injectable (tests step it instead of sleeping)."""

    def __init__(self, label: str, out: TextIO | None = None, after_s: float | None = None,
                 every_s: float | None = None, clock: Callable[[], float] = time.perf_counter):
        self.label, self.out, self.clock = label, out, clock
        self.after_s = PROGRESS_AFTER_S if after_s is None else after_s
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.started = clock()
        self.last: float | None = None  # when the last line was written

    def _say(self, line: str) -> None:
        print(line, file=self.out or sys.stderr, flush=True)
        log.info(line)

    def __call__(self, fraction: float) -> None:
        now = self.clock()
        elapsed = now - self.started
        due = elapsed >= self.after_s if self.last is None else now - self.last >= self.every_s
        if due and fraction < 1.0:
            self._say(f"{self.label}: {100 * fraction:.0f}% after {elapsed:.1f} s")
            self.last = now

    def close(self) -> None:
        if self.last is not None:
            self._say(f"{self.label}: done in {self.clock() - self.started:.1f} s")


class _Callback:
    """A user's ``fn(fraction)``: every update, then 1.0 once at the end."""

    def __init__(self, fn: Callable[[float], None]):
        self.fn, self.last = fn, None

    def __call__(self, fraction: float) -> None:
        if fraction < 1.0:
            self.fn(fraction)
            self.last = fraction

    def close(self) -> None:
        self.fn(1.0)


def reporter(progress: ProgressArg, label: str) -> Reporter | _Callback | None:
    """What a ``progress=`` argument asks for (module docstring): an object to call with the fraction
    done and to ``close()`` at the end, or None for silence."""
    if progress is False:
        return None
    if progress is None or progress is True:
        return Reporter(label)
    if not callable(progress):
        raise InvalidMaskError(f"progress must be None, a bool or a callable fn(fraction), got {progress!r}")
    return _Callback(progress)
