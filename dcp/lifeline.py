"""Helper processes that never outlive their parent, nor hold its output open.

dcp starts long-lived helpers (the partitioner worker, the loader's background planner) that block on a
pipe for their next job. If the parent dies abnormally (SIGKILL, SIGTERM from torchrun, an abort,
``os._exit``) no ``atexit`` hook runs, so a helper would wait forever and, holding the parent's inherited
stdout, keep ``torchrun ... | tail`` from ever returning. A helper therefore calls, first thing:

- ``tie_to_parent(parent_pid, pdeathsig)``: on Linux the kernel sends it SIGKILL when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``; only when the parent started it from its main thread, since the signal
  follows the *thread* that created the child), and on every platform a daemon thread polls
  ``os.getppid()`` (or, for a "forkserver" child, the multiprocessing parent sentinel) and exits the
  process once the parent is gone: within ``poll_s`` seconds even when the main thread is busy in C++
  code that holds no GIL;
- ``detach_stdio()``: file descriptors 0, 1 and 2 point at /dev/null (a helper reports through its pipe).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def started_from_main_thread() -> bool:
    """Whether the calling thread is the main one: then ``PR_SET_PDEATHSIG`` is safe for a child it starts
    (no spurious kill when a short-lived worker thread exits)."""
    return threading.current_thread() is threading.main_thread()


def _set_pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no libc symbol: the watchdog thread still applies
        pass


def _watch(gone, poll_s: float) -> None:
    while True:
        if gone():
            os._exit(0)  # the parent is gone: no cleanup can matter to anyone now
        time.sleep(poll_s)


def tie_to_parent(parent_pid: int | None, pdeathsig: bool = True, poll_s: float = 0.5) -> None:
    """Make this process exit when its parent dies, whatever the cause.

    ``parent_pid``: the parent's pid at start (a reparented child sees another ``os.getppid()``), or None
    when the process that must not be outlived is not this one's parent: a multiprocessing child started
    by a "forkserver" (its parent is the server, which lives as long as any of its children), watched
    through the multiprocessing parent sentinel instead. ``pdeathsig`` only for a direct parent."""
    if parent_pid is None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        if parent is None:
            return
        gone = lambda: not parent.is_alive()  # noqa: E731
    else:
        if pdeathsig:
            _set_pdeathsig()
        gone = lambda: os.getppid() != parent_pid  # noqa: E731
    if gone():  # the parent died before the kernel (or the watchdog) could be told
        os._exit(0)
    threading.Thread(target=_watch, args=(gone, poll_s), daemon=True, name="dcp-parent-watch").start()


def detach_stdio() -> None:
    """Point stdin, stdout and stderr (fds 0-2) at /dev/null, so that the parent's pipes close with it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    finally:
        if null > 2:
            os.close(null)


__all__ = ["tie_to_parent", "detach_stdio", "started_from_main_thread"]
