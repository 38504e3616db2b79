#!/usr/bin/env python
"""GPU-path benchmark: host/device copies, async-save staging, cold loads into device tensors.

One process, one device, one run. It builds a synthetic state dict on the
device (2-D bf16 and fp32 tensors of random bit patterns, NaNs included,
plus a few small 1-D ones; ``--gb`` in total) and measures, in GB/s
(10^9 bytes per second):

1. **Raw copies**: device-to-host ``copy_`` into a pinned host tensor and
   into a pageable one, and host-to-device from the pinned one (one tensor
   of ``min(--gb, 4)`` GB, best of N, ``torch.cuda.synchronize()`` around
   each). These are the ceilings for steps 2 and 4.
2. **Staging for async save**: DCP's own stager
   (``DefaultStager(StagingOptions(use_pinned_memory=True,
   use_async_staging=False, use_non_blocking_copy=True))``): the first
   ``stage()`` (allocates and pins host memory) and a second one (copies
   into the cached pinned storages); ``_create_cpu_state_dict(pin_memory=True)``
   (allocation and pinning alone) and ``_copy_state_dict`` into it. Then the
   *blocking part* of ``dcp.async_save`` (the time until it returns: the
   staging; the upload runs in DCP's thread and is timed to completion
   separately) with ``UCPStorageWriter``/``UCPSavePlanner`` and with
   ``FileSystemWriter``, each with DCP's default stager (a pageable CPU copy)
   and with a reused pinned ``DefaultStager`` (its second save). Ratios are
   to the pinned device-to-host copy of step 1.
3. **Storage read bandwidth**: every file of both checkpoints is fsynced
   and evicted from the page cache (``POSIX_FADV_DONTNEED``), then read
   sequentially (one thread, 16 MiB ``readinto``), and, evicted again,
   with ``--io-threads`` threads issuing 16 MiB ``preadv`` calls. The better
   of the two is the reference for step 4. The fraction of each file still
   resident after eviction (``mincore``) is recorded; if it is not near 0
   (tmpfs, some network or overlay file systems), "cold" means warm.
4. **Loads into device tensors** (same layout, one process): ``dcp.load``
   with ``UCPStorageReader``/``UCPLoadPlanner`` (the staging path of
   ``ucp_dcp.byteio.transfer``: pinned, double-buffered), with the same reader but
   the double buffering switched off (``StagingBuffers(overlap=False)``: one
   slab at a time, blocking copies), and with DCP's
   ``FileSystemReader``/``DefaultLoadPlanner``. Cold (files evicted before
   each run, best of ``--repeats``) with the ratio to step 3, and warm (page
   cache hot: storage out of the picture) with the ratio to the pinned
   host-to-device copy of step 1. After every load each tensor is compared
   with the saved one bit for bit, on the device; a mismatch is printed and
   makes the run exit non-zero.

``--device cpu`` runs the same steps on CPU tensors without pinning (a
smoke check, e.g. in the tests: "device-to-host" is then a memcpy, and CPU
targets of the saved dtype are filled in place, so step 4 does not exercise
the staging path at all).

Caveats: the checkpoint directory decides what "storage" means (``--dir``;
the default is a temporary directory under the system temp dir, which may
be tmpfs: see the residency column). Pinning host memory is slow the first
time (``cudaHostRegister``/``cudaHostAlloc``), which is why the first and
later staging calls are reported apart. One process drives one GPU; a
multi-GPU node shares PCIe/host bandwidth between ranks, which this does
not measure. The state is random bits, so nothing compresses.

Usage::

    python benchmarks/bench_gpu.py                      # 4 GB state on cuda
    python benchmarks/bench_gpu.py --gb 8 --dir /nvme/tmp
    python benchmarks/bench_gpu.py --device cpu --quick # smoke check, seconds

Writes ``benchmarks/results/gpu.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import mmap
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import ucp_dcp.dcp.reader as ucp_storage
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.byteio.transfer import StagingBuffers

try:  # private helpers of DCP's stagers; present in torch 2.4+
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
except ImportError:  # pragma: no cover
    _copy_state_dict = _create_cpu_state_dict = None  # type: ignore[assignment]

GB = 1e9
MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
READ_BLOCK = 16 * MiB
RAW_COPY_CAP = 4 << 30
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu.json"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes, device work included."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def best_of(n: int, fn: Callable[[], Any], device: torch.device) -> float:
    return min(timed(fn, device) for _ in range(max(n, 1)))


def make_state(total_bytes: int, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 and fp32 2-D tensors of random bits (NaNs included) plus small 1-D ones, ~``total_bytes``."""
    g = torch.Generator(device=device).manual_seed(seed)
    per = int(min(max(total_bytes // 16, MiB), 256 * MiB))
    cols = 4096 if per >= 64 * MiB else 1024
    sd: dict[str, torch.Tensor] = {}
    made, i = 0, 0
    while made < total_bytes:
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        nbytes = min(per, max(total_bytes - made, cols * dtype.itemsize))
        rows = max(nbytes // (cols * dtype.itemsize), 1)
        rows += i % 3  # not every size a power of two
        n = rows * cols * dtype.itemsize // 4
        bits = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=device, generator=g)
        sd[f"layers.{i}.weight"] = bits.view(dtype).view(rows, cols)
        bias = torch.randint(-(2**31), 2**31 - 1, (cols // 2 + 7,), dtype=torch.int32, device=device, generator=g)
        sd[f"layers.{i}.bias"] = bias.view(torch.float32)
        made += rows * cols * dtype.itemsize + bias.numel() * 4
        i += 1
    return sd


def state_bytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def bit_mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (compared where they live)."""
    bad = []
    for k, w in want.items():
        t = got[k]
        if t.shape != w.shape or t.dtype != w.dtype or t.device != w.device:
            bad.append(f"{k}: {t.dtype}{list(t.shape)}@{t.device} vs {w.dtype}{list(w.shape)}@{w.device}")
            continue
        iv = _INT_OF_SIZE[w.element_size()]
        if not torch.equal(t.view(iv), w.view(iv)):
            bad.append(f"{k}: bits differ")
    return bad


def files_under(root: str) -> list[str]:
    return sorted(str(p) for p in Path(root).rglob("*") if p.is_file())


def fsync_and_evict(files: Sequence[str]) -> None:
    """Make every page clean (fsync), then drop the files from the page cache."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(files: Sequence[str]) -> float | None:
    """Fraction of the files' pages in the page cache (mmap + mincore; faults nothing in)."""
    total = resident = 0
    try:
        for path in files:
            size = os.path.getsize(path)
            if size == 0:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, _MAP_FAILED):
                    return None
                try:
                    vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
                    if _libc.mincore(addr, size, vec) != 0:
                        return None
                    resident += sum(b & 1 for b in bytes(vec))
                    total += len(vec)
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return None
    return resident / total if total else 0.0


def fs_type(path: str) -> str:
    """File system type of the mount holding ``path`` (from /proc/mounts), or "?"."""
    try:
        path = os.path.realpath(path)
        best, kind = "", "?"
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) > len(best):
                        best, kind = parts[1], parts[2]
        return kind
    except OSError:
        return "?"


@contextmanager
def staging_overlap(overlap: bool | None) -> Iterator[None]:
    """Make UCPStorageReader build its StagingBuffers with ``overlap`` (None: unchanged)."""
    if overlap is None:
        yield
        return
    real = ucp_storage.StagingBuffers
    ucp_storage.StagingBuffers = partial(StagingBuffers, overlap=overlap)  # type: ignore[misc]
    try:
        yield
    finally:
        ucp_storage.StagingBuffers = real  # type: ignore[misc]


# --------------------------------------------------------------------------
# the steps
# --------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device, workdir: str) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = self.cuda
        self.workdir = workdir
        self.rows: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.results: dict[str, Any] = {}

    def row(self, step: str, what: str, nbytes: int, seconds: float, ref: str | None = None,
            ref_gbps: float | None = None, **extra: Any) -> float:
        gbps = nbytes / seconds / GB if seconds > 0 else float("inf")
        ratio = gbps / ref_gbps if ref_gbps else None
        self.rows.append({"step": step, "what": what, "bytes": nbytes, "seconds": seconds, "gbps": gbps,
                          "ratio": ratio, "ratio_to": ref, **extra})
        return gbps

    # ---------------------------------------------------------------- 1
    def raw_copies(self) -> None:
        n = int(min(self.args.gb * GB, RAW_COPY_CAP))
        reps = self.args.copy_repeats
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        src.random_(0, 256)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin)
        tag = "pinned" if self.pin else "pageable (cpu: no pinning)"
        d2h = best_of(reps, lambda: pinned.copy_(src), self.device)
        self.d2h = self.row("1 raw", f"device->host, {tag}", n, d2h)
        if self.pin:
            pageable = torch.empty(n, dtype=torch.uint8)
            d2h_pg = best_of(reps, lambda: pageable.copy_(src), self.device)
            self.row("1 raw", "device->host, pageable", n, d2h_pg, "1 d2h", self.d2h)
        h2d = best_of(reps, lambda: src.copy_(pinned), self.device)
        self.h2d = self.row("1 raw", f"host->device, {tag}", n, h2d)
        if not torch.equal(src, pinned.to(self.device)):
            self.failures.append("raw copy: host and device differ")
        # The buffers (up to 3 x 4 GB) are freed on return.

    # ---------------------------------------------------------------- 2
    def staging(self, sd: dict[str, torch.Tensor]) -> None:
        nb = state_bytes(sd)
        opts = StagingOptions(use_pinned_memory=self.pin, use_shared_memory=False,
                              use_async_staging=False, use_non_blocking_copy=self.cuda)
        stager = DefaultStager(opts)
        out: dict[str, Any] = {}
        first = timed(lambda: out.__setitem__("sd", stager.stage(sd)), self.device)
        self.row("2 stage", "DefaultStager.stage, 1st (alloc+pin+copy)", nb, first, "1 d2h", self.d2h)
        again = timed(lambda: out.__setitem__("sd", stager.stage(sd)), self.device)
        self.row("2 stage", "DefaultStager.stage, 2nd (cached)", nb, again, "1 d2h", self.d2h)
        self.failures += [f"DefaultStager: {m}" for m in bit_mismatches(
            {k: v.to(self.device) for k, v in out["sd"].items()}, sd)]
        stager.close()
        out.clear()
        gc.collect()
        if _create_cpu_state_dict is not None:
            t0 = time.perf_counter()
            cpu_sd = _create_cpu_state_dict(sd, pin_memory=self.pin)
            create = time.perf_counter() - t0
            self.row("2 stage", "_create_cpu_state_dict (alloc+pin only)", nb, create)
            copy = timed(lambda: _copy_state_dict(sd, cpu_sd, non_blocking=self.cuda), self.device)
            self.row("2 stage", "_copy_state_dict into it", nb, copy, "1 d2h", self.d2h)
            del cpu_sd
            gc.collect()
        self.dirs = {"ucp": os.path.join(self.workdir, "ucp"), "dcp": os.path.join(self.workdir, "dcp")}
        writers: dict[str, Callable[[], tuple[Any, Any]]] = {
            "ucp": lambda: (UCPStorageWriter(self.dirs["ucp"], overwrite=True), UCPSavePlanner()),
            "dcp": lambda: (FileSystemWriter(self.dirs["dcp"]), None),
        }
        for fmt, make in writers.items():
            label = "UCPStorageWriter" if fmt == "ucp" else "FileSystemWriter"
            blocking, total = self._async_save(sd, make, None)
            self.row("2 async_save", f"{label}, default stager: blocking part", nb, blocking, "1 d2h",
                     self.d2h, upload_s=total - blocking)
            stager = DefaultStager(opts)
            try:
                blocking1, _ = self._async_save(sd, make, stager)
                blocking2, total2 = self._async_save(sd, make, stager)
            finally:
                stager.close()
            self.row("2 async_save", f"{label}, pinned DefaultStager 1st: blocking", nb, blocking1, "1 d2h",
                     self.d2h)
            self.row("2 async_save", f"{label}, pinned DefaultStager 2nd: blocking", nb, blocking2, "1 d2h",
                     self.d2h, upload_s=total2 - blocking2)
            gc.collect()

    def _async_save(self, sd: dict[str, torch.Tensor], make: Callable[[], tuple[Any, Any]],
                    stager: Any) -> tuple[float, float]:
        writer, planner = make()
        sync(self.device)
        t0 = time.perf_counter()
        resp = dcp.async_save(sd, storage_writer=writer, planner=planner, async_stager=stager)
        blocking = time.perf_counter() - t0
        upload = getattr(resp, "upload_completion", resp)
        upload.result()
        return blocking, time.perf_counter() - t0

    # ---------------------------------------------------------------- 3
    def storage_read(self) -> None:
        files = [f for d in self.dirs.values() for f in files_under(d)]
        nb = sum(os.path.getsize(f) for f in files)
        fsync_and_evict(files)
        resident = resident_fraction(files)
        buf = bytearray(READ_BLOCK)
        view = memoryview(buf)

        def sequential() -> None:
            for path in files:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(view):
                        pass

        seq = timed(sequential, torch.device("cpu"))
        s_gbps = self.row("3 storage", "sequential read, 1 thread, cold", nb, seq, resident_after_evict=resident)
        fsync_and_evict(files)
        par = timed(lambda: parallel_read(files, self.args.io_threads), torch.device("cpu"))
        p_gbps = self.row("3 storage", f"preadv, {self.args.io_threads} threads, cold", nb, par)
        self.storage_gbps = max(s_gbps, p_gbps)
        self.results["storage"] = {"files": len(files), "bytes": nb, "resident_after_evict": resident,
                                   "fs_type": fs_type(self.workdir)}
        if resident is not None and resident > 0.05:
            print(f"warning: {resident:.0%} of the checkpoint stayed in the page cache after eviction "
                  f"({fs_type(self.workdir)}): cold numbers are warm", file=sys.stderr)

    # ---------------------------------------------------------------- 4
    def loads(self, sd: dict[str, torch.Tensor]) -> None:
        nb = state_bytes(sd)
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        variants: list[tuple[str, str, Callable[[], tuple[Any, Any]], bool | None]] = [
            ("ucp", "UCPStorageReader", lambda: (UCPStorageReader(self.dirs["ucp"], io_threads=self.args.io_threads,
                                                                  max_buffer_bytes=self.args.buffer_mb * MiB),
                                                 UCPLoadPlanner()), None),
            ("ucp", "UCPStorageReader, no overlap", lambda: (
                UCPStorageReader(self.dirs["ucp"], io_threads=self.args.io_threads,
                                 max_buffer_bytes=self.args.buffer_mb * MiB), UCPLoadPlanner()), False),
            ("dcp", "FileSystemReader", lambda: (FileSystemReader(self.dirs["dcp"]), DefaultLoadPlanner()), None),
        ]
        for fmt, label, make, overlap in variants:
            files = files_under(self.dirs[fmt])
            best = math.inf
            for _ in range(self.args.repeats):
                for t in target.values():
                    t.view(_INT_OF_SIZE[t.element_size()]).fill_(-1)
                fsync_and_evict(files)
                best = min(best, self._load(target, make, overlap))
                self._check(target, sd, f"{label} cold")
            self.row("4 load", f"{label}, cold", nb, best, "3 storage best", self.storage_gbps)
            warm = math.inf
            for _ in range(self.args.repeats):
                warm = min(warm, self._load(target, make, overlap))
            self._check(target, sd, f"{label} warm")
            self.row("4 load", f"{label}, warm", nb, warm, "1 h2d", self.h2d)

    def _load(self, target: dict[str, torch.Tensor], make: Callable[[], tuple[Any, Any]],
              overlap: bool | None) -> float:
        reader, planner = make()
        with staging_overlap(overlap):
            return timed(lambda: dcp.load(target, storage_reader=reader, planner=planner), self.device)

    def _check(self, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
        bad = bit_mismatches(got, want)
        if bad:
            print(f"MISMATCH after {what}: {bad[:5]}", file=sys.stderr)
            self.failures += [f"{what}: {m}" for m in bad]


def parallel_read(files: Sequence[str], threads: int) -> None:
    """Read all of ``files`` with ``threads`` threads, each preadv-ing 16 MiB pieces."""
    work = [(p, off, min(READ_BLOCK, size - off)) for p in files
            for size in [os.path.getsize(p)] for off in range(0, size, READ_BLOCK)]
    lock = threading.Lock()
    fds = {p: os.open(p, os.O_RDONLY) for p in files}

    def worker() -> None:
        buf = memoryview(bytearray(READ_BLOCK))
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


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'step':<13} {'measurement':<52} {'GB':>7} {'s':>8} {'GB/s':>7} {'ratio':>6}  ratio to"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if r["ratio"] is not None else ""
        lines.append(f"{r['step']:<13} {r['what']:<52} {r['bytes'] / GB:>7.3f} {r['seconds']:>8.3f} "
                     f"{r['gbps']:>7.2f} {ratio:>6}  {r['ratio_to'] or ''}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gb", type=float, default=None,
                   help="state size in GB (default 4 on cuda, 0.5 on cpu; --quick: 0.25 / 0.03)")
    p.add_argument("--quick", action="store_true", help="small smoke run, one repeat")
    p.add_argument("--dir", default=None,
                   help="where checkpoints are written (a fresh subdirectory, removed after; default: system temp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--repeats", type=int, default=None, help="timed loads per variant, best kept (default 3; quick 1)")
    p.add_argument("--io-threads", type=int, default=4, help="read threads (UCPStorageReader, parallel read)")
    p.add_argument("--buffer-mb", type=int, default=64, help="UCPStorageReader max_buffer_bytes, in MiB")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path (default benchmarks/results/gpu.json)")
    args = p.parse_args(argv)
    if args.gb is None:
        args.gb = (0.25 if args.device == "cuda" else 0.03) if args.quick else (4.0 if args.device == "cuda" else 0.5)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    args.copy_repeats = 2 if args.quick else 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: run with --device cpu for a smoke check", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    t_start = time.perf_counter()
    base = args.dir or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench_gpu_", dir=base)
    bench = Bench(args, device, workdir)
    try:
        sd = make_state(int(args.gb * GB), device)
        nb = state_bytes(sd)
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in sd.values()})
        print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
              f"state {nb / GB:.3f} GB in {len(sd)} tensors ({', '.join(dtypes)}), dir {workdir} "
              f"({fs_type(workdir)})", flush=True)
        bench.raw_copies()
        bench.staging(sd)
        bench.storage_read()
        bench.loads(sd)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t_start
    print()
    print(table(bench.rows))
    result = {
        "config": {k: v for k, v in vars(args).items()},
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "cuda": torch.version.cuda, "fs_type": fs_type(workdir)},
        "state_bytes": nb,
        "rows": bench.rows,
        **bench.results,
        "failures": bench.failures,
        "wall_s": wall,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwall time {wall:.1f}s; results written to {args.out}")
    if bench.failures:
        print(f"\nFAILURES ({len(bench.failures)}):", file=sys.stderr)
        for m in bench.failures[:50]:
            print(f"  {m}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
