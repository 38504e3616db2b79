"""Local reads that block in the kernel, for the deadline tests (issue 25).

A FIFO cannot pose as a data file (``preadv`` on a pipe fails at once with ESPIPE, and its size
is 0), and the project machines have no FUSE library to slow a mount with. So the reads of real
data files go through a ``preadv`` that first reads one byte from a FIFO nobody writes to: the
I/O thread blocks in the kernel, as on a hung mount, and nothing in the library can wake it.
Writing to the FIFO lets the blocked reads go on.
"""

from __future__ import annotations

import os
import re
from typing import Any

LEFT_BEHIND = "a blocked local read cannot be cancelled: its I/O thread is left behind"


def stall_reads_of(paths: list[str], fifo: str) -> tuple[Any, int]:
    """Make every ``os.preadv`` of the files ``paths`` first read a byte from a new FIFO at
    ``fifo`` (blocking in the kernel until someone writes it). Returns the real ``preadv`` (to
    put back) and the FIFO's write end (write to it to let the blocked reads go on)."""
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


def deadline_error(rank: int | None, path: str | None = None, start: int | None = None,
                   nbytes: int | None = None) -> str:
    """A regular expression of the exact message of a local read of ``nbytes`` at ``start`` of
    ``path`` on ``rank`` past its deadline (None: any rank, any file, any range); the deadline and
    the time waited are its groups."""
    where = re.escape(path) if path is not None else r"\S+"
    if start is not None and nbytes is not None:
        span, n = re.escape(f"[{start}, {start + nbytes})"), str(nbytes)
    else:
        span, n = r"\[\d+, \d+\)", r"\d+"
    return (
        where
        + f": reading bytes {span} failed: DeadlineExceeded: "
        + (re.escape(f"rank {rank}") if rank is not None else r"rank \d+")
        + re.escape("'s read did not return within its deadline (")
        + r"(\d+\.\d\d) s for "
        + n
        + r" bytes\) and waited (\d+\.\d\d) s; "
        + re.escape(LEFT_BEHIND)
    )
