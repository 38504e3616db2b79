"""The byte-range reader: exact offset reads straight into memory.

Callers describe what they need as :class:`~ucp_dcp.byteio.segments.Segment` records (a byte range
of a file and a buffer of its length, usually a slice of the destination tensor's storage);
:class:`RangeReader` coalesces them into ``os.preadv`` calls
(:func:`~ucp_dcp.byteio.segments.coalesce`) run on I/O threads, each under a deadline
(:mod:`~ucp_dcp.byteio.workers`), and allocates no per-read memory (the scratch buffer for gaps is
shared). Each file is read *exact* or *sequential*, chosen once per load
(:meth:`RangeReader.plan_access`; docs/resharding.md, "Streamed or exact, per file"). A segment's
``done`` callback runs on the I/O thread that completes it; segments with callbacks go in calls of
at most :data:`HOOKED_REQUEST_BYTES`.

The local files it reads are opened here too (:func:`open_data_file`), and so are those whose
headers :mod:`ucp_dcp.format` parses (:class:`FileAccess`, :func:`read_header`,
:func:`read_safetensors`): the local twin of :class:`~ucp_dcp.byteio.objrange.ObjectAccess`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from ..core.spans import ACCESS_MODES, SEQUENTIAL, file_access
from ..errors import CheckpointFormatError, InvalidArgumentError, TruncatedFileError
from ..format.header import (
    FileHeader,
    RandomAccess,
    SafetensorsHeader,
    parse_header,
    parse_safetensors,
)
from .progress import Progress
from .requests import RequestPolicy
from .segments import Request, Segment, coalesce, spread
from .workers import IOWorkers

__all__ = [
    "ByteSource",
    "MappedSpan",
    "FileHandles",
    "RangeReader",
    "ReadStats",
    "storage_view",
    "tensor_view",
    "HOOKED_REQUEST_BYTES",
    "Extents",
    "IO_THREADS",
    "MAX_REQUEST_BYTES",
    "check_access",
    "open_data_file",
    "FileAccess",
    "read_header",
    "read_safetensors",
]

Extents = Mapping[int, tuple[np.ndarray, np.ndarray]]
"""Every byte range a load will read, per file number: ``(starts, lengths)`` arrays."""

# Requests a thread has announced to the kernel ahead of reading them: the
# device works on up to this many while the thread waits for the first.
_PREFETCH_WINDOW = 32

# A file read as a stream is shared among threads in stretches of at least this many bytes: a
# shorter read is not worth a hand-off to another thread (and the read-ahead needs a run-up).
STREAM_STRETCH = 4 << 20

# Segments that carry a ``done`` callback are coalesced into requests of at
# most this many bytes (or one segment, if longer): the callback then runs
# while what the request read is still in the CPU's cache (a checksum over
# it costs about half as much as over memory read back from DRAM).
HOOKED_REQUEST_BYTES = 1 << 20


@dataclass
class ReadStats:
    """What a reader asked storage for: calls, bytes requested (gaps included), and per file
    the bytes and the seconds its requests took (which file held this rank up)."""

    calls: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    file_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes requested per file number (requests that named their file)."""
    file_seconds: dict[int, float] = field(default_factory=dict)
    """Seconds of requests per file number, summed over the threads that made them (on object
    storage, each batch of concurrent requests' time shared among them by bytes)."""
    progress: Progress | None = field(default=None, repr=False)
    """Fed every request's bytes, to log a long load's progress (set by the load)."""
    into: tuple[ReadStats, int] | None = field(default=None, repr=False)
    """``(stats, base)``: count into ``stats`` instead, file numbers shifted by ``base`` (a reader
    that is one part of a reader of several checkpoints' files)."""

    def add(self, calls: int, nbytes: int, file: int = -1, seconds: float = 0.0) -> None:
        """Count ``calls`` system calls that requested ``nbytes`` bytes; with ``file``, also
        ``nbytes`` and ``seconds`` (how long they took) for that file."""
        if self.into is not None:
            stats, base = self.into
            return stats.add(calls, nbytes, file + base if file >= 0 else -1, seconds)
        with self._lock:
            self.calls += calls
            self.bytes += nbytes
            if file >= 0:
                self.file_bytes[file] = self.file_bytes.get(file, 0) + nbytes
                self.file_seconds[file] = self.file_seconds.get(file, 0.0) + seconds
            if self.progress is not None:
                self.progress.add(nbytes)

    def slowest_file(self) -> int | None:
        """The file number whose requests took the most seconds (more bytes breaks a tie); None
        if no request named its file."""
        if not self.file_seconds:
            return None
        return max(self.file_seconds, key=lambda f: (self.file_seconds[f], self.file_bytes[f]))


