"""The slow rank named: progress lines of long loads and saves, and the slowest rank and file.

A rank's reads of one data file (or its writes) are slowed where the library meets the OS
(``os.preadv``, ``durable._pwrite``); the reader and writer must name that rank and that file,
and the progress lines must appear on the ``ucp_dcp.progress`` logger.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import re
import time
import uuid
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dist_utils import bit_equal, run_ranks
from stall import deadline_error, stall_reads_of
from ucp_dcp import (
    ReadOptions,
    ProgressConfig,
    RequestPolicy,
    SlowestRecord,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
)
from ucp_dcp.byteio import durable
from ucp_dcp.byteio.progress import Progress
from ucp_dcp.dcp import slowest
from ucp_dcp.errors import InvalidArgumentError, StorageError, TruncatedFileError, unwrap

WATCHDOG_S = 120
EVERY = ProgressConfig(interval=0.05, threshold=0.0)  # a line at the first request after 50 ms
DELAY_S = 0.25
FAST = RequestPolicy(attempts=1, deadline_floor_s=0.3, deadline_cap_s=0.5)  # a blocked read: 0.3 s


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_lines_at_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    p = Progress("load of /ckpt", 3, config=ProgressConfig(interval=10, threshold=5), clock=clock)
    caplog.set_level(logging.INFO, logger="ucp_dcp.progress")
    for t, n in ((1, 10**6), (6, 2 * 10**6), (7, 10**6), (16, 4 * 10**6)):
        clock.now = 100.0 + t
        p.add(n)
    clock.now = 120.0
    assert p.finish("slowest file f (1.0 s, 2.0 MB)") == 20.0
    assert [r.name for r in caplog.records] == ["ucp_dcp.progress"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "rank 3: load of /ckpt: 3.0 MB read in 6.0 s (0.5 MB/s; 0.5 MB/s over the last 6.0 s)",
        "rank 3: load of /ckpt: 8.0 MB read in 16.0 s (0.5 MB/s; 0.5 MB/s over the last 10.0 s)",
        "rank 3: load of /ckpt: done, 8.0 MB read in 20.0 s (0.4 MB/s); "
        "slowest file f (1.0 s, 2.0 MB)",
    ]


def test_short_operations_log_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    caplog.set_level(logging.INFO, logger="ucp_dcp.progress")
    p = Progress("save to /ckpt", 0, verb="written", config=ProgressConfig(), clock=clock)
    clock.now += 4.9
    p.add(10**9)
    assert p.finish() == pytest.approx(4.9)
    assert caplog.records == [] and p.lines == 0
    with pytest.raises(InvalidArgumentError, match=r"interval must be positive"):
        ProgressConfig(interval=0)


def test_the_slowest_gather_moves_numbers_on_the_groups_device(monkeypatch: Any) -> None:
    """The end-of-load gather moves six numbers a rank, in host memory where the group moves it,
    on the current CUDA device for NCCL alone, and falls back to objects elsewhere; a record
    comes back whole, its file by position in the load's files."""
    cpu = torch.device("cpu")
    for backend, want in [("gloo", cpu), ("cpu:gloo,cuda:nccl", cpu), ("nccl", None), ("ucc", None)]:
        monkeypatch.setattr(slowest, "group_backend", lambda g, b=backend: b)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert slowest._wire_device(None) == want, backend
    paths = ["/ckpt/rank00000-a.safetensors", "/ckpt/rank00001-a.safetensors"]
    rec = SlowestRecord(3, paths[1], 12.25, 3 * 2**40 + 7, 9.5, 2**33 + 1)
    assert slowest._decode(slowest._encode(rec, paths), paths) == rec
    none = SlowestRecord(0, "", 0.001, 0)
    assert slowest._decode(slowest._encode(none, paths), paths) == none
    # A file the other rank's list lacks (a failed load with no source) is named by no one.
    assert slowest._decode(slowest._encode(rec, paths), []) == SlowestRecord(
        3, "", 12.25, 3 * 2**40 + 7, 9.5, 2**33 + 1
    )


