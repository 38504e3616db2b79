"""Segments, what a read fills, and the requests they become: neighbours coalesced into calls.

A reader is handed :class:`Segment` records (bytes of a file into a buffer, with an optional
callback once they are in); :func:`coalesce` turns them into :class:`Request` records, one
system call or ranged GET each: neighbours a small gap apart share a request (the gap landing in
scratch memory), a long segment is split so that threads share it, and segments with callbacks
are kept in smaller requests (:data:`~ucp_dcp.byteio.rangeio.HOOKED_REQUEST_BYTES`). Pure arithmetic
on offsets and buffers: the local reader (:mod:`~ucp_dcp.byteio.rangeio`) and the object reader
(:mod:`~ucp_dcp.byteio.objrange`) run the requests.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, NamedTuple

from ..errors import InvalidArgumentError

__all__ = ["Segment", "Request", "coalesce", "spread"]

_BY_POSITION = itemgetter(0, 1)

try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024
_IOV_MAX = max(16, min(_IOV_MAX, 1024))


class Segment(NamedTuple):
    """``len(dest)`` bytes at ``offset`` of file number ``file`` go into ``dest``.

    ``done``, if given, is called on an I/O thread as ``done(n)`` once the
    whole segment has been read, ``n`` being the number of segments sharing
    that callback which the call completed (segments coalesced into one
    ``preadv`` report together); an exception it raises fails the read. A
    named tuple rather than a dataclass: strided loads make tens of
    thousands of them, and tuples are the cheapest record to build.
    """

    file: int
    offset: int
    dest: memoryview
    done: Callable[[int], None] | None = None


@dataclass
class Request:
    """One call: ``nbytes`` bytes of file number ``file`` at ``offset`` into ``bufs`` (gaps into
    scratch), and the callbacks to run once it is done (each with how many of its segments this
    request completed)."""

    file: int
    offset: int
    bufs: list[memoryview]
    nbytes: int
    done: list[list[Any]] | None = None  # [callback, segments of this request that carry it]

    @property
    def end(self) -> int:
        """The byte just past the request."""
        return self.offset + self.nbytes


class _AfterAll:
    """Calls ``fn(1)`` once it has been called ``n`` times (from any threads): a segment split into
    ``n`` requests."""

    def __init__(self, n: int, fn: Callable[[int], None]) -> None:
        self.n = n
        self.fn = fn
        self._lock = threading.Lock()

    def __call__(self, parts: int) -> None:
        with self._lock:
            self.n -= parts
            last = self.n == 0
        if last:
            self.fn(1)


def coalesce(
    segments: Sequence[Segment],
    *,
    gap_bytes: int,
    max_request: int,
    hooked_request: int,
    scratch: memoryview,
    max_bufs: int = _IOV_MAX,
) -> list[Request]:
    """``segments`` coalesced into requests, in file and offset order.

    Neighbours at most ``gap_bytes`` apart share a request, the gap landing
    in ``scratch`` (at least ``gap_bytes`` long); a request holds at most
    ``max_request`` bytes (``hooked_request`` once a segment with a ``done``
    callback is in it) and ``max_bufs`` buffers; a longer segment is split,
    its callback running after its last part.
    """
    reqs: list[Request] = []
    cur: Request | None = None
    for s in sorted(segments, key=_BY_POSITION):
        n = len(s.dest)
        if n == 0:
            if s.done is not None:
                raise InvalidArgumentError("an empty segment cannot carry a done callback")
            continue
        if cur is not None and cur.file == s.file:
            gap = s.offset - (cur.offset + cur.nbytes)
            limit = max_request if s.done is None and not cur.done else hooked_request
            if (
                0 <= gap <= gap_bytes
                and cur.nbytes + gap + n <= limit
                and len(cur.bufs) + 2 <= max_bufs
            ):
                if gap:
                    cur.bufs.append(scratch[:gap])
                cur.bufs.append(s.dest)
                cur.nbytes += gap + n
                if s.done is not None:
                    if cur.done and cur.done[-1][0] is s.done:
                        cur.done[-1][1] += 1
                    else:
                        cur.done = [*(cur.done or ()), [s.done, 1]]
                continue
        # A range larger than one request is split so threads share it.
        off, dest = s.offset, s.dest
        done = s.done
        if done is not None and n > max_request:
            done = _AfterAll(-(-n // max_request), done)
        while len(dest) > max_request:
            reqs.append(
                Request(
                    s.file,
                    off,
                    [dest[:max_request]],
                    max_request,
                    None if done is None else [[done, 1]],
                )
            )
            off += max_request
            dest = dest[max_request:]
        cur = Request(s.file, off, [dest], len(dest), None if done is None else [[done, 1]])
        reqs.append(cur)
    return reqs


def spread(reqs: list[Request], n: int) -> list[list[Request]]:
    """Split ``reqs`` into at most ``n`` runs of consecutive requests of similar byte totals."""
    if n <= 1 or len(reqs) <= 1:
        return [reqs]
    target = sum(r.nbytes for r in reqs) / n
    out: list[list[Request]] = [[]]
    acc = 0
    for r in reqs:
        if acc >= target and len(out) < n:
            out.append([])
            acc = 0
        out[-1].append(r)
        acc += r.nbytes
    return out
