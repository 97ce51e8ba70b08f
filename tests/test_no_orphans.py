"""Helper processes die with their parent, however it dies, and never hold its output open.

A parent script (a separate interpreter, its stdout and stderr one pipe read by this test) starts the
partitioner worker (``dcp.partition.worker``) by planning under a time budget, or the loader's background
planner (``dcp.integration.worker.PlanWorker``) in the middle of a job that itself started a partitioner
worker (started by "spawn", or by a "forkserver"). The test kills the parent with SIGKILL or SIGTERM (no
``atexit`` runs either way) and then requires every helper to be gone and the pipe to reach end-of-file
within 10 s.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GRACE_S = 10.0

HELPERS = '''
import os, time
import dcp
from dcp.masks import CausalMask

SPEC = dcp.BatchSpec([300, 120], CausalMask(), 2, 1, 8)
# Mt-KaHyPar in the partitioner worker (a loose memory budget, so that the search runs the hypergraph candidate)
CONFIG = dcp.PlannerConfig(block_size=32, time_budget_s=60, epsilon_memory=1.0)


def plan_then_hang(description, cluster, config):
    """A planner job that starts the partitioner worker, says where it is, and then never finishes."""
    from dcp.partition.worker import WORKER

    dcp.plan(SPEC, cluster, CONFIG)
    with open(os.environ["DCP_TEST_PIDFILE"] + ".tmp", "w") as f:
        f.write(str(WORKER._proc.pid))
    os.replace(os.environ["DCP_TEST_PIDFILE"] + ".tmp", os.environ["DCP_TEST_PIDFILE"])
    time.sleep(600)
'''

PARENT = '''
import os, sys, time
import dcp
import orphan_helpers as h


def main(helper):
    if helper == "partitioner":
        from dcp.partition.worker import WORKER

        dcp.plan(h.SPEC, dcp.Cluster(1, 2), h.CONFIG)
        pids = [WORKER._proc.pid]
    else:
        from dcp.integration import PlanWorker, WorkerConfig

        method = "forkserver" if helper == "plan_worker_forkserver" else "spawn"
        worker = PlanWorker(dcp.Cluster(1, 2), h.CONFIG, WorkerConfig(plan_fn=h.plan_then_hang, start_method=method))
        worker.submit(h.SPEC)
        path = os.environ["DCP_TEST_PIDFILE"]
        while not os.path.exists(path):
            time.sleep(0.05)
        pids = [worker.pid, int(open(path).read())]
    print("PIDS", *pids, flush=True)
    print("the parent writes to its stderr too", file=sys.stderr, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1])
'''


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that may never come counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _read_until(fd: int, deadline: float, stop) -> bytes:
    """Read ``fd`` until ``stop(data)`` holds, end-of-file, or the deadline; returns what was read."""
    data = b""
    while time.monotonic() < deadline and not stop(data):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("helper", ["partitioner", "plan_worker", "plan_worker_forkserver"])
def test_helpers_exit_with_their_parent_and_release_its_output(tmp_path, helper, sig):
    (tmp_path / "orphan_helpers.py").write_text(textwrap.dedent(HELPERS))
    (tmp_path / "parent.py").write_text(textwrap.dedent(PARENT))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]),
           "DCP_TEST_PIDFILE": str(tmp_path / "partitioner.pid")}
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), helper], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env)
    fd = parent.stdout.fileno()
    try:
        out = _read_until(fd, time.monotonic() + 60, lambda d: b"PIDS" in d and d.endswith(b"\n"))
        line = next((x for x in out.decode().splitlines() if x.startswith("PIDS")), None)
        assert line, f"the parent did not start its helpers: {out.decode()[-2000:]}"
        pids = [int(x) for x in line.split()[1:]]
        assert all(_alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(timeout=GRACE_S)
        killed = time.monotonic()
        rest = _read_until(fd, killed + GRACE_S, lambda d: False)
        eof = time.monotonic() < killed + GRACE_S
        while any(_alive(p) for p in pids) and time.monotonic() < killed + GRACE_S:
            time.sleep(0.05)
        left = [p for p in pids if _alive(p)]
        assert not left, f"{helper} processes {left} outlived their parent ({sig.name}) by {GRACE_S:g} s"
        assert eof, f"the parent's stdout stayed open {GRACE_S:g} s after its death: {rest[-500:]!r}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in locals().get("pids", []):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
