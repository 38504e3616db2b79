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
import gc
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import ucp_dcp.byteio.engine as ucp_engine
from harness import (
    GB,
    Column,
    MiB,
    best_of,
    bit_equal,
    default_out,
    files_under,
    fs_type,
    fsync_and_evict,
    make_reader,
    make_writer,
    parallel_read,
    print_failures,
    quick_defaults,
    resident_fraction,
    sequential_read,
    sync,
    tensor_bytes,
    text_table,
    timed,
    write_json,
)
from ucp_dcp.byteio.transfer import StagingBuffers

try:  # private helpers of DCP's stagers; present in torch 2.4+
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
except ImportError:  # pragma: no cover
    _copy_state_dict = _create_cpu_state_dict = None  # type: ignore[assignment]

RAW_COPY_CAP = 4 << 30
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

warnings.filterwarnings("ignore", module=r"torch\.distributed\.checkpoint.*")


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


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


def bit_mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (compared where they live)."""
    bad = []
    for k, w in want.items():
        t = got[k]
        if t.shape != w.shape or t.dtype != w.dtype or t.device != w.device:
            bad.append(f"{k}: {t.dtype}{list(t.shape)}@{t.device} vs {w.dtype}{list(w.shape)}@{w.device}")
        elif not bit_equal(t, w):
            bad.append(f"{k}: bits differ")
    return bad


@contextmanager
def staging_overlap(overlap: bool | None) -> Iterator[None]:
    """Make UCPStorageReader build its StagingBuffers with ``overlap`` (None: unchanged)."""
    if overlap is None:
        yield
        return
    real = ucp_engine.StagingBuffers
    ucp_engine.StagingBuffers = partial(StagingBuffers, overlap=overlap)  # type: ignore[misc]
    try:
        yield
    finally:
        ucp_engine.StagingBuffers = real  # type: ignore[misc]


# --------------------------------------------------------------------------
# the steps
# --------------------------------------------------------------------------


@dataclass
class Row:
    """One measurement: ``bytes`` moved in ``seconds``, and its bandwidth's ratio to a reference."""

    step: str
    what: str
    bytes: int
    seconds: float
    gbps: float
    ratio: float | None
    ratio_to: str | None
    extra: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The JSON record: the fields, with ``extra``'s keys in place of ``extra``."""
        out = asdict(self)
        extra = out.pop("extra")
        return {**out, **extra}


class Bench:
    """The four steps on one device; rows, failures and extra results accumulate here."""

    def __init__(self, args: argparse.Namespace, device: torch.device, workdir: str) -> None:
        self.args = args
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = self.cuda
        self.workdir = workdir
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.results: dict[str, Any] = {}

    def row(self, step: str, what: str, nbytes: int, seconds: float, ref: str | None = None,
            ref_gbps: float | None = None, **extra: Any) -> float:
        """Record one measurement; returns its bandwidth in GB/s."""
        gbps = nbytes / seconds / GB if seconds > 0 else float("inf")
        self.rows.append(Row(step, what, nbytes, seconds, gbps, gbps / ref_gbps if ref_gbps else None, ref, extra))
        return gbps

    # ---------------------------------------------------------------- 1
    def raw_copies(self) -> None:
        """Step 1: device->host (pinned, pageable) and host->device copy bandwidth."""
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
        """Step 2: DCP's stager, and the blocking part of ``dcp.async_save`` with each writer."""
        nb = tensor_bytes(sd)
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
            "ucp": lambda: make_writer("ucp", self.dirs["ucp"], overwrite=True),
            "dcp": lambda: make_writer("dcp", self.dirs["dcp"]),
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
        """Step 3: cold sequential (one thread) and parallel (preadv threads) read of both checkpoints."""
        files = [f for d in self.dirs.values() for f in files_under(d)]
        nb = sum(os.path.getsize(f) for f in files)
        fsync_and_evict(files)
        resident = resident_fraction(files)
        seq = timed(lambda: sequential_read(files))
        s_gbps = self.row("3 storage", "sequential read, 1 thread, cold", nb, seq, resident_after_evict=resident)
        fsync_and_evict(files)
        par = timed(lambda: parallel_read(files, self.args.io_threads))
        p_gbps = self.row("3 storage", f"preadv, {self.args.io_threads} threads, cold", nb, par)
        self.storage_gbps = max(s_gbps, p_gbps)
        self.results["storage"] = {"files": len(files), "bytes": nb, "resident_after_evict": resident,
                                   "fs_type": fs_type(self.workdir) or "?"}
        if resident is not None and resident > 0.05:
            print(f"warning: {resident:.0%} of the checkpoint stayed in the page cache after eviction "
                  f"({fs_type(self.workdir) or '?'}): cold numbers are warm", file=sys.stderr)

    # ---------------------------------------------------------------- 4
    def loads(self, sd: dict[str, torch.Tensor]) -> None:
        """Step 4: cold and warm ``dcp.load`` into device tensors with each reader, each checked bit for bit."""
        nb = tensor_bytes(sd)
        target = {k: torch.empty_like(v) for k, v in sd.items()}
        ucp = {"io_threads": self.args.io_threads, "max_buffer_bytes": self.args.buffer_mb * MiB}
        variants: list[tuple[str, str, Callable[[], tuple[Any, Any]], bool | None]] = [
            ("ucp", "UCPStorageReader", lambda: make_reader("ucp", self.dirs["ucp"], **ucp), None),
            ("ucp", "UCPStorageReader, no overlap", lambda: make_reader("ucp", self.dirs["ucp"], **ucp), False),
            ("dcp", "FileSystemReader", lambda: make_reader("dcp", self.dirs["dcp"], default_planner=True), None),
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


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


COLUMNS = [Column("step", 13, "<"), Column("measurement", 52, "<", 1), Column("GB", 7, gap=1),
           Column("s", 8, gap=1), Column("GB/s", 7, gap=1), Column("ratio", 6, gap=1),
           Column("ratio to", 0, "<", 2)]


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width text table."""
    head, *lines = text_table(COLUMNS, [
        [r.step, r.what, f"{r.bytes / GB:.3f}", f"{r.seconds:.3f}", f"{r.gbps:.2f}",
         f"{r.ratio:.2f}" if r.ratio is not None else "", r.ratio_to or ""] for r in rows])
    return "\n".join([head, "-" * len(head), *lines])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with device- and --quick-dependent defaults filled in."""
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
    p.add_argument("--out", default=default_out("gpu.json"), help="JSON results path (default benchmarks/results/gpu.json)")
    args = p.parse_args(argv)
    if args.gb is None:
        args.gb = (0.25 if args.device == "cuda" else 0.03) if args.quick else (4.0 if args.device == "cuda" else 0.5)
    quick_defaults(args, repeats=(1, 3))
    args.copy_repeats = 2 if args.quick else 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the four steps on one device, print the table, write the JSON; 0 if every load was exact."""
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
        nb = tensor_bytes(sd)
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in sd.values()})
        print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}), "
              f"state {nb / GB:.3f} GB in {len(sd)} tensors ({', '.join(dtypes)}), dir {workdir} "
              f"({fs_type(workdir) or '?'})", flush=True)
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
                "cuda": torch.version.cuda, "fs_type": fs_type(workdir) or "?"},
        "state_bytes": nb,
        "rows": [r.as_dict() for r in bench.rows],
        **bench.results,
        "failures": bench.failures,
        "wall_s": wall,
    }
    write_json(args.out, result)
    print(f"\nwall time {wall:.1f}s; results written to {args.out}")
    print_failures(bench.failures, limit=50)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
