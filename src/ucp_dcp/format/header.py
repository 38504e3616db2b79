"""Safetensors data-file headers: parsing (one size limit) and laying out a data file."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable

from ..errors import CheckpointFormatError
from .names import ALIGN, BLOCK_SUMS_ENTRY, FORMAT_NAME, FORMAT_VERSION, MAX_HEADER_BYTES, PAD_PREFIX
from .records import Layout



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
                dtype=self.dtype, shape=list(self.shape), offsets=list(self.offsets), sizes=list(self.sizes)
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


def has_block_sums(meta: "EntryMeta | None", nbytes: int) -> bool:
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
    shapes: dict[str, tuple[int, ...]]  # entry name -> shape of the stored chunk
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


def _open_for_header(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointFormatError(f"data file {path} is missing") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    if hasattr(os, "posix_fadvise"):
        # Without this the header read leaves read-ahead marks in the page
        # cache, and a later exact read of a marked page makes the kernel
        # stream in the rest of the file: other ranks' bytes.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def parse_safetensors(path: str, fd: int | None = None) -> SafetensorsHeader:
    """Read and validate the header of safetensors file ``path`` (any writer's).

    Checks the header length against :data:`MAX_HEADER_BYTES` and the file
    size, that every entry has a dtype code, a shape and a byte range inside
    the file. Raises :class:`CheckpointFormatError` naming the file.
    """
    own = fd is None
    if own:
        fd = _open_for_header(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointFormatError(f"{path}: truncated ({size} bytes; a safetensors file starts with 8)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointFormatError(
                f"{path}: header length {n} exceeds the file ({size} bytes): truncated or not safetensors"
            )
        raw = os.pread(fd, n, 8)
    finally:
        if own:
            os.close(fd)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    md = doc.pop("__metadata__", None) or {}
    if not isinstance(md, dict):
        raise CheckpointFormatError(f"{path}: __metadata__ is not a JSON object")
    entries: dict[str, StEntry] = {}
    end_of_data = data_start
    for name, e in doc.items():
        try:
            b, en = e["data_offsets"]
            shape = tuple(e["shape"])
            code = e["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: entry {name!r} is malformed") from None
        if not (isinstance(b, int) and isinstance(en, int) and 0 <= b <= en):
            raise CheckpointFormatError(f"{path}: entry {name!r} has bad data_offsets {e['data_offsets']!r}")
        if not (isinstance(code, str) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in shape)):
            raise CheckpointFormatError(f"{path}: entry {name!r} has a bad dtype or shape")
        entries[name] = StEntry(name, code, shape, data_start + b, en - b)
        end_of_data = max(end_of_data, data_start + en)
    if end_of_data > size:
        raise CheckpointFormatError(
            f"{path}: truncated: entries need {end_of_data} bytes but the file has {size}"
        )
    return SafetensorsHeader(path, size, entries, md)


def read_header(path: str, fd: int | None = None) -> FileHeader:
    """Read and validate the header of native data file ``path``.

    Raises :class:`CheckpointFormatError` naming the file when it is
    truncated, not safetensors, not written by ucp_dcp, or has an entry
    outside the file.
    """
    st = parse_safetensors(path, fd)
    try:
        ucp = json.loads(st.metadata["ucp_dcp"])
        entries_meta = ucp["entries"]
        rank = int(ucp["rank"])
        world_size = int(ucp["world_size"])
        save_id = str(ucp["save_id"])
    except (KeyError, TypeError, ValueError, json.JSONDecodeError):
        raise CheckpointFormatError(f"{path}: safetensors file without ucp_dcp metadata") from None
    if ucp.get("version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: unsupported format version {ucp.get('version')!r}")
    ranges = {name: (e.start, e.nbytes) for name, e in st.entries.items()}
    shapes = {name: e.shape for name, e in st.entries.items()}
    meta: dict[str, EntryMeta] = {}
    if not isinstance(entries_meta, dict):
        raise CheckpointFormatError(f"{path}: ucp_dcp metadata without an entries object")
    for name, m in entries_meta.items():
        if name not in ranges:
            raise CheckpointFormatError(f"{path}: metadata names entry {name!r} that the file does not hold")
        try:
            layout = Layout.from_json(m["layout"], f"{path}: {name}") if m.get("layout") else None
            meta[name] = EntryMeta(
                m["kind"], m["fqn"], m.get("dtype", "uint8"), tuple(m.get("shape", ())),
                tuple(m.get("offsets", ())), tuple(m.get("sizes", ())), m["xxh3"], layout,
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointFormatError(f"{path}: metadata of entry {name!r} is malformed ({e})") from None
    return FileHeader(path, st.size, rank, world_size, save_id, ranges, shapes, meta,
                      block_sums_record(path, ucp, st.entries))


def block_sums_record(path: str, ucp: dict[str, Any], entries: dict[str, StEntry]) -> BlockSumsRecord | None:
    """The block checksums a data file's ``ucp_dcp`` metadata ``ucp`` announces (None: it has none)."""
    bs = ucp.get("block_sums")
    if bs is None:
        return None
    e = entries.get(BLOCK_SUMS_ENTRY)
    block, digest = (bs.get("block"), bs.get("xxh3")) if isinstance(bs, dict) else (None, None)
    if not (isinstance(block, int) and not isinstance(block, bool) and block > 0 and isinstance(digest, str)):
        raise CheckpointFormatError(f"{path}: malformed block_sums metadata {bs!r}")
    if e is None or e.st_dtype != "U64" or e.nbytes % 8:
        raise CheckpointFormatError(f"{path}: block_sums metadata without a U64 {BLOCK_SUMS_ENTRY} entry")
    return BlockSumsRecord(block, e.start, e.nbytes, digest)


@dataclass
class PlannedEntry:
    """An entry to write: name, safetensors dtype and shape, byte length, metadata."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    meta: EntryMeta | None  # None for padding


def layout_file(
    entries: Iterable[PlannedEntry], rank: int, world_size: int, save_id: str, align: int = ALIGN,
    *, block_sums: tuple[int, str] | None = None,
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
    header: dict[str, Any] = {}
    p = 0
    for e in layout:
        header[e.name] = {"dtype": e.st_dtype, "shape": list(e.shape), "data_offsets": [p, p + e.nbytes]}
        p += e.nbytes
    header["__metadata__"] = {
        "ucp_dcp": json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "rank": rank,
                "world_size": world_size,
                "save_id": save_id,
                "entries": {e.name: e.meta.to_json() for e in entries if e.meta is not None},
                **({"block_sums": {"block": block_sums[0], "xxh3": block_sums[1]}} if block_sums else {}),
            },
            separators=(",", ":"),
        )
    }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    total = 8 + len(raw)
    padded = -(-total // align) * align if pos else -(-total // 8) * 8
    raw += b" " * (padded - total)
    data_start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, [data_start + r for r in rel], data_start + pos
