"""Checking verified reads: the blocks a batch of reads touched, hashed against their checksums.

:class:`~ucp_dcp.byteio.blockverify.BlockVerifier` plans reads of chunk regions as batches
(:class:`Batch`); this module checks them once their bytes are in memory (:class:`BlockChecks`,
the verifier's base): every block read in place is hashed where it landed, the blocks read into
scratch memory are hashed there and the bytes the load needs copied into place. A long run read
in place is hashed piece by piece by the I/O thread that read each piece, while the piece is
still in the CPU cache; a whole chunk read in place feeds its pieces, in order as they land, to
one streaming hash of the chunk (:class:`ChunkStream`) compared with the chunk's recorded xxh3-64
(a call per piece, which releases the GIL, where its blocks take a call each that holds it), and
only on a mismatch are its blocks compared, to name the one that differs.

A mismatch raises :class:`~ucp_dcp.ChecksumError` naming the file, the tensor, the chunk, the
block and the writing rank.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from ..errors import ChecksumError, InvalidArgumentError
from ..format import Location
from .integrity import BlockSums, _hash_array, chunk_what

__all__ = ["ChunkCheck", "Batch", "BlockChecks", "ChunkStream"]


@dataclass(frozen=True)
class ChunkCheck:
    """How reads of one saved chunk are checked: by ``verifier``, against ``sums``;
    ``fqn``/``offsets`` name it."""

    verifier: BlockChecks
    sums: BlockSums
    fqn: str
    offsets: tuple[int, ...]


_hash = xxhash.xxh3_64_intdigest
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
            out[full] = np.fromiter(map(_hash_array, rows), np.uint64, nfull)
            rest = ~full
    for i, o, n in zip(np.flatnonzero(rest).tolist(), offs[rest].tolist(), lens[rest].tolist()):
        out[i] = _hash_array(arr[o : o + n])  # short last blocks, irregular strides
    return out


def _arith(x: np.ndarray) -> int | None:
    """The common step of ``x`` when it is an arithmetic progression of 2+ values, else None."""
    if len(x) < 2:
        return None
    step = int(x[1] - x[0])
    return step if step > 0 and bool(np.all(np.diff(x) == step)) else None


class BlockChecks:
    """The checking methods of :class:`~ucp_dcp.byteio.blockverify.BlockVerifier`, which sets
    these attributes."""

    paths: Sequence[str]
    ranks: Sequence[int | None]
    bytes: int
    seconds: float
    _lock: threading.Lock

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
        with batch.lock:
            batch.left -= n
            last = batch.left == 0
        self._spent(time.thread_time() - t0, nbytes)
        if last:
            self._check_now(batch, run_hashed=True)

    def _feed(self, batch: Batch, off: int, end: int) -> None:
        """Piece ``dest[off:end]`` of a whole chunk landed: feed the chunk's hash every landed piece
        that is next in order, while it is still in the CPU's cache. Pieces land on several I/O
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
            raise ChecksumError(
                self.paths[location.file],
                chunk_what(batch.check.fqn, batch.check.offsets),
                str(location.xxh3),
                got,
                self.ranks[location.file],
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
        of the whole run: no per-block offsets, lengths or index arrays.
        """
        if k0 >= k1:
            return 0
        bs, n = batch.check.sums.block, batch.location.nbytes
        nbytes = min(k1 * bs, n) - k0 * bs
        nfull = nbytes // bs  # only the chunk's last block may be short
        arr = np.frombuffer(batch.dest, dtype=np.uint8, count=nbytes, offset=off)
        if nfull == k1 - k0:
            got = np.fromiter(map(_hash_array, arr.reshape(nfull, bs)), np.uint64, nfull)
        else:
            got = np.empty(k1 - k0, dtype=np.uint64)
            got[:nfull] = np.fromiter(
                map(_hash_array, arr[: nfull * bs].reshape(nfull, bs)), np.uint64, nfull
            )
            got[nfull] = _hash_array(arr[nfull * bs :])
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
        so, do, ln = batch.copies
        if not len(so):
            return
        if len(so) <= _FEW:
            dview, sview = batch.dest, batch.scratch.data
            for s, d, w in zip(so.tolist(), do.tolist(), ln.tolist()):
                dview[d : d + w] = sview[s : s + w]
            return
        sstep, dstep = _arith(so), _arith(do)
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
