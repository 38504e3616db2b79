"""Safetensors data-file headers: parsing (one size limit) and laying out a data file.

No file is opened here: parsing reads through a :class:`RandomAccess` the caller gives
(:mod:`ucp_dcp.byteio.rangeio` opens local files).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.values import dtype_name
from ..errors import CheckpointFormatError
from .names import (
    ALIGN,
    BLOCK_SUMS_ENTRY,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    PAD_PREFIX,
    chunk_entry_name,
    dtype_from_st,
    rank_local_entry_name,
    value_entry_name,
)
from .records import Layout
from .schema import (
    check_chunk_box,
    check_chunk_bytes,
    field_dict,
    field_dtype,
    field_int,
    field_shape,
    field_str,
    field_xxh3,
    is_index_list,
    is_int,
    parse_json,
)


@dataclass(frozen=True)
class EntryMeta:
    """What a data file records about one entry, beyond safetensors' own fields."""

    kind: str  # "tensor" | "value" | "rank_local"
    fqn: str
    dtype: str  # torch dtype name of the logical tensor ("uint8" for values)
    shape: tuple[int, ...]  # global shape (tensors), byte length (values)
    offsets: tuple[int, ...]  # global offsets of this chunk (tensors)
    sizes: tuple[int, ...]  # size of this chunk per dim (tensors)
    xxh3: str
    layout: Layout | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form stored in the file header."""
        d: dict[str, Any] = {"kind": self.kind, "fqn": self.fqn, "xxh3": self.xxh3}
        if self.kind == "tensor":
            d.update(
                dtype=self.dtype,
                shape=list(self.shape),
                offsets=list(self.offsets),
                sizes=list(self.sizes),
            )
            if self.layout is not None:
                d["layout"] = self.layout.to_json()
        return d


@dataclass(frozen=True)
class BlockSumsRecord:
    """Where a data file keeps the block checksums of its tensor chunks.

    Entry :data:`~ucp_dcp.format.names.BLOCK_SUMS_ENTRY` (``nbytes`` at
    absolute offset ``start``) holds one little-endian uint64 xxh3-64 per
    ``block`` bytes of every tensor chunk (:func:`has_block_sums`), chunk
    after chunk in file order; a chunk's last block may be shorter.
    ``xxh3`` is the checksum of the entry itself.
    """

    block: int
    start: int
    nbytes: int
    xxh3: str


def has_block_sums(meta: EntryMeta | None, nbytes: int) -> bool:
    """Whether an entry has block checksums: the non-empty tensor chunks."""
    return meta is not None and meta.kind == "tensor" and nbytes > 0


@dataclass
class FileHeader:
    """A parsed data-file header: per entry, its absolute byte range and metadata."""

    path: str
    size: int
    rank: int
    world_size: int
    save_id: str
    ranges: dict[str, tuple[int, int]]  # entry name -> (start, nbytes), absolute
    meta: dict[str, EntryMeta]  # entry name -> ucp metadata (pads have none)
    block_sums: BlockSumsRecord | None = None  # None: written before block checksums


@dataclass(frozen=True)
class StEntry:
    """One entry of a safetensors header: dtype code, shape and absolute byte range."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass
class SafetensorsHeader:
    """A parsed safetensors header: file size, entries in file order, ``__metadata__``."""

    path: str
    size: int
    entries: dict[str, StEntry]
    metadata: dict[str, Any]


