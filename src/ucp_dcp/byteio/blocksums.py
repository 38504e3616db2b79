"""Block checksums, computed at save, planned and checked at load.

A whole-entry digest can only be checked by a read of the whole chunk, and a resharding load reads
parts of chunks; so every data file also records the xxh3-64 of each ``block`` bytes of each tensor
chunk, and a load checks exactly the blocks its reads touch. :class:`BlockHasher` computes them
while :class:`~ucp_dcp.byteio.datafile.DataFileWriter` writes a chunk; :class:`BlockSums` holds one
chunk's recorded sums; :class:`BlockVerifier` plans a read so that every block it touches is whole
in memory (in place, or read whole into scratch) and checks it (:class:`Batch`,
:class:`ChunkStream`). The file layout: docs/format.md ("Block checksums"); how a load reads and
checks: docs/resharding.md ("Verified loads").
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import xxhash
from numpy.lib.stride_tricks import as_strided

from ..core.boxes import runs
from ..core.sharding import Box
from ..core.spans import expand, merge_ranges
from ..errors import ChecksumError, InvalidArgumentError
from ..format import Location
from .integrity import chunk_mismatch, chunk_what
from .rangeio import HOOKED_REQUEST_BYTES, ByteSource, storage_view
from .segments import Segment

__all__ = [
    "BlockSums",
    "BlockHasher",
    "BlockVerifier",
    "read_verified",
    "ChunkCheck",
    "Batch",
    "ChunkStream",
]

# A block's xxh3-64, also of numpy arrays (the rows of a 2-D view, hashed in place). Arrays have the
# buffer protocol, but numpy's stubs declare it (``__buffer__``) only for Python 3.12+ and mypy
# checks for 3.10; taking ``.data`` of every row instead would double the cost of hashing a block.
_hash = cast("Callable[[np.ndarray | memoryview], int]", xxhash.xxh3_64_intdigest)


def _hash_rows(rows: np.ndarray) -> np.ndarray:
    """The xxh3-64 of every row of 2-D ``uint8`` array ``rows`` (a block per row, hashed in place:
    cheaper per block than slicing a memoryview for each)."""
    return np.fromiter(map(_hash, rows), np.uint64, len(rows))


@dataclass(frozen=True, eq=False)
class BlockSums:
    """The recorded xxh3-64 of every ``block`` bytes of one saved chunk (``sums[k]``: block
    ``k``)."""

    block: int
    sums: np.ndarray  # uint64, ceil(nbytes / block) of them


class BlockHasher:
    """The xxh3-64 of every ``block`` bytes of an ``nbytes``-long stream fed to :meth:`update` in
    pieces of any size."""

    def __init__(self, nbytes: int, block: int) -> None:
        self.block = block
        self.sums = np.zeros(-(-nbytes // block), dtype=np.uint64)
        self._k = 0  # the block being filled
        self._fill = 0  # its bytes hashed so far
        self._partial: xxhash.xxh3_64 | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Hash the next ``len(data)`` bytes of the stream."""
        view = memoryview(data).cast("B")
        b, n, off = self.block, len(view), 0
        if self._fill:
            assert self._partial is not None
            off = min(b - self._fill, n)
            self._partial.update(view[:off])
            self._fill += off
            if self._fill < b:
                return
            self._end_partial()
        full = (n - off) // b
        if full:
            rows = np.frombuffer(view, dtype=np.uint8, count=full * b, offset=off).reshape(full, b)
            self.sums[self._k : self._k + full] = _hash_rows(rows)
            self._k += full
            off += full * b
        if off < n:
            self._partial = xxhash.xxh3_64(view[off:])
            self._fill = n - off

    def digests(self) -> np.ndarray:
        """Every block's digest (call once the whole stream was fed)."""
        if self._fill:
            self._end_partial()
        if self._k != len(self.sums):
            raise InvalidArgumentError(f"block hasher fed {self._k} of {len(self.sums)} blocks")
        return self.sums

    def _end_partial(self) -> None:
        """Record the digest of the block being filled, and start the next."""
        assert self._partial is not None
        self.sums[self._k] = self._partial.intdigest()
        self._k, self._fill, self._partial = self._k + 1, 0, None


