"""The native format: a ``ucp_index.json`` plus safetensors data files with per-entry checksums."""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from ..byteio.blocksums import BlockSums
from ..errors import CheckpointFormatError, ChecksumError
from ..format import INDEX_FILE, FileHeader, Location, chunk_entry_name, has_block_sums, load_index, read_header
from .base import Source, SourceOptions, register

__all__ = ["NativeSource"]


@register
class NativeSource(Source):
    """A universal checkpoint written by :class:`~ucp_dcp.UCPStorageWriter`.

    Explicit index entries carry their location; compact ones name only the
    file, and the byte range comes from that file's header, read once per
    file and only for the files this process actually reads from.
    """

    format = "ucp_dcp"
    checksums = True

    def __init__(self, path: str) -> None:
        index = load_index(path)
        super().__init__(path, index, [os.path.join(path, f.name) for f in index.files])
        self._headers: dict[int, FileHeader] = {}
        # Per file: (block size, every block checksum, first checksum of the entry at each offset), or None.
        self._block_sums: dict[int, tuple[int, np.ndarray, dict[int, int]] | None] = {}
        self._lock = threading.Lock()
        self._sums_lock = threading.Lock()  # not _lock: reading the sums reads the header

    @classmethod
    def detect(cls, path: str) -> bool:
        """A directory holding ``ucp_index.json``."""
        return os.path.isfile(os.path.join(path, INDEX_FILE))

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "NativeSource":
        """Read and validate the index (no data file is opened yet)."""
        return cls(path)

    def header(self, file: int) -> FileHeader:
        """Parsed header of data file ``file``; checks its size against the index."""
        h = self._headers.get(file)
        if h is None:
            with self._lock:
                h = self._headers.get(file)
                if h is None:
                    h = read_header(self.paths[file])
                    rec = self.index.files[file]
                    if h.size != rec.size:
                        raise CheckpointFormatError(
                            f"{self.paths[file]}: {h.size} bytes on disk but the index recorded {rec.size}: "
                            "the file was truncated or replaced after the checkpoint was committed"
                        )
                    self._headers[file] = h
        return h

    def locate(self, fqn: str, idx: int) -> Location:
        """From the index (explicit chunk lists) or from the data file's header (compact ones)."""
        rec = self.index.tensors[fqn]
        if not rec.compact:
            return super().locate(fqn, idx)
        box = self.box(fqn, idx)
        file = rec.files[idx]
        h = self.header(file)
        name = chunk_entry_name(fqn, box.offsets)
        try:
            start, nbytes = h.ranges[name]
            meta = h.meta[name]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.paths[file]}: the index says it holds chunk {name!r} of {fqn!r}, but it does not"
            ) from None
        want = box.numel * rec.dtype.itemsize
        if nbytes != want or meta.fqn != fqn:
            raise CheckpointFormatError(
                f"{self.paths[file]}: entry {name!r} has {nbytes} bytes, expected {want} for chunk "
                f"{list(box.sizes)} of {fqn!r}"
            )
        return Location(file, start, nbytes, meta.xxh3)

    def block_sums(self, fqn: str, idx: int, location: Location) -> BlockSums | None:
        """From the data file's block checksums' entry (read once per file); None for files written without."""
        if location.file not in self._block_sums:
            with self._sums_lock:
                if location.file not in self._block_sums:
                    self._block_sums[location.file] = self._read_block_sums(location.file)
        table = self._block_sums[location.file]
        if table is None:
            return None
        block, sums, first = table
        if not location.nbytes:  # an empty chunk: no blocks
            return BlockSums(block, sums[:0])
        k = first.get(location.start)
        if k is None:
            raise CheckpointFormatError(
                f"{self.paths[location.file]}: no block checksums for the entry at byte {location.start} "
                f"(chunk {idx} of {fqn!r})"
            )
        return BlockSums(block, sums[k : k - (-location.nbytes // block)])

    def _read_block_sums(self, file: int) -> tuple[int, np.ndarray, dict[int, int]] | None:
        h = self.header(file)
        rec = h.block_sums
        if rec is None:
            return None
        # One checksum per block of every tensor chunk, chunk after chunk in file order.
        first: dict[int, int] = {}
        k = 0
        for start, nbytes in sorted(r for name, r in h.ranges.items() if has_block_sums(h.meta.get(name), r[1])):
            first[start] = k
            k += -(-nbytes // rec.block)
        path = self.paths[file]
        if 8 * k != rec.nbytes:
            raise CheckpointFormatError(
                f"{path}: {rec.nbytes // 8} block checksums recorded for the {k} blocks of its tensor chunks"
            )
        fd = os.open(path, os.O_RDONLY)
        try:
            raw = os.pread(fd, rec.nbytes, rec.start)
        finally:
            os.close(fd)
        digest = xxhash.xxh3_64_hexdigest(raw)
        if len(raw) != rec.nbytes or digest != rec.xxh3:
            raise ChecksumError(path, "the block checksums", rec.xxh3, digest, self.file_rank(file))
        return rec.block, np.frombuffer(raw, dtype="<u8"), first

    def checksummed_records(self) -> list[tuple[str, Location]]:
        """The block checksums' entry of every data file that has one."""
        out = []
        for i in range(len(self.paths)):
            try:
                rec = self.header(i).block_sums
            except CheckpointFormatError:
                continue  # check_files() reports it
            if rec is not None:
                out.append(("the block checksums", Location(i, rec.start, rec.nbytes, rec.xxh3)))
        return out

    def check_files(self) -> list[str]:
        """Every data file's header parses and its size is the one the index recorded."""
        problems = []
        for i, f in enumerate(self.index.files):
            try:
                h = read_header(self.paths[i])
                if h.size != f.size:
                    problems.append(f"{f.name}: {h.size} bytes on disk, the index recorded {f.size}")
            except CheckpointFormatError as e:
                problems.append(str(e))
        return problems
