"""Block checksums: an xxh3-64 of every fixed-size block of every tensor chunk.

A chunk's whole-entry xxh3-64 can only be checked by a read of the whole
chunk, and a resharding load reads parts of chunks. So every data file also
records the xxh3-64 of each ``block`` bytes of each tensor chunk (blocks
start at the chunk's first byte; the last may be shorter), and a load checks
exactly the blocks its reads touch:

* :class:`BlockHasher` computes them while :class:`~ucp_dcp.byteio.datafile.DataFileWriter`
  writes the chunk, in pieces of any size.
* :class:`BlockVerifier` turns a read of a region of a chunk into segments
  for :class:`~ucp_dcp.byteio.rangeio.RangeReader` such that every block the
  read touches is complete in memory once the read is done: a block that
  lies inside one contiguous run of the destination is read in place and
  hashed there; any other touched block (the edges of a run, or a block
  holding several narrow runs) is read whole into scratch memory, hashed
  there, and the bytes the load needs are copied into place. The scratch
  reads sit next to the destination reads in the file, so the range reader
  coalesces them into the same ``preadv`` calls, and with 4 KiB blocks
  starting on page boundaries they read no page the load did not need.

A mismatch raises :class:`~ucp_dcp.ChecksumError` naming the file, the
tensor, the chunk, the block and the writing rank.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import xxhash
from numpy.lib.stride_tricks import as_strided

from ..core.sharding import Box, runs
from ..errors import ChecksumError
from ..format import Location
from .integrity import chunk_what
from .rangeio import RangeReader, Segment, storage_view

__all__ = ["BlockSums", "BlockHasher", "BlockVerifier", "ChunkCheck", "read_verified"]

_hash = xxhash.xxh3_64_intdigest
# A run holding at least this many whole blocks is checked by the I/O thread
# that read it, right after the read, while other threads still read.
_HOOK_BLOCKS = 64
# Scratch memory is carved out of buffers of at least this size, reused across batches.
_ARENA_BYTES = 1 << 20


@dataclass(frozen=True, eq=False)
class BlockSums:
    """The recorded xxh3-64 of every ``block`` bytes of one saved chunk (``sums[k]``: block ``k``)."""

    block: int
    sums: np.ndarray  # uint64, ceil(nbytes / block) of them


class BlockHasher:
    """The xxh3-64 of every ``block`` bytes of an ``nbytes``-long stream fed to :meth:`update` in pieces of any size."""

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
            self.sums[self._k] = self._partial.intdigest()
            self._k, self._fill, self._partial = self._k + 1, 0, None
        full = (n - off) // b
        if full:
            self.sums[self._k : self._k + full] = np.fromiter(
                (_hash(view[o : o + b]) for o in range(off, off + full * b, b)), np.uint64, full
            )
            self._k += full
            off += full * b
        if off < n:
            self._partial = xxhash.xxh3_64(view[off:])
            self._fill = n - off

    def digests(self) -> np.ndarray:
        """Every block's digest (call once the whole stream was fed)."""
        if self._fill:
            assert self._partial is not None
            self.sums[self._k] = self._partial.intdigest()
            self._k, self._fill, self._partial = self._k + 1, 0, None
        if self._k != len(self.sums):
            raise ValueError(f"block hasher fed {self._k} of {len(self.sums)} blocks")
        return self.sums


@dataclass(frozen=True)
class _Chunk:
    """The chunk a read checks: where it is, its block checksums, its name for errors."""

    location: Location
    sums: BlockSums
    fqn: str
    offsets: tuple[int, ...]


@dataclass
class _Batch:
    """The checks of one batch of reads of one chunk that :meth:`BlockVerifier.check` runs."""

    chunk: _Chunk
    dest: memoryview  # the destination's storage
    dest_offs: np.ndarray  # where each in-place block starts in ``dest``
    dest_blocks: np.ndarray  # its block number
    scratch: np.ndarray  # the touched blocks read whole, one after the other
    scratch_blocks: np.ndarray  # the block number of each
    copies: tuple[np.ndarray, np.ndarray, np.ndarray]  # scratch offset, dest offset, length of each piece