def test_object_store_reads_and_writes_report(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ucp_dcp.progress")
    url = f"memory://ucp-{uuid.uuid4().hex[:8]}/ckpt"
    sd = {"a": torch.arange(300 * 70, dtype=torch.float32).reshape(300, 70)}
    writer = UCPStorageWriter(url, progress=EVERY)
    dcp.save(sd, storage_writer=writer, planner=UCPSavePlanner())
    out = {"a": torch.zeros(300, 70)}
    reader = UCPStorageReader(url, options=ReadOptions(progress=EVERY))
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert bit_equal(out["a"], sd["a"])
    w, r = writer.rank_record, reader.last_load.rank_record
    assert w is not None and r is not None and writer.slowest == w and reader.last_load.slowest == r
    assert w.rank == 0 and w.file.startswith(url) and w.file.endswith(".safetensors")
    assert w.bytes == w.file_bytes > 300 * 70 * 4
    # The object reader charged its requests to the one data object.
    assert r.file == w.file and 0 < r.file_bytes == r.bytes == reader.last_load.bytes_requested
    assert r.file_seconds > 0 and r.seconds >= r.file_seconds
    lines = [x.getMessage() for x in caplog.records]
    assert any(m.startswith(f"rank 0: save to {url}: done, ") for m in lines), lines
    assert any(m.startswith(f"rank 0: load of {url}: done, ") and r.file in m for m in lines), lines


class _Lines(logging.Handler):
    """Keeps every message of the ``ucp_dcp.progress`` logger (spawned ranks have no caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        log = logging.getLogger("ucp_dcp.progress")
        log.setLevel(logging.INFO)
        log.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _slowed(real: Any, wanted: str) -> Any:
    """``real`` (an ``os`` read or write call), its first call on a file named ``wanted...``
    ``DELAY_S`` late."""
    slept = []

    def call(fd: int, *args: Any) -> Any:
        if not slept and wanted in os.readlink(f"/proc/self/fd/{fd}"):
            slept.append(fd)
            time.sleep(DELAY_S)
        return real(fd, *args)

    return call


def _full() -> dict[str, torch.Tensor]:
    return {
        f"w{i}": torch.arange(i * 10**5, i * 10**5 + 300 * 100, dtype=torch.float32).reshape(300, 100)
        for i in range(2)
    }


def _slow_rank_named(rank: int, world: int, root: str) -> None:
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    lines = _Lines()
    full = _full()
    # Save: rank 1's writes are slow; the coordinator (rank 0) names it.
    if rank == 1:
        durable._pwrite = _slowed(os.pwrite, "rank00001-")  # a write of its own data file
    writer = UCPStorageWriter(root, progress=EVERY)
    sd = {f"w{rank}": full[f"w{rank}"]}  # each rank saves one tensor into its own file
    dcp.save(sd, storage_writer=writer, planner=UCPSavePlanner())
    durable._pwrite = os.pwrite
    own = writer.rank_record
    assert own is not None and own.rank == rank and f"rank{rank:05d}-" in own.file, own
    assert own.bytes == own.file_bytes == os.path.getsize(own.file)
    if rank == 0:
        assert writer.slowest is not None and writer.slowest.rank == 1, writer.slowest
        assert "rank00001-" in writer.slowest.file and writer.slowest.seconds >= DELAY_S
        assert any(m.startswith(f"save to {root}: slowest rank rank 1: ") for m in lines.lines)
    else:
        assert writer.slowest == own
        assert any(m.startswith(f"rank 1: save to {root}: done, ") for m in lines.lines)

    # Load every tensor whole on every rank: each rank reads both files; rank 1's reads of
    # rank 0's file are slow. Every rank learns that rank 1 was slowest, and where.
    names = sorted(os.listdir(root))
    slow_file = next(n for n in names if n.startswith("rank00000-"))
    real_preadv = os.preadv
    if rank == 1:
        os.preadv = _slowed(real_preadv, slow_file)
    out = {k: torch.zeros_like(v) for k, v in full.items()}
    reader = UCPStorageReader(root, options=ReadOptions(read_once=False, progress=EVERY))
    dcp.load(out, storage_reader=reader, planner=UCPLoadPlanner())
    assert all(bit_equal(out[k], full[k]) for k in full)
    mine = reader.last_load.rank_record
    assert mine is not None and mine.rank == rank and mine.bytes == reader.last_load.bytes_requested
    if rank == 1:
        os.preadv = real_preadv
        assert mine.file == os.path.join(root, slow_file) and mine.file_seconds >= DELAY_S, mine
        assert any(m.startswith(f"rank 1: load of {root}: ") and " read in " in m for m in lines.lines)
        done = [m for m in lines.lines if m.startswith(f"rank 1: load of {root}: done, ")]
        assert len(done) == 1 and f"slowest file {mine.file} (" in done[0], lines.lines
    job = reader.last_load.slowest
    assert isinstance(job, SlowestRecord) and job.rank == 1, job
    assert job.file == os.path.join(root, slow_file) and job.seconds >= DELAY_S
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, job)
    assert everyone == [job] * world
    if rank == 0:
        assert any(m.startswith(f"load of {root}: slowest rank rank 1: ") for m in lines.lines)

    # A load that fails on rank 1 (its reads of rank 0's file come back empty: a truncated file)
    # fails on every rank with rank 1's error; the gather at its end waits for no one.
    if rank == 1:
        os.preadv = lambda fd, bufs, off: (
            0 if slow_file in os.readlink(f"/proc/self/fd/{fd}") else real_preadv(fd, bufs, off)
        )
    failed = UCPStorageReader(root, options=ReadOptions(read_once=False))
    with pytest.raises(CheckpointException) as caught:
        dcp.load({k: torch.zeros_like(v) for k, v in full.items()}, storage_reader=failed,
                 planner=UCPLoadPlanner())
    os.preadv = real_preadv
    err = unwrap(caught.value)
    assert isinstance(err, TruncatedFileError) and slow_file in str(err), caught.value
    assert list(caught.value.failures) == [1]
    assert failed.last_load.slowest is not None and failed.last_load.rank_record is not None

    # A load whose rank 1 blocks in a read (issue 25; tests/stall.py) fails on every rank with rank
    # 1's StorageError naming the file, the byte range, the rank and the time waited, within the
    # deadline: on its own (rank 1's read of rank 0's file) and in the read-once exchange (every
    # rank's reads block: the job plan may give this small state to one reader, whichever it is).
    fifo = os.path.join(os.path.dirname(root), "stall")
    for once in (False, True):
        blocked = [os.path.join(root, slow_file)] if not once else [os.path.join(root, n) for n in names]
        real = end = None
        if rank == 1 or once:
            real, end = stall_reads_of(blocked, f"{fifo}-{once}-{rank}")
        late = UCPStorageReader(root, options=ReadOptions(read_once=once, requests=FAST))
        t0 = time.monotonic()
        with pytest.raises(CheckpointException) as caught:
            dcp.load({k: torch.zeros_like(v) for k, v in full.items()}, storage_reader=late,
                     planner=UCPLoadPlanner())
        took = time.monotonic() - t0
        if real is not None:
            os.preadv = real
        err = unwrap(caught.value)
        assert isinstance(err, StorageError) and err.errno == errno.ETIMEDOUT, caught.value
        assert late.source is not None
        # Any read of the reading rank's in the exchange; alone, rank 1's of the chunk of w0 (in
        # rank 0's file).
        pattern = deadline_error(None)
        if not once:
            loc = late.source.locate("w0", 0)
            pattern = deadline_error(1, late.source.paths[loc.file], loc.start, loc.nbytes)
        m = re.fullmatch(pattern, str(err))
        assert m, (pattern, str(err))
        deadline, waited = map(float, m.groups())
        assert deadline == 0.30 and 0.30 <= waited < 1.5 and took < 8.0, (m.groups(), took)
        if end is not None:
            os.write(end, b"x" * 64)

    # A load without collectives (no_dist, one rank alone) gathers nothing: it would hang here.
    if rank == 0:
        alone = UCPStorageReader(root, options=ReadOptions(read_once=False))
        out = {k: torch.zeros_like(v) for k, v in full.items()}
        dcp.load(out, storage_reader=alone, planner=UCPLoadPlanner(), no_dist=True)
        assert all(bit_equal(out[k], full[k]) for k in full)
        assert alone.last_load.slowest == alone.last_load.rank_record and alone.last_load.slowest is not None
        assert alone.last_load.slowest.rank == 0 and alone.last_load.slowest.bytes > 0
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.multiproc
def test_slow_rank_and_file_named(tmp_path) -> None:
    run_ranks(2, _slow_rank_named, str(tmp_path / "ckpt"))
