"""Local reads that cannot stall a load (issue 25): a read an I/O thread makes gets a deadline
(``ucp_dcp.byteio.workers``), and one past it fails the load with the library's StorageError
naming the file, the byte range, the rank and how long it waited.

The blocked reads are real reads of real files, held in the kernel on a FIFO (tests/stall.py
says why not a FIFO or FUSE mount as the data file itself). A rank whose read blocks fails every
rank of a 2-rank load, with and without the read-once exchange: tests/test_slow_rank.py, which
spawns those ranks already. Each test is bounded by a watchdog of its own; the deadlines are
short (0.3-0.5 s).
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import watchdog  # noqa: F401 (an autouse fixture)
from stall import deadline_error, stall_reads_of

from ucp_dcp import RequestPolicy
from ucp_dcp.byteio.rangeio import MappedSpan, RangeReader
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.errors import StorageError

FAST = RequestPolicy(attempts=1, deadline_floor_s=0.3, deadline_cap_s=0.5)



def _data(path: Path, n: int) -> bytes:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    path.write_bytes(data.numpy().tobytes())
    return path.read_bytes()


def test_a_blocked_read_fails_at_its_deadline_naming_file_range_and_rank(tmp_path: Path) -> None:
    """A read that blocks fails after its deadline (the floor: nothing was observed yet); the
    reader closes without waiting for the blocked thread, and that thread reads nothing more
    once its read returns."""
    good, slow = tmp_path / "good.bin", tmp_path / "slow.bin"
    good_bytes, _ = _data(good, 1 << 16), _data(slow, 1 << 16)
    real, end = stall_reads_of([str(slow)], str(tmp_path / "stall"))
    try:
        reader = RangeReader([str(good), str(slow)], threads=2, gap_bytes=0, requests=FAST)
        out = bytearray(8192)
        reader.read([Segment(0, 4096, memoryview(out))])  # the other file reads as ever
        assert out == good_bytes[4096 : 4096 + 8192]
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            reader.read([Segment(1, 4096, memoryview(bytearray(8192)))])
        took = time.monotonic() - t0
        assert e.value.errno == errno.ETIMEDOUT
        m = re.fullmatch(deadline_error(0, str(slow), 4096, 8192), str(e.value))
        assert m, str(e.value)
        deadline, waited = map(float, m.groups())
        # One observed read (8 KiB from page cache) is not enough for a median: the floor.
        # The waiting thread wakes at the deadline; a busy machine may wake it late, not early.
        assert deadline == 0.30 and 0.30 <= waited < 1.0 and took < 2.0, (m.groups(), took)
        # The load is failed: a later read says so at once, without touching the files.
        with pytest.raises(StorageError) as again:
            reader.read([Segment(0, 0, memoryview(bytearray(16)))])
        assert again.value is e.value
        copied: list[bytes] = []  # and so does a read of mapped spans, which copies nothing
        with pytest.raises(StorageError) as mapped:
            reader.read_mapped(0, [MappedSpan(0, 16, lambda v: copied.append(bytes(v)))])
        assert mapped.value is e.value and copied == []
        left = list(reader._workers._threads)
        assert len(left) == 2 and all(t.daemon for t in left)
        t0 = time.monotonic()
        reader.close()
        assert time.monotonic() - t0 < 1.0  # no join of the blocked thread
    finally:
        os.preadv = real  # type: ignore[assignment]
        os.write(end, b"x" * 64)  # the blocked read returns; its thread then stops
    for t in left:
        t.join(5.0)
        assert not t.is_alive(), t.name
    os.close(end)


_EXITS = """
import os, sys, time
sys.path.insert(0, {tests!r})
from stall import stall_reads_of
from ucp_dcp import RequestPolicy
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.byteio.segments import Segment
from ucp_dcp.errors import StorageError
d = {d!r}
open(os.path.join(d, "f"), "wb").write(bytes(1 << 16))
stall_reads_of([os.path.join(d, "f")], os.path.join(d, "stall"))
reader = RangeReader([os.path.join(d, "f")], requests=RequestPolicy(attempts=1, deadline_floor_s=0.3, deadline_cap_s=0.5))
try:
    reader.read([Segment(0, 0, memoryview(bytearray(100)))])
except StorageError as e:
    print("failed:", e.errno)
