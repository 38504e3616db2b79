"""The chunk-read engine: regions of saved chunks read into destination tensors, checked.

Every read of tensor data goes through one :class:`ChunkReads` (the DCP reader, the single-process
:class:`~ucp_dcp.tools.checkpoint.Checkpoint`, ``convert``), over the
:class:`~ucp_dcp.byteio.rangeio.ByteSource` it is made with (local files, object storage: another
source of bytes plugs in there, with no change here). Region by region it reads either

* **direct**: segments into the destination's own memory, batched across regions into one
  :meth:`ByteSource.read <ucp_dcp.byteio.rangeio.ByteSource.read>` per batch; or
* **staged**: a cast, a device destination, another stored dimension order, or a region cheaper
  read as covering spans (:func:`~ucp_dcp.core.spans.prefer_span`), read at
  :meth:`~ChunkReads.flush` through one :class:`~ucp_dcp.byteio.transfer.StagingBuffers`.

With ``verify`` every byte read is checked before the region's callback runs
(:class:`~ucp_dcp.byteio.blocksums.BlockVerifier`; a chunk without block checksums:
:class:`~ucp_dcp.byteio.integrity.ChunkVerifier`). See docs/resharding.md ("Exact reads",
"Verified loads").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .blocksums import BlockSums, BlockVerifier, ChunkCheck
from .integrity import HASH_BLOCK, ChunkVerifier
from .rangeio import ByteSource
from .segments import Segment
from .transfer import (
    ChunkRegion,
    StagingBuffers,
    check_writable,
    needs_staging,
    segments_into,
    spanned,
    staging_plan,
)

__all__ = ["ChunkReads", "ReadTotals", "Region"]

# Direct segments are read once this many are pending: bounds the bookkeeping memory (a strided
# load makes tens of thousands of short segments), not just the data.
MAX_PENDING_SEGMENTS = 16384


@dataclass
class ReadTotals:
    """What a :class:`ChunkReads` did so far.

    ``regions`` added, ``staged`` of them read through staging memory;
    ``calls``/``bytes``: what its byte source was asked for (gaps included),
    since the engine was made; ``verified_bytes``/``verify_seconds``: bytes
    hashed to check reads, and the time spent doing it.
    """

    regions: int = 0
    staged: int = 0
    calls: int = 0
    bytes: int = 0
    verified_bytes: int = 0
    verify_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Region:
    """A region of a saved chunk to read: ``part`` into ``dest`` (the region's shape). ``name`` and
    ``chunk_offsets`` (the chunk's offsets in the tensor) name the chunk in errors; ``sums``: its
    block checksums (None: nothing to check block by block); ``done`` runs once ``dest`` holds
    the checked bytes (in a read-once load, once every rank succeeded). What
    :meth:`ChunkReads.add` stages, and what a read-once load's
    :class:`~ucp_dcp.dcp.read_once.exchange.LocalNeeds` fill."""

    part: ChunkRegion
    dest: torch.Tensor
    name: str
    chunk_offsets: tuple[int, ...]
    sums: BlockSums | None
    done: Callable[[], None] | None


class ChunkReads:
    """Reads regions of saved chunks from ``source`` into destination tensors (see the module).

    Args:
        source: where the files' bytes come from; the caller owns it (it is
            not closed here).
        paths: path of each file number, for errors.
        ranks: writing rank of each file number (None where unknown), for errors.
        verify: check the bytes read against the checksums recorded at save.
        max_buffer_bytes: bound on the staging memory; with ``scratch_in_buffer``
            and ``verify`` it also holds the block verifier's scratch memory
            (16 MiB), when it is at least twice that.
        reread_block: largest block read at once when a chunk is read again
            to check its whole checksum.

    Use as a context manager, or call :meth:`close`, which does not read
    what is pending (call :meth:`flush` first).
    """

    def __init__(
        self,
        source: ByteSource,
        paths: Sequence[str],
        ranks: Sequence[int | None],
        *,
        verify: bool = True,
        max_buffer_bytes: int = 64 << 20,
        scratch_in_buffer: bool = True,
        reread_block: int = HASH_BLOCK,
    ) -> None:
        self.source = source
        self.verify = verify
        self.blocks = BlockVerifier(paths, ranks) if verify else None
        self.chunks = ChunkVerifier(source, paths, ranks, block=reread_block) if verify else None
        self.staging_bytes = max_buffer_bytes
        if scratch_in_buffer and self.blocks is not None:
            if max_buffer_bytes >= 2 * self.blocks.scratch_limit:
                self.staging_bytes -= self.blocks.scratch_limit
        self._segments: list[Segment] = []
        self._done: list[Callable[[], None]] = []
        self._staged: list[tuple[Region, ChunkCheck | None]] = []
        self._regions = 0
        self._n_staged = 0
        self._start = (source.stats.calls, source.stats.bytes)

    # ------------------------------------------------------------ adding
    def add(
        self,
        part: ChunkRegion,
        dest: torch.Tensor,
        *,
        name: str,
        chunk_offsets: tuple[int, ...],
        sums: BlockSums | None = None,
        done: Callable[[], None] | None = None,
    ) -> None:
        """Read ``part`` into ``dest`` (the region's shape; any dtype, device, strides).

        ``name`` and ``chunk_offsets`` (the chunk's offsets in the tensor)
        name the chunk in a :class:`~ucp_dcp.ChecksumError`; ``sums``: the
        chunk's block checksums (None: none recorded, or not verifying);
        ``done()`` runs once ``dest`` holds the checked bytes (a CUDA
        destination may still be receiving them on its current stream).
        Direct reads may run here already; staged ones run at :meth:`flush`.
        """
        check_writable(dest, name)
        self._regions += 1
        check = None
        if self.blocks is not None and sums is not None:
            check = ChunkCheck(self.blocks, sums, name, chunk_offsets)
        if needs_staging(dest, part.dtype, part.location) or spanned(self.source, part, dest):
            self._staged.append((Region(part, dest, name, chunk_offsets, sums, done), check))
            return
        if check is not None:
            verifier = check.verifier
            loc, sizes, region = part.location, part.chunk_sizes, part.region
            for batch in verifier.plan(loc, check, sizes, region, dest):
                self._segments.extend(batch)
                if verifier.scratch_bytes >= verifier.scratch_limit:
                    self._read_direct()  # bound the scratch memory (this region is done later)
        else:
            if self.chunks is not None:
                # The destination holds exactly the chunk's bytes after the read: hash it there.
                # Otherwise the chunk is read again.
                whole = dest if part.whole and dest.is_contiguous() else None
                self.chunks.add(part.location, name, chunk_offsets, whole)
            self._segments.extend(segments_into(part.location, part.chunk_sizes, part.region, dest))
        if done is not None:
            self._done.append(done)
        if len(self._segments) >= MAX_PENDING_SEGMENTS:
            self._read_direct()

    def check_chunk(self, part: ChunkRegion, name: str, chunk_offsets: tuple[int, ...]) -> None:
        """Check the whole chunk ``part`` belongs to against its recorded checksum now (reading it
        again), once per engine; nothing without ``verify`` or without a checksum."""
        if self.chunks is not None:
            self.chunks.add(part.location, name, chunk_offsets)
            self.chunks.check()  # right after a read of it: its pages are likely still cached

    # ------------------------------------------------------------ reading
    def flush(self) -> None:
        """Read everything added so far, check it, and run the callbacks."""
        self._read_direct()
        self._read_staged()  # one StagingBuffers per flush; it allocates only for staged regions

    def _read_direct(self) -> None:
        segments, self._segments = self._segments, []
        done, self._done = self._done, []
        self.source.read(segments)
        # Before the callbacks: they may move the data on.
        if self.blocks is not None:
            self.blocks.check()  # also copies the edges of reads from scratch into place
        if self.chunks is not None:
            self.chunks.check()
        for fn in done:
            fn()

    def _read_staged(self) -> None:
        staged, self._staged = self._staged, []
        self._n_staged += len(staged)
        # How each region is read (as spans or slab by slab), decided once, and the staging it
        # takes: one buffer for all of them, sized for the largest.
        plans = [
            staging_plan(self.source, r.part, r.dest, check.sums.block if check else 0)
            for r, check in staged
        ]
        largest = max((nbytes for _, nbytes in plans), default=0)
        with StagingBuffers(self.staging_bytes, largest_bytes=largest) as staging:
            for (r, check), (span, _) in zip(staged, plans):
                # With block checksums, every slab is checked in the staging buffer.
                staging.read(self.source, r.part, r.dest, check, span)
                if r.done is not None:
                    r.done()
                if check is None:  # a cast or device copy: the chunk is read again
                    self.check_chunk(r.part, r.name, r.chunk_offsets)

    # ------------------------------------------------------------ totals, lifetime
    @property
    def stats(self) -> ReadTotals:
        """What this engine read and checked so far."""
        verified = [v for v in (self.blocks, self.chunks) if v is not None]
        return ReadTotals(
            regions=self._regions,
            staged=self._n_staged,
            calls=self.source.stats.calls - self._start[0],
            bytes=self.source.stats.bytes - self._start[1],
            verified_bytes=sum(v.bytes for v in verified),
            verify_seconds=sum(v.seconds for v in verified),
        )

    def close(self) -> None:
        """Drop what is pending and hand the verifier's scratch memory back (the source stays
        open)."""
        self._segments, self._done, self._staged = [], [], []
        if self.blocks is not None:
            self.blocks.close()

    def __enter__(self) -> ChunkReads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