@dataclass(frozen=True)
class ChunkCheck:
    """How reads of one saved chunk are checked: by ``verifier``, against ``sums``;
    ``fqn``/``offsets`` name it."""

    verifier: BlockVerifier
    sums: BlockSums
    fqn: str
    offsets: tuple[int, ...]


# Up to this many blocks (or pieces to copy) are handled in a plain loop: cheaper than a dozen small
# array operations.
_FEW = 8
_NO_I64 = np.zeros(0, np.int64)
_NO_U8 = np.zeros(0, np.uint8)
_NO_I64.flags.writeable = _NO_U8.flags.writeable = False


def _none(dtype: type) -> Any:
    """A field defaulting to the shared empty array of ``dtype``."""
    empty = _NO_U8 if dtype is np.uint8 else _NO_I64
    return dataclasses.field(default_factory=lambda: empty)


@dataclass
class ChunkStream:
    """The xxh3-64 of a whole chunk read in place, fed its pieces in order as they land.

    ``landed`` maps the offset in the destination of each piece read but not hashed yet to its
    end; ``at`` is where the hash has got to, ``end`` the chunk's end; ``feeding``: a thread is
    feeding it. All under the batch's lock.
    """

    at: int
    end: int
    hasher: Any = dataclasses.field(default_factory=xxhash.xxh3_64)
    landed: dict[int, int] = dataclasses.field(default_factory=dict)
    feeding: bool = False


@dataclass
class Batch:
    """The checks of one batch of reads of one chunk that :meth:`BlockVerifier.check` runs."""

    location: Location
    check: ChunkCheck
    dest: memoryview  # the destination's storage
    # Each array, where the batch has none, is one shared read-only empty array: a batch replaces
    # its arrays, never writes into them.
    dest_offs: np.ndarray = _none(np.int64)  # where each in-place block starts in ``dest``
    dest_blocks: np.ndarray = _none(np.int64)  # its block number
    scratch: np.ndarray = _none(np.uint8)  # the touched blocks read whole, one after the other
    scratch_blocks: np.ndarray = _none(np.int64)  # the block number of each
    # scratch offset, dest offset, length of each piece
    copies: tuple[np.ndarray, np.ndarray, np.ndarray] = dataclasses.field(
        default_factory=lambda: (_NO_I64,) * 3
    )
    # In-place blocks that are consecutive blocks at consecutive offsets (one run: the common case),
    # as (offset in ``dest`` of the first, first block, end block), checked without per-block
    # arrays.
    run: tuple[int, int, int] | None = None
    pieces: int = 0  # segments of ``run`` whose callbacks hash their own blocks
    # The whole chunk read in place (``run`` is all of it): its pieces feed one hash instead.
    stream: ChunkStream | None = None
    left: int = 0  # its segments not read yet
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    checked: bool = False


def _rows(arr: np.ndarray, start: int, count: int, width: int, step: int, what: str) -> np.ndarray:
    """``count`` rows of ``width`` bytes of 1-D ``uint8`` array ``arr``, row ``i`` starting at byte
    ``start + i * step``: one strided view, no copy.

    numpy's ``as_strided`` checks nothing, and a view past the end of ``arr`` reads (or, as a copy's
    destination, writes) memory that is not ``arr``'s; so the rows must lie inside it, or an
    :class:`InvalidArgumentError` names the view (a planning bug, never bad data on disk).
    """
    end = start + (count - 1) * step + width  # the byte just past the last row
    if count < 1 or width < 0 or start < 0 or step < 0 or end > len(arr):
        raise InvalidArgumentError(
            f"{what}: {count} rows of {width} bytes every {step} bytes from byte {start} "
            f"(up to byte {end}) are not inside a buffer of {len(arr)} bytes"
        )
    return as_strided(arr[start:], (count, width), (step, 1))


