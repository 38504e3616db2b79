"""Save time against the storage's write limit: ucp_dcp and DCP's FileSystemWriter, paired, one process.

Every round times, in the same order and the same process: the physical
write limit (``--writers`` parallel writers of plain files holding the
state's bytes, write + fsync; each also with writeback started after every
8 MiB piece with ``sync_file_range``, the limit is the fastest of them in
that round), ``UCPStorageWriter(threads=t)`` for each ``--ucp-threads``
value, and DCP's ``FileSystemWriter(thread_count=t)`` for each
``--dcp-threads`` value. A save's time is that of ``dcp.save`` (which
fsyncs in both writers). Reported per case: median and minimum over the
rounds, and the median over rounds of the ratio to that round's limit and
to that round's DCP save with its default thread count (1), so load from
other processes on the machine hits both sides of a ratio alike.

    python benchmarks/bench_save.py --size-mb 300 --repeats 11

The directory must be on the disk being measured (default: under /tmp),
not on tmpfs.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from typing import Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ucp_dcp import UCPSavePlanner, UCPStorageWriter

_PIECE = 8 << 20


def make_state(size_mb: int, hidden: int = 2048) -> dict[str, object]:
    """Transformer-like fp32 weights with two optimizer moments each, about ``size_mb`` MiB, and a value."""
    g = torch.Generator().manual_seed(0)
    h = hidden
    shapes = {"qkv": (3 * h, h), "o": (h, h), "up": (2 * h, h), "down": (h, 2 * h), "norm": (h,)}
    layer = sum(int(np.prod(s)) for s in shapes.values()) * 4 * 3
    sd: dict[str, object] = {}
    for j in range(max(1, round(size_mb * 2**20 / layer))):
        for n, s in shapes.items():
            for part in ("w", "exp_avg", "exp_avg_sq"):
                sd[f"layer{j}.{n}.{part}"] = torch.randn(*s, generator=g)
    sd["step"] = 3
    return sd


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def write_limit(d: str, nbytes: int, writers: int, kick: bool) -> float:
    """Seconds for ``writers`` threads to write and fsync ``nbytes`` in total, one file each."""
    buf = memoryview(np.random.default_rng(0).integers(0, 255, _PIECE, dtype=np.uint8))
    sfr = _sync_file_range() if kick else None
    per = nbytes // writers
    paths = [os.path.join(d, f"limit{i}") for i in range(writers)]

    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < per:
                n = os.pwrite(fd, buf[: min(_PIECE, per - off)], off)
                if sfr is not None:
                    sfr(fd, off, n, 2)  # SYNC_FILE_RANGE_WRITE
                off += n
            os.fsync(fd)
        finally:
            os.close(fd)

    os.sync()
    t = time.perf_counter()
    threads = [threading.Thread(target=write, args=(p,)) for p in paths]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    for p in paths:
        os.remove(p)
    return dt


def timed_save(d: str, sd: dict[str, object], fmt: str, threads: int) -> float:
    """Seconds ``dcp.save`` takes into a fresh directory."""
    path = os.path.join(d, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    os.sync()
    gc.collect()
    t = time.perf_counter()
    if fmt == "ucp":
        dcp.save(sd, storage_writer=UCPStorageWriter(path, threads=threads), planner=UCPSavePlanner(), no_dist=True)
    else:
        dcp.save(sd, storage_writer=FileSystemWriter(path, thread_count=threads), no_dist=True)
    return time.perf_counter() - t


def main() -> None:
    """Run the rounds and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--writers", default="1,2,4", help="parallel writers of the write limit")
    ap.add_argument("--ucp-threads", default="1,2,4")
    ap.add_argument("--dcp-threads", default="1,2,4")
    ap.add_argument("--dir", default=None, help="work directory (default: a fresh one under /tmp)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    sd = make_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
    d = args.dir or tempfile.mkdtemp(prefix="bench_save-", dir="/tmp")
    os.makedirs(d, exist_ok=True)
    cases: list[tuple[str, int, Callable[[], float]]] = []
    for w in ints(args.writers):
        for kick in (False, True):
            cases.append(("limit" + ("+wb" if kick else ""), w, lambda w=w, k=kick: write_limit(d, nbytes, w, k)))
    for fmt, ts in (("ucp", ints(args.ucp_threads)), ("dcp", ints(args.dcp_threads))):
        for t in ts:
            cases.append((fmt, t, lambda f=fmt, t=t: timed_save(d, sd, f, t)))
    try:
        for _, _, run in cases:  # warm-up: imports, page-cache growth, first-touch of the state
            run()
        times: dict[tuple[str, int], list[float]] = {(n, t): [] for n, t, _ in cases}
        for _ in range(args.repeats):
            for n, t, run in cases:
                times[(n, t)].append(run())
    finally:
        shutil.rmtree(d, ignore_errors=True)
    rounds = range(args.repeats)
    limit = [min(v[r] for (n, _), v in times.items() if n.startswith("limit")) for r in rounds]
    base = times.get(("dcp", 1))
    print(f"state {nbytes / 2**20:.1f} MiB, {args.repeats} rounds; limit per round (s): "
          + " ".join(f"{x:.3f}" for x in limit))
    print(f"{'case':10s} {'threads':>7s} {'median s':>9s} {'min s':>7s} {'GiB/s':>6s} {'x limit':>8s} {'x dcp(1)':>9s}")
    for (n, t), v in times.items():
        med = statistics.median(v)
        xl = statistics.median(v[r] / limit[r] for r in rounds)
        xd = f"{statistics.median(v[r] / base[r] for r in rounds):9.2f}" if base else f"{'':9s}"
        print(f"{n:10s} {t:7d} {med:9.3f} {min(v):7.3f} {nbytes / med / 2**30:6.2f} {xl:8.2f} {xd}")


if __name__ == "__main__":
    main()