class RandomAccess(Protocol):
    """Bytes that can be read at any offset: a local file, or an object read with ranged
    requests."""

    size: int
    """Total length in bytes."""

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset``."""
        ...


def parse_safetensors(path: str, access: RandomAccess) -> SafetensorsHeader:
    """Read and validate the header of safetensors file ``path`` (any writer's) through ``access``.

    Checks the header length against :data:`MAX_HEADER_BYTES` and the file size, that every entry
    has a dtype code, a shape and a byte range inside the file. Raises
    :class:`CheckpointFormatError` naming the file. ``access`` reads the bytes (a local file:
    :class:`~ucp_dcp.byteio.rangeio.FileAccess`; an object:
    :class:`~ucp_dcp.byteio.objrange.ObjectAccess`).
    """
    size = access.size
    head = access.pread(8, 0)
    if len(head) < 8:
        raise CheckpointFormatError(
            f"{path}: truncated ({size} bytes; a safetensors file starts with 8)"
        )
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise CheckpointFormatError(
            f"{path}: header length {n} exceeds the file ({size} bytes): truncated or not "
            "safetensors"
        )
    raw = access.pread(n, 8)
    doc = parse_json(raw, f"{path}: header is not valid JSON")
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    md = doc.pop("__metadata__", None) or {}
    if not isinstance(md, dict):
        raise CheckpointFormatError(f"{path}: __metadata__ is not a JSON object")
    entries: dict[str, StEntry] = {}
    end_of_data = data_start
    for name, e in doc.items():
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if not is_index_list(offsets, 2) or offsets[0] > offsets[1]:
            raise CheckpointFormatError(
                f"{path}: entry {name!r} has bad data_offsets {offsets!r}"[:300]
            )
        shape = field_shape(e, "shape", f"{path}: entry {name!r}")
        code = field_str(e, "dtype", f"{path}: entry {name!r}")
        b, en = offsets
        dtype = dtype_from_st(code)
        if dtype is not None and en - b != math.prod(shape) * dtype.itemsize:
            raise CheckpointFormatError(
                f"{path}: entry {name!r} holds {en - b} bytes, but {code}{list(shape)} needs "
                f"{math.prod(shape) * dtype.itemsize}"
            )
        entries[name] = StEntry(name, code, shape, data_start + b, en - b)
        end_of_data = max(end_of_data, data_start + en)
    if end_of_data > size:
        raise CheckpointFormatError(
            f"{path}: truncated: entries need {end_of_data} bytes but the file has {size}"
        )
    # Entries must not share bytes (safetensors lays them end to end): then
    # no two records can claim the same data, and together they fit the file.
    ordered = sorted((e for e in entries.values() if e.nbytes), key=lambda e: e.start)
    for a, b_ in zip(ordered, ordered[1:]):
        if b_.start < a.start + a.nbytes:
            raise CheckpointFormatError(f"{path}: entries {a.name!r} and {b_.name!r} overlap")
    return SafetensorsHeader(path, size, entries, md)


_KINDS = ("tensor", "value", "rank_local")


def parse_header(path: str, access: RandomAccess) -> FileHeader:
    """Read and validate the header of native data file ``path`` through ``access``.

    Raises :class:`CheckpointFormatError` naming the file (and the entry and
    field) when it is truncated, not safetensors, not written by ucp_dcp,
    has an entry outside the file, or metadata that does not describe its
    entries: every entry's name, kind, dtype, box and byte count must agree.
    """
    st = parse_safetensors(path, access)
    raw = st.metadata.get("ucp_dcp")
    if not isinstance(raw, str):
        raise CheckpointFormatError(f"{path}: safetensors file without ucp_dcp metadata")
    ucp = parse_json(raw, f"{path}: ucp_dcp metadata is not valid JSON")
    if not isinstance(ucp, dict):
        raise CheckpointFormatError(f"{path}: safetensors file without ucp_dcp metadata")
    if ucp.get("version") != FORMAT_VERSION or isinstance(ucp.get("version"), bool):
        raise CheckpointFormatError(
            f"{path}: unsupported format version {ucp.get('version')!r}"[:300]
        )
    where = f"{path}: ucp_dcp metadata"
    world_size = field_int(ucp, "world_size", where, lo=1)
    rank = field_int(ucp, "rank", where, hi=world_size - 1)
    save_id = field_str(ucp, "save_id", where)
    entries_meta = field_dict(ucp, "entries", where)
    ranges = {name: (e.start, e.nbytes) for name, e in st.entries.items()}
    meta: dict[str, EntryMeta] = {}
    for name, m in entries_meta.items():
        e = st.entries.get(name)
        if e is None:
            raise CheckpointFormatError(
                f"{path}: metadata names entry {name!r} that the file does not hold"
            )
        if dtype_from_st(e.st_dtype) is None:
            raise CheckpointFormatError(
                f"{path}: entry {name!r} has dtype code {e.st_dtype!r}, which ucp_dcp does not "
                "write"
            )
        meta[name] = _entry_meta(m, name, e.nbytes, f"{path}: metadata of entry {name!r}")
    return FileHeader(
        path,
        st.size,
        rank,
        world_size,
        save_id,
        ranges,
        meta,
        block_sums_record(path, ucp, st.entries),
    )


# Blocks are 4 KiB when written; anything past 1 GiB is damage (and would
# overflow the C integers block arithmetic is done in).
_MAX_BLOCK = 1 << 30


def block_sums_record(
    path: str, ucp: dict[str, Any], entries: dict[str, StEntry]
) -> BlockSumsRecord | None:
    """The block checksums a data file's ``ucp_dcp`` metadata ``ucp`` announces (None: it has
    none)."""
    bs = ucp.get("block_sums")
    if bs is None:
        return None
    e = entries.get(BLOCK_SUMS_ENTRY)
    block, digest = (bs.get("block"), bs.get("xxh3")) if isinstance(bs, dict) else (None, None)
    if not (is_int(block) and 0 < block <= _MAX_BLOCK and isinstance(digest, str)):
        raise CheckpointFormatError(f"{path}: malformed block_sums metadata {bs!r}")
    if e is None or e.st_dtype != "U64" or e.nbytes % 8:
        raise CheckpointFormatError(
            f"{path}: block_sums metadata without a U64 {BLOCK_SUMS_ENTRY} entry"
        )
    return BlockSumsRecord(block, e.start, e.nbytes, digest)


def _entry_meta(m: Any, name: str, nbytes: int, where: str) -> EntryMeta:
    kind = field_str(m, "kind", where)
    if kind not in _KINDS:
        raise CheckpointFormatError(
            f"{where}: field 'kind' must be one of {list(_KINDS)}, got {kind!r}"
        )
    fqn = field_str(m, "fqn", where)
    xxh3 = field_xxh3(m, "xxh3", where)
    if kind != "tensor":
        expected = value_entry_name(fqn) if kind == "value" else rank_local_entry_name(fqn)
        if name != expected:
            raise CheckpointFormatError(
                f"{where}: a {kind} named {fqn!r} must be stored as entry {expected!r}"
            )
        return EntryMeta(kind, fqn, "uint8", (), (), (), xxh3)
    dtype = field_dtype(m, "dtype", where)
    shape = field_shape(m, "shape", where)
    box = check_chunk_box(m.get("offsets"), m.get("sizes"), shape, where)
    check_chunk_bytes(box, dtype, nbytes, where)
    if name != chunk_entry_name(fqn, box.offsets):
        raise CheckpointFormatError(
            f"{where}: a chunk of {fqn!r} at {list(box.offsets)} must be stored as entry "
            f"{chunk_entry_name(fqn, box.offsets)!r}"
        )
    layout = Layout.from_field(m, len(shape), where)
    return EntryMeta(kind, fqn, dtype_name(dtype), shape, box.offsets, box.sizes, xxh3, layout)


@dataclass
class PlannedEntry:
    """An entry to write: name, safetensors dtype and shape, byte length, metadata."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    meta: EntryMeta | None  # None for padding


