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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import xxhash

from ..byteio.durable import atomic_write
from ..core.sharding import Box
from ..core.values import dtype_from_name
from ..errors import CheckpointFormatError
from .header import EntryMeta, read_header
from .names import INDEX_FILE
from .records import ChunkRecord, FileRecord, Index, Layout, Location, TensorRecord
from .schema import parse_json

__all__ = [
    "WrittenEntry",
    "build_index",
    "index_digest",
    "index_bytes",
    "write_index",
    "commit_index",
    "load_index",
    "parse_index",
    "rebuild_index",
]

DIGEST_FIELD = "digest"


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
    without per-chunk entries (mesh-planned tensors, :mod:`ucp_dcp.dcp._mesh_groups`).
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
                raise CheckpointFormatError(
                    f"{files[fi].name}: entry {e.name!r} has unknown kind {e.meta.kind!r}"
                )
    tensors: dict[str, TensorRecord] = {}
    for fqn in sorted(per_tensor):
        items = per_tensor[fqn]
        first = items[0][1].meta
        for fi, e in items:
            if (e.meta.dtype, e.meta.shape) != (first.dtype, first.shape):
                raise CheckpointFormatError(
                    f"tensor {fqn!r} is saved as {first.dtype}{list(first.shape)} in one file and "
                    "as "
                    f"{e.meta.dtype}{list(e.meta.shape)} in {files[fi].name}"
                )
        dtype = dtype_from_name(first.dtype)
        chunks = {Box(e.meta.offsets, e.meta.sizes): (fi, e) for fi, e in items}
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
            raise CheckpointFormatError(
                f"tensor {fqn!r} was written both per chunk and through its mesh group"
            )
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


def index_digest(doc: dict[str, Any]) -> str:
    """The digest of index document ``doc``: xxh3-128 (hex) of its canonical JSON without the
    ``digest`` field.

    Canonical: keys sorted, no whitespace (``separators=(",", ":")``),
    non-ASCII characters escaped, as ``json.dumps(..., sort_keys=True)``
    writes it. Raises ``ValueError`` for a document JSON cannot hold (NaN).
    """
    body = {k: v for k, v in doc.items() if k != DIGEST_FIELD}
    return xxhash.xxh3_128_hexdigest(
        json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")
    )


def write_index(directory: str, index: Index) -> None:
    """Write ``ucp_index.json`` atomically (:func:`~ucp_dcp.byteio.durable.atomic_write`), with its
    digest.

    Readers see either the previous index or the complete new one, never a
    partial file; a failed write leaves no temp file.
    """
    atomic_write(os.path.join(directory, INDEX_FILE), index_bytes(index))


def index_bytes(index: Index) -> bytes:
    """The bytes of ``ucp_index.json`` for ``index``: its JSON with the digest field."""
    doc = index.to_json()
    doc[DIGEST_FIELD] = index_digest(doc)
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def commit_index(directory: str, index: Index) -> None:
    """Commit a checkpoint: write its index atomically, then remove data files of older saves.

    Until the rename the previous index (if any) and its data files stay
    loadable; after it, only native data files the new index does not name
    are removed, never anything else kept in the directory.
    """
    write_index(directory, index)
    keep = {f.name for f in index.files}
    for name in os.listdir(directory):
        if name.startswith("rank") and name.endswith(".safetensors") and name not in keep:
            os.remove(os.path.join(directory, name))


def load_index(directory: str) -> Index:
    """Read and validate ``ucp_index.json`` of checkpoint ``directory``.

    An index that records a digest must match it (:func:`index_digest`);
    then every field is checked (:meth:`Index.from_json`).
    """
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
            hint = (
                " (it holds a DCP .metadata file: it was saved with DCP's default FileSystemWriter)"
            )
        raise CheckpointFormatError(
            f"{directory}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing{hint}. "
            "A save that did not finish leaves no index; load an earlier checkpoint "
            "or rebuild the index from complete data files with ucp_dcp.rebuild_index(path, "
            "write=True)"
        ) from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read the index ({e.strerror or e})") from None
    return parse_index(raw, path)


def parse_index(raw: bytes, path: str) -> Index:
    """Parse and validate the bytes of an index read from ``path`` (a file or an object's URL).

    An index that records a digest must match it (:func:`index_digest`);
    then every field is checked (:meth:`Index.from_json`).
    """
    rebuild = (
        "if the data files are complete, "
        "rebuild it with ucp_dcp.rebuild_index(path, write=True, replace=True)"
    )
    doc = parse_json(raw, f"{path}: truncated or corrupt index", f"; {rebuild}")
    if isinstance(doc, dict) and DIGEST_FIELD in doc:  # indexes written before digests have none
        recorded = doc[DIGEST_FIELD]
        try:
            actual = index_digest(doc)
        except (ValueError, RecursionError):
            actual = "(not canonical JSON)"
        if recorded != actual:
            raise CheckpointFormatError(
                f"{path}: the index does not match its digest (recorded {str(recorded)[:40]!r}, "
                "its content "
                f"hashes to {actual}): it was changed after it was written; {rebuild}"
            )
    return Index.from_json(doc, path)


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
                raise FileExistsError(
                    f"{directory}/{INDEX_FILE} exists; not overwriting it (pass replace=True to "
                    "replace a "
                    "damaged index with the one rebuilt from the data files)"
                )
        write_index(directory, index)
    return index
