"""The native format: a ``ucp_index.json`` plus safetensors data files with per-entry checksums.

Also loading the index of a local checkpoint (:func:`load_index`) and
rebuilding it from the data files' headers (:func:`rebuild_index`).
"""

from __future__ import annotations

import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import xxhash

from ..byteio.blocksums import BlockSums
from ..byteio.integrity import value_what
from ..byteio.location import ModelDir, path_arg, write_index
from ..byteio.objrange import ObjectAccess
from ..byteio.rangeio import FileAccess, read_header
from ..errors import CheckpointExistsError, CheckpointFormatError, ChecksumError
from ..format import (
    INDEX_FILE,
    EntryMeta,
    FileHeader,
    FileRecord,
    Index,
    Location,
    WrittenEntry,
    build_index,
    chunk_entry_name,
    dtype_name,
    has_block_sums,
    parse_index,
    rank_local_entry_name,
    split_rank_local_key,
    value_entry_name,
)
from .base import Source, SourceOptions, register

__all__ = ["NativeSource", "load_index", "missing_index", "rebuild_index"]


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
    title = "ucp_dcp"
    looks_for = INDEX_FILE
    detect_order = 10

    def __init__(self, d: ModelDir) -> None:
        """The checkpoint in directory view ``d`` (local or in object storage); open a path with
        :meth:`~ucp_dcp.sources.base.Source.open`."""
        index = parse_index(d.read(INDEX_FILE), d.path_of(INDEX_FILE))
        super().__init__(d.where, index, [d.path_of(f.name) for f in index.files])
        self.store = d.store
        self._headers: dict[int, FileHeader] = {}
        # Made under _lock by header(), which the sums read first.
        self._objects: dict[int, ObjectAccess] = {}
        # Per file: (block size, every block checksum, first checksum of the entry at each offset),
        # or None.
        self._block_sums: dict[int, tuple[int, np.ndarray, dict[int, int]] | None] = {}
        self._lock = threading.Lock()
        self._sums_lock = threading.Lock()  # not _lock: reading the sums reads the header

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory holding ``ucp_index.json`` (in a store: one GET, whose bytes opening
        parses)."""
        return d.holds(INDEX_FILE)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> NativeSource:
        """Read and validate the index (no data file is opened yet)."""
        return cls(d)

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
        follow its header usually arrive with the header's first request."""
        if self.store is None:
            return None
        obj = self._objects.get(file)
        if obj is None:  # the index's size: no request to ask the store
            rec = self.index.files[file]
            obj = self._objects[file] = ObjectAccess(
                self.store, rec.name, rec.size, head_bytes=head_request_bytes(rec.size)
            )
        return obj

    def prepare(
        self, chunks: Sequence[tuple[str, int]], values: Sequence[str], threads: int = 4
    ) -> None:
        """In object storage, fetch the first request of every data file the load reads whose
        header is not parsed yet, in one batch of concurrent requests: one after the other, each
        a round trip, they would keep the store idle before the first byte of data is asked
        for."""
        files = self.first_requests(chunks, values)
        if files:
            self.hold_first_requests(self.fetch_first_requests(files))

    def _accesses(self, files: Sequence[int]) -> list[ObjectAccess]:
        """The objects of ``files`` (in object storage), made if need be."""
        with self._lock:
            objs = [self._object(f) for f in files]
        return [o for o in objs if o is not None]

    # -------------------------------------------- first requests (dcp.read_once.first_requests)
    def first_requests(self, chunks: Sequence[tuple[str, int]], values: Sequence[str]) -> list[int]:
        """In object storage, the data files a load of ``chunks`` and ``values`` reads whose
        header is not parsed or fetched yet (none for local files)."""
        if self.store is None:
            return []
        files: set[int] = set()
        for fqn, idx in chunks:
            rec = self.index.tensors.get(fqn)
            file = rec.chunk_file(idx) if rec is not None else None
            if file is not None:
                files.add(file)
        for key in values:
            try:
                files.add(Source.value_location(self, key).file)
            except CheckpointFormatError:
                pass  # the read names it
        held = self._objects
        return [
            f for f in sorted(files) if f not in self._headers and not (f in held and held[f].head)
        ]

    def first_request_bytes(self, file: int) -> int:
        """The length of data file ``file``'s first request (:meth:`ObjectAccess.first_request`,
        from the index's record of its size: the same on every rank)."""
        _, start, end = self._accesses([file])[0].first_request()
        return end - start

    def fetch_first_requests(self, files: Sequence[int]) -> dict[int, bytes]:
        """The first requests of ``files`` (in object storage), in one batch; not kept."""
        assert self.store is not None
        asked = [(f, o) for f, o in zip(files, self._accesses(files)) if o.size]  # empty: none
        got = self.store.read_ranges([o.first_request() for _, o in asked])
        return {f: b"" for f in files} | {f: data for (f, _), data in zip(asked, got)}

    def hold_first_requests(self, heads: Mapping[int, bytes]) -> None:
        """Keep first requests fetched by another rank: the headers are parsed from them."""
        with self._lock:
            for f, data in heads.items():
                obj = self._object(f)
                if obj is not None and not obj.head:
                    obj.hold_head(data)

    def held_heads(self) -> dict[int, memoryview]:
        """The data files' first requests held (:meth:`prepare`): what a load reads inside them
        (the first chunks of a file whose header is short, small values) costs no request."""
        return {file: memoryview(obj.head) for file, obj in list(self._objects.items())}

    def _entry(self, file: int, name: str, what: Callable[[], str]) -> tuple[int, int, EntryMeta]:
        """``(start, nbytes, metadata)`` of entry ``name`` of data file ``file``; the index says it
        holds ``what()`` (words made only for an error: a load asks this of every chunk)."""
        h = self.header(file)
        meta = h.meta.get(name)
        if meta is None:
            raise CheckpointFormatError(
                f"{self.paths[file]}: the index says it holds {what()} (entry {name!r}), but it "
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
        # parse_index gives every explicit chunk its location, and a compact one its file.
        assert file is not None, (fqn, idx)
        name = chunk_entry_name(fqn, box.offsets)

        def what() -> str:  # made only for an error: a load locates every chunk it reads
            return f"chunk {list(box.offsets)} of {fqn!r}"

        start, nbytes, meta = self._entry(file, name, what)
        found = (meta.fqn, meta.dtype, meta.shape, meta.offsets, meta.sizes)
        want = (fqn, dtype_name(rec.dtype), rec.shape, box.offsets, box.sizes)
        if found != want:
            raise CheckpointFormatError(
                f"{self.paths[file]}: entry {name!r} is a {meta.dtype}{list(meta.sizes)} chunk of "
                f"{meta.fqn!r} "
                f"{list(meta.shape)}, but the index has {what()} as {want[1]}{list(box.sizes)} of "
                f"{list(rec.shape)}"
            )
        here = Location(file, start, nbytes, meta.xxh3)
        if loc is not None and loc != here:
            raise CheckpointFormatError(_disagree(self.paths[file], what(), here, loc))
        return here

    def value_location(self, key: str) -> Location:
        """From the index, cross-checked with the data file's header like :meth:`locate`."""
        loc = super().value_location(key)
        rl = split_rank_local_key(key)
        what = value_what(key)
        name = rank_local_entry_name(rl[1]) if rl else value_entry_name(key)
        start, nbytes, meta = self._entry(loc.file, name, lambda: what)
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
        obj = self._object(file)
        if rec is None:
            if obj is not None:
                obj.release()
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
        if obj is not None:
            raw = obj.pread(rec.nbytes, rec.start)
            obj.release()  # the header is parsed and the checksums copied out: nothing more to read
        else:
            with FileAccess(path) as f:
                raw = f.pread(rec.nbytes, rec.start)
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


def head_request_bytes(size: int) -> int:
    """The first request for the header of a data file of ``size`` bytes in object storage.

    It should also hold the block checksums that follow the header, read next: one request
    instead of three (header length, header, checksums), each a round trip, and on some servers
    a read of the whole object (moto's). The checksums take 8 bytes per 4 KiB block, at most
    ``size / 512``. The header takes a few hundred bytes per entry: guessed as a 128th of the
    file, at least 64 KiB and at most 1 MiB, so what a smaller rank's read does not need (the
    first chunks, when the header is shorter) is at most about 1% of the file. A longer header
    costs one more request (:class:`~ucp_dcp.byteio.objrange.ObjectAccess` extends the prefix it
    holds past the header by as much again, checksums included).
    """
    header = min(max(size // 128, 64 << 10), 1 << 20)
    return min(max(size, 1), header + size // 512)


def _disagree(path: str, what: str, here: Location, listed: Location) -> str:
    return (
        f"{path}: the index records {what} at bytes "
        f"[{listed.start}, {listed.start + listed.nbytes}) with xxh3 {listed.xxh3}, the file's "
        f"header at [{here.start}, {here.start + here.nbytes}) with "
        f"xxh3 {here.xxh3}"
    )


def missing_index(where: str, hint: str = "", local: bool = True) -> CheckpointFormatError:
    """The error for checkpoint ``where`` without its index: a save that did not finish, with the
    way to recover (``hint``: what else the directory holds; ``local``: the index can be rebuilt
    there)."""
    rebuild = (
        " or rebuild the index from complete data files with "
        "ucp_dcp.rebuild_index(path, write=True)"
        if local
        else ""
    )
    return CheckpointFormatError(
        f"{where}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing{hint}. A save that did not "
        f"finish leaves no index; load an earlier checkpoint{rebuild}"
    )


def load_index(directory: str) -> Index:
    """Read and validate ``ucp_index.json`` of checkpoint ``directory``.

    An index that records a digest must match it
    (:func:`~ucp_dcp.format.index_digest`); then every field is checked
    (:meth:`~ucp_dcp.format.Index.from_json`).
    """
    directory = path_arg(directory, "load_index: directory")
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"{directory}: not a checkpoint (no such directory)")
    path = os.path.join(directory, INDEX_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        hint = ""
        if os.path.exists(os.path.join(directory, ".metadata")):
            hint = (
                " (it holds a DCP .metadata file: it was saved with DCP's default FileSystemWriter)"
            )
        raise missing_index(directory, hint) from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read the index ({e.strerror or e})") from None
    return parse_index(raw, path)


def rebuild_index(
    directory: str, *, save_id: str | None = None, write: bool = False, replace: bool = False
) -> Index:
    """Rebuild the index from the data files' headers alone.

    Recovers a checkpoint whose index was lost, and checks that the data
    files describe themselves. A directory can also hold the files of a save
    that never committed; when files of several saves are present, pick one
    with ``save_id`` (it is part of every data file name) rather than have
    them mixed. The result must cover every tensor it names completely. With
    ``write=True`` it is written as ``ucp_index.json``, atomically; an
    existing index is replaced only with ``replace=True`` (for one that is
    damaged: the data files' headers carry their own checksums and boxes).
    """
    directory = path_arg(directory, "rebuild_index: directory")
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointFormatError(
            f"{directory}: no .safetensors data files to rebuild an index from"
        )
    headers = {n: read_header(os.path.join(directory, n)) for n in names}
    saves: dict[str, list[str]] = defaultdict(list)
    for n, h in headers.items():
        saves[h.save_id].append(n)
    if save_id is None and len(saves) > 1:
        listing = "; ".join(f"{sid}: {len(ns)} file(s)" for sid, ns in sorted(saves.items()))
        raise CheckpointFormatError(
            f"{directory}: holds data files of {len(saves)} different saves ({listing}); "
            "pass rebuild_index(path, save_id=...) to choose the one to rebuild"
        )
    chosen = saves.get(save_id) if save_id is not None else next(iter(saves.values()))
    if not chosen:
        raise CheckpointFormatError(f"{directory}: no data files of save {save_id!r}")
    files = [FileRecord(n, headers[n].rank, headers[n].size) for n in chosen]
    written = [
        [WrittenEntry(name, m, *headers[n].ranges[name]) for name, m in headers[n].meta.items()]
        for n in chosen
    ]
    index = build_index(max(headers[n].world_size for n in chosen), files, written)
    for fqn, t in index.tensors.items():
        covered = sum(c.box.numel for c in t.chunk_list())
        if covered != math.prod(t.shape):
            raise CheckpointFormatError(
                f"{directory}: the data files of save {headers[chosen[0]].save_id} cover "
                f"{covered} of the "
                f"{math.prod(t.shape)} elements of {fqn!r}: a data file is missing"
            )
    if write:
        if os.path.exists(os.path.join(directory, INDEX_FILE)):
            if not replace:
                raise CheckpointExistsError(
                    f"{directory}/{INDEX_FILE} exists; not overwriting it (pass replace=True to "
                    "replace a "
                    "damaged index with the one rebuilt from the data files)"
                )
        write_index(directory, index)
    return index
