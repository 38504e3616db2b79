"""Physical limits a checkpoint path is judged against: storage read bandwidth, memory copies.

:func:`sequential_read` and :func:`parallel_read` read whole files the
simplest fast ways (one thread with 16 MiB ``readinto``; N threads with
16 MiB ``preadv``); :func:`copy_floor` times ``copy_`` of tensors into
preallocated buffers. :func:`timed` and :func:`best_of` time a call with the
device synchronised around it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

READ_BLOCK = 16 << 20  # bytes per read call


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device = torch.device("cpu")) -> float:
    """Seconds ``fn()`` takes, device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def best_of(n: int, fn: Callable[[], Any], device: torch.device = torch.device("cpu")) -> float:
    """The least of ``n`` (at least one) :func:`timed` runs."""
    return min(timed(fn, device) for _ in range(max(n, 1)))


def sequential_read(files: Sequence[str], block: int = READ_BLOCK) -> None:
    """Read every file front to back with one thread, ``block`` bytes per ``readinto``."""
    view = memoryview(bytearray(block))
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def parallel_read(files: Sequence[str], threads: int, block: int = READ_BLOCK) -> None:
    """Read all of ``files`` with ``threads`` threads, each ``preadv``-ing ``block``-byte pieces."""
    work = [(p, off, min(block, size - off)) for p in files
            for size in [os.path.getsize(p)] for off in range(0, size, block)]
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY) for p in files}

    def worker() -> None:
        buf = memoryview(bytearray(block))
        while True:
            with lock:
                if not work:
                    return
                p, off, n = work.pop()
            got = 0
            while got < n:
                k = os.preadv(fds[p], [buf[got:n]], off + got)
                if k <= 0:
                    raise EOFError(p)
                got += k

    try:
        ts = [threading.Thread(target=worker) for _ in range(max(threads, 1))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for fd in fds.values():
            os.close(fd)


def copy_floor(tensors: Sequence[torch.Tensor], repeat: int) -> list[float]:
    """Seconds to ``copy_`` every tensor into preallocated (already faulted-in) buffers, per repeat."""
    bufs = [torch.empty_like(t) for t in tensors]
    for b, s in zip(bufs, tensors):
        b.copy_(s)  # fault the pages in
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for b, s in zip(bufs, tensors):
            b.copy_(s)
        runs.append(time.perf_counter() - t0)
    return runs