def storage_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of the whole storage of CPU tensor ``t``.

    Destination views are strided windows into a storage; addressing the
    storage directly lets one ``preadv`` fill many rows of a non-contiguous
    view without a staging copy.
    """
    st = t.untyped_storage()
    n = st.nbytes()
    if n == 0:
        return memoryview(bytearray())
    # A ctypes array over the storage's memory costs a seventh of a uint8 tensor's numpy view,
    # and a load makes one per destination tensor. The array holds the storage, and every view
    # of the memoryview holds the array: the memory lives as long as any view of it.
    raw = (ctypes.c_char * n).from_address(st.data_ptr())
    raw._storage = st  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


def tensor_view(t: torch.Tensor) -> memoryview:
    """A read-only byte view of contiguous CPU tensor ``t`` (for hashing, writing): of its values
    (a conjugate or negative view is resolved first, into a copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    t = t.detach().resolve_conj().resolve_neg()
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def open_data_file(path: str, *, random: bool = True) -> int:
    """Open data file ``path`` for random reads (no read-ahead), or with ``random=False`` for a
    stream (the kernel's default read-ahead); a missing or unreadable file is a
    :class:`CheckpointFormatError` naming it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointFormatError(f"data file {path} is missing") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a directory opens, and fails its first read
        os.close(fd)
        raise CheckpointFormatError(f"data file {path} is not a regular file")
    if random and hasattr(os, "posix_fadvise"):
        # Without this the header read leaves read-ahead marks in the page
        # cache, and a later exact read of a marked page makes the kernel
        # stream in the rest of the file: other ranks' bytes.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class FileAccess:
    """:class:`~ucp_dcp.format.header.RandomAccess` over a local file, opened by
    :func:`open_data_file` and closed by :meth:`close` (or the ``with`` block)."""

    def __init__(self, path: str) -> None:
        self.fd = open_data_file(path)
        self.size = os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset``."""
        return os.pread(self.fd, n, offset)

    def close(self) -> None:
        """Close the descriptor."""
        os.close(self.fd)

    def __enter__(self) -> FileAccess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_H = TypeVar("_H")


def _parsed(parse: Callable[[str, RandomAccess], _H], path: str, access: RandomAccess | None) -> _H:
    """``parse(path, access)``, or over the local file at ``path`` when ``access`` is None."""
    if access is not None:
        return parse(path, access)
    with FileAccess(path) as f:
        return parse(path, f)


def read_safetensors(path: str, access: RandomAccess | None = None) -> SafetensorsHeader:
    """The checked header of safetensors file ``path``: read through ``access``, or from the local
    file (:func:`~ucp_dcp.format.header.parse_safetensors`)."""
    return _parsed(parse_safetensors, path, access)


def read_header(path: str, *, access: RandomAccess | None = None) -> FileHeader:
    """The checked header of native data file ``path``: read through ``access``, or from the local
    file (:func:`~ucp_dcp.format.header.parse_header`)."""
    return _parsed(parse_header, path, access)


class FileHandles:
    """Descriptors of a list of files, each opened once on first use; thread-safe.

    Opened with ``POSIX_FADV_RANDOM``: callers request exactly the bytes they
    need, and read-ahead would only pull in neighbours other ranks own; with
    ``random=False``, with the kernel's read-ahead (files read as streams).
    """

    def __init__(self, paths: Sequence[str], *, random: bool = True) -> None:
        self.paths = list(paths)
        self.random = random
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def get(self, file: int) -> int:
        """The descriptor of file number ``file``; a missing file is a format error naming it."""
        fd = self._fds.get(file)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                fd = open_data_file(self.paths[file], random=self.random)
                self._fds[file] = fd
        return fd

    def close(self, keep: frozenset[str] = frozenset()) -> None:
        """Close every descriptor opened so far, except those of the paths in ``keep`` (a read
        left blocked in one: closing it would let its number name another file)."""
        with self._lock:
            for file, fd in self._fds.items():
                if self.paths[file] not in keep:
                    os.close(fd)
            self._fds.clear()


class ByteSource(Protocol):
    """Where the bytes of a checkpoint's files come from: the seam every read goes through.

    Files are numbered (``Segment.file``); :meth:`read` fills each segment's
    buffer from its byte range and runs its ``done`` callback once it is
    read. :class:`RangeReader` reads local files with ``preadv``,
    :class:`~ucp_dcp.byteio.objrange.ObjectRangeReader` objects with ranged
    requests; another way to obtain the bytes (a per-file access strategy,
    bytes shared between ranks) is one more class with these four members,
    and every read path (:mod:`~ucp_dcp.byteio.engine`, staging, spans,
    verification) works with it unchanged.
    """

    gap_bytes: int
    """Neighbouring ranges at most this far apart are read together (the span cost model reads
    it)."""
    stats: ReadStats
    """Calls (or requests) made and bytes requested, gaps included."""
    maps_files: bool = False
    """Whether :meth:`read_mapped` can read spans from files mapped into memory (the span cost
    model reads it)."""

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill every segment's buffer (and run its callback); raises naming the file on a
        failure."""
        ...

    def close(self) -> None:
        """Release files, threads or connections."""
        ...

    def plan_access(
        self, extents: Extents, mode: str = "auto", shared: Extents | None = None
    ) -> dict[int, str]:
        """Choose how to read each file from every range the load will read there (``mode``: one
        of :data:`~ucp_dcp.core.spans.ACCESS_MODES`; ``shared``: ranges other ranks on this
        machine read), before the first :meth:`read`; the choice per file number. A source with
        one way of reading (object storage) chooses nothing."""
        check_access(mode)
        return {}

    def read_mapped(self, file: int, spans: Sequence[MappedSpan]) -> bool:
        """Run each span's ``fn`` with its bytes of file ``file`` mapped into memory, where the
        source can map the file; False (nothing run) where it cannot (object storage: the
        caller reads the spans instead)."""
        return False


class MappedSpan(NamedTuple):
    """``fn(view)``, given ``view``: bytes ``[start, start + nbytes)`` of a file mapped into
    memory, read-only by contract (:meth:`ByteSource.read_mapped`). What ``fn`` copies out of the
    view is what the span reads."""

    start: int
    nbytes: int
    fn: Callable[[memoryview], None]


def check_access(mode: str) -> str:
    """``mode`` if it is one of :data:`~ucp_dcp.core.spans.ACCESS_MODES`, else an
    :class:`InvalidArgumentError` naming it and them."""
    if mode not in ACCESS_MODES:
        raise InvalidArgumentError(f"access must be one of {ACCESS_MODES}, got {mode!r}")
    return mode


# Read threads per rank, the one default of every reader (UCPStorageReader, Checkpoint,
# convert, RangeReader). Measured on the development VM (2 cores, virtio disk, cold page cache
# evicted with benchmarks/harness/pagecache.py; RangeReader reading 64 MiB files, 3 runs each): with
# 4 ranks reading at once, 2 threads per rank pulled a median 1.6-2.1 GB/s in 1-16 MiB requests, 4
# threads 1.2-1.5 GB/s, 8 threads 0.7-1.4 GB/s; one rank alone, 1-2 threads 2.7-2.9 GB/s in 1 MiB
# requests, 4 threads 1.6-2.1. Each thread announces its requests a window ahead
# (POSIX_FADV_WILLNEED), so two keep the device's queue full; more only contend for the cores.
# Scattered one-page reads (one per 8 KiB) ran at 0.10-0.15 GB/s with 4 ranks whatever the thread
# count: bound by calls, not by requests in flight (core/spans.py reads such regions as spans).
# A file read as a stream (access="sequential", chosen per file under "auto") is shared among as
# many lanes, the calling thread being the first, each with the kernel's read-ahead.
IO_THREADS = 2

# The largest single read, the one default of every reader (ReadOptions.max_request_bytes, a
# source's open_reader, RangeReader, ObjectRangeReader): a big tensor is read as several such
# requests, by several threads at once. (RequestPolicy's min/max_part_bytes bound something
# else: the parts an object-store GET is sent as, from the hedge budget.)
MAX_REQUEST_BYTES = 16 << 20


def _release(
    workers: IOWorkers,
    files: FileHandles,
    lanes: Sequence[FileHandles],
    maps: dict[int, mmap.mmap | None],
) -> None:
    """Stop ``workers``, unmap the files and close the descriptors, but those of a read left
    blocked."""
    workers.close()
    keep = frozenset(workers.blocked())
    for m in maps.values():
        if m is not None and not keep:
            try:
                m.close()
            except BufferError:  # a view of it is still held: unmapped once that is collected
                pass
    maps.clear()
    files.close(keep)
    for lane in lanes:
        lane.close(keep)


class RangeReader(ByteSource):
    """Reads byte ranges of a fixed list of files with coalesced ``preadv`` calls.

    Args:
        paths: the files; segments refer to them by position.
        threads: size of the I/O thread pool.
        gap_bytes: neighbouring ranges at most this far apart are read with one call, the gap
            landing in a scratch buffer (the page holding it is fetched anyway).
        max_request_bytes: upper bound on one call, so that a large range is split across threads.
        requests: the deadline of each call (its floor, cap and factor; see
            :mod:`~ucp_dcp.byteio.workers`): :class:`~ucp_dcp.byteio.requests.RequestPolicy`'s
            defaults when None. A read gets ``attempts`` times the deadline of one try (it is not
            tried again); the hedging fields do not apply to local files.
    """

    maps_files = True  # local files: read_mapped maps them

    def __init__(
        self,
        paths: Sequence[str],
        *,
        threads: int = IO_THREADS,
        gap_bytes: int = 0,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        requests: RequestPolicy | None = None,
    ) -> None:
        self._paths = list(paths)
        self._files = FileHandles(self._paths)
        self.gap_bytes = gap_bytes
        self._scratch = memoryview(bytearray(max(gap_bytes, 1)))
        self._max_request = max(max_request_bytes, 1)
        self._hooked_request = min(self._max_request, HOOKED_REQUEST_BYTES)
        self._threads = max(threads, 1)
        self._workers = IOWorkers(self._threads, requests or RequestPolicy())
        self.stats = ReadStats()
        self._sequential: frozenset[int] = frozenset()  # files read as streams (plan_access)
        # Per stream lane, descriptors of its own: the kernel keeps one read-ahead state per open
        # file, and lanes sharing a descriptor would break each other's pattern.
        self._lanes = [FileHandles(self._paths, random=False) for _ in range(self._threads)]
        # Files mapped into memory for span reads (read_mapped), each once; None: cannot be.
        self._maps: dict[int, mmap.mmap | None] = {}
        self._maps_lock = threading.Lock()
        # Closed by close(), or when the reader is collected unclosed: a long-lived process
        # keeps no descriptor, mapping or thread of a reader it dropped.
        self._release = weakref.finalize(
            self, _release, self._workers, self._files, self._lanes, self._maps
        )

    # -------------------------------------------------------------- files
    def fd(self, file: int) -> int:
        """Open (once) and return the descriptor of file number ``file``."""
        return self._files.get(file)

    def close(self) -> None:
        """Close every file and stop the I/O threads (not waiting for one left blocked in a read
        past its deadline, whose file stays open)."""
        self._release()

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_mapped(self, file: int, spans: Sequence[MappedSpan]) -> bool:
        """Run each span's ``fn`` with a view of its bytes of the file mapped into memory, on the
        I/O threads, each under a read's deadline (its page faults are the read); False (nothing
        run) where the file cannot be mapped.

        Why: a span read with ``preadv`` copies every byte of the span into staging memory, and
        then the needed ones into place; from a mapping the span's pages are asked for the same
        way, but only the needed bytes are copied, once (a column slice of rows: about half the
        work).
        A span past the file's end is not mapped (a truncated file): the caller reads it, and
        :meth:`read` names the truncation.
        """
        m = self._map(file)
        if m is None or any(s.start < 0 or s.start + s.nbytes > len(m) for s in spans):
            return False
        view = memoryview(m)
        path = self._paths[file]

        def run(span: MappedSpan) -> None:
            workers = self._workers
            workers.begin(path, span.start, span.nbytes)
            ok = False
            try:
                if hasattr(os, "posix_fadvise"):
                    # The mapping reads no page around a fault (MADV_RANDOM): the span's pages are
                    # asked for here, all at once, and no other (as a span read with preadv).
                    os.posix_fadvise(self.fd(file), span.start, span.nbytes, os.POSIX_FADV_WILLNEED)
                span.fn(view[span.start : span.start + span.nbytes])
                ok = True
            finally:
                took = workers.end(ok=ok)
            # Unmapped from this process once copied out (the page cache keeps the pages): its
            # resident memory does not grow with every span it read.
            first = span.start // mmap.PAGESIZE * mmap.PAGESIZE
            m.madvise(mmap.MADV_DONTNEED, first, span.start + span.nbytes - first)
            self.stats.add(1, span.nbytes, file, took)

        try:
            futures = [self._workers.submit(run, s) for s in spans]
            self._workers.wait(futures)
        finally:
            view.release()
        return True

    def _map(self, file: int) -> mmap.mmap | None:
        """File ``file`` mapped whole (copy-on-write: writable views, nothing written back), once;
        None where it cannot be (empty, or a file system without mappings)."""
        with self._maps_lock:
            if file not in self._maps:
                m = None
                try:
                    fd = self.fd(file)
                    size = os.fstat(fd).st_size
                    if size:
                        m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
                        # No read-around on a fault: it would pull in pages of other ranks' parts.
                        m.madvise(mmap.MADV_RANDOM)
                except (OSError, ValueError):
                    m = None
                self._maps[file] = m
            return self._maps[file]

    def plan_access(
        self, extents: Extents, mode: str = "auto", shared: Extents | None = None
    ) -> dict[int, str]:
        """Choose, per file, a stream (:data:`~ucp_dcp.core.spans.SEQUENTIAL`) or exact reads
        (:data:`~ucp_dcp.core.spans.EXACT`): ``mode`` for every file, or with ``"auto"``
        :func:`~ucp_dcp.core.spans.file_access` of its ranges (and of the ``shared`` ranges
        other ranks on this machine read there). Later reads follow it; a file not in
        ``extents`` is read exactly."""
        check_access(mode)
        shared = shared or {}
        chosen = {
            f: mode
            if mode != "auto"
            else file_access(starts, lengths, os.fstat(self.fd(f)).st_size, shared=shared.get(f))
            for f, (starts, lengths) in extents.items()
        }
        self._sequential = frozenset(f for f, how in chosen.items() if how == SEQUENTIAL)
        return chosen

    # -------------------------------------------------------------- reads
    def plan(self, segments: Sequence[Segment]) -> list[Request]:
        """Coalesce ``segments`` into calls (exposed for tests)."""
        return coalesce(
            segments,
            gap_bytes=self.gap_bytes,
            max_request=self._max_request,
            hooked_request=self._hooked_request,
            scratch=self._scratch,
        )

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill every segment's buffer; raises on a short file or an I/O error, and once a read
        was past its deadline, that read's :class:`~ucp_dcp.errors.StorageError` again."""
        if self._workers.failed is not None:
            raise self._workers.failed
        reqs = self.plan(segments)
        if not reqs:
            return
        tasks: list[tuple[Callable[[Sequence[Request]], None], list[Request]]] = []
        if self._sequential:
            stream = [r for r in reqs if r.file in self._sequential]
            reqs = [r for r in reqs if r.file not in self._sequential]
            # One in-order stretch per lane (a thread and its descriptors), each at least
            # STREAM_STRETCH long: each lane's stream is one the read-ahead follows. Lane 0 is the
            # calling thread (no hand-off; a short read stays there), the others pool threads.
            total = sum(r.nbytes for r in stream)
            lanes = max(1, min(self._threads, total // STREAM_STRETCH))
            batches = [b for b in spread(stream, lanes) if b]
            tasks += [(functools.partial(self._stream, i), b) for i, b in enumerate(batches)]
        streams = len(tasks)
        if reqs:
            tasks += [(self._run_all, b) for b in spread(reqs, self._threads * 4)]
        # With deadlines, every call runs on an I/O thread, none on this one: this thread keeps
        # their deadlines (a read blocked in the kernel here could not be timed). Without, this
        # thread takes a stream's first lane, or the only task (no hand-off). Every call
        # finishes before this returns, also when one fails (no thread may still write into a
        # buffer the caller reuses), except a call past its deadline, which fails the load.
        here = None
        if not self._workers.policy.local_deadlines and (streams or len(tasks) == 1):
            here = tasks.pop(0)
        futures = [self._workers.submit(fn, b) for fn, b in tasks]
        error: BaseException | None = None
        if here is not None:
            try:
                here[0](here[1])
            except BaseException as e:
                error = e
        self._workers.wait(futures, error)

    def _run_all(self, reqs: Sequence[Request]) -> None:
        # One pool task per batch, not per request: strided loads issue tens
        # of thousands of small reads, and a task per read costs more than it.
        # Each read is announced (POSIX_FADV_WILLNEED, exactly its bytes) a
        # window ahead, so a cold read of many small ranges keeps the device
        # busy instead of waiting on one page at a time.
        n = len(reqs)
        for r in reqs[:_PREFETCH_WINDOW]:
            self._advise(r)
        for i, r in enumerate(reqs):
            self._workers.check()  # before opening anything: the reader may be closed
            if i + _PREFETCH_WINDOW < n:
                self._advise(reqs[i + _PREFETCH_WINDOW])
            self._run(r)

    def _stream(self, lane: int, reqs: Sequence[Request]) -> None:
        # Requests in file order through lane ``lane``'s descriptors (opened without
        # POSIX_FADV_RANDOM), never announced: the kernel's read-ahead runs ahead of them.
        files = self._lanes[lane]
        for r in reqs:
            self._workers.check()
            self._run(r, files.get(r.file))

    def _advise(self, r: Request) -> None:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd(r.file), r.offset, r.nbytes, os.POSIX_FADV_WILLNEED)

    def _run(self, r: Request, fd: int | None = None) -> None:
        fd = self.fd(r.file) if fd is None else fd
        workers = self._workers
        workers.begin(self._paths[r.file], r.offset, r.nbytes)
        bufs, off, left, calls = r.bufs, r.offset, r.nbytes, 0
        try:
            while left:
                got = os.preadv(fd, bufs, off)
                calls += 1
                if got <= 0:
                    raise TruncatedFileError(
                        f"{self._paths[r.file]}: needed bytes [{off}, {off + left}) but the file "
                        f"ends at {os.fstat(fd).st_size}: truncated data file"
                    )
                off += got
                left -= got
                if left:  # short read: drop what was filled and go on
                    workers.check()  # left behind: fd may be closed by now
                    while got >= len(bufs[0]):
                        got -= len(bufs[0])
                        bufs = bufs[1:]
                    bufs = [bufs[0][got:], *bufs[1:]]
        finally:
            took = workers.end(ok=not left)
        self.stats.add(calls, r.nbytes, r.file, took)
        if r.done:
            for fn, n in r.done:
                fn(n)
