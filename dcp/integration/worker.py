"""Planning in a background process, so that the next batch is planned while the current one trains.

``PlanWorker`` owns one worker process (multiprocessing context "spawn" by default, so no CUDA or thread
state of the trainer is inherited). Jobs travel as ``BatchSpec.describe()`` dicts; answers come back as
``Plan.to_bytes()`` (``LayeredPlan.to_bytes()`` for a layered batch; ``cache.CachedPlan.from_bytes`` reads either).
The trainer never blocks without a limit: ``result`` polls the answer queue every
``poll_s`` seconds, checks that the worker is alive, and raises

- ``PlanningError`` when the planner raised in the worker (its type and message are kept),
- ``PlannerWorkerDiedError`` when the worker process exited (killed, crashed, out of memory),
- ``PlanningTimeoutError`` when no answer came within ``timeout_s`` (the worker is then killed).

The worker is not a daemon process, because the planner may start its own partitioner process (see
``dcp.partition.worker``); it is shut down by ``close()``, when the ``PlanWorker`` is garbage collected,
or at interpreter exit (a ``multiprocessing.util.Finalize`` that runs before multiprocessing joins its
children), and it exits by itself when its parent dies, however it dies (SIGKILL included: ``dcp.lifeline``),
without holding the parent's stdout/stderr.

``InlinePlanner`` has the same interface and plans synchronously in the calling process (debugging,
single-process runs without a spare core).
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import queue
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable

from dcp.cluster import Cluster
from dcp.config import PlannerConfig
from dcp.errors import DcpError, InvalidConfigError
from dcp.lifeline import detach_stdio, started_from_main_thread, tie_to_parent
from dcp.spec import BatchSpec


class PlanningError(DcpError, RuntimeError):
    """The planner failed on a batch (in the worker process or inline).

    Attributes: ``remote_type`` (class name of the planner's exception), ``remote_traceback`` (text).
    """

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = ""):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class PlannerWorkerDiedError(PlanningError):
    """The planner worker process exited before answering."""


class PlanningTimeoutError(PlanningError):
    """The planner worker did not answer within its time limit."""


def plan_description(description: dict, cluster: Cluster, config: PlannerConfig) -> bytes:
    """The default job: ``dcp.plan(BatchSpec.from_description(description), cluster, config).to_bytes()`` (a
    ``LayeredPlan``'s bytes for a batch with layer kinds)."""
    from dcp.planner.dcp_planner import plan

    # silent: the loader reports how long a step waited for its plan (``DCPBatch.waited_s``)
    return plan(BatchSpec.from_description(description), cluster, config, progress=False).to_bytes()


PlanFn = Callable[[dict, Cluster, PlannerConfig], bytes]
READY = -1  # job id of the worker's start-up message


@dataclass(frozen=True)
class WorkerConfig:
    """How the planner worker runs.

    Args:
        mode: "process" (a background worker process) or "inline" (plan synchronously in this process).
        start_method: multiprocessing start method of the worker: "spawn" (default) or "forkserver".
        poll_s: how often a waiting trainer checks the answer queue and the worker's liveness.
        timeout_s: limit on waiting for one plan once the worker is up (None: no limit; the liveness check
            still applies).
        start_timeout_s: limit on the worker's start (importing dcp in a fresh interpreter).
        plan_fn: module-level (picklable) function ``(spec description, cluster, config) -> plan bytes``
            run for each job; None: ``plan_description``. Tests inject failures through it.
    """

    mode: str = "process"
    start_method: str = "spawn"
    poll_s: float = 0.02
    timeout_s: float | None = 600.0
    start_timeout_s: float = 120.0
    plan_fn: PlanFn | None = None

    def __post_init__(self):
        if self.mode not in ("process", "inline"):
            raise InvalidConfigError(f"worker mode must be 'process' or 'inline', got {self.mode!r}")
        if self.start_method not in ("spawn", "forkserver"):
            raise InvalidConfigError(f"start_method must be 'spawn' or 'forkserver', got {self.start_method!r}")
        if not self.poll_s > 0:
            raise InvalidConfigError(f"poll_s must be positive, got {self.poll_s!r}")
        if not self.start_timeout_s > 0:
            raise InvalidConfigError(f"start_timeout_s must be positive, got {self.start_timeout_s!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise InvalidConfigError(f"timeout_s must be positive or None, got {self.timeout_s!r}")


def _run_job(plan_fn: PlanFn, description: dict, cluster: Cluster, config: PlannerConfig):
    """``("ok", bytes, seconds, warnings)`` or ``("error", (type, message, traceback), seconds, warnings)``."""
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            data = plan_fn(description, cluster, config)
            if not isinstance(data, (bytes, bytearray)):
                raise TypeError(f"the plan function returned {type(data).__name__}, not bytes")
            status, payload = "ok", bytes(data)
        except BaseException as err:  # noqa: BLE001 - every failure goes back to the trainer
            status, payload = "error", (type(err).__name__, str(err), traceback.format_exc())
    notes = [str(w.message) for w in caught]
    return status, payload, time.perf_counter() - started, notes


def _serve(jobs, results, cluster: Cluster, config: PlannerConfig, plan_fn: PlanFn, parent_pid: int | None,
           pdeathsig: bool) -> None:
    """Worker main loop: ``(job_id, description)`` in, ``(job_id, status, payload, seconds, notes)`` out.
    Exits when the trainer dies, even mid-job, and never holds its stdout/stderr (``dcp.lifeline``):
    ``parent_pid`` is the trainer's pid ("spawn"), or None under "forkserver" (the trainer is not this
    process's parent; the multiprocessing parent sentinel tells when it is gone)."""
    tie_to_parent(parent_pid, pdeathsig)
    detach_stdio()
    results.put((READY, "ready", None, 0.0, []))
    while True:
        job = jobs.get()
        if job is None:
            return
        job_id, description = job
        results.put((job_id, *_run_job(plan_fn, description, cluster, config)))


def _shutdown(proc, jobs, stop=None, thread=None, grace_s: float = 2.0) -> None:
    if proc is None:
        return
    try:
        if proc.is_alive():
            try:
                jobs.put_nowait(None)
            except Exception:  # noqa: BLE001 - a broken queue: kill below
                pass
            proc.join(grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(grace_s)
    except (ValueError, AssertionError, OSError):  # already closed / not our child any more
        pass
    try:
        jobs.cancel_join_thread()
        jobs.close()
    except Exception:  # noqa: BLE001
        pass
    if stop is not None:
        stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(1.0)


def _raise_remote(job_id: int, payload, notes) -> None:
    rtype, message, tb = payload
    raise PlanningError(f"planning batch {job_id} failed in the planner: {rtype}: {message}", rtype, tb)


def _receive(results, done: dict, cond: threading.Condition, decode, stop: threading.Event, state: dict) -> None:
    """Receiver thread: move answers out of the pipe as soon as they arrive (and decode them), so that a
    trainer asking for a plan that is ready never waits on the worker process being scheduled."""
    while not stop.is_set():
        try:
            item = results.get(timeout=0.2)
        except queue.Empty:
            continue
        except (EOFError, OSError, ValueError):  # queue closed: the worker is being shut down
            return
        job_id, status, payload, seconds, notes = item
        if job_id == READY:
            with cond:
                state["ready_at"] = time.monotonic()
                cond.notify_all()
            continue
        if status == "ok" and decode is not None:
            try:
                payload = decode(payload)
            except Exception as err:  # noqa: BLE001 - e.g. corrupt plan bytes
                status, payload = "error", (type(err).__name__, str(err), traceback.format_exc())
        with cond:
            done[job_id] = (status, payload, seconds, notes)
            cond.notify_all()


class PlanWorker:
    """A background planning process for one (cluster, planner config).

    ``job = worker.submit(spec)`` returns at once; ``plan, seconds = worker.result(job)`` waits (with
    polling, liveness checks and ``config.timeout_s``) for the answer: the plan bytes, or
    ``decode(bytes)`` when a ``decode`` function is given (run on a receiver thread as soon as the answer
    arrives, e.g. ``CachedPlan.from_bytes``). Jobs are planned in submission order.
    """

    def __init__(self, cluster: Cluster, config: PlannerConfig, worker_config: WorkerConfig | None = None,
                 decode: Callable[[bytes], object] | None = None):
        self.cluster, self.config = cluster, config
        self.wc = worker_config or WorkerConfig()
        self.plan_fn = self.wc.plan_fn or plan_description
        self.decode = decode
        self._proc = self._jobs = self._results = self._finalizer = self._thread = self._stop = None
        self._next_id = 0
        self._done: dict[int, tuple] = {}
        self._cond = threading.Condition()
        self.notes: list[str] = []

    # ----------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the worker process (done lazily by the first ``submit``)."""
        if self._proc is not None and self._proc.is_alive():
            return
        self.close()
        ctx = mp.get_context(self.wc.start_method)
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        self._proc = ctx.Process(target=_serve, args=(self._jobs, self._results, self.cluster, self.config,
                                                      self.plan_fn, *self._parent()),
                                 daemon=False, name="dcp-plan-worker")
        self._proc.start()
        self._stop = threading.Event()
        self._state = {"ready_at": None}
        self._thread = threading.Thread(target=_receive, args=(self._results, self._done, self._cond, self.decode,
                                                               self._stop, self._state), daemon=True,
                                        name="dcp-plan-receiver")
        self._thread.start()
        self._finalizer = mp_util.Finalize(self, _shutdown, args=(self._proc, self._jobs, self._stop, self._thread),
                                           exitpriority=10)

    def _parent(self) -> tuple[int | None, bool]:
        """(this trainer's pid if it is the worker's parent, else None; whether the kernel may signal the
        worker its parent's death: only from the main thread, whose exit would fire it)."""
        if self.wc.start_method == "forkserver":  # the worker's parent is the server, not this process
            return None, False
        return os.getpid(), started_from_main_thread()

    def close(self) -> None:
        """Stop the worker (pending jobs are dropped)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = self._jobs = self._results = self._finalizer = self._thread = self._stop = None
        with self._cond:
            self._done.clear()

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------------------------- jobs
    def submit(self, spec: BatchSpec) -> int:
        """Queue ``spec`` for planning; returns the job id."""
        if self._proc is None or not self._proc.is_alive():
            self.start()
        job_id = self._next_id
        self._next_id += 1
        try:
            self._jobs.put((job_id, spec.describe()))
        except Exception as err:  # noqa: BLE001
            raise PlanningError(f"cannot hand batch {job_id} to the planner worker: {err}") from err
        return job_id

    def ready(self, job_id: int) -> bool:
        """Whether the answer to ``job_id`` has arrived (never blocks)."""
        with self._cond:
            return job_id in self._done

    def result(self, job_id: int, timeout_s: float | None = None) -> tuple[object, float]:
        """``(plan bytes or decoded plan, planning seconds)``; raises a ``PlanningError`` (see module docstring)."""
        limit = self.wc.timeout_s if timeout_s is None else timeout_s
        asked = time.monotonic()
        dead_since = None
        with self._cond:
            while job_id not in self._done:
                if self._proc is None:
                    raise PlannerWorkerDiedError(f"batch {job_id}: the planner worker is not running")
                self._cond.wait(self.wc.poll_s)
                if job_id in self._done:
                    break
                if not self._proc.is_alive():
                    if dead_since is None:  # an answer may still be in the pipe: give the receiver a moment
                        dead_since = time.monotonic()
                    elif time.monotonic() - dead_since > 0.5:
                        code = self._proc.exitcode
                        self._cond.release()
                        try:
                            self.close()
                        finally:
                            self._cond.acquire()
                        raise PlannerWorkerDiedError(f"batch {job_id}: the planner worker process died (exit code "
                                                     f"{code}) before answering")
                ready_at = self._state["ready_at"]
                now = time.monotonic()
                over = (now - max(asked, ready_at) > limit) if ready_at is not None and limit is not None else \
                    (now - asked > max(limit or 0.0, self.wc.start_timeout_s))
                if over:
                    self._cond.release()
                    try:
                        self.close()
                    finally:
                        self._cond.acquire()
                    what = f"within {limit:g} s" if ready_at is not None else \
                        f"(the worker did not start within {max(limit or 0.0, self.wc.start_timeout_s):g} s)"
                    raise PlanningTimeoutError(f"batch {job_id}: no plan from the planner worker {what}; the worker "
                                               f"was stopped")
            status, payload, seconds, notes = self._done.pop(job_id)
        for note in notes:
            self.notes.append(note)
            warnings.warn(f"dcp planner (batch {job_id}): {note}", RuntimeWarning, stacklevel=2)
        if status != "ok":
            _raise_remote(job_id, payload, notes)
        return payload, seconds


class InlinePlanner:
    """``PlanWorker``'s interface, planning synchronously in this process when the result is asked for."""

    def __init__(self, cluster: Cluster, config: PlannerConfig, worker_config: WorkerConfig | None = None,
                 decode: Callable[[bytes], object] | None = None):
        self.cluster, self.config, self.decode = cluster, config, decode
        self.wc = worker_config or WorkerConfig(mode="inline")
        self.plan_fn = self.wc.plan_fn or plan_description
        self._jobs: dict[int, dict] = {}
        self._next_id = 0
        self.notes: list[str] = []
        self.alive, self.pid = True, None

    def start(self) -> None:
        pass

    def close(self) -> None:
        self._jobs.clear()

    def submit(self, spec: BatchSpec) -> int:
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = spec.describe()
        return job_id

    def ready(self, job_id: int) -> bool:
        return False

    def result(self, job_id: int, timeout_s: float | None = None) -> tuple[bytes, float]:
        status, payload, seconds, notes = _run_job(self.plan_fn, self._jobs.pop(job_id), self.cluster, self.config)
        if status == "ok" and self.decode is not None:
            try:
                payload = self.decode(payload)
            except Exception as err:  # noqa: BLE001
                status, payload = "error", (type(err).__name__, str(err), traceback.format_exc())
        for note in notes:
            self.notes.append(note)
            warnings.warn(f"dcp planner (batch {job_id}): {note}", RuntimeWarning, stacklevel=2)
        if status != "ok":
            _raise_remote(job_id, payload, notes)
        return payload, seconds


def make_planner(cluster: Cluster, config: PlannerConfig, worker_config: WorkerConfig | None = None,
                 decode: Callable[[bytes], object] | None = None):
    """A ``PlanWorker`` or an ``InlinePlanner`` according to ``worker_config.mode``."""
    wc = worker_config or WorkerConfig()
    return (PlanWorker if wc.mode == "process" else InlinePlanner)(cluster, config, wc, decode)


__all__ = ["PlanWorker", "InlinePlanner", "WorkerConfig", "make_planner", "plan_description", "PlanningError",
           "PlannerWorkerDiedError", "PlanningTimeoutError"]