def _digests(
    mem: memoryview | np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    block: int,
    what: str = "blocks to hash",
) -> np.ndarray:
    """xxh3-64 of ``mem[offs[i] : offs[i] + lens[i]]`` for every ``i`` (``what`` names them in
    errors).

    Blocks of full length at a constant stride (a run, consecutive runs of
    one block, scratch) are hashed as the rows of one strided 2-D view,
    which costs a third less per block than slicing a memoryview for each.
    """
    out = np.empty(len(offs), dtype=np.uint64)
    full = lens == block
    nfull = int(full.sum())
    arr = np.frombuffer(mem, dtype=np.uint8)
    rest = np.ones(len(offs), dtype=bool)
    if nfull:
        fo = offs[full] if nfull < len(offs) else offs
        step = block if nfull == 1 else _arith(fo)
        if step is not None:
            rows = _rows(arr, int(fo[0]), nfull, block, step, what)
            out[full] = _hash_rows(rows)
            rest = ~full
    for i, o, n in zip(np.flatnonzero(rest).tolist(), offs[rest].tolist(), lens[rest].tolist()):
        out[i] = _hash(arr[o : o + n])  # short last blocks, irregular strides
    return out


def _arith(x: np.ndarray) -> int | None:
    """The common step of ``x`` (2+ values: its callers' have more than one) when it is an
    arithmetic progression, else None."""
    step = int(x[1] - x[0])
    return step if step > 0 and bool(np.all(np.diff(x) == step)) else None


# ---------------------------------------------------------------- the verifier

# A batch read in at most this many stretches of the file (its segments closer
# than a page are read by one call) is checked by the I/O thread that
# completes it, while the other threads still read, so that hashing overlaps
# the reads. A batch of more (narrow strided runs, one call each) is checked
# by check() after the reads: a callback per call would cost more than it hides.
_HOOK_STRETCHES = 64
_PAGE = 4096
# Scratch memory is carved out of buffers of at least this size, reused across batches.
_ARENA_BYTES = 1 << 20
# Scratch buffers kept between verifiers, so that the next load reuses their
# pages instead of faulting in fresh ones (a load per tensor, repeated loads).
_POOL_BYTES = 32 << 20
_pool: list[np.ndarray] = []
_pool_lock = threading.Lock()
# A run read in place is cut into pieces of about this size, each hashed by the I/O thread that read
# it right after the read (why this size: rangeio.HOOKED_REQUEST_BYTES).
_PIECE = HOOKED_REQUEST_BYTES


def _take_arena(nbytes: int) -> np.ndarray:
    with _pool_lock:
        for i, a in enumerate(_pool):
            if len(a) >= nbytes:
                return _pool.pop(i)
    return np.empty(max(nbytes, _ARENA_BYTES), dtype=np.uint8)


def _give_arenas(arenas: list[np.ndarray]) -> None:
    with _pool_lock:
        total = sum(len(a) for a in _pool)
        for a in sorted(arenas, key=len, reverse=True):
            if total + len(a) <= _POOL_BYTES:
                _pool.append(a)
                total += len(a)


