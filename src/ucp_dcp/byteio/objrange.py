"""Ranged reads of objects into destination memory: the object-storage twin of :class:`~ucp_dcp.byteio.rangeio.RangeReader`.

The same interface (``read(segments)``, ``stats``, ``gap_bytes``,
``close``), so every read path (staged column reads, spans, verification)
works unchanged on object storage. What differs is the cost model: on a
file system a call costs a system call, on object storage a request costs a
round trip (milliseconds) and is billed, so neighbouring ranges are merged
across larger gaps (:data:`OBJECT_GAP_BYTES`), and many requests are in
flight at once (one ``cat_ranges`` batch per window of
``window_bytes``, the next window fetched while the current one is copied
into place; two windows bound the memory the fetched bytes take).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .objstore import ObjectStore
from .rangeio import ReadStats, Segment

__all__ = ["ObjectRangeReader", "OBJECT_GAP_BYTES"]

OBJECT_GAP_BYTES = 32 << 10
"""Neighbouring ranges at most this far apart are fetched with one request. A round trip costs
at least the time of 100 KiB on any link (a millisecond at 100 MB/s), so merging a smaller gap
saves time; keeping it small keeps the bytes fetched (which egress bills) close to those needed:
column slices of narrow rows are merged, other ranks' shards are not."""


@dataclass
class _Request:
    """One ranged GET: bytes ``[start, end)`` of object ``file``, and where its pieces go."""

    file: int
    start: int
    end: int
    pieces: list[tuple[int, memoryview]] = field(default_factory=list)  # (offset in the object, destination)
    done: list[Callable[[int], None]] = field(default_factory=list)


class ObjectRangeReader:
    """Reads byte ranges of a fixed list of objects with coalesced, concurrent ranged GETs.

    Args:
        store: the checkpoint's store.
        names: the objects, by position (``Segment.file``).
        gap_bytes: neighbouring ranges at most this far apart share a request.
        max_request_bytes: upper bound on one request (a large range is split).
        window_bytes: bytes fetched per batch of concurrent requests; two
            windows are held at most (one being copied into place while the
            next is fetched), so the staging memory stays within 64 MiB.
    """

    def __init__(
        self,
        store: ObjectStore,
        names: Sequence[str],
        *,
        gap_bytes: int = OBJECT_GAP_BYTES,
        max_request_bytes: int = 16 << 20,
        window_bytes: int = 32 << 20,
    ) -> None:
        self.store = store
        self.names = list(names)
        self.gap_bytes = gap_bytes
        self._max_request = max(max_request_bytes, 1)
        self._window = max(window_bytes, self._max_request)
        self.stats = ReadStats()

    def close(self) -> None:
        """Nothing to release (the store's connections belong to fsspec's cached filesystem)."""

    def __enter__(self) -> "ObjectRangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def plan(self, segments: Sequence[Segment]) -> list[_Request]:
        """Coalesce ``segments`` into requests (exposed for tests)."""
        reqs: list[_Request] = []
        cur: _Request | None = None
        for s in sorted(segments, key=lambda s: (s.file, s.offset)):
            n = len(s.dest)
            if n == 0:
                if s.done is not None:
                    raise ValueError("an empty segment cannot carry a done callback")
                continue
            if (cur is not None and cur.file == s.file and 0 <= s.offset - cur.end <= self.gap_bytes
                    and s.offset + n - cur.start <= self._max_request):
                cur.end = s.offset + n
                cur.pieces.append((s.offset, s.dest))
                if s.done is not None:
                    cur.done.append(s.done)
                continue
            # A range larger than one request is split; its callback runs after the last part.
            off, dest = s.offset, s.dest
            while len(dest) > self._max_request:
                reqs.append(_Request(s.file, off, off + self._max_request, [(off, dest[: self._max_request])]))
                off += self._max_request
                dest = dest[self._max_request :]
            cur = _Request(s.file, off, off + len(dest), [(off, dest)], [s.done] if s.done is not None else [])
            reqs.append(cur)
        return reqs

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill every segment's buffer; a failed or short request raises naming the object.

        The requests go out in windows of ``window_bytes``; the next window
        is being fetched while the current one is copied into place, so at
        most two windows of fetched bytes are held.
        """
        windows: list[list[_Request]] = [[]]
        held = 0
        for r in self.plan(segments):
            if windows[-1] and held + (r.end - r.start) > self._window:
                windows.append([])
                held = 0
            windows[-1].append(r)
            held += r.end - r.start
        if not windows[-1]:
            return
        if len(windows) == 1:
            self._place(windows[0], self._fetch(windows[0]))
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ucp-fetch") as pool:
            ahead = pool.submit(self._fetch, windows[0])
            for k in range(len(windows)):
                datas = ahead.result()
                if k + 1 < len(windows):
                    ahead = pool.submit(self._fetch, windows[k + 1])
                try:
                    self._place(windows[k], datas)
                except BaseException:
                    ahead.cancel()
                    raise

    def _fetch(self, window: list[_Request]) -> list[bytes]:
        return self.store.read_ranges([(self.names[r.file], r.start, r.end) for r in window])

    def _place(self, window: list[_Request], datas: list[bytes]) -> None:
        for r, data in zip(window, datas):
            view = memoryview(data)
            for off, dest in r.pieces:
                dest[:] = view[off - r.start : off - r.start + len(dest)]
            self.stats.add(1, r.end - r.start)
            # Callbacks report segments done, as RangeReader's do: one call per segment here.
            for fn in r.done:
                fn(1)
