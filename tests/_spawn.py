"""One harness for multi-process tests: run a function on N gloo ranks and collect each rank's result.

    results = run_ranks(fn, world, tmp_path, *args)   # fn(rank, world, *args) -> dict (or (dict, clean))

Each rank joins a gloo process group on a free local port, runs ``fn`` with one intra-op thread, and
writes its result (or ``{"crash": traceback}``) to ``tmp_path`` atomically; the parent enforces a
deadline, kills what is left, and returns the results in rank order. ``fn`` must be a module-level
function of an importable module (the children import it by name). A rank whose ``fn`` returns
``(result, False)`` leaves without the final barrier (``os._exit``): its process group may be broken.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import time
import traceback
from typing import Callable

#: modules a forkserver imports once, so that every rank forks from a warm interpreter
PRELOAD = ["torch", "torch.distributed", "numpy", "dcp.execute", "dcp.planner", "dcp.masks.registry"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    """forkserver (one clean server imports torch once, ranks fork from it) where available, else spawn.
    Never plain fork: the pytest process may already run OpenMP threads."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        return "forkserver"
    return "spawn"


def _result_path(outdir: str, tag: str, rank: int) -> str:
    return os.path.join(outdir, f"{tag}-{rank}.pkl")


def _rank_main(rank: int, world: int, port: int, outdir: str, tag: str, group_timeout_s: float, fn: Callable,
               args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    clean = True
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=group_timeout_s))
        result = fn(rank, world, *args)
        if isinstance(result, tuple):
            result, clean = result
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        result, clean = {"crash": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}, False
    if result is not None:
        path = _result_path(outdir, tag, rank)
        with open(path + ".tmp", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)
    if clean:
        dist.barrier()
        dist.destroy_process_group()
    else:
        os._exit(0)  # a broken process group may hang in its destructor


def run_ranks(fn: Callable, world: int, tmp_path, *args, deadline_s: float = 90.0, group_timeout_s: float = 30.0,
              allow_missing: bool = False, check: bool = True, tag: str | None = None,
              method: str | None = None) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return their results in rank order.

    Args:
        deadline_s: limit on the whole run (an ``AssertionError`` names the function past it).
        group_timeout_s: the process group's own timeout.
        allow_missing: a rank that wrote no result gives None instead of failing.
        check: fail (``AssertionError`` with the traceback) when a rank reports a crash.
        tag: file name prefix of the results (default: the function's name).
        method: multiprocessing start method (default: ``start_method()``).
    """
    import torch.multiprocessing as mp

    tag = tag or fn.__name__
    outdir = str(tmp_path)
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), outdir, tag, group_timeout_s, fn, args),
                             nprocs=world, join=False, start_method=method or start_method())
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"{tag} on {world} processes did not finish in {deadline_s:g} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for rank in range(world):
        path = _result_path(outdir, tag, rank)
        if not os.path.exists(path):
            assert allow_missing, f"{tag}: rank {rank} wrote no result"
            results.append(None)
            continue
        with open(path, "rb") as f:
            res = pickle.load(f)
        if check and isinstance(res, dict):
            assert "crash" not in res, f"{tag}: rank {rank} crashed:\n{res['crash']}"
        results.append(res)
    return results
