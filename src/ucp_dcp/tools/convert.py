"""``convert``: any source into a universal checkpoint, streaming with bounded memory.

Every key, value and chunk box is kept: each data file of the source
becomes one native data file of the same writing rank holding the same
chunks, so the saved sharding is preserved. Tensor bytes are copied slab by
slab through one buffer of at most ``buffer_bytes`` (read as byte ranges,
never ``torch.load``\\ ed) and hashed on the way by the one data-file writer;
values are re-encoded as tagged JSON. The index is written last,
atomically. Loading does not need this (every entry point reads every source
directly); converting pays off when a checkpoint is read many times, or to
get checksums for a format that has none.
"""

from __future__ import annotations

import math
import os
import uuid
from typing import Any

import torch

from ..byteio.datafile import DataFileWriter, chunk_entry, value_entry
from ..byteio.durable import write_remedy
from ..byteio.engine import ChunkReads
from ..byteio.location import commit_index, path_arg, view_of, write_error
from ..byteio.progress import ProgressFn, progress_fn
from ..byteio.rangeio import storage_view, tensor_view
from ..byteio.transfer import ChunkRegion
from ..core.boxes import slabs
from ..core.sharding import Box
from ..dcp.options import ReadOptions
from ..errors import CheckpointExistsError, CheckpointFormatError, UCPError
from ..format import (
    INDEX_FILE,
    FileRecord,
    Index,
    PlannedEntry,
    WrittenEntry,
    build_index,
    data_file_name,
    rank_local_key,
)
from ..sources import Source, read_values
from .checkpoint import Checkpoint, local_output

__all__ = ["convert"]


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    options: ReadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    prefix: str = "",
    dcp_values: str | None = "weights_only",
    overwrite: bool = False,
    sync_files: bool = True,
    on_progress: ProgressFn | None = None,
) -> Index:
    """Write checkpoint ``src`` (any format :func:`~ucp_dcp.sources.open_source` reads) as a
    universal one at ``dst``; returns the index written.

    Args:
        src: the checkpoint, as :class:`~ucp_dcp.Checkpoint` takes it (a local path or a URL).
        dst: the output directory (created if needed), local only: a URL is refused with
            :class:`~ucp_dcp.errors.StorageError` (save to object storage with
            ``UCPStorageWriter``, or copy the converted directory there). It may be ``src``
            itself for a DCP checkpoint (its files are left alone; the universal index takes
            precedence when loading).
        options, storage_options, prefix: how to read ``src``, as :class:`~ucp_dcp.Checkpoint`
            takes them; ``max_buffer_bytes`` bounds the copy buffer and staging memory together,
            and ``verify`` checks what is read against the source's checksums, so that damaged
            bytes are not given fresh ones (:class:`~ucp_dcp.ChecksumError`).
        dcp_values: as :class:`~ucp_dcp.Checkpoint`'s, but ``"weights_only"`` by default (a load
            refuses DCP's pickled values unless asked).
        overwrite: replace a universal checkpoint already at ``dst`` (refused otherwise); the
            old one stays loadable until the new index replaces it.
        sync_files: fsync every data file before the index is written.
        on_progress: ``on_progress(done_bytes, total_bytes)`` after every entry.

    Raises:
        ~ucp_dcp.errors.CheckpointWriteError: ``dst`` cannot be made or written (read-only,
            full: the message names the file and the remedy, and keeps the errno); nothing is
            committed there.
    """
    src = path_arg(src, "convert: src")
    progress = progress_fn(on_progress, "convert")
    dst = local_output(
        path_arg(dst, "convert: dst"), "convert", ", or save to the URL with UCPStorageWriter"
    )
    with Checkpoint(
        src,
        options=options,
        storage_options=storage_options,
        prefix=prefix,
        dcp_values=dcp_values,
    ) as ckpt:
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise CheckpointExistsError(
                f"{dst}: is a file; convert writes a checkpoint directory: name a new directory"
            )
        if os.path.exists(os.path.join(dst, INDEX_FILE)) and not overwrite:
            raise CheckpointExistsError(
                f"{dst} already holds a committed ucp_dcp checkpoint ({INDEX_FILE}); refusing to "
                "replace it. Convert into a new directory, or pass overwrite=True"
            ).with_option("overwrite", True, "overwrite=True")
        view_of(dst).make()
        try:
            return _convert(ckpt, dst, progress, sync_files)
        except UCPError:
            raise
        except OSError as e:  # writing dst: reads fail as the library's own errors
            raise write_error(
                e,
                f"{e.filename or dst}: convert could not write ({e.strerror or e}); nothing is "
                f"committed in {dst}: {write_remedy(e)}, and convert again",
            ) from e


# What one output file holds, in source order: ("t", fqn, idx), ("v", key), or ("e", fqn) for a
# tensor of no elements the source lists with no chunk at all.
_Item = tuple[Any, ...]


