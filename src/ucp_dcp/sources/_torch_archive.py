"""``torch.save`` archives read without running code from them or building their tensors.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (the pickle that
rebuilds the object) and one uncompressed record ``<name>/data/<key>`` per
storage. The pickle goes through the library's one restricted unpickler
(:mod:`._pickle`), for the purpose the caller names: each tensor becomes a
:class:`TensorRef` (storage key and geometry; no data is read). Two readers
share the archive parsing:

* :func:`read_torch_archive`: a whole file (DeepSpeed's state files) as inert
  records, and where each storage record's bytes start, so a reader can fetch
  any slice of any tensor with one ``pread``;
* :func:`parse_tensor_item`: the byte address of one saved tensor held inside
  a larger file (DCP's ``.distcp`` items).
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..byteio.objstore import ObjectStore
from ..byteio.rangeio import ReadStats
from ..core.boxes import row_major_strides
from ..errors import CheckpointFormatError, StorageError
from ._pickle import PurposeName, TensorRef, unpickle

__all__ = [
    "TorchArchive",
    "read_torch_archive",
    "StoredTensor",
    "PRead",
    "item_ends",
    "parse_tensor_item",
    "dim_order",
]

# A pickle describing state (not tensor data) is small; a larger one is damaged or hostile.
_MAX_PICKLE_BYTES = 256 * 1024 * 1024
_LOCAL_HEADER = 30


@dataclass
class TorchArchive:
    """A ``torch.save`` file: its object tree (with :class:`TensorRef` leaves) and where the
    storages are."""

    path: str
    obj: Any
    size: int
    # Storage key -> (absolute start, nbytes).
    records: dict[str, tuple[int, int]] = field(default_factory=dict)

    def byte_range(self, t: TensorRef, what: str) -> tuple[int, int]:
        """``(absolute start, nbytes)`` of dense tensor ``t``; an error naming ``what`` if it is not
        dense row-major."""
        if t.numel > 1 and not _row_major(t.size, t.stride):
            raise CheckpointFormatError(
                f"{self.path}: {what} is not stored row-major (stride {list(t.stride)})"
            )
        start, nbytes = self.records[t.storage]
        off = t.storage_offset * t.dtype.itemsize
        if off + t.nbytes > nbytes:
            raise CheckpointFormatError(
                f"{self.path}: {what} ({t.nbytes} bytes at element {t.storage_offset}) runs past "
                "its storage "
                f"record data/{t.storage} of {nbytes} bytes"
            )
        return start + off, t.nbytes


@contextmanager
def archive_errors(where: str) -> Iterator[None]:
    """Reading a ``torch.save`` archive: what zipfile (and the struct reads of its headers) raise
    on a damaged one becomes :class:`CheckpointFormatError` ``"{where}: not a readable torch.save
    archive (...)"``; a store that failed to answer (:class:`StorageError`, an ``OSError`` too)
    and a finding that names what is wrong already (:class:`CheckpointFormatError`, a
    ``ValueError`` too) pass as they are."""
    try:
        yield
    except (StorageError, CheckpointFormatError):
        raise
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        OSError,
        EOFError,
        ValueError,
        struct.error,
        zlib.error,  # a damaged compressed member
        NotImplementedError,  # a damaged directory: "zip file version 12.8", "compression type 9"
        RuntimeError,  # a damaged flag: "... is encrypted, password required for extract"
    ) as e:
        raise CheckpointFormatError(f"{where}: not a readable torch.save archive ({e})") from None


def _unpickle_archive(
    f: Any, where: str, purpose: PurposeName, max_bytes: int, too_large: str
) -> tuple[Any, dict[str, zipfile.ZipInfo]]:
    """The object tree of the ``torch.save`` archive open as ``f`` (its ``data.pkl`` unpickled
    for ``purpose``) and its storage records: key -> its ``<name>/data/<key>`` record.

    Refuses (naming ``where``) archives without exactly one ``<name>/data.pkl``,
    pickles over ``max_bytes`` (``too_large`` says why that is wrong here)
    and big-endian data. An :class:`_ObjectFile` fetches the small records first, in one batch.
    """
    with archive_errors(where):
        zf = zipfile.ZipFile(f)
        if isinstance(f, _ObjectFile):
            f.fetch_small_records(zf)
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointFormatError(
                f"{where}: not a torch.save archive (no single <name>/data.pkl)"
            )
        prefix = pkls[0][: -len("data.pkl")]
        info = zf.getinfo(pkls[0])
        if info.file_size > max_bytes:
            raise CheckpointFormatError(
                f"{where}: data.pkl of {info.file_size} bytes is {too_large}"
            )
        pkl = zf.read(info)
        if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
            raise CheckpointFormatError(f"{where}: big-endian tensor data is not supported")
        records = {
            n[len(prefix) + 5 :]: zf.getinfo(n)
            for n in zf.namelist()
            if n.startswith(prefix + "data/")
        }
    return unpickle(pkl, where, purpose, records), records


def stored_record_start(
    read_at: Callable[[int, int], bytes], info: zipfile.ZipInfo, where: str, size: int, of: str
) -> int:
    """Offset (in the archive) of the first data byte of uncompressed zip record ``info``, refused
    unless the record ends inside the archive's ``size`` bytes (``of``: the file or the item).

    ``read_at(offset, n)`` reads from the archive. The central directory
    does not say where the data starts: the local header in front of it has
    its own name and extra-field lengths (torch pads the extra field so data
    is aligned).
    """
    if (
        info.compress_type != zipfile.ZIP_STORED
        or info.flag_bits & 0x1
        or info.compress_size != info.file_size
    ):
        raise CheckpointFormatError(f"{where}: record {info.filename} is compressed or encrypted")
    local = read_at(info.header_offset, _LOCAL_HEADER)
    if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04":
        raise CheckpointFormatError(f"{where}: bad local zip header for {info.filename}")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + _LOCAL_HEADER + name_len + extra_len
    if start + info.file_size > size:
        record = info.filename.split("/", 1)[1]  # data/<key>
        raise CheckpointFormatError(f"{where}: storage record {record} runs past the end of {of}")
    return start


def read_torch_archive(
    path: str,
    purpose: PurposeName,
    *,
    store: ObjectStore | None = None,
    size: int | None = None,
) -> TorchArchive:
    """Read ``path`` (a ``torch.save`` file) as inert records: only its central directory,
    ``data.pkl`` and its storage records' local headers.

    With ``store``, ``path`` is the URL of an object in it (``size``, when
    the listing gave it, saves asking): the archive is read with a few
    ranged requests (:class:`_ObjectFile`: the tail, the pickle, the local
    headers in one batch), never downloaded whole.

    Raises :class:`CheckpointFormatError` naming the file when it is not a
    ``torch.save`` zip archive, when its pickle names a global outside
    ``purpose``'s table (checked before anything is built), or when a storage
    record is missing, compressed or runs past the end of the file.
    """
    if store is not None:
        name = store.name_of(path)
        obj = _ObjectFile(store, name, store.size(name) if size is None else size)
        return _read_archive(obj, path, obj.size, purpose, obj.read_at)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    with f:

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(f.fileno(), n, offset)

        return _read_archive(f, path, os.fstat(f.fileno()).st_size, purpose, read_at)


def _read_archive(
    f: Any,
    path: str,
    size: int,
    purpose: PurposeName,
    read_at: Callable[[int, int], bytes],
) -> TorchArchive:
    """The archive open as ``f``: a local file, or an :class:`_ObjectFile`, which fetches ahead
    what will be read."""
    tree, infos = _unpickle_archive(f, path, purpose, _MAX_PICKLE_BYTES, "too large to be state")
    if isinstance(f, _ObjectFile):  # every storage record's local header, in one batch
        f.fetch([(zi.header_offset, zi.header_offset + _LOCAL_HEADER) for zi in infos.values()])
    records: dict[str, tuple[int, int]] = {}
    for key, zi in infos.items():
        records[key] = (stored_record_start(read_at, zi, path, size, "the file"), zi.file_size)
    return TorchArchive(path, tree, size, records)


# The end of an archive fetched by the first request: the end-of-central-directory
# record and, for files of up to some hundreds of tensors, the whole central directory.
_TAIL_BYTES = 256 << 10
# Room for the local header's extra field, which the central directory does
# not give (torch pads it to align the data; zip64 adds 20 bytes).
_EXTRA_SLACK = 256


class HeldBytesFile(io.RawIOBase):
    """A read-only seekable file of ``size`` bytes, as :mod:`zipfile` wants one, over pieces held in
    memory.

    ``pieces`` are ``(offset, bytes)``; a read inside one is served from it,
    any other goes to :meth:`read_missing`. A seek before the start is an
    ``OSError``, which :mod:`zipfile` takes for a file too short to be an
    archive.
    """

    def __init__(self, size: int, pieces: list[tuple[int, bytes]]) -> None:
        super().__init__()
        self.size = size
        self.pieces = pieces
        self._pos = 0

    def read_missing(self, offset: int, n: int) -> bytes:
        """``n`` bytes at ``offset`` (fewer at the end) that no piece holds."""
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(f"seek to {base + offset}, before the start")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self._pos + n)
        data = self.read_at(self._pos, max(0, end - self._pos))
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def read_at(self, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes at ``offset`` (fewer at the end): from a held piece, else
        :meth:`read_missing`."""
        end = min(offset + n, self.size)
        if offset >= end:
            return b""
        for start, data in self.pieces:
            if start <= offset and end <= start + len(data):
                return data[offset - start : end - start]
        return self.read_missing(offset, end - offset)


