"""A persistent worker process that runs partitioning jobs under a time budget.

Partitioners are C++ code that cannot be interrupted, and Mt-KaHyPar's thread pool must not be created
in a process that later forks. So jobs run in one long-lived child (forked once, on first use): its
thread pool and imports stay warm across plans; a job that overruns its budget gets the child killed
(and a fresh one on the next job), and the caller falls back. The child exits when its parent dies,
however it dies, and does not hold the parent's stdout/stderr (``dcp.lifeline``).
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import threading
import time

from dcp.errors import PartitionerError
from dcp.lifeline import detach_stdio, started_from_main_thread, tie_to_parent


class PartitionerTimeout(PartitionerError):
    """The partitioner did not finish within its time budget."""


def _serve(conn, parent_pid: int | None = None, pdeathsig: bool = False, parent_end=None):
    if parent_end is not None:  # the parent's end, inherited by fork: close it so its death reads as EOF
        parent_end.close()
    if parent_pid is not None:  # never outlive the parent, never hold its stdout (dcp.lifeline)
        tie_to_parent(parent_pid, pdeathsig)
        detach_stdio()
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        fn, args = job
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as err:  # report every failure to the parent instead of dying silently
            conn.send(("error", f"{type(err).__name__}: {err}"))


class _Worker:
    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None
        self._conn = None

    def _start(self):
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        ctx = mp.get_context(method)
        parent, child = ctx.Pipe()
        args = (child, os.getpid(), started_from_main_thread(), parent if method == "fork" else None)
        self._proc = ctx.Process(target=_serve, args=args, daemon=True, name="dcp-partitioner")
        self._proc.start()
        child.close()
        self._conn = parent

    def stop(self):
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def call(self, fn, args, timeout_s: float | None):
        """Run ``fn(*args)`` (a module-level function; args picklable) in the worker."""
        return self.submit(fn, args, timeout_s).result()

    def submit(self, fn, args, timeout_s: float | None) -> "Pending":
        """Start ``fn(*args)`` in the worker and return at once; ``Pending.result()`` waits for it (the
        budget counts from now), so the caller can work meanwhile. The worker serves one job at a time:
        until ``result()`` or ``cancel()``, other callers wait."""
        self._lock.acquire()
        try:
            if self._proc is None or not self._proc.is_alive():
                self.stop()
                self._start()
            try:
                self._conn.send((fn, args))
            except Exception as err:  # e.g. an unpicklable partitioner
                raise PartitionerError(f"cannot hand the job to the partitioner process: {err}") from err
        except BaseException:
            self._lock.release()
            raise
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return Pending(self, deadline, timeout_s)


class Pending:
    """A job running in the worker (``_Worker.submit``)."""

    def __init__(self, worker: _Worker, deadline: float | None, timeout_s: float | None):
        self._worker, self._deadline, self._timeout_s = worker, deadline, timeout_s
        self._done = False

    def result(self):
        """The job's return value; ``PartitionerTimeout`` past the budget (the worker is killed, a fresh
        one serves the next job), ``PartitionerError`` if the job failed or the worker died."""
        if self._done:
            raise PartitionerError("this job's result was already taken")
        w = self._worker
        try:
            wait = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)
            if not w._conn.poll(wait):
                w.stop()
                raise PartitionerTimeout(f"partitioning exceeded its {self._timeout_s:.1f} s budget")
            try:
                status, payload = w._conn.recv()
            except EOFError:
                code = w._proc.exitcode
                w.stop()
                raise PartitionerError(f"partitioner process died (exit code {code})") from None
        finally:
            self._done = True
            w._lock.release()
        if status != "ok":
            raise PartitionerError(payload)
        return payload

    def cancel(self) -> None:
        """Abandon the job: the worker is killed (a job cannot be interrupted) and restarts on next use."""
        if not self._done:
            self._done = True
            try:
                self._worker.stop()
            finally:
                self._worker._lock.release()


WORKER = _Worker()
atexit.register(WORKER.stop)
