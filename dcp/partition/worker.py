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
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                self.stop()
                self._start()
            try:
                self._conn.send((fn, args))
            except Exception as err:  # e.g. an unpicklable partitioner
                raise PartitionerError(f"cannot hand the job to the partitioner process: {err}") from err
            if not self._conn.poll(timeout_s):
                self.stop()
                raise PartitionerTimeout(f"partitioning exceeded its {timeout_s:.1f} s budget")
            try:
                status, payload = self._conn.recv()
            except EOFError:
                code = self._proc.exitcode
                self.stop()
                raise PartitionerError(f"partitioner process died (exit code {code})") from None
        if status != "ok":
            raise PartitionerError(payload)
        return payload


WORKER = _Worker()
atexit.register(WORKER.stop)