reader.close()
"""


def test_a_process_with_a_read_left_behind_still_exits(tmp_path: Path) -> None:
    """The blocked thread is a daemon: the interpreter exits normally (no os._exit) while it is
    still blocked in the kernel."""
    code = _EXITS.format(tests=str(Path(__file__).parent), d=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"failed: {errno.ETIMEDOUT}\n", (done.stdout, done.stderr)


@pytest.mark.parametrize("deadlines", [True, False])
def test_which_thread_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deadlines: bool) -> None:
    """With deadlines (the default) every read runs on an I/O thread, the calling thread keeping
    time; ``RequestPolicy(local_deadlines=False)`` reads a lone request on the calling thread (no
    hand-off, no deadline). The bytes are the same."""
    path = tmp_path / "f.bin"
    data = _data(path, 1 << 16)
    readers: list[int] = []
    real = os.preadv

    def preadv(fd: int, bufs: Any, off: int) -> int:
        readers.append(threading.get_ident())
        return real(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", preadv)
    with RangeReader([str(path)], requests=RequestPolicy(local_deadlines=deadlines)) as reader:
        out = bytearray(5000)
        reader.read([Segment(0, 1000, memoryview(out))])
    assert out == data[1000:6000]
    assert len(readers) == 1 and (readers[0] == threading.get_ident()) is not deadlines


def test_a_local_read_gets_the_time_of_every_try(tmp_path: Path) -> None:
    """A local read is not tried again: its deadline is ``attempts`` times an object-store try's
    (here 2 x the 0.3 s floor)."""
    path = tmp_path / "f.bin"
    _data(path, 1 << 14)
    real, end = stall_reads_of([str(path)], str(tmp_path / "stall"))
    try:
        reader = RangeReader([str(path)], requests=RequestPolicy(attempts=2, deadline_floor_s=0.3))
        with pytest.raises(StorageError) as e:
            reader.read([Segment(0, 0, memoryview(bytearray(100)))])
        m = re.fullmatch(deadline_error(0, str(path), 0, 100), str(e.value))
        assert m and float(m.group(1)) == 0.60 and 0.60 <= float(m.group(2)) < 1.5, str(e.value)
        reader.close()
    finally:
        os.preadv = real  # type: ignore[assignment]
        os.write(end, b"x" * 64)
        os.close(end)


@pytest.mark.parametrize("deadlines", [True, False])
def test_a_read_past_the_end_of_a_data_file_is_truncated_naming_what_was_needed(tmp_path: Path, deadlines: bool) -> None:
    """A range that starts inside the file and ends past it: the bytes that are there come (a short
    read), then the read fails naming the file, the bytes still needed and the file's size; on the
    calling thread as on an I/O thread."""
    from ucp_dcp.errors import TruncatedFileError

    path = tmp_path / "f.bin"
    _data(path, 4096)
    with RangeReader([str(path)], gap_bytes=0, requests=RequestPolicy(local_deadlines=deadlines)) as reader:
        with pytest.raises(TruncatedFileError) as e:
            # Two buffers in one read call: the short read fills the first and part of the second.
            reader.read([Segment(0, 4000, memoryview(bytearray(50))), Segment(0, 4050, memoryview(bytearray(950)))])
    assert str(e.value) == f"{path}: needed bytes [4096, 5000) but the file ends at 4096: truncated data file"


def test_a_data_file_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    from ucp_dcp.errors import CheckpointFormatError

    loop = tmp_path / "loop.bin"
    loop.symlink_to(loop)
    with pytest.raises(CheckpointFormatError) as e:
        RangeReader([str(loop)]).read([Segment(0, 0, memoryview(bytearray(8)))])
    assert str(e.value) == f"{loop}: cannot open (Too many levels of symbolic links)"


def test_io_workers_skip_a_task_cancelled_before_it_ran_and_wait_untimed_without_deadlines() -> None:
    """A queued task whose future was cancelled is not run, and the thread goes on to the next;
    without local deadlines the waiting thread waits for several futures with no timeout."""
    from ucp_dcp.byteio.workers import IOWorkers

    workers = IOWorkers(1, RequestPolicy(local_deadlines=False))
    release, ran = threading.Event(), []
    first = workers.submit(lambda _: release.wait(5), None)
    skipped = workers.submit(ran.append, "cancelled")
    assert skipped.cancel()
    rest = [workers.submit(ran.append, k) for k in range(3)]
    release.set()
    workers.wait([first, *rest])
    workers.close()
    assert ran == [0, 1, 2] and first.result() is True and skipped.cancelled()