def _items_by_file(source: Source) -> dict[int, list[_Item]]:
    """Every chunk and value of ``source``, grouped by source file and ordered by position."""
    per_file: dict[int, list[tuple[int, _Item]]] = {}
    chunkless = []
    for fqn in source.index.tensors:
        n = len(source.chunks(fqn))
        if n == 0:  # only a tensor of no elements passes the source's coverage check so
            chunkless.append(fqn)
        for idx in range(n):
            file, start = source.chunk_origin(fqn, idx)
            per_file.setdefault(file, []).append((start, ("t", fqn, idx)))
    keys = [
        *source.index.values,
        *(rank_local_key(r, k) for k, v in source.index.rank_local.items() for r in v),
    ]
    for key in keys:
        loc = source.value_location(key)
        per_file.setdefault(loc.file, []).append((loc.start, ("v", key)))
    # One empty chunk each (no bytes), in the first file, as a save records such a tensor.
    first = per_file.setdefault(min(per_file, default=0), [])
    first += [(-1, ("e", fqn)) for fqn in chunkless]
    return {f: [it for _, it in sorted(items, key=lambda x: x[0])] for f, items in per_file.items()}


def _entry(source: Source, item: _Item, value: bytes | None) -> PlannedEntry:
    if item[0] == "v":
        assert value is not None
        return value_entry(item[1], len(value))
    rec = source.index.tensors[item[1]]
    if item[0] == "e":
        return chunk_entry(item[1], rec.dtype, rec.shape, (0,) * len(rec.shape), rec.shape)
    _, fqn, idx = item
    box = source.box(fqn, idx)
    return chunk_entry(fqn, rec.dtype, rec.shape, box.offsets, box.sizes)


def _convert(ckpt: Checkpoint, dst: str, progress: ProgressFn, sync_files: bool) -> Index:
    source, reader = ckpt.source, ckpt._reader
    index, budget = source.index, ckpt.options.buffer_bytes
    per_file = _items_by_file(source)
    buf = torch.empty(budget, dtype=torch.uint8)
    # A chunk stored in another dimension order is read through staging memory as well: each of
    # the copy buffer and the staging memory gets half the budget.
    engine = ckpt._chunk_reads(budget // 2)
    save_id = uuid.uuid4().hex[:8]
    files: list[FileRecord] = []
    written: list[list[WrittenEntry]] = []
    per_rank: dict[int, int] = {}
    try:
        # Values first (they are small): their sizes are only known once encoded.
        keys = [it[1] for items in per_file.values() for it in items if it[0] == "v"]
        values = dict(zip(keys, read_values(source, reader, keys)))
        planned = {
            fi: [_entry(source, it, values.get(it[1]) if it[0] == "v" else None) for it in items]
            for fi, items in per_file.items()
        }
        total = sum(e.nbytes for entries in planned.values() for e in entries)
        done = 0
        for fi in sorted(per_file):
            # (A source of no data file at all gets one, of rank 0, for its empty tensors.)
            rank = (source.file_rank(fi) if fi < len(source.paths) else None) or 0
            n = per_rank.get(rank, 0)
            per_rank[rank] = n + 1
            name = data_file_name(rank, save_id if n == 0 else f"{save_id}-{n}")
            items, entries = per_file[fi], planned[fi]
            path = os.path.join(dst, name)
            out = DataFileWriter(
                path,
                entries,
                rank=rank,
                world_size=index.world_size,
                save_id=save_id,
                sync=sync_files,
            )
            try:
                with out:
                    for i, it in enumerate(items):
                        if it[0] == "v":
                            out.write(i, values[it[1]])
                        elif it[0] == "t":
                            _copy_chunk(source, engine, it[1], it[2], out, i, buf)
                        done += entries[i].nbytes
                        progress(done, total)
            except OSError as e:
                # A write to the open file (pwrite, fsync) names no file: the error names this one.
                if e.filename is None:
                    e.filename = path
                raise
            files.append(FileRecord(name, rank, out.size))
            written.append([WrittenEntry.of(e, s) for e, s in zip(out.entries, out.starts)])
    finally:
        engine.close()
    result = build_index(index.world_size, files, written)
    commit_index(dst, result)
    return result


def _copy_chunk(
    source: Source,
    engine: ChunkReads,
    fqn: str,
    idx: int,
    out: DataFileWriter,
    i: int,
    buf: torch.Tensor,
) -> None:
    """Copy chunk ``idx`` of ``fqn`` row-major into entry ``i`` of ``out``, slab by slab through
    ``buf``; a verifying ``engine`` checks what is read against the source's checksums."""
    rec = source.index.tensors[fqn]
    box = source.box(fqn, idx)
    dtype, es = rec.dtype, rec.dtype.itemsize
    if box.numel == 0:
        return
    try:
        location = source.locate(fqn, idx)
    except CheckpointFormatError:
        # Not a byte range (a DCP item with overlapping strides): the source
        # reads it whole, bounded by that one item.
        out.write(i, tensor_view(source.materialize(engine.source, fqn, idx)))
        return
    whole = ChunkRegion(location, box.sizes, Box.whole(box.sizes), dtype)
    sums = source.sums_to_check(fqn, idx, location, engine.verify)
    if sums is None:  # no block checksums: the whole chunk, read again (from the page cache)
        engine.check_chunk(whole, fqn, box.offsets)
    budget = engine.staging_bytes if location.dim_order else buf.numel()
    bview = storage_view(buf)
    for offs, sizes in slabs(box.sizes, es, budget):
        nbytes = math.prod(sizes) * es
        slab = buf[:nbytes].view(dtype).view(sizes)
        part = ChunkRegion(location, box.sizes, Box(tuple(offs), tuple(sizes)), dtype)
        engine.add(part, slab, name=fqn, chunk_offsets=box.offsets, sums=sums)
        engine.flush()
        out.write(i, bview[:nbytes])
