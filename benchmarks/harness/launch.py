"""Launching: ranks (``torch.multiprocessing.spawn`` + gloo), forked children, ports, progress lines.

:func:`spawn_ranks` runs a function on N spawned processes joined in one
gloo process group on 127.0.0.1 and returns what each rank returned (JSON,
through files). :func:`run_forked` runs one function in a forked child, so
that its memory is returned and an out-of-memory kill loses one call, not
the run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_T0 = time.perf_counter()


def log(msg: str, width: int = 8) -> None:
    """A progress line, stamped with the seconds since the harness was imported."""
    print(f"[{time.perf_counter() - _T0:{width}.1f}s] {msg}", flush=True)


def rank_log(msg: str) -> None:
    """A progress line from rank 0 of a spawned world, only when ``BENCH_VERBOSE=1``."""
    if os.environ.get("BENCH_VERBOSE") != "1":
        return
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"  [{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def set_rank_env(verbose: bool) -> None:
    """Environment the spawned ranks inherit: one thread each, honest RSS baselines, verbosity.

    The fixed mmap threshold makes glibc return every large free to the OS
    (the default threshold adapts upward and then keeps freed buffers on the
    heap), so RSS baselines taken between successive measurements in one
    process are not hiding reusable memory.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.environ["BENCH_VERBOSE"] = "1" if verbose else "0"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
                result_dir: str, timeout_min: float) -> None:
    # A rank killed by a signal (a C++ abort, a segfault) prints every thread's Python stack to
    # its stderr, which the parent shows: CI once had a rank abort here with no stack at all.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=timeout_min))
    try:
        out = fn(rank, world, *args)
        Path(result_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_min: float = 30.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; their return values in rank order.

    Each rank has one torch thread and a gloo process group (CPU, TCP on
    127.0.0.1) before ``fn`` runs, and destroys it after. ``fn`` must be a
    module-level function and its return value JSON-serialisable. A rank that
    raises makes this raise (``torch.multiprocessing.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory(prefix="bench_ranks_") as rd:
        mp.spawn(_rank_entry, args=(world, free_port(), fn, args, rd, timeout_min), nprocs=world, join=True)
        return [json.loads(Path(rd, f"rank{r}.json").read_text()) for r in range(world)]


def fresh_dir(path: str, group: dist.ProcessGroup | None = None) -> None:
    """An empty directory at ``path``: made by rank 0 of ``group``, the others wait at a barrier."""
    if dist.get_rank(group) == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
    dist.barrier(group=group)


class ChildFailed(RuntimeError):
    """A forked child raised, or died without sending a result."""


def _forked(fn: Callable[..., Any], args: tuple[Any, ...], conn: Any) -> None:
    try:
        msg: tuple[str, Any] = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        traceback.print_exc()
        msg = ("error", f"{type(e).__name__}: {e}")
    conn.send(msg)
    conn.close()


def run_forked(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a forked child process; its (picklable) result, or :class:`ChildFailed`."""
    ctx = multiprocessing.get_context("fork")
    rconn, wconn = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_forked, args=(fn, args, wconn))
    p.start()
    wconn.close()
    msg = None
    with contextlib.suppress(EOFError):
        msg = rconn.recv()
    p.join()
    if msg is None:
        sig = -p.exitcode if p.exitcode and p.exitcode < 0 else None
        why = f"killed by signal {sig}" + (" (out of memory?)" if sig == 9 else "") if sig else f"exit {p.exitcode}"
        raise ChildFailed(f"child process died without a result: {why}")
    if msg[0] == "error":
        raise ChildFailed(msg[1])
    return msg[1]