def layout_file(
    entries: Iterable[PlannedEntry],
    rank: int,
    world_size: int,
    save_id: str,
    align: int = ALIGN,
    *,
    block_sums: tuple[int, str] | None = None,
) -> tuple[bytes, list[int], int]:
    """Lay out a data file: its header bytes and each entry's absolute offset.

    Entries of at least ``align`` bytes start on an ``align`` boundary;
    padding entries fill the gaps. Returns ``(header, offsets, file_size)``;
    the header contains the checksums already in ``meta`` (callers that hash
    while writing lay out twice: a checksum has a fixed width, so the header
    length does not change). ``block_sums``, ``(block, xxh3)``, announces a
    :data:`~ucp_dcp.format.names.BLOCK_SUMS_ENTRY` among ``entries``.
    """
    entries = list(entries)
    # Data offsets are relative to the data section, which starts right after
    # the header; the header is padded with spaces so that the data section
    # itself starts on an alignment boundary.
    rel: list[int] = []
    layout: list[PlannedEntry] = []
    pos = 0
    npad = 0
    for e in entries:
        if e.nbytes >= align and pos % align:
            pad = align - pos % align
            layout.append(PlannedEntry(f"{PAD_PREFIX}{npad}", "U8", (pad,), pad, None))
            npad += 1
            pos += pad
        rel.append(pos)
        layout.append(e)
        pos += e.nbytes
    header = header_entries((e.name, e.st_dtype, e.shape, e.nbytes) for e in layout)
    header["__metadata__"] = {
        "ucp_dcp": json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "rank": rank,
                "world_size": world_size,
                "save_id": save_id,
                "entries": {e.name: e.meta.to_json() for e in entries if e.meta is not None},
                **(
                    {"block_sums": {"block": block_sums[0], "xxh3": block_sums[1]}}
                    if block_sums
                    else {}
                ),
            },
            separators=(",", ":"),
        )
    }
    head = encode_header(header, align if pos else 8)
    return head, [len(head) + r for r in rel], len(head) + pos


def header_entries(entries: Iterable[tuple[str, str, Sequence[int], int]]) -> dict[str, Any]:
    """A safetensors header's tensor entries for ``(name, dtype code, shape, nbytes)`` laid end to
    end from the data section's first byte, in order."""
    header: dict[str, Any] = {}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return header


def encode_header(header: dict[str, Any], align: int = 8) -> bytes:
    """A safetensors header's bytes: the JSON's length (little-endian u64), then the JSON,
    space-padded so that the data section after it starts on an ``align`` boundary."""
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw
