"""Building, writing, reading and rebuilding the global index.

The coordinator builds the index at the end of a save from what every rank
reports it wrote (:class:`WrittenEntry`); :func:`rebuild_index` builds the
same index from the data files' headers alone. Both go through
:func:`build_index`, which stores a tensor compactly when its chunks are
exactly those of the DTensor layout it was saved with.
"""

from __future__ import annotations

import json
import math
import os
import threading
import uuid
from collections import defaultdict
from dataclasses import dataclass

from .format import (
    INDEX_FILE,
    CheckpointFormatError,
    ChunkRecord,
    EntryMeta,
    FileHeader,
    FileRecord,
    Index,
    Layout,
    Location,
    TensorRecord,
    chunk_entry_name,
    read_header,
)
from .sharding import Box, Grid
from .values import dtype_from_name

__all__ = ["WrittenEntry", "build_index", "write_index", "fsync_path", "load_index", "rebuild_index", "ChunkLocator"]


@dataclass(frozen=True)
class WrittenEntry:
    """One entry a rank wrote: its name, metadata and absolute byte range."""

    name: str
    meta: EntryMeta
    start: int
    nbytes: int


def build_index(
    world_size: int,
    files: list[FileRecord],
    written: list[list[WrittenEntry]],
    layouts: dict[str, Layout | None] | None = None,
    compact: dict[str, TensorRecord] | None = None,
) -> Index:
    """The index of a checkpoint whose file ``i`` holds ``written[i]``.

    ``layouts`` (from the save planner) overrides the layout recorded in the
    entries; a tensor is stored compactly when its layout's chunk boxes are
    exactly the boxes written, each once. ``compact`` adds records built
    without per-chunk entries (mesh-planned tensors, :mod:`ucp_dcp.compact`).
    """
    per_tensor: dict[str, list[tuple[int, WrittenEntry]]] = defaultdict(list)
    values: dict[str, Location] = {}
    rank_local: dict[str, dict[int, Location]] = defaultdict(dict)
    for fi, entries in enumerate(written):
        for e in entries:
            loc = Location(fi, e.start, e.nbytes, e.meta.xxh3)
            if e.meta.kind == "tensor":
                per_tensor[e.meta.fqn].append((fi, e))
            elif e.meta.kind == "value":
                values[e.meta.fqn] = loc
            elif e.meta.kind == "rank_local":
                rank_local[e.meta.fqn][files[fi].rank] = loc
            else:
                raise CheckpointFormatError(f"{files[fi].name}: entry {e.name!r} has unknown kind {e.meta.kind!r}")
    tensors: dict[str, TensorRecord] = {}
    for fqn in sorted(per_tensor):
        items = per_tensor[fqn]
        first = items[0][1].meta
        for fi, e in items:
            if (e.meta.dtype, e.meta.shape) != (first.dtype, first.shape):
                raise CheckpointFormatError(
                    f"tensor {fqn!r} is saved as {first.dtype}{list(first.shape)} in one file and as "
                    f"{e.meta.dtype}{list(e.meta.shape)} in {files[fi].name}"
                )
        dtype = dtype_from_name(first.dtype)
        chunks = {
            Box(e.meta.offsets, e.meta.sizes): (fi, e) for fi, e in items
        }
        if layouts is not None and fqn in layouts:
            layout = layouts[fqn]
        else:
            found = {e.meta.layout for _, e in items}
            layout = found.pop() if len(found) == 1 else None
        compact_files = _compact(layout, first.shape, chunks, len(items))
        if compact_files is not None:
            tensors[fqn] = TensorRecord(dtype, first.shape, layout, True, compact_files)
        else:
            recs = [
                ChunkRecord(box, Location(fi, e.start, e.nbytes, e.meta.xxh3))
                for box, (fi, e) in sorted(chunks.items(), key=lambda kv: kv[0].offsets)
            ]
            tensors[fqn] = TensorRecord(dtype, first.shape, layout, False, chunks=recs)
    for fqn, rec in (compact or {}).items():
        if fqn in tensors:
            raise CheckpointFormatError(f"tensor {fqn!r} was written both per chunk and through its mesh group")
        tensors[fqn] = rec
    return Index(world_size, files, dict(sorted(tensors.items())), values, dict(rank_local))


def _compact(
    layout: Layout | None,
    shape: tuple[int, ...],
    chunks: dict[Box, tuple[int, WrittenEntry]],
    n_written: int,
) -> list[int] | None:
    if layout is None or n_written != len(chunks):
        return None
    try:
        grid = layout.grid(shape)
    except ValueError:
        return None
    if grid.n_chunks != len(chunks):
        return None
    files = []
    for k in range(grid.n_chunks):
        hit = chunks.get(grid.box(k))
        if hit is None:
            return None
        files.append(hit[0])
    return files


def write_index(directory: str, index: Index) -> None:
    """Write ``ucp_index.json`` atomically: temp file, fsync, rename, fsync dir.

    Readers see either the previous index or the complete new one, never a
    partial file.
    """
    final = os.path.join(directory, INDEX_FILE)
    tmp = os.path.join(directory, f".{INDEX_FILE}.{uuid.uuid4().hex[:8]}.tmp")
    data = json.dumps(index.to_json(), separators=(",", ":")).encode("utf-8")
    try:
        write_bytes_durable(tmp, data, exclusive=True)
        os.replace(tmp, final)
    except BaseException:
        # Disk full, I/O error: the previous index (if any) is untouched; leave no temp file.
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_path(directory)


