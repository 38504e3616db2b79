"""The native format: a ``ucp_index.json`` plus safetensors data files with per-entry checksums."""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from ..byteio.blocksums import BlockSums
from ..byteio.objstore import ObjectAccess, ObjectStore
from ..errors import CheckpointFormatError, ChecksumError
from ..format import (
    INDEX_FILE,
    EntryMeta,
    FileHeader,
    Location,
    chunk_entry_name,
    dtype_name,
    has_block_sums,
    load_index,
    parse_index,
    rank_local_entry_name,
    read_header,
    split_rank_local_key,
    value_entry_name,
)
from .base import Source, SourceOptions, register

__all__ = ["NativeSource"]


@register
class NativeSource(Source):
    """A universal checkpoint written by :class:`~ucp_dcp.UCPStorageWriter`.

    Explicit index entries carry their location; compact ones name only the
    file, and the byte range comes from that file's header, read once per
    file and only for the files this process actually reads from. Either
    way every chunk and value read is cross-checked against its entry in the
    data file's header, so an index that disagrees with its data files fails
    naming both.
    """

    format = "ucp_dcp"
    checksums = True

    def __init__(
        self, path: str, store: ObjectStore | None = None, raw_index: bytes | None = None
    ) -> None:
        """The checkpoint in directory ``path``, or at ``store``'s URL (``raw_index``: its index, if
        already read)."""
        if store is None:
            index = load_index(path)
            paths = [os.path.join(path, f.name) for f in index.files]
        else:
            raw = store.read(INDEX_FILE) if raw_index is None else raw_index
            index = parse_index(raw, store.url_of(INDEX_FILE))
            paths = [store.url_of(f.name) for f in index.files]
        super().__init__(path, index, paths)
        self.store = store
        self._headers: dict[int, FileHeader] = {}
        self._objects: dict[
            int, ObjectAccess
        ] = {}  # made under _lock by header(), which the sums read first
        # Per file: (block size, every block checksum, first checksum of the entry at each offset),
        # or None.
        self._block_sums: dict[int, tuple[int, np.ndarray, dict[int, int]] | None] = {}
        self._lock = threading.Lock()
        self._sums_lock = threading.Lock()  # not _lock: reading the sums reads the header

    @classmethod
    def detect(cls, path: str) -> bool:
        """A directory holding ``ucp_index.json``."""
        return os.path.isfile(os.path.join(path, INDEX_FILE))

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> NativeSource:
        """Read and validate the index (no data file is opened yet)."""
        return cls(path)

    def header(self, file: int) -> FileHeader:
        """Parsed header of data file ``file``; checks its size, rank and world size against the
        index."""
        h = self._headers.get(file)
        if h is None:
            with self._lock:
                h = self._headers.get(file)
                if h is None:
                    h = read_header(self.paths[file], access=self._object(file))
                    rec = self.index.files[file]
                    if h.size != rec.size:
                        raise CheckpointFormatError(
                            f"{self.paths[file]}: {h.size} bytes on disk but the index recorded "
                            f"{rec.size}: "
                            "the file was truncated or replaced after the checkpoint was committed"
                        )
                    if (h.rank, h.world_size) != (rec.rank, self.index.world_size):
                        raise CheckpointFormatError(
                            f"{self.paths[file]}: written by rank {h.rank} of world size "
                            f"{h.world_size}, but the "
                            f"index says rank {rec.rank} of {self.index.world_size}"
                        )
                    self._headers[file] = h
        return h

    def _object(self, file: int) -> ObjectAccess | None:
        """Data file ``file`` as an object (None for a local file), kept: the block checksums that
        follow
        its header usually arrive with the header's first request."""
        if self.store is None:
            return None
        obj = self._objects.get(file)
        if obj is None:  # the index's size: no request to ask the store
            rec = self.index.files[file]
            obj = self._objects[file] = ObjectAccess(self.store, rec.name, rec.size)
        return obj

    def _entry(self, file: int, name: str, what: str) -> tuple[int, int, EntryMeta]:
        """``(start, nbytes, metadata)`` of entry ``name`` of data file ``file``; the index says it
        holds ``what``."""
        h = self.header(file)
        meta = h.meta.get(name)
        if meta is None:
            raise CheckpointFormatError(
                f"{self.paths[file]}: the index says it holds {what} (entry {name!r}), but it "
                "does not"
            )
        return (*h.ranges[name], meta)

    def locate(self, fqn: str, idx: int) -> Location:
        """From the index (explicit chunk lists) or the data file's header (compact ones),
        cross-checked.

        Either way the chunk's entry in the data file's header must agree with
        the index: same tensor, dtype, global shape and box, and for explicit
        chunks the same byte range and checksum.
        """
        rec = self.index.tensors[fqn]
        box = self.box(fqn, idx)
        loc = rec.chunk_location(idx)  # None for compact records: the header says
        file = rec.chunk_file(idx)
        if file is None:
            return super().locate(fqn, idx)  # raises: an explicit chunk listed without its bytes
        name = chunk_entry_name(fqn, box.offsets)
        what = f"chunk {list(box.offsets)} of {fqn!r}"
        start, nbytes, meta = self._entry(file, name, what)
        found = (meta.fqn, meta.dtype, meta.shape, meta.offsets, meta.sizes)
        want = (fqn, dtype_name(rec.dtype), rec.shape, box.offsets, box.sizes)
        if found != want:
            raise CheckpointFormatError(
                f"{self.paths[file]}: entry {name!r} is a {meta.dtype}{list(meta.sizes)} chunk of "
                f"{meta.fqn!r} "
                f"{list(meta.shape)}, but the index has {what} as {want[1]}{list(box.sizes)} of "
                f"{list(rec.shape)}"
            )
        here = Location(file, start, nbytes, meta.xxh3)
        if loc is not None and loc != here:
            raise CheckpointFormatError(_disagree(self.paths[file], what, here, loc))
        return here

    def value_location(self, key: str) -> Location:
        """From the index, cross-checked with the data file's header like :meth:`locate`."""
        loc = super().value_location(key)
        rl = split_rank_local_key(key)
        what = f"rank-local value {rl[1]!r} of rank {rl[0]}" if rl else f"value {key!r}"
        name = rank_local_entry_name(rl[1]) if rl else value_entry_name(key)
        start, nbytes, meta = self._entry(loc.file, name, what)
        if rl and self.header(loc.file).rank != rl[0]:
            raise CheckpointFormatError(
                f"{self.paths[loc.file]}: the index has {what} in the file of rank "
                f"{self.header(loc.file).rank}"
            )
        here = Location(loc.file, start, nbytes, meta.xxh3)
        if here != loc:
            raise CheckpointFormatError(_disagree(self.paths[loc.file], what, here, loc))
        return loc

    def block_sums(self, fqn: str, idx: int, location: Location) -> BlockSums | None:
        """From the data file's block checksums' entry (read once per file); None for files written
        without."""
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
                f"{self.paths[location.file]}: no block checksums for the entry at byte "
                f"{location.start} "
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
        for start, nbytes in sorted(
            r for name, r in h.ranges.items() if has_block_sums(h.meta.get(name), r[1])
        ):
            first[start] = k
            k += -(-nbytes // rec.block)
        path = self.paths[file]
        if 8 * k != rec.nbytes:
            raise CheckpointFormatError(
                f"{path}: {rec.nbytes // 8} block checksums recorded for the {k} blocks of its "
                "tensor chunks"
            )
        obj = self._object(file)
        if obj is not None:
            raw = obj.pread(rec.nbytes, rec.start)
        else:
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
        """Every data file's header parses, matches the index's record of the file, and lists only
        what the index lists.

        Together with :meth:`locate` and :meth:`value_location` (the index's
        entries are in the headers, alike), this cross-checks the index and
        the headers both ways: an entry deleted from the index, or renamed in
        it, leaves an entry in some header that the index does not list.
        """
        problems = []
        for i in range(len(self.index.files)):
            try:
                h = self.header(i)
            except CheckpointFormatError as e:
                problems.append(str(e))
                continue
            for name, m in h.meta.items():
                problem = self._unlisted(i, h, m)
                if problem:
                    problems.append(f"{self.paths[i]}: entry {name!r} holds {problem}")
        return problems

    def _unlisted(self, file: int, h: FileHeader, m: EntryMeta) -> str | None:
        """Why the index does not list header entry ``m`` of data file ``file`` there (None if it
        does)."""
        if m.kind == "value":
            loc = self.index.values.get(m.fqn)
            listed = loc is not None and loc.file == file
            return None if listed else f"value {m.fqn!r}, which the index does not list there"
        if m.kind == "rank_local":
            loc = self.index.rank_local.get(m.fqn, {}).get(h.rank)
            if loc is not None and loc.file == file:
                return None
            return (
                f"rank {h.rank}'s rank-local value {m.fqn!r}, which the index does not list there"
            )
        what = f"chunk {list(m.offsets)} of tensor {m.fqn!r}, which the index does not list there"
        rec = self.index.tensors.get(m.fqn)
        if rec is None or len(m.offsets) != len(rec.shape):
            return what
        try:
            idx = self.chunk_index(m.fqn, m.offsets, None)
        except CheckpointFormatError:
            return what
        return None if rec.chunk_file(idx) == file else what


def _disagree(path: str, what: str, here: Location, listed: Location) -> str:
    return (
        f"{path}: the index records {what} "
        f"at bytes [{listed.start}, {listed.start + listed.nbytes}) with xxh3 "
        f"{listed.xxh3}, the file's header at [{here.start}, {here.start + here.nbytes}) with "
        f"xxh3 {here.xxh3}"
    )
