"""Physical limits a checkpoint path is judged against: storage read and write bandwidth, memory copies.

:func:`sequential_read` and :func:`parallel_read` read whole files the
simplest fast ways (one thread with 16 MiB ``readinto``; N threads with
16 MiB ``preadv``); :func:`parallel_write` writes and fsyncs files with N
threads; :func:`storage_limits` measures the best cold read and write+fsync
bandwidth of the disk under a directory (the physical limits
``bench_reshard.py`` divides bytes by); :func:`copy_floor` times ``copy_``
of tensors into preallocated buffers. :func:`timed` and :func:`best_of` time
a call with the device synchronised around it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
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


def parallel_sequential_read(files: Sequence[str], readers: int, block: int = READ_BLOCK) -> int:
    """Read all of ``files`` with ``readers`` threads, each front to back through its own contiguous span.

    The files' bytes, taken in order, are cut into ``readers`` spans of
    (nearly) equal size; each thread ``preadv``-s its span in ``block``-byte
    calls, so each sees a sequential stream and gets the kernel's readahead.
    Returns the bytes read.
    """
    sizes = [os.path.getsize(p) for p in files]
    total = sum(sizes)
    n = max(readers, 1)
    bounds = [total * i // n for i in range(n + 1)]
    fds = [os.open(p, os.O_RDONLY) for p in files]
    starts = [sum(sizes[:i]) for i in range(len(files))]
    errors: list[BaseException] = []

    def worker(lo: int, hi: int) -> None:
        buf = memoryview(bytearray(block))
        try:
            for fd, start, size in zip(fds, starts, sizes):
                a, b = max(lo, start), min(hi, start + size)
                off = a - start
                while off < b - start:
                    k = os.preadv(fd, [buf[:min(block, b - start - off)]], off)
                    if k <= 0:
                        raise EOFError(f"short read at {off} of {size} bytes")
                    off += k
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(e)

    try:
        ts = [threading.Thread(target=worker, args=(bounds[i], bounds[i + 1])) for i in range(n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        for fd in fds:
            os.close(fd)
    if errors:
        raise errors[0]
    return total


def parallel_write(directory: str, total_bytes: int, writers: int, block: int = READ_BLOCK) -> list[str]:
    """Write ``total_bytes`` into ``writers`` new files under ``directory``, one thread each, and fsync them.

    Each thread ``pwrite``-s its file front to back in ``block``-byte calls
    from one already-faulted buffer (non-zero bytes, so no file system can
    skip them), then ``fsync``-s it; the call returns once every file is on
    disk. Timing it gives the write+fsync bandwidth a checkpoint writer with
    as many threads could reach. Returns the paths written.
    """
    n = max(writers, 1)
    sizes = [total_bytes * (i + 1) // n - total_bytes * i // n for i in range(n)]
    paths = [os.path.join(directory, f"write_probe_{i}.bin") for i in range(n)]
    src = memoryview(bytes(range(256)) * (block // 256 + 1))[:block]
    errors: list[BaseException] = []

    def worker(path: str, size: int) -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                off = 0
                while off < size:
                    off += os.pwrite(fd, src[:min(block, size - off)], off)
                os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(p, k)) for p, k in zip(paths, sizes)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return paths


def _evict(paths: Sequence[str]) -> None:
    # fsync first: POSIX_FADV_DONTNEED leaves dirty pages in the cache.
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@dataclass
class StorageLimits:
    """Cold read and write+fsync bandwidth of one disk, and every configuration tried.

    ``read_runs`` / ``write_runs`` hold one dict per configuration
    (``threads``, ``block``, ``seconds``, ``bytes_per_s``); the fastest of
    them is ``best_read`` / ``best_write``, and its bandwidth
    ``best_single_read_bytes_per_s`` / ``best_single_write_bytes_per_s``.
    That configuration is then run ``confirm`` more times
    (``read_confirm`` / ``write_confirm``) and the physical limit,
    ``read_bytes_per_s`` / ``write_bytes_per_s``, is the median of those
    runs: the same statistic the loads and saves it judges are reported
    with. The fastest single run of a sweep is the largest of a dozen
    noisy samples, an estimate biased upwards by the noise itself (on a
    16-core machine its configurations spread over 1.6-2.4 GB/s).
    """

    directory: str
    probe_bytes: int
    read_bytes_per_s: float = 0.0
    write_bytes_per_s: float = 0.0
    best_single_read_bytes_per_s: float = 0.0
    best_single_write_bytes_per_s: float = 0.0
    best_read: dict[str, Any] = field(default_factory=dict)
    best_write: dict[str, Any] = field(default_factory=dict)
    read_runs: list[dict[str, Any]] = field(default_factory=list)
    write_runs: list[dict[str, Any]] = field(default_factory=list)
    read_confirm: list[dict[str, Any]] = field(default_factory=list)
    write_confirm: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able copy."""
        return asdict(self)


