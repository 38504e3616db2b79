"""Verified reads: plan reads of chunk regions so that every block they touch is checked.

Every data file records the xxh3-64 of every block of every tensor chunk
(:mod:`~ucp_dcp.byteio.integrity`), and a load checks exactly the blocks its
reads touch:

:class:`BlockVerifier` turns a read of a region of a chunk into segments
for :class:`~ucp_dcp.byteio.rangeio.RangeReader` such that every block the
read touches is complete in memory once the read is done: a block that
lies inside one contiguous run of the destination is read in place and
hashed there; any other touched block (the edges of a run, or a block
holding several narrow runs) is read whole into scratch memory, hashed
there, and the bytes the load needs are copied into place. The scratch
reads sit next to the destination reads in the file, so the range reader
coalesces them into the same ``preadv`` calls, and with 4 KiB blocks
starting on page boundaries they read no page the load did not need.
A long run read in place is cut into pieces of about 1 MiB, each hashed by
the I/O thread that reads it; a whole chunk read in place feeds its pieces
to one streaming hash of the chunk. Other batches whose reads take few
``preadv`` calls (neighbouring rows) are checked by the I/O thread that
completes their last segment, while the other threads still read; the rest
after the reads.

The checking itself (hashing, comparing, copying scratch into place) is
:mod:`~ucp_dcp.byteio.blockcheck`, this verifier's base class. A mismatch
raises :class:`~ucp_dcp.ChecksumError` naming the file, the tensor, the
chunk, the block and the writing rank.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..core.boxes import runs
from ..core.sharding import Box
from ..errors import InvalidArgumentError
from ..format import Location
from .blockcheck import Batch, BlockChecks, ChunkCheck, ChunkStream
from .rangeio import HOOKED_REQUEST_BYTES, ByteSource, storage_view
from .segments import Segment

__all__ = ["BlockVerifier", "read_verified"]


# ---------------------------------------------------------------- planning the reads

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
# it right after the read, while it is still in the CPU's cache (see rangeio.HOOKED_REQUEST_BYTES).
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


class BlockVerifier(BlockChecks):
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
        src, dst = grid.src * es, grid.dst * es
        length = grid.count * es
        if len(src) > 1 and not bool(np.all(np.diff(src) > 0)):
            order = np.argsort(src, kind="stable")
            src, dst = src[order], dst[order]
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
        edges: list[
            tuple[int, int, int]
        ] = []  # through scratch: (start in the chunk, end, offset in view)
        if first < last:
            batch.run = (at + first - start, first // bs, -(-last // bs))
            # In pieces, each hashed by the I/O thread that read it while it is
            # still in the CPU's cache (the reader keeps requests that carry
            # callbacks near this size), rather than all of it after the last read.
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
        cnt = -(-(dfb - da) // bs)
        total = int(cnt.sum())
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        j = np.arange(total, dtype=np.int64) - first
        batch.dest_blocks = np.repeat(da // bs, cnt) + j
        batch.dest_offs = np.repeat(dd, cnt) + j * bs
        # Through scratch: every block a piece touches, read whole; runs of neighbouring blocks in
        # one segment.
        blocks = (
            np.unique(np.concatenate([ps // bs, (pe - 1) // bs]))
            if len(ps)
            else np.zeros(0, np.int64)
        )
        cuts = np.flatnonzero(np.diff(blocks) != 1) + 1
        g0 = np.concatenate([[0], cuts]).astype(np.int64) if len(blocks) else np.zeros(0, np.int64)
        g1 = (
            np.concatenate([cuts, [len(blocks)]]).astype(np.int64)
            if len(blocks)
            else np.zeros(0, np.int64)
        )
        gs, ge = blocks[g0] * bs, np.minimum(blocks[g1 - 1] * bs + bs, n)
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
    assert isinstance(v, BlockVerifier), "a check made by another verifier plans no reads"
    for segments in v.plan(location, check, chunk_sizes, region, dest, view):
        reader.read(segments)
        v.check()
