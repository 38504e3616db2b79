"""Real multi-process ranks for tests: torch.multiprocessing (from a fork server) + gloo on CPU."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any, Callable

import pytest

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# Ranks start from a fork server that imported these once (issue: the suite's time). A spawned
# rank spent 3-4 s of a 2-core machine importing torch; a rank forked from the server starts in
# about 0.1 s. The server is a clean process (no threads, no process group), so its children
# are as fresh as spawned ones; what a spawned child would take from the test process at the
# time of the call (environment, working directory, sys.path) is handed to _entry and set there.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor", "ucp_dcp"]


def _entry(
    rank: int,
    world: int,
    init_file: str,
    fn: Callable[..., None],
    args: tuple[Any, ...],
    parent: tuple[dict[str, str], str, list[str]],
) -> None:
    env, cwd, path = parent
    # A rank that dies of a signal (SIGSEGV, SIGABRT) leaves every thread's Python stack here;
    # run_ranks adds it to the error, which otherwise names only the signal.
    fault = open(_fault_file(init_file, rank), "w")  # noqa: SIM115 - open until os._exit
    faulthandler.enable(file=fault, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # The rank's work is done and checked. Under load a gloo rank sometimes
    # aborts in the interpreter's exit-time destructors ("terminate called
    # without an active exception", SIGABRT; seen once in CI in the FSDP2 save
    # of test_fsdp1), as the demos' torchrun workers did (examples/train_demo.py
    # end_worker): skip them. A failure above still raises, and mp.spawn
    # reports its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fault_file(init_file: str, rank: int) -> str:
    return f"{init_file}.fault-{rank}"


def run_ranks(world: int, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` new processes (forked from the fork server) with a
    gloo group.

    ``fn`` must be a module-level function. An exception on any rank fails
    the call with that rank's traceback.
    """
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "init")
        try:
            mp.start_processes(
                _entry,
                args=(world, init, fn, args, parent),
                nprocs=world,
                join=True,
                start_method="forkserver",
            )
        except mp.ProcessExitedException as e:
            stacks = "".join(
                f"\n--- rank {r} ---\n{text}"
                for r in range(world)
                if os.path.exists(_fault_file(init, r))
                and (text := open(_fault_file(init, r)).read().strip())
            )
            raise AssertionError(f"{e}; the ranks' stacks at the signal:{stacks or ' none'}") from e


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs, -0.0 and all), not numeric equality."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def count_read_bytes(monkeypatch: Any) -> dict[str, int]:
    """Count every byte read through os.preadv/os.pread from now on (``["bytes"]``)."""
    counted = {"bytes": 0}
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, bufs: Any, off: int) -> int:
        n = real_preadv(fd, bufs, off)
        counted["bytes"] += n
        return n

    def pread(fd: int, n: int, off: int) -> bytes:
        data = real_pread(fd, n, off)
        counted["bytes"] += len(data)
        return data

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    return counted


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}``: the nested state dict DCP flattens back to ``flat``'s keys."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        *parents, leaf = k.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


def flatten(sd: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of :func:`nest`."""
    out: dict[str, Any] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


WATCHDOG_S = 60.0


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """Imported by a test module, every test in it that hangs (a stalled request, a blocked
    read) fails after ``WATCHDOG_S`` with every thread's stack instead of holding the suite."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
