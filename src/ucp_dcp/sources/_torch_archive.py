"""A whole ``torch.save`` file read as inert records, its tensors as byte ranges.

Formats that keep their state in ``torch.save`` files (DeepSpeed's
``*_model_states.pt`` / ``*_optim_states.pt``, DeepSpeed Universal's
``fp32.pt``) pickle dicts of tensors and a few of their own classes. To read
such a file without running code from it, :func:`read_torch_archive`:

* opens the zip archive (only its central directory and ``data.pkl``; in
  object storage with a few ranged requests: the tail, the pickle, the
  storage records' local headers in one batch);
* unpickles ``data.pkl`` with the library's one restricted unpickler
  (:mod:`._pickle`), for the purpose the caller names: containers,
  ``torch.Size``, dtypes, each tensor as a :class:`TensorRef` (storage key
  and geometry; no data is read), the format's own classes as
  :class:`Inert` records. Anything else is refused, naming it, before
  anything is built;
* finds where each storage record's bytes start in the file, so a reader
  can fetch any slice of any tensor with one ``pread``.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..byteio.objstore import ObjectStore
from ..core.contiguous import row_major_strides
from ..errors import CheckpointFormatError, StorageError
from ._pickle import PurposeName, TensorRef, unpickle

__all__ = [
    "TorchArchive",
    "read_torch_archive",
    "read_pickle_record",
    "storage_records",
    "stored_record_start",
    "archive_errors",
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
    records: dict[str, tuple[int, int]] = field(
        default_factory=dict
    )  # storage key -> (absolute start, nbytes)

    def byte_range(self, t: TensorRef, what: str) -> tuple[int, int]:
        """``(absolute start, nbytes)`` of dense tensor ``t``; an error naming ``what`` if it is not
        dense row-major."""
        if t.numel > 1 and tuple(s for s, n in zip(t.stride, t.size) if n > 1) != tuple(
            s for s, n in zip(row_major_strides(t.size), t.size) if n > 1
        ):
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
    ) as e:
        raise CheckpointFormatError(f"{where}: not a readable torch.save archive ({e})") from None


def read_pickle_record(
    zf: zipfile.ZipFile, where: str, max_bytes: int, too_large: str
) -> tuple[str, bytes]:
    """``(prefix, data.pkl bytes)`` of an open ``torch.save`` archive; records are under ``prefix``.

    Refuses (naming ``where``) archives without exactly one ``<name>/data.pkl``,
    pickles over ``max_bytes`` (``too_large`` says why that is wrong here)
    and big-endian data. zipfile's own errors pass through to the caller.
    """
    pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pkls) != 1:
        raise CheckpointFormatError(
            f"{where}: not a torch.save archive (no single <name>/data.pkl)"
        )
    prefix = pkls[0][: -len("data.pkl")]
    info = zf.getinfo(pkls[0])
    if info.file_size > max_bytes:
        raise CheckpointFormatError(f"{where}: data.pkl of {info.file_size} bytes is {too_large}")
    pkl = zf.read(info)
    if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
        raise CheckpointFormatError(f"{where}: big-endian tensor data is not supported")
    return prefix, pkl


def storage_records(zf: zipfile.ZipFile, prefix: str) -> dict[str, zipfile.ZipInfo]:
    """The storage records of an open ``torch.save`` archive: key -> its ``<prefix>data/<key>``."""
    return {
        n[len(prefix) + 5 :]: zf.getinfo(n) for n in zf.namelist() if n.startswith(prefix + "data/")
    }


def stored_record_start(
    read_at: Callable[[int, int], bytes], info: zipfile.ZipInfo, where: str
) -> int:
    """Offset (in the archive) of the first data byte of uncompressed zip record ``info``.

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
    return info.header_offset + _LOCAL_HEADER + name_len + extra_len


def read_torch_archive(
    path: str,
    purpose: PurposeName,
    *,
    store: ObjectStore | None = None,
    size: int | None = None,
) -> TorchArchive:
    """Read ``path`` (a ``torch.save`` file) as inert records; see the module docstring.

    With ``store``, ``path`` is the URL of an object in it (``size``, when
    the listing gave it, saves asking): the archive is read with a few
    ranged requests (:class:`_ObjectFile`), never downloaded whole.

    Raises :class:`CheckpointFormatError` naming the file when it is not a
    ``torch.save`` zip archive, when its pickle names a global outside
    ``purpose``'s table (checked before anything is built), or when a storage
    record is missing, compressed or runs past the end of the file.
    """
    if store is not None:
        name = store.name_of(path)
        obj = _ObjectFile(store, name, store.size(name) if size is None else size)
        return _read_archive(obj, path, obj.size, purpose, obj.read_at, obj)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    with f:

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(f.fileno(), n, offset)

        return _read_archive(f, path, os.fstat(f.fileno()).st_size, purpose, read_at, None)


def _read_archive(
    f: Any,
    path: str,
    size: int,
    purpose: PurposeName,
    read_at: Callable[[int, int], bytes],
    obj: _ObjectFile | None,
) -> TorchArchive:
    """The archive open as ``f`` (a local file, or an :class:`_ObjectFile` ``obj`` that fetches
    ahead)."""
    with archive_errors(path):
        zf = zipfile.ZipFile(f)
        if obj is not None:
            obj.fetch_small_records(zf)
        prefix, pkl = read_pickle_record(zf, path, _MAX_PICKLE_BYTES, "too large to be state")
        infos = storage_records(zf, prefix)
    tree = unpickle(pkl, path, purpose, infos)
    if obj is not None:  # every storage record's local header, in one batch
        obj.fetch([(zi.header_offset, zi.header_offset + _LOCAL_HEADER) for zi in infos.values()])
    records: dict[str, tuple[int, int]] = {}
    for key, zi in infos.items():
        start = stored_record_start(read_at, zi, f"{path}")
        if start + zi.file_size > size:
            raise CheckpointFormatError(
                f"{path}: storage record data/{key} runs past the end of the file"
            )
        records[key] = (start, zi.file_size)
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
