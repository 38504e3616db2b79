"""Local reads that cannot stall a load (issue 25): a read an I/O thread makes gets a deadline
(``ucp_dcp.byteio.workers``), and one past it fails the load with the library's StorageError
naming the file, the byte range, the rank and how long it waited.

A FIFO cannot pose as a data file (``preadv`` on a pipe fails at once with ESPIPE, and its size
is 0), and this machine has no FUSE library to slow a mount with. So the reads of one real data
file go through a ``preadv`` that first reads one byte from a FIFO nobody writes to: the I/O
thread blocks in the kernel, exactly as on a hung mount, and nothing in the library can wake it.
The test writes to the FIFO at the end, which lets the left-behind thread return. Each test is
bounded by a watchdog of its own; the deadlines are short (0.3-0.5 s).
"""

from __future__ import annotations

import errno
import faulthandler
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import RequestPolicy, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.byteio.rangeio import RangeReader, Segment
from ucp_dcp.errors import StorageError, unwrap

WATCHDOG_S = 60.0
FAST = RequestPolicy(deadline_floor_s=0.3, deadline_cap_s=0.5)
LEFT_BEHIND = "a blocked local read cannot be cancelled: its I/O thread is left behind"


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    """A test that hangs fails with every thread's stack instead of holding the suite."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def stall_reads_of(paths: list[str], fifo: str) -> tuple[Any, int]:
    """Make every ``os.preadv`` of the files ``paths`` first read a byte from the FIFO ``fifo``
    (blocking in the kernel until someone writes it). Returns the real ``preadv`` (to put back)
    and the FIFO's write end (write to it to let the blocked reads go on)."""
    os.mkfifo(fifo)
    end = os.open(fifo, os.O_RDWR)  # a reader and a writer at once: opening never blocks
    stalled = {(st.st_dev, st.st_ino) for st in map(os.stat, paths)}
    real = os.preadv

    def preadv(fd: int, bufs: Any, off: int) -> int:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in stalled:
            os.read(end, 1)
        return real(fd, bufs, off)

    os.preadv = preadv  # type: ignore[assignment]
    return real, end


def expected_error(path: str, start: int, nbytes: int, rank: int) -> str:
    """The exact message of a read of ``nbytes`` at ``start`` of ``path`` on ``rank`` past its
    deadline: the deadline and the time waited are groups."""
    return (
        re.escape(f"{path}: reading bytes [{start}, {start + nbytes}) failed: DeadlineExceeded: ")
        + re.escape(f"rank {rank}'s read did not return within its deadline (")
        + r"(\d+\.\d\d)"
        + re.escape(f" s for {nbytes} bytes) and waited ")
        + r"(\d+\.\d\d)"
        + re.escape(f" s; {LEFT_BEHIND}")
    )


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
        m = re.fullmatch(expected_error(str(slow), 4096, 8192, 0), str(e.value))
        assert m, str(e.value)
        deadline, waited = map(float, m.groups())
        # One observed read (8 KiB from page cache) is not enough for a median: the floor.
        assert deadline == 0.30 and 0.30 <= waited < 0.45 and took < 1.0, (m.groups(), took)
        # The load is failed: a later read says so at once, without touching the files.
        with pytest.raises(StorageError) as again:
            reader.read([Segment(0, 0, memoryview(bytearray(16)))])
        assert again.value is e.value
        left = [t for t in threading.enumerate() if t.name.startswith("ucp-read") and t.daemon]
        t0 = time.monotonic()
        reader.close()
        assert time.monotonic() - t0 < 0.2
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
from test_local_deadlines import FAST, stall_reads_of
from ucp_dcp.byteio.rangeio import RangeReader, Segment
from ucp_dcp.errors import StorageError
d = {d!r}
open(os.path.join(d, "f"), "wb").write(bytes(1 << 16))
stall_reads_of([os.path.join(d, "f")], os.path.join(d, "stall"))
reader = RangeReader([os.path.join(d, "f")], requests=FAST)
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


def _load_stalled_on_rank_1(rank: int, world: int, ckpt: str, fifo_dir: str) -> None:
    sd = {"w": torch.arange(64 * 1024, dtype=torch.float32).reshape(256, 256), "step": 3}
    dcp.save(sd, storage_writer=UCPStorageWriter(ckpt), planner=UCPSavePlanner())
    # A load with the deadlines as set passes, bit-exact (no read is late).
    target = {"w": torch.zeros(256, 256), "step": 0}
    dcp.load(target, storage_reader=UCPStorageReader(ckpt, requests=FAST), planner=UCPLoadPlanner())
    assert bit_equal(target["w"], sd["w"]) and target["step"] == 3
    reader = UCPStorageReader(ckpt, requests=FAST)
    paths = [os.path.join(ckpt, f) for f in sorted(os.listdir(ckpt)) if f.endswith(".safetensors")]
    real = end = None
    if rank == 1:  # every data read of rank 1 blocks
        real, end = stall_reads_of(paths, os.path.join(fifo_dir, "stall"))
    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointException) as e:
            dcp.load({"w": torch.zeros(256, 256), "step": 0}, storage_reader=reader, planner=UCPLoadPlanner())
    finally:
        if real is not None:
            os.preadv = real  # type: ignore[assignment]
    took = time.monotonic() - t0
    err = unwrap(e.value)
    assert isinstance(err, StorageError) and err.errno == errno.ETIMEDOUT, repr(e.value)
    assert reader.source is not None
    loc = reader.source.locate("w", 0)
    m = re.fullmatch(expected_error(reader.source.paths[loc.file], loc.start, loc.nbytes, 1), str(err))
    assert m, str(err)
    deadline, waited = map(float, m.groups())
    assert deadline == 0.30 and 0.30 <= waited < 0.6 and took < 5.0, (m.groups(), took)
    if end is not None:
        os.write(end, b"x" * 64)


def test_a_rank_whose_read_blocks_fails_every_rank_naming_it(tmp_path: Path) -> None:
    """2 ranks; rank 1's reads of the data files block: both ranks fail with rank 1's error
    (DCP gathers every rank's result), within the deadline and the load's own work."""
    run_ranks(2, _load_stalled_on_rank_1, str(tmp_path / "ckpt"), str(tmp_path))