def _arith(x: np.ndarray) -> int | None:
    """The common step of ``x`` when it is an arithmetic progression of 2+ values, else None."""
    if len(x) < 2:
        return None
    step = int(x[1] - x[0])
    return step if step > 0 and bool(np.all(np.diff(x) == step)) else None


class BlockVerifier:
    """Checks the blocks that reads of saved chunks touch against their block checksums.

    :meth:`plan` turns the read of a region of a chunk into batches of
    segments (see the module docstring); read each batch (any number of
    batches together) and call :meth:`check` once the reads completed: it
    hashes every block the batches touched, compares, and copies the bytes
    read into scratch memory into their destinations. Scratch memory is
    reused across batches; :attr:`scratch_bytes` says how much the pending
    batches hold, and a batch holds at most about ``scratch_limit`` bytes.

    ``bytes`` counts the bytes hashed, ``seconds`` the time spent planning,
    hashing and copying.

    Args:
        paths: path of each file number, for errors.
        ranks: writing rank of each file number (None where unknown), for errors.
        scratch_limit: bound on the scratch memory of one batch.
    """

    def __init__(self, paths: Sequence[str], ranks: Sequence[int | None], *, scratch_limit: int = 16 << 20) -> None:
        self.paths = paths
        self.ranks = ranks
        self.scratch_limit = max(scratch_limit, 1)
        self.bytes = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # bytes and seconds: runs are checked on I/O threads too
        self._pending: list[_Batch] = []
        self._arenas: list[np.ndarray] = []
        self._arena = 0  # the arena being carved
        self._used = 0  # bytes carved out of it
        self.scratch_bytes = 0

    # ------------------------------------------------------------ scratch
    def _scratch(self, nbytes: int) -> np.ndarray:
        while self._arena < len(self._arenas) and self._used + nbytes > len(self._arenas[self._arena]):
            self._arena, self._used = self._arena + 1, 0
        if self._arena == len(self._arenas):
            self._arenas.append(np.empty(max(nbytes, _ARENA_BYTES), dtype=np.uint8))
        a = self._arenas[self._arena][self._used : self._used + nbytes]
        self._used += nbytes
        self.scratch_bytes += nbytes
        return a

    # ------------------------------------------------------------ planning
    def plan(
        self,
        location: Location,
        sums: BlockSums,
        fqn: str,
        offsets: Sequence[int],
        chunk_sizes: Sequence[int],
        region: Box,
        dest: torch.Tensor,
        view: memoryview | None = None,
    ) -> Iterator[list[Segment]]:
        """Batches of segments that read ``region`` of a saved chunk into CPU tensor ``dest`` and complete every block they touch.

        As :func:`~ucp_dcp.byteio.transfer.segments_into` (``dest`` has the
        region's shape and the saved dtype, ``chunk_sizes`` and ``region``
        are in the chunk's stored order); ``fqn`` and ``offsets`` name the
        chunk in errors. Each batch is registered for :meth:`check` when it
        is yielded.
        """
        t0: float | None = time.perf_counter()
        es = dest.element_size()
        grid = runs(chunk_sizes, region, dest.stride(), dest.storage_offset())
        if not grid.count:
            return
        view = storage_view(dest) if view is None else view
        src, dst = grid.src * es, grid.dst * es
        length = grid.count * es
        if len(src) > 1 and not bool(np.all(np.diff(src) > 0)):
            order = np.argsort(src, kind="stable")
            src, dst = src[order], dst[order]
        # Each run's edges take at most two scratch blocks.
        step = max(1, self.scratch_limit // (2 * sums.block))
        chunk = _Chunk(location, sums, fqn, tuple(offsets))
        try:
            for i in range(0, len(src), step):
                batch, segments = self._batch(chunk, src[i : i + step], dst[i : i + step], length, view)
                self._pending.append(batch)
                self._spent(time.perf_counter() - t0)
                t0 = None  # the caller's reads are not ours
                yield segments
                t0 = time.perf_counter()
        finally:
            if t0 is not None:
                self._spent(time.perf_counter() - t0)

    def _spent(self, seconds: float, nbytes: int = 0) -> None:
        with self._lock:
            self.seconds += seconds
            self.bytes += nbytes

    def _batch(
        self, chunk: _Chunk, a: np.ndarray, dst: np.ndarray, length: int, view: memoryview,
    ) -> tuple[_Batch, list[Segment]]:
        bs, n, file, base = chunk.sums.block, chunk.location.nbytes, chunk.location.file, chunk.location.start
        b = a + length
        if len(a) and (int(a[0]) < 0 or int(b[-1]) > n):
            raise ValueError(f"read [{int(a[0])}, {int(b[-1])}) outside a chunk of {n} bytes")
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
        segments: list[Segment] = []
        # In place: one segment per run that holds whole blocks, one hash per block. A run of
        # many blocks is checked by the I/O thread that reads it; the others by check().
        da, dfb, dd = ca[direct], fb[direct], dst[direct] + (ca[direct] - a[direct])
        cnt = -(-(dfb - da) // bs)
        big = cnt >= _HOOK_BLOCKS
        if big.any():
            segments += [
                Segment(file, base + s, view[d : d + e - s], functools.partial(self._check_run, chunk, view, d, s, e))
                for s, e, d in zip(da[big].tolist(), dfb[big].tolist(), dd[big].tolist())
            ]
            small = ~big
            da, dfb, dd, cnt = da[small], dfb[small], dd[small], cnt[small]
        segments += [Segment(file, base + s, view[d : d + e - s]) for s, e, d in zip(da.tolist(), dfb.tolist(), dd.tolist())]
        total = int(cnt.sum())
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        j = np.arange(total, dtype=np.int64) - first
        dest_blocks = np.repeat(da // bs, cnt) + j
        dest_offs = np.repeat(dd, cnt) + j * bs
        # Through scratch: every block a piece touches, read whole; runs of neighbouring blocks in one segment.
        if len(ps):
            blocks = np.unique(np.concatenate([ps // bs, (pe - 1) // bs]))
        else:
            blocks = np.zeros(0, dtype=np.int64)
        scratch_a = np.zeros(0, dtype=np.uint8)
        copies = (np.zeros(0, np.int64),) * 3
        if len(blocks):
            scratch_a = self._scratch(len(blocks) * bs)
            scratch = memoryview(scratch_a)
            cuts = np.flatnonzero(np.diff(blocks) != 1) + 1
            g0 = np.concatenate([[0], cuts])
            g1 = np.concatenate([cuts, [len(blocks)]])
            starts = blocks[g0] * bs
            ends = np.minimum(blocks[g1 - 1] * bs + bs, n)
            segments += [Segment(file, base + s, scratch[p : p + e - s])
                         for s, e, p in zip(starts.tolist(), ends.tolist(), (g0 * bs).tolist())]
            so = np.searchsorted(blocks, ps // bs) * bs + ps % bs
            copies = (so, pd, pe - ps)
        batch = _Batch(chunk, view, dest_offs, dest_blocks, scratch_a, blocks, copies)
        return batch, segments

    # ------------------------------------------------------------ checking
    def check(self) -> None:
        """Hash and compare every block of the batches planned so far (their reads must have completed),
        then copy their scratch bytes into place; raises :class:`ChecksumError` on the first mismatch."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        nbytes = 0
        try:
            pending, self._pending = self._pending, []
            for batch in pending:
                nbytes += self._check(batch)
        finally:
            self._arena = self._used = self.scratch_bytes = 0
            self._spent(time.perf_counter() - t0, nbytes)

    def _check_run(self, chunk: _Chunk, mem: memoryview, at: int, start: int, end: int) -> None:
        """The whole blocks ``[start, end)`` of ``chunk``, read into ``mem`` at ``at`` (on an I/O thread)."""
        t0 = time.perf_counter()
        bs = chunk.sums.block
        blocks = np.arange(start // bs, -(-end // bs), dtype=np.int64)
        self._spent(time.perf_counter() - t0, self._compare(chunk, mem, at + (blocks * bs - start), blocks))

    def _compare(self, chunk: _Chunk, mem: memoryview, offs: np.ndarray, blocks: np.ndarray) -> int:
        """Hash block ``blocks[i]`` of ``chunk`` at ``mem[offs[i]:]`` for every ``i`` and compare; the bytes hashed."""
        if not len(blocks):
            return 0
        bs, n = chunk.sums.block, chunk.location.nbytes
        ends = offs + np.minimum(bs, n - blocks * bs)
        got = np.fromiter((_hash(mem[o:e]) for o, e in zip(offs.tolist(), ends.tolist())), np.uint64, len(blocks))
        want = chunk.sums.sums[blocks]
        bad = np.flatnonzero(got != want)
        if len(bad):
            i = bad[np.argmin(blocks[bad])]
            k = int(blocks[i])
            raise ChecksumError(
                self.paths[chunk.location.file],
                f"{chunk_what(chunk.fqn, chunk.offsets)}, block {k} (bytes [{k * bs}, {min(k * bs + bs, n)}) "
                "of the chunk)",
                f"{int(want[i]):016x}", f"{int(got[i]):016x}", self.ranks[chunk.location.file],
            )
        return int((ends - offs).sum())

    def _check(self, batch: _Batch) -> int:
        bs = batch.chunk.sums.block
        nbytes = self._compare(batch.chunk, batch.dest, batch.dest_offs, batch.dest_blocks)
        scratch_offs = np.arange(len(batch.scratch_blocks), dtype=np.int64) * bs
        nbytes += self._compare(batch.chunk, memoryview(batch.scratch), scratch_offs, batch.scratch_blocks)
        self._copy(batch)
        return nbytes

    @staticmethod
    def _copy(batch: _Batch) -> None:
        so, do, ln = batch.copies
        if not len(so):
            return
        sstep, dstep = _arith(so), _arith(do)
        if sstep is not None and dstep is not None and bool(np.all(ln == ln[0])):
            # Equal pieces at equal strides (a column slice of rows): one strided copy.
            m, w = len(so), int(ln[0])
            dest = np.frombuffer(batch.dest, dtype=np.uint8)
            np.copyto(as_strided(dest[int(do[0]) :], (m, w), (dstep, 1)),
                      as_strided(batch.scratch[int(so[0]) :], (m, w), (sstep, 1)))
            return
        dview, sview = batch.dest, memoryview(batch.scratch)
        for s, d, w in zip(so.tolist(), do.tolist(), ln.tolist()):
            dview[d : d + w] = sview[s : s + w]


@dataclass(frozen=True)
class ChunkCheck:
    """How reads of one saved chunk are checked: by ``verifier``, against ``sums``; ``fqn``/``offsets`` name it."""

    verifier: BlockVerifier
    sums: BlockSums
    fqn: str
    offsets: tuple[int, ...]


def read_verified(
    reader: RangeReader,
    location: Location,
    chunk_sizes: Sequence[int],
    region: Box,
    dest: torch.Tensor,
    check: ChunkCheck,
    view: memoryview | None = None,
) -> None:
    """Read ``region`` of a saved chunk into CPU tensor ``dest`` now, checking every block the read touches."""
    v = check.verifier
    for segments in v.plan(location, check.sums, check.fqn, check.offsets, chunk_sizes, region, dest, view):
        reader.read(segments)
        v.check()
