"""The global index: building it, and its bytes (serialising, parsing, the digest).

The coordinator builds the index at the end of a save from what every rank reports it wrote
(:class:`WrittenEntry`); :func:`~ucp_dcp.sources.native.rebuild_index` builds the same index from
the data files' headers alone. Both go through :func:`build_index`, which stores a tensor compactly
when its chunks are exactly those of the DTensor layout it was saved with. No file is opened here:
the index is committed by :func:`~ucp_dcp.byteio.location.commit_index` and loaded by
:func:`~ucp_dcp.sources.native.load_index`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import xxhash

from ..core.sharding import Box
from ..core.values import dtype_from_name
from ..errors import CheckpointFormatError, InvalidArgumentError
from .header import EntryMeta, PlannedEntry
from .records import ChunkRecord, FileRecord, Index, Layout, Location, TensorRecord
from .schema import parse_json

__all__ = ["WrittenEntry", "build_index", "index_digest", "index_bytes", "parse_index"]

DIGEST_FIELD = "digest"


@dataclass(frozen=True)
class WrittenEntry:
    """One entry a rank wrote: its name, metadata and absolute byte range."""

    name: str
    meta: EntryMeta
    start: int
    nbytes: int

    @classmethod
    def of(cls, entry: PlannedEntry, start: int) -> WrittenEntry:
        """The record of ``entry`` (a tensor chunk or a value) written at byte ``start``.

        Raises :class:`~ucp_dcp.errors.InvalidArgumentError` for an entry
        without metadata (padding, block checksums): the index records none.
        """
        if entry.meta is None:
            raise InvalidArgumentError(
                f"entry {entry.name!r} is padding or block checksums, not a tensor chunk or a "
                "value: the index records only those"
            )
        return cls(entry.name, entry.meta, start, entry.nbytes)


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
    per_tensor: dict[str, list[tuple[Location, WrittenEntry]]] = defaultdict(list)
    values: dict[str, Location] = {}
    rank_local: dict[str, dict[int, Location]] = defaultdict(dict)
    for fi, entries in enumerate(written):
        for e in entries:
            loc = Location(fi, e.start, e.nbytes, e.meta.xxh3)
            if e.meta.kind == "tensor":
                per_tensor[e.meta.fqn].append((loc, e))
            elif e.meta.kind == "value":
                values[e.meta.fqn] = loc
            else:  # "rank_local": the only other kind a header may name (header._KINDS)
                rank_local[e.meta.fqn][files[fi].rank] = loc
    tensors: dict[str, TensorRecord] = {}
    for fqn in sorted(per_tensor):
        items = per_tensor[fqn]
        first = items[0][1].meta
        for loc, e in items:
            if (e.meta.dtype, e.meta.shape) != (first.dtype, first.shape):
                raise CheckpointFormatError(
                    f"tensor {fqn!r} is saved as {first.dtype}{list(first.shape)} in one file and "
                    "as "
                    f"{e.meta.dtype}{list(e.meta.shape)} in {files[loc.file].name}"
                )
        dtype = dtype_from_name(first.dtype)
        chunks = {Box(e.meta.offsets, e.meta.sizes): loc for loc, e in items}
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
                ChunkRecord(box, loc)
                for box, loc in sorted(chunks.items(), key=lambda kv: kv[0].offsets)
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
    chunks: dict[Box, Location],
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
        files.append(hit.file)
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


def index_bytes(index: Index) -> bytes:
    """The bytes of ``ucp_index.json`` for ``index``: its JSON with the digest field."""
    doc = index.to_json()
    doc[DIGEST_FIELD] = index_digest(doc)
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def parse_index(raw: bytes, path: str) -> Index:
    """Parse and validate the bytes of an index read from ``path`` (a file or an object's URL).

    An index that records a digest must match it (:func:`index_digest`);
    then every field is checked (:meth:`Index.from_json`).
    """
    rebuild = (
        "if the data files are complete, rebuild it with "
        "ucp_dcp.rebuild_index(path, write=True, replace=True)"
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