def write_bytes_durable(path: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` (created, or truncated unless ``exclusive``) and fsync it.

    ``exclusive`` refuses an existing file (``O_EXCL``), for temp names that
    must be fresh. The caller renames into place and fsyncs the directory.
    """
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(directory: str) -> None:
    """fsync a directory (or file) by path, so a rename in it is durable; best effort."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(dfd)


def load_index(directory: str) -> Index:
    """Read and validate ``ucp_index.json`` of checkpoint ``directory``."""
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"{directory}: not a checkpoint (no such directory)")
    path = os.path.join(directory, INDEX_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        hint = ""
        if os.path.exists(os.path.join(directory, ".metadata")):
            hint = " (it holds a DCP .metadata file: it was saved with DCP's default FileSystemWriter)"
        raise CheckpointFormatError(
            f"{directory}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing{hint}. "
            "A save that did not finish leaves no index; load an earlier checkpoint "
            "or rebuild the index from complete data files with ucp_dcp.rebuild_index"
        ) from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: truncated or corrupt index ({e})") from None
    return Index.from_json(doc, path)


def rebuild_index(directory: str, *, save_id: str | None = None, write: bool = False) -> Index:
    """Rebuild the index from the data files' headers alone.

    Recovers a checkpoint whose index was lost, and checks that the data
    files describe themselves. A directory can also hold the files of a save
    that never committed; when files of several saves are present, pick one
    with ``save_id`` (it is part of every data file name) rather than have
    them mixed. The result must cover every tensor it names completely. With
    ``write=True`` it is written as ``ucp_index.json`` (refused if one exists).
    """
    names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointFormatError(f"{directory}: no .safetensors data files to rebuild an index from")
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
        [WrittenEntry(name, m, *headers[n].ranges[name]) for name, m in headers[n].meta.items()] for n in chosen
    ]
    index = build_index(max(headers[n].world_size for n in chosen), files, written)
    for fqn, t in index.tensors.items():
        covered = sum(c.box.numel for c in t.chunk_list())
        if covered != math.prod(t.shape):
            raise CheckpointFormatError(
                f"{directory}: the data files of save {headers[chosen[0]].save_id} cover {covered} of the "
                f"{math.prod(t.shape)} elements of {fqn!r}: a data file is missing"
            )
    if write:
        if os.path.exists(os.path.join(directory, INDEX_FILE)):
            raise FileExistsError(f"{directory}/{INDEX_FILE} exists; not overwriting it")
        write_index(directory, index)
    return index


class ChunkLocator:
    """Finds the bytes of saved chunks, reading data-file headers on demand.

    Explicit index entries carry their location; compact ones name only the
    file, and the byte range comes from that file's header (read once per
    file, only for files this rank actually reads from).
    """

    def __init__(self, directory: str, index: Index) -> None:
        self.directory = directory
        self.index = index
        self.paths = [os.path.join(directory, f.name) for f in index.files]
        self._headers: dict[int, FileHeader] = {}
        self._chunk_lists: dict[str, list[ChunkRecord]] = {}
        self._by_offsets: dict[str, dict[tuple[int, ...], int]] = {}
        self._lock = threading.Lock()

    def chunks(self, fqn: str) -> list[ChunkRecord]:
        """The chunk list of tensor ``fqn`` (cached; O(chunks): for tools, not planners)."""
        cl = self._chunk_lists.get(fqn)
        if cl is None:
            cl = self.index.tensors[fqn].chunk_list()
            self._chunk_lists[fqn] = cl
        return cl

    def grid(self, fqn: str) -> Grid | None:
        """The chunk grid of tensor ``fqn`` (None for an irregular chunk list)."""
        return self.index.tensors[fqn].grid()

    def box(self, fqn: str, idx: int) -> Box:
        """The box of chunk ``idx`` of tensor ``fqn``."""
        rec = self.index.tensors[fqn]
        return rec.grid().box(idx) if rec.compact else rec.chunks[idx].box  # type: ignore[union-attr]

    def chunk_index(self, fqn: str, offsets: tuple[int, ...], hint: int | None) -> int:
        """Position of the chunk of ``fqn`` starting at ``offsets``."""
        rec = self.index.tensors[fqn]
        n = rec.grid().n_chunks if rec.compact else len(rec.chunks)  # type: ignore[union-attr]
        if hint is not None and 0 <= hint < n and self.box(fqn, hint).offsets == offsets:
            return hint
        found: int | None
        if rec.compact:
            found = rec.grid().find(offsets)  # type: ignore[union-attr]
        else:
            m = self._by_offsets.get(fqn)
            if m is None:
                m = {c.box.offsets: i for i, c in enumerate(rec.chunks)}
                self._by_offsets[fqn] = m
            found = m.get(offsets)
        if found is None:
            raise CheckpointFormatError(f"tensor {fqn!r} has no saved chunk at offsets {list(offsets)}")
        return found

    def header(self, file: int) -> FileHeader:
        """Parsed header of file number ``file``; checks its size against the index."""
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
        """Location of chunk ``idx`` of tensor ``fqn``."""
        rec = self.index.tensors[fqn]
        if not rec.compact:
            loc = rec.chunks[idx].location
            assert loc is not None
            return loc
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