READ_THREADS = (1, 3, 6, 12)
READ_BLOCKS = (1 << 20, 16 << 20)
WRITE_THREADS = (1, 2, 4, 8)
# Runs of the fastest configuration whose median is the limit (StorageLimits).
CONFIRM_RUNS = 5


def storage_limits(directory: str, probe_bytes: int = 512 << 20, *, files: int = 8,
                   read_threads: Sequence[int] = READ_THREADS, read_blocks: Sequence[int] = READ_BLOCKS,
                   write_threads: Sequence[int] = WRITE_THREADS, write_block: int = READ_BLOCK,
                   repeats: int = 1, confirm: int = CONFIRM_RUNS) -> StorageLimits:
    """The cold read and write+fsync bandwidth parallel sequential readers and writers get.

    In a fresh scratch directory under ``directory`` (which must be on the
    disk to measure, not tmpfs): for every writer count, time
    :func:`parallel_write` of ``probe_bytes`` (fsync included) and delete
    the files; then write ``files`` files of ``probe_bytes`` in all and, for
    every (reader count, block size), evict them from the page cache and
    time :func:`parallel_sequential_read` of all of them. Each configuration
    runs ``repeats`` times; the fastest configuration then runs ``confirm``
    more times and the median of those is the limit (see
    :class:`StorageLimits`; ``confirm=0`` keeps the fastest single run). The
    scratch directory is removed afterwards.
    """
    t_start = time.perf_counter()
    res = StorageLimits(directory=directory, probe_bytes=probe_bytes)
    scratch = tempfile.mkdtemp(prefix="storage_limits_", dir=directory)

    def write_run(threads: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        written = parallel_write(scratch, probe_bytes, threads, write_block)
        dt = time.perf_counter() - t0
        for p in written:
            os.unlink(p)
        return {"threads": threads, "block": write_block, "seconds": dt, "bytes_per_s": probe_bytes / dt}

    def read_run(paths: Sequence[str], threads: int, block: int) -> dict[str, Any]:
        _evict(paths)
        t0 = time.perf_counter()
        n = parallel_sequential_read(paths, threads, block)
        dt = time.perf_counter() - t0
        return {"threads": threads, "block": block, "seconds": dt, "bytes_per_s": n / dt}

    try:
        res.write_runs = [write_run(t) for t in write_threads for _ in range(max(repeats, 1))]
        res.best_write = max(res.write_runs, key=lambda r: r["bytes_per_s"])
        res.write_confirm = [write_run(res.best_write["threads"]) for _ in range(max(confirm, 0))]
        paths = parallel_write(scratch, probe_bytes, files, write_block)
        res.read_runs = [read_run(paths, t, b) for b in read_blocks for t in read_threads
                         for _ in range(max(repeats, 1))]
        res.best_read = max(res.read_runs, key=lambda r: r["bytes_per_s"])
        res.read_confirm = [read_run(paths, res.best_read["threads"], res.best_read["block"])
                            for _ in range(max(confirm, 0))]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res.best_single_read_bytes_per_s = res.best_read["bytes_per_s"]
    res.best_single_write_bytes_per_s = res.best_write["bytes_per_s"]
    res.read_bytes_per_s = statistics.median(
        [r["bytes_per_s"] for r in res.read_confirm] or [res.best_single_read_bytes_per_s])
    res.write_bytes_per_s = statistics.median(
        [r["bytes_per_s"] for r in res.write_confirm] or [res.best_single_write_bytes_per_s])
    res.seconds = time.perf_counter() - t_start
    return res


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