class BlockVerifier:
    """Checks the blocks that reads of saved chunks touch against their block checksums.

    :meth:`plan` turns the read of a region of a chunk into batches of segments (see the module
    docstring); read each batch with :class:`~ucp_dcp.byteio.rangeio.RangeReader` (any number of
    batches together) and call :meth:`check` once the reads completed. Checking a batch hashes and
    compares every block it touched and copies the bytes read into scratch memory into place. A
    batch read in few stretches of the file is checked by the I/O thread that completes its last
    segment (the read then raises what it found); :meth:`check` checks the others, and frees the
    scratch memory for reuse. :attr:`scratch_bytes` says how much the pending batches hold; a batch
    holds at most about ``scratch_limit``.

    ``bytes`` counts the bytes hashed, ``seconds`` the CPU time spent
    planning, hashing and copying (on every thread).

    Args:
        paths: path of each file number, for errors.
        ranks: writing rank of each file number (None where unknown), for errors.
        scratch_limit: bound on the scratch memory of one batch.
    """

    def __init__(
        self, paths: Sequence[str], ranks: Sequence[int | None], *, scratch_limit: int = 16 << 20
    ) -> None:
        self.paths = paths
        self.ranks = ranks
        self.scratch_limit = max(scratch_limit, 1)
        self.bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # bytes and seconds: runs are checked on I/O threads too
        self._pending: list[Batch] = []
        self._arenas: list[np.ndarray] = []
        self._arena = 0  # the arena being carved
        self._used = 0  # bytes carved out of it
        self.scratch_bytes = 0

    # ------------------------------------------------------------ scratch
    def _scratch(self, nbytes: int) -> np.ndarray:
        while self._arena < len(self._arenas) and self._used + nbytes > len(
            self._arenas[self._arena]
        ):
            self._arena, self._used = self._arena + 1, 0
        if self._arena == len(self._arenas):
            self._arenas.append(_take_arena(nbytes))
        a = self._arenas[self._arena][self._used : self._used + nbytes]
        self._used += nbytes
        self.scratch_bytes += nbytes
        return a

    # ------------------------------------------------------------ planning
    def plan(
        self,
        location: Location,
        check: ChunkCheck,
        chunk_sizes: Sequence[int],
        region: Box,
        dest: torch.Tensor,
        view: memoryview | None = None,
    ) -> Iterator[list[Segment]]:
        """Batches of segments that read ``region`` of a saved chunk into CPU tensor ``dest`` and
        complete every block they touch.

        As :func:`~ucp_dcp.byteio.transfer.segments_into` (``dest`` has the
        region's shape and the saved dtype, ``chunk_sizes`` and ``region``
        are in the chunk's stored order), checked against ``check.sums``.
        Each batch is registered for :meth:`check` when it is yielded.
        """
        t0 = time.thread_time()
        es = dest.element_size()
        if dest.is_contiguous() and not any(region.offsets) and region.sizes == tuple(chunk_sizes):
            # The whole chunk into a contiguous tensor, every read of a same-layout restart: one
            # run, planned without arrays.
            if region.numel:
                view = storage_view(dest) if view is None else view
                at = int(dest.storage_offset()) * es
                batch, segments = self._batch_one(location, check, 0, at, region.numel * es, view)
                self._pending.append(batch)
                self._spent(time.thread_time() - t0)
                yield segments
            return
        grid = runs(chunk_sizes, region, dest.stride(), int(dest.storage_offset()))
        if not grid.count:
            return
        view = storage_view(dest) if view is None else view
        # Ascending: runs() lists them in row-major order of the region, which is row-major in the
        # chunk too.
        src, dst = grid.src * es, grid.dst * es
        length = grid.count * es
        # Each run's edges take at most two scratch blocks.
        bs = check.sums.block
        step = max(1, self.scratch_limit // (2 * bs))
        i = 0
        while i < len(src):
            j = min(i + step, len(src))
            while j < len(src) and (int(src[j - 1]) + length - 1) // bs == int(src[j]) // bs:
                # The next run starts in the block this one ends in: no block is split between
                # batches (it would be read and hashed twice).
                j = max(
                    j + 1,
                    int(np.searchsorted(src, ((int(src[j - 1]) + length - 1) // bs + 1) * bs)),
                )
            if len(src) == 1:  # one contiguous run: the common case, in plain integers
                batch, segments = self._batch_one(
                    location, check, int(src[0]), int(dst[0]), length, view
                )
            else:
                batch, segments = self._batch(location, check, src[i:j], dst[i:j], length, view)
            i = j
            self._pending.append(batch)
            self._spent(time.thread_time() - t0)
            yield segments  # the caller's reads are not ours to count
            t0 = time.thread_time()
        self._spent(time.thread_time() - t0)

    def _batch_one(
        self,
        location: Location,
        check: ChunkCheck,
        start: int,
        at: int,
        length: int,
        view: memoryview,
    ) -> tuple[Batch, list[Segment]]:
        """:meth:`_batch` for a single run ``[start, start + length)`` of the chunk, read into
        ``view`` at ``at``."""
        bs, n, file, base = check.sums.block, location.nbytes, location.file, location.start
        end = start + length
        if start < 0 or end > n:
            raise InvalidArgumentError(f"read [{start}, {end}) outside a chunk of {n} bytes")
        first = min(-(-start // bs) * bs, n)  # the run's whole blocks are [first, last)
        last = n if end == n else end // bs * bs
        batch = Batch(location, check, view)
        done = functools.partial(self._segment_done, batch)
        segments: list[Segment] = []
        # Read through scratch: (start in the chunk, end, offset in view).
        edges: list[tuple[int, int, int]] = []
        if first < last:
            batch.run = (at + first - start, first // bs, -(-last // bs))
            # In pieces (_PIECE), each hashed by the I/O thread that read it, rather than
            # all of it after the last read.
            piece = max(bs, _PIECE // bs * bs)
            for p in range(first, last, piece):
                q = min(p + piece, last)
                off = at + p - start
                segments.append(
                    Segment(
                        file,
                        base + p,
                        view[off : off + q - p],
                        functools.partial(self._piece_done, batch, off, p // bs, -(-q // bs)),
                    )
                )
            batch.pieces = len(segments)
            if start == 0 and end == n and location.xxh3:
                batch.stream = ChunkStream(at, at + n)
            edges += [(start, first, at)] if start < first else []
            edges += [(last, end, at + last - start)] if last < end else []
        else:
            edges.append((start, end, at))
        if edges:
            blocks = sorted({k for s, e, _ in edges for k in (s // bs, (e - 1) // bs)})
            batch.scratch = self._scratch(len(blocks) * bs)
            batch.scratch_blocks = np.array(blocks, dtype=np.int64)
            scratch = batch.scratch.data
            for i, k in enumerate(blocks):
                if i and blocks[i - 1] == k - 1:  # the previous segment already covers it
                    continue
                j = i
                while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
                    j += 1
                stop = min(blocks[j] * bs + bs, n)
                segments.append(
                    Segment(file, base + k * bs, scratch[i * bs : i * bs + stop - k * bs], done)
                )
            pos = {k: i for i, k in enumerate(blocks)}
            so, do, ln = zip(*[(pos[s // bs] * bs + s % bs, d, e - s) for s, e, d in edges])
            batch.copies = (
                np.array(so, dtype=np.int64),
                np.array(do, dtype=np.int64),
                np.array(ln, dtype=np.int64),
            )
        batch.left = len(segments)
        return batch, segments

    def _batch(
        self,
        location: Location,
        check: ChunkCheck,
        a: np.ndarray,
        dst: np.ndarray,
        length: int,
        view: memoryview,
    ) -> tuple[Batch, list[Segment]]:
        bs, n, file, base = check.sums.block, location.nbytes, location.file, location.start
        b = a + length
        if len(a) and (int(a[0]) < 0 or int(b[-1]) > n):
            raise InvalidArgumentError(
                f"read [{int(a[0])}, {int(b[-1])}) outside a chunk of {n} bytes"
            )
        # Block boundaries are the multiples of the block size, and the chunk's end.
        ca = np.minimum(-(-a // bs) * bs, n)  # first boundary at or after each run's start
        fb = np.where(b == n, n, b // bs * bs)  # last boundary at or before its end
        direct = ca < fb  # the run holds whole blocks [ca, fb): read and hash them in place
        head = direct & (a < ca)
        tail = direct & (fb < b)
        whole = ~direct  # no whole block inside: the run goes through scratch
        # Pieces read through scratch: (start in the chunk, end, offset in dest).
        ps = np.concatenate([a[whole], a[head], fb[tail]])
        pe = np.concatenate([b[whole], ca[head], b[tail]])
        pd = np.concatenate([dst[whole], dst[head], dst[tail] + (fb[tail] - a[tail])])
        batch = Batch(location, check, view)
        # In place: one segment per run that holds whole blocks, one hash per block.
        da, dfb, dd = ca[direct], fb[direct], dst[direct] + (ca[direct] - a[direct])
        row, batch.dest_blocks = expand(da // bs, -(-dfb // bs))  # da: a block boundary
        batch.dest_offs = dd[row] + (batch.dest_blocks - da[row] // bs) * bs
        # Through scratch: every block a piece touches, read whole; runs of neighbouring blocks in
        # one segment.
        blocks = (
            np.unique(np.concatenate([ps // bs, (pe - 1) // bs]))
            if len(ps)
            else np.zeros(0, np.int64)
        )
        gs, ge = merge_ranges(blocks * bs, np.minimum(blocks * bs + bs, n))
        g0 = np.searchsorted(blocks, gs // bs)  # where each run of blocks starts in scratch
        done = None
        starts, ends = np.concatenate([da, gs]), np.concatenate([dfb, ge])
        order = np.argsort(starts, kind="stable")
        if int(np.count_nonzero(starts[order][1:] - ends[order][:-1] >= _PAGE)) < _HOOK_STRETCHES:
            done = functools.partial(self._segment_done, batch)
        segments = [
            Segment(file, base + s, view[d : d + e - s], done)
            for s, e, d in zip(da.tolist(), dfb.tolist(), dd.tolist())
        ]
        if len(blocks):
            batch.scratch = self._scratch(len(blocks) * bs)
            batch.scratch_blocks = blocks
            scratch = batch.scratch.data
            segments += [
                Segment(file, base + s, scratch[p : p + e - s], done)
                for s, e, p in zip(gs.tolist(), ge.tolist(), (g0 * bs).tolist())
            ]
            batch.copies = (np.searchsorted(blocks, ps // bs) * bs + ps % bs, pd, pe - ps)
        batch.left = len(segments)
        return batch, segments

    # ------------------------------------------------------------ checking
    def check(self) -> None:
        """Hash and compare every block of the batches planned so far (their reads must have
        completed), then copy their scratch bytes into place; raises :class:`ChecksumError` on the
        first mismatch."""
        if not self._pending:
            return
        try:
            pending, self._pending = self._pending, []
            for batch in pending:
                if not batch.checked:  # read without its callbacks, or a callback failed
                    self._check_now(batch)
        finally:
            self._arena = self._used = self.scratch_bytes = 0

    def close(self) -> None:
        """Hand the scratch memory back for the next verifier; call once no read of this one runs
        any more.

        Memory of batches left unchecked (a read failed) is dropped instead.
        """
        arenas, self._arenas = self._arenas, []
        self._arena = self._used = self.scratch_bytes = 0
        if not self._pending:
            _give_arenas(arenas)
        self._pending = []

    # ------------------------------------------------------------ checking a batch
    def _spent(self, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.seconds += seconds
            self.bytes += nbytes

    def check_span(
        self, check: ChunkCheck, location: Location, mem: np.ndarray, at: int, blocks: np.ndarray
    ) -> None:
        """Hash and compare blocks ``blocks`` (ascending, each once) of the chunk, read whole into
        ``mem``, whose first byte is byte ``at`` of the chunk (a block boundary); raises
        :class:`ChecksumError` on a mismatch.

        For reads that stage a chunk's covering span (:mod:`ucp_dcp.core.spans`) and copy out of it
        afterwards.
        """
        t0 = time.thread_time()
        nbytes = 0
        try:
            if len(blocks):
                bs = check.sums.block
                if (
                    at % bs
                    or int(blocks[0]) * bs < at
                    or min(int(blocks[-1]) * bs + bs, location.nbytes) - at > len(mem)
                ):
                    raise InvalidArgumentError(
                        f"blocks {int(blocks[0])}..{int(blocks[-1])} are not inside the span read "
                        f"at {at}"
                    )
                batch = Batch(location, check, mem.data)
                nbytes = self._compare(batch, mem.data, blocks * bs - at, blocks)
        finally:
            self._spent(time.thread_time() - t0, nbytes)

    def _segment_done(self, batch: Batch, n: int) -> None:
        """``n`` segments of ``batch`` were read (on an I/O thread): check the batch after its last
        one."""
        with batch.lock:
            batch.left -= n
            last = batch.left == 0
        if last:  # every piece of the run was hashed by its own callback
            self._check_now(batch, run_hashed=batch.pieces > 0)

    def _piece_done(self, batch: Batch, off: int, k0: int, k1: int, n: int) -> None:
        """A piece of ``batch``'s run (blocks ``k0 .. k1-1`` at ``dest[off:]``) was read: hash and
        compare it now; the rest of the batch once its last segment is read. A whole chunk's
        pieces go into its one hash instead (:meth:`_feed`)."""
        if batch.stream is not None:
            self._feed(batch, off, min(off + (k1 - k0) * batch.check.sums.block, batch.stream.end))
            return
        t0 = time.thread_time()
        nbytes = self._compare_run(batch, off, k0, k1)  # raising fails the read
        self._spent(time.thread_time() - t0, nbytes)
        self._segment_done(batch, n)

    def _feed(self, batch: Batch, off: int, end: int) -> None:
        """Piece ``dest[off:end]`` of a whole chunk landed: feed the chunk's hash every landed piece
        that is next in order, right after it landed. Pieces land on several I/O
        threads in any order; one thread at a time feeds the hash (each update releases the GIL),
        and a piece that lands meanwhile is left for it. Whoever feeds the last piece compares the
        chunk's digest (:meth:`_check_whole`)."""
        stream = batch.stream
        assert stream is not None
        with batch.lock:
            stream.landed[off] = end
            if stream.feeding:
                return
            stream.feeding = True
        t0 = time.thread_time()
        nbytes = 0
        try:
            while True:
                with batch.lock:
                    at = stream.at
                    stop = stream.landed.pop(at, None)
                    if stop is None:
                        stream.feeding = False
                        return
                stream.hasher.update(batch.dest[at:stop])
                nbytes += stop - at
                stream.at = stop
                if stop == stream.end:
                    self._check_whole(batch, stream.hasher.hexdigest())
                    self._check_now(batch, run_hashed=True)
                    return
        finally:
            self._spent(time.thread_time() - t0, nbytes)

    def _check_whole(self, batch: Batch, got: str) -> None:
        """Compare ``got``, the whole chunk's xxh3-64, with the recorded one. On a mismatch its
        blocks are compared, to name the one that differs (the error a partial read gives);
        blocks that all match under a chunk checksum that does not are reported for the chunk."""
        location = batch.location
        if got != location.xxh3:
            assert batch.run is not None
            self._compare_run(batch, *batch.run)  # raises naming the block, if one differs
            raise chunk_mismatch(
                self.paths, self.ranks, location, batch.check.fqn, batch.check.offsets, got
            )

    def _check_now(self, batch: Batch, run_hashed: bool = False) -> None:
        t0 = time.thread_time()
        nbytes = 0
        try:
            nbytes = self._check(batch, run_hashed)
            batch.checked = True
        finally:
            self._spent(time.thread_time() - t0, nbytes)

    def _mismatch(self, batch: Batch, k: int, want: int, got: int) -> ChecksumError:
        """The error for block ``k`` of the batch's chunk hashing to ``got`` instead of ``want``."""
        location, check = batch.location, batch.check
        bs, n = check.sums.block, location.nbytes
        return ChecksumError(
            self.paths[location.file],
            f"{chunk_what(check.fqn, check.offsets)}, block {k} "
            f"(bytes [{k * bs}, {min(k * bs + bs, n)}) of the chunk)",
            f"{want:016x}",
            f"{got:016x}",
            self.ranks[location.file],
        )

    def _compare_run(self, batch: Batch, off: int, k0: int, k1: int) -> int:
        """Hash blocks ``k0 .. k1-1`` of the batch's chunk, one after the other from
        ``batch.dest[off:]``, and compare; the bytes hashed.

        One pass of the hash over rows of a reshaped view and one comparison
        of the whole run: no per-block offsets, lengths or index arrays. ``k0 < k1``: a run and
        each piece of it hold a whole block at least.
        """
        bs, n = batch.check.sums.block, batch.location.nbytes
        nbytes = min(k1 * bs, n) - k0 * bs
        nfull = nbytes // bs  # only the chunk's last block may be short
        arr = np.frombuffer(batch.dest, dtype=np.uint8, count=nbytes, offset=off)
        got = np.empty(k1 - k0, dtype=np.uint64)
        got[:nfull] = _hash_rows(arr[: nfull * bs].reshape(nfull, bs))
        if nfull < k1 - k0:
            got[nfull] = _hash(arr[nfull * bs :])
        want = batch.check.sums.sums[k0:k1]
        if not np.array_equal(got, want):
            i = int(np.flatnonzero(got != want)[0])
            raise self._mismatch(batch, k0 + i, int(want[i]), int(got[i]))
        return nbytes

    def _compare(self, batch: Batch, mem: memoryview, offs: np.ndarray, blocks: np.ndarray) -> int:
        """Hash block ``blocks[i]`` of the batch's chunk at ``mem[offs[i]:]`` for every ``i`` and
        compare; the bytes hashed."""
        if not len(blocks):
            return 0
        location, check = batch.location, batch.check
        bs, n = check.sums.block, location.nbytes
        if len(blocks) <= _FEW:  # the edges of a run: a loop costs less than the arrays
            sums, nbytes = check.sums.sums, 0
            for o, k in zip(offs.tolist(), blocks.tolist()):
                w = min(bs, n - k * bs)
                digest, recorded = _hash(mem[o : o + w]), int(sums[k])
                if digest != recorded:
                    raise self._mismatch(batch, k, recorded, digest)
                nbytes += w
            return nbytes
        lens = np.minimum(bs, n - blocks * bs)
        got = _digests(mem, offs, lens, bs, f"blocks of {chunk_what(check.fqn, check.offsets)}")
        want = check.sums.sums[blocks]
        bad = np.flatnonzero(got != want)
        if len(bad):
            i = bad[np.argmin(blocks[bad])]
            raise self._mismatch(batch, int(blocks[i]), int(want[i]), int(got[i]))
        return int(lens.sum())

    def _check(self, batch: Batch, run_hashed: bool = False) -> int:
        """Hash and compare the batch's blocks (but for its run when ``run_hashed``: every piece's
        callback did), copy its scratch bytes into place; the bytes hashed."""
        bs = batch.check.sums.block
        nbytes = (
            self._compare_run(batch, *batch.run) if batch.run is not None and not run_hashed else 0
        )
        nbytes += self._compare(batch, batch.dest, batch.dest_offs, batch.dest_blocks)
        if len(batch.scratch_blocks):
            scratch_offs = np.arange(len(batch.scratch_blocks), dtype=np.int64) * bs
            nbytes += self._compare(batch, batch.scratch.data, scratch_offs, batch.scratch_blocks)
            self._copy(batch)
        return nbytes

    @staticmethod
    def _copy(batch: Batch) -> None:
        so, do, ln = batch.copies  # one piece at least: the batch has scratch blocks
        # Few pieces: a slice copy each costs less than finding the strides.
        sstep, dstep = (None, None) if len(so) <= _FEW else (_arith(so), _arith(do))
        if sstep is not None and dstep is not None and bool(np.all(ln == ln[0])):
            # Equal pieces at equal strides (a column slice of rows): one strided copy.
            m, w = len(so), int(ln[0])
            dest = np.frombuffer(batch.dest, dtype=np.uint8)
            what = f"pieces of {chunk_what(batch.check.fqn, batch.check.offsets)} copied"
            np.copyto(
                _rows(dest, int(do[0]), m, w, dstep, f"{what} into the destination"),
                _rows(batch.scratch, int(so[0]), m, w, sstep, f"{what} out of scratch"),
            )
            return
        dview, sview = batch.dest, batch.scratch.data
        for s, d, w in zip(so.tolist(), do.tolist(), ln.tolist()):
            dview[d : d + w] = sview[s : s + w]


def read_verified(
    reader: ByteSource,
    location: Location,
    chunk_sizes: Sequence[int],
    region: Box,
    dest: torch.Tensor,
    check: ChunkCheck,
    view: memoryview | None = None,
) -> None:
    """Read ``region`` of a saved chunk into CPU tensor ``dest`` now, checking every block the read
    touches."""
    v = check.verifier
    for segments in v.plan(location, check, chunk_sizes, region, dest, view):
        reader.read(segments)
        v.check()
