"""An object's bytes as a :class:`~ucp_dcp.byteio.rangeio.ByteSource`, every request through the
:class:`~ucp_dcp.byteio.objstore.ObjectStore` it reads from (deadlines, retries, hedges, the bound
on requests in flight).

:class:`ObjectAccess` is one object as random access (header parsing); :class:`ObjectRangeReader`
is the object-storage twin of :class:`~ucp_dcp.byteio.rangeio.RangeReader`, so every read path
(staged column reads, spans, verification) works unchanged on object storage. Only the cost model
differs: a request costs a round trip and is billed, so neighbouring ranges are merged across
larger gaps (:data:`OBJECT_GAP_BYTES`), many requests are in flight at once, and bytes already
fetched are kept (an object's end, :meth:`ObjectRangeReader.hold`). How a load's requests go out:
docs/object-storage.md ("How a load works").
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .objstore import ObjectStore
from .rangeio import MAX_REQUEST_BYTES, ByteSource, ReadStats
from .segments import Request, Segment, coalesce

__all__ = [
    "ObjectAccess",
    "ObjectRangeReader",
    "OBJECT_GAP_BYTES",
]


_HEAD_BYTES = 64 << 10
# The most fetched bytes an ObjectRangeReader holds: windows fetched ahead and the one being placed.
_STAGING_BYTES = 64 << 20


class ObjectAccess:
    """One object as :class:`~ucp_dcp.format.header.RandomAccess`: header parsing reads it through
    this.

    The first read that starts within the first ``head_bytes`` fetches at least that prefix (64
    KiB by default), which holds a data file's header in one request (it is read as its length,
    then its body). A later read that starts inside the prefix held, or right after it, extends
    the prefix in one request, to its end plus ``head_bytes`` more: what usually follows a
    header (a native data file's block checksums) comes with it. Any other read is one request
    of its own. ``size``, when the caller knows it (an index records every data file's size),
    saves the request that would ask the store; an object shorter than that fails its first read
    that reaches past its end (:class:`~ucp_dcp.errors.TruncatedFileError`, naming it).
    """

    def __init__(
        self,
        store: ObjectStore,
        name: str,
        size: int | None = None,
        *,
        head_bytes: int = _HEAD_BYTES,
    ) -> None:
        self.store = store
        self.name = name
        self.size = store.size(name) if size is None else size
        self.head_bytes = max(head_bytes, 1)
        self._head = b""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end of the object)."""
        end = min(offset + n, self.size)
        if offset >= end:
            return b""
        held = len(self._head)
        if end > held and offset <= max(held, self.head_bytes - 1):
            # One request extends the prefix held (the first fetches it) past this read.
            want = min(self.size, max(end + (self.head_bytes if held else 0), self.head_bytes))
            self._head += self.store.read(self.name, held, want)
        if end <= len(self._head):
            return self._head[offset:end]
        return self.store.read(self.name, offset, end)

    def first_request(self) -> tuple[str, int, int]:
        """``(name, start, end)`` of the first request (the prefix, or the whole of a shorter
        object)."""
        return self.name, 0, min(self.size, self.head_bytes)

    def hold_head(self, data: bytes) -> None:
        """Take the first request's bytes, fetched by someone else (no request is made)."""
        self._head = data

    @property
    def head(self) -> bytes:
        """The prefix held (from byte 0; empty before the first read and after :meth:`release`)."""
        return self._head

    def release(self) -> None:
        """Forget the prefix held (the bytes parsed from it are no longer read)."""
        self._head = b""


OBJECT_GAP_BYTES = 32 << 10
"""Neighbouring ranges at most this far apart are fetched with one request. A round trip costs
at least the time of 100 KiB on any link (a millisecond at 100 MB/s), so merging a smaller gap
saves time; keeping it small keeps the bytes fetched (which egress bills) close to those needed:
column slices of narrow rows are merged, other ranks' shards are not."""


class ObjectRangeReader(ByteSource):
    """Reads byte ranges of a fixed list of objects with coalesced, concurrent ranged GETs.

    The fetched bytes held are at most :data:`_STAGING_BYTES`: as many windows are fetched ahead
    of the one being copied into place as fit (at least one). A slow request holds back only its
    own window; the requests of the windows ahead keep the store busy meanwhile.

    Args:
        store: the checkpoint's store.
        names: the objects, by position (``Segment.file``).
        sizes: their sizes, if known (lets a request near an object's end read to it).
        gap_bytes: neighbouring ranges at most this far apart share a request.
        max_request_bytes: upper bound on one request (a large range is split).
        window_bytes: bytes fetched per batch of concurrent requests (the store splits each request
            into parts that run concurrently:
            :meth:`~ucp_dcp.byteio.scheduler.RequestScheduler.part_bytes`).
    """

    def __init__(
        self,
        store: ObjectStore,
        names: Sequence[str],
        *,
        sizes: Sequence[int] | None = None,
        gap_bytes: int = OBJECT_GAP_BYTES,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        window_bytes: int = 16 << 20,
    ) -> None:
        self.store = store
        self.names = list(names)
        self.sizes = list(sizes) if sizes is not None and len(sizes) == len(self.names) else None
        self.gap_bytes = gap_bytes
        # Per object, bytes already fetched and where they start (a request's read on to the
        # object's end, a source's header request): segments inside them cost no request.
        self._held: dict[int, list[tuple[int, bytes | memoryview]]] = {}
        self._scratch = memoryview(bytearray(max(gap_bytes, 1)))  # where merged gaps land
        self._max_request = max(max_request_bytes, 1)
        self._window = max(window_bytes, self._max_request)
        self.stats = ReadStats()

    def close(self) -> None:
        """Nothing to release (the store's connections belong to fsspec's cached filesystem)."""

    def __enter__(self) -> ObjectRangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hold(self, file: int, start: int, data: bytes | memoryview) -> None:
        """Keep ``data``, object ``file``'s bytes from ``start``: later segments inside them are
        filled from memory (bytes held from the same ``start`` before are replaced)."""
        if len(data):
            held = [h for h in self._held.get(file, ()) if h[0] != start]
            self._held[file] = [*held, (start, data)]

    def plan(self, segments: Sequence[Segment]) -> list[Request]:
        """Coalesce ``segments`` into requests (exposed for tests):
        :func:`~ucp_dcp.byteio.segments.coalesce`.

        Unlike a file's, a request's size is not cut down for segments with
        callbacks, nor its pieces counted: each cut would cost a round trip.
        """
        return coalesce(
            segments,
            gap_bytes=self.gap_bytes,
            max_request=self._max_request,
            hooked_request=self._max_request,
            scratch=self._scratch,
            max_bufs=sys.maxsize,
        )

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill every segment's buffer; a failed or short request raises naming the object.

        The requests go out in windows of ``window_bytes``, fetched ahead as the class says.
        """
        segments = self._from_held(segments)
        windows: list[list[Request]] = [[]]
        held = 0
        for r in self.plan(segments):
            if windows[-1] and held + r.nbytes > self._window:
                windows.append([])
                held = 0
            windows[-1].append(r)
            held += r.nbytes
        if not windows[-1]:
            return
        self.store.scheduler.expect(sum(self._end(r) - r.offset for w in windows for r in w))
        if len(windows) == 1:
            self._place(windows[0], self._fetch(windows[0]))
            return
        largest = max(sum(r.nbytes for r in w) for w in windows)
        # No more windows ahead than requests may be in flight: a thread per window beyond
        # that would only wait for a slot (thousands of tiny windows, thousands of threads).
        ahead_most = min(self.store.requests.max_in_flight, len(windows))
        n = max(1, min(_STAGING_BYTES // max(largest, 1) - 1, ahead_most))
        with ThreadPoolExecutor(n, thread_name_prefix="ucp-fetch") as pool:
            ahead = deque(pool.submit(self._fetch, w) for w in windows[:n])
            for k in range(len(windows)):
                datas = ahead.popleft().result()
                if k + n < len(windows):
                    ahead.append(pool.submit(self._fetch, windows[k + n]))
                try:
                    self._place(windows[k], datas)
                except BaseException:
                    for f in ahead:
                        f.cancel()
                    raise

    def _from_held(self, segments: Sequence[Segment]) -> Sequence[Segment]:
        """Fill the segments that lie inside bytes held; return the others."""
        if not self._held:
            return segments
        rest = []
        for s in segments:
            for start, data in self._held.get(s.file, ()):
                at = s.offset - start
                if 0 <= at and at + len(s.dest) <= len(data):
                    s.dest[:] = data[at : at + len(s.dest)]
                    if s.done is not None:
                        s.done(1)
                    break
            else:
                rest.append(s)
        return rest

    def _end(self, r: Request) -> int:
        """Where request ``r`` stops: the object's end if that is within the gap, else its own."""
        size = self.sizes[r.file] if self.sizes is not None else 0
        return size if r.end < size <= r.end + self.gap_bytes else r.end

    def _fetch(self, window: list[Request]) -> list[bytes]:
        t0 = time.perf_counter()
        datas = self.store.read_ranges(
            [(self.names[r.file], r.offset, self._end(r)) for r in window]
        )
        # The batch's requests run concurrently and report together: each object is charged
        # the batch's time by its share of the bytes.
        seconds, total = time.perf_counter() - t0, max(sum(len(d) for d in datas), 1)
        for r, data in zip(window, datas):
            self.stats.add(1, len(data), r.file, seconds * len(data) / total)
        return datas

    def _place(self, window: list[Request], datas: list[bytes]) -> None:
        for r, data in zip(window, datas):
            view, at = memoryview(data), 0
            for buf in r.bufs:  # gaps land in the scratch buffer, as with preadv
                buf[:] = view[at : at + len(buf)]
                at += len(buf)
            if len(data) > r.nbytes:
                self.hold(r.file, r.end, bytes(view[r.nbytes :]))
            for fn, n in r.done or ():
                fn(n)