class _ObjectFile(HeldBytesFile):
    """An object in a store as the read-only seekable file :mod:`zipfile` wants, read by ranged
    requests.

    Bytes come from windows fetched ahead: the tail on creation (zip's end
    records and central directory), the small records (``data.pkl``,
    ``byteorder``) in one batch once the directory is known
    (:meth:`fetch_small_records`), the storage records' local headers in
    another (:meth:`fetch`). A read outside them is one ranged request.
    """

    def __init__(self, store: ObjectStore, name: str, size: int) -> None:
        super().__init__(size, [])
        self.store = store
        self.name = name
        if size:
            self.fetch([(max(0, size - _TAIL_BYTES), size)])

    def read_missing(self, offset: int, n: int) -> bytes:
        self.fetch([(offset, offset + n)])
        return self.pieces[-1][1][:n]

    def fetch(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch ``[start, end)`` ranges (clipped to the object) in one batch of requests, unless
        already held."""
        want = []
        for s, e in ranges:
            e = min(e, self.size)
            if s < e and not any(ws <= s and e <= ws + len(d) for ws, d in self.pieces):
                want.append((self.name, s, e))
        for (_, s, _), data in zip(want, self.store.read_ranges(want) if want else []):
            self.pieces.append((s, data))

    def fetch_small_records(self, zf: zipfile.ZipFile) -> None:
        """Fetch every record that is not tensor data (``data.pkl``, ``byteorder``, ...) with its
        local header.

        One request for the lot when they are next to each other (torch
        writes them first); a pickle too large to be state is left for
        :func:`read_pickle_record` to refuse.
        """
        spans = sorted(
            (
                zi.header_offset,
                zi.header_offset
                + _LOCAL_HEADER
                + len(zi.orig_filename.encode())
                + _EXTRA_SLACK
                + zi.compress_size,
            )
            for zi in zf.infolist()
            if "/data/" not in zi.filename and zi.compress_size <= _MAX_PICKLE_BYTES
        )
        merged: list[tuple[int, int]] = []
        for s, e in spans:
            if merged and s <= merged[-1][1] + _EXTRA_SLACK:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self.fetch(merged)


# One tensor item: an archive inside a larger file (a DCP ``.distcp`` item).

PRead = Callable[[int, int], bytes]
"""``pread(n, offset)``: up to ``n`` bytes of a file at ``offset`` (fewer only at its end)."""

# Bytes read at each end of an item to parse it: the zip central directory
# (7 records of a torch.save archive) sits at the end, data.pkl and the
# storage record's local header at the start. Anything not in them is read
# on demand.
_ITEM_HEAD_BYTES = 768
_ITEM_TAIL_BYTES = 768
_ITEM_MAX_PICKLE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class StoredTensor:
    """Where a ``torch.save``\\ d tensor's bytes are and how they are laid out."""

    dtype: torch.dtype
    data_start: int  # absolute offset of the storage record in the data file
    record_nbytes: int
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def span(self) -> int:
        """Elements of the storage from its start to one past the tensor's last (of a non-empty
        tensor)."""
        return self.storage_offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1


class _ItemView(HeldBytesFile):
    """A read-only, seekable view of ``[base, base + length)`` of a file.

    Reads that fall inside the pieces read up front are served from them;
    anything else is read with ``pread`` and counted in ``stats``.
    """

    def __init__(
        self,
        pread: PRead,
        base: int,
        length: int,
        pieces: list[tuple[int, bytes]],
        stats: ReadStats,
    ) -> None:
        super().__init__(length, pieces)
        self._pread, self._base, self._stats = pread, base, stats

    def read_missing(self, offset: int, n: int) -> bytes:
        return _pread_exact(self._pread, n, self._base + offset, self._stats)


def _pread_exact(pread: PRead, n: int, offset: int, stats: ReadStats) -> bytes:
    parts, calls, got = [], 0, 0
    while got < n:
        chunk = pread(n - got, offset + got)
        calls += 1
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    stats.add(calls, got)
    return b"".join(parts)


def item_ends(offset: int, length: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` ranges of a file that :func:`parse_tensor_item` reads first for item
    ``[offset, offset + length)``.

    A caller that fetches them itself (many items' in one batch of ranged
    requests) passes their bytes as ``ends``.
    """
    if length <= _ITEM_HEAD_BYTES + _ITEM_TAIL_BYTES:
        return [(offset, offset + length)]
    return [
        (offset, offset + _ITEM_HEAD_BYTES),
        (offset + length - _ITEM_TAIL_BYTES, offset + length),
    ]


def parse_tensor_item(
    pread: PRead,
    offset: int,
    length: int,
    where: str,
    stats: ReadStats,
    ends: Sequence[bytes] | None = None,
) -> StoredTensor:
    """Find a ``torch.save``\\ d tensor's storage bytes inside ``[offset, offset + length)`` of a
    file.

    Returns its storage record's absolute start and, from ``data.pkl`` (purpose
    ``"distcp_item"``: torch's plain tensor rebuild functions only), the storage key, dtype,
    ``storage_offset``, size and stride. Only the item's two ends are read (:func:`item_ends`),
    more only if the archive needs it. ``pread`` reads the file (local or an object); ``ends``,
    when given, are the bytes of :func:`item_ends` already read (counted by whoever read them).
    """
    ranges = item_ends(offset, length)
    if ends is None:
        ends = [_pread_exact(pread, e - s, s, stats) for s, e in ranges]
    pieces = [(s - offset, data) for (s, _), data in zip(ranges, ends)]
    if sum(len(p) for _, p in pieces) < min(length, _ITEM_HEAD_BYTES + _ITEM_TAIL_BYTES):
        raise CheckpointFormatError(f"{where}: truncated: the data file ends inside the item")
    view = _ItemView(pread, offset, length, pieces, stats)
    t, records = _unpickle_archive(
        view, where, "distcp_item", _ITEM_MAX_PICKLE_BYTES, "not a tensor's"
    )
    if not isinstance(t, TensorRef):
        raise CheckpointFormatError(f"{where}: the item does not hold a tensor")
    rec = records[t.storage]
    with archive_errors(where):
        start = stored_record_start(view.read_at, rec, where, length, "the item")
    return StoredTensor(t.dtype, offset + start, rec.file_size, t.storage_offset, t.size, t.stride)


def dim_order(size: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The dimension order in which ``size``/``stride`` is dense row-major, or None.

    Identity for a row-major tensor; ``(1, 0)`` for a transposed matrix;
    ``(0, 2, 3, 1)`` for ``channels_last``. None when no order makes it dense
    (overlapping or gapped strides). Size-1 dims may have any stride.
    """
    nd = len(size)
    if _row_major(size, stride):
        return tuple(range(nd))
    big = [d for d in range(nd) if size[d] > 1]
    order = sorted(big, key=lambda d: -stride[d]) + [d for d in range(nd) if size[d] <= 1]
    expect = row_major_strides([size[d] for d in order])
    if all(stride[d] == e for d, e in zip(order, expect) if size[d] > 1):
        return tuple(order)
    return None


def _row_major(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` is the dense row-major one of ``size`` (size-1 dims may have any)."""
    rm = row_major_strides(size)
    return all(st == r for n, st, r in zip(size, stride, rm) if n > 1)
