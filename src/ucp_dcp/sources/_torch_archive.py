"""A whole ``torch.save`` file read as inert records, its tensors as byte ranges.

Formats that keep their state in ``torch.save`` files (DeepSpeed's
``*_model_states.pt`` / ``*_optim_states.pt``, DeepSpeed Universal's
``fp32.pt``) pickle dicts of tensors and a few of their own classes. To read
such a file without running code from it, :func:`read_torch_archive`:

* opens the zip archive (only its central directory and ``data.pkl``; in
  object storage with a few ranged requests: the tail, the pickle, the
  storage records' local headers in one batch);
* unpickles ``data.pkl`` with :class:`_InertUnpickler`, whose ``find_class``
  is the only door from a pickle to code. It hands out containers
  (``OrderedDict``), ``torch.Size``, dtypes, and for tensors a function that
  returns a :class:`TensorRef` (storage key and geometry; no data is read).
  Classes the caller allows by ``(module, name)`` become :class:`Inert`
  records holding the constructor arguments and state the pickle gives them;
  the real class is never imported. Anything else is refused, naming it,
  before anything is built;
* finds where each storage record's bytes start in the file, so a reader
  can fetch any slice of any tensor with one ``pread``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import dtype_from_pickle_storage_type
from ..byteio.objstore import ObjectStore
from ..core.sharding import row_major_strides
from ..errors import CheckpointFormatError, StorageError

__all__ = [
    "TensorRef",
    "Inert",
    "TorchArchive",
    "read_torch_archive",
    "read_pickle_record",
    "stored_record_start",
]

# A pickle describing state (not tensor data) is small; a larger one is damaged or hostile.
_MAX_PICKLE_BYTES = 256 * 1024 * 1024
_LOCAL_HEADER = 30


@dataclass(frozen=True)
class TensorRef:
    """A tensor in the archive: its storage record and geometry, no data."""

    storage: str
    dtype: torch.dtype
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's elements (dense)."""
        return self.numel * self.dtype.itemsize


class Inert:
    """An object of a class the caller allowed, recorded instead of built.

    ``qualname`` is ``"module.name"``; ``args`` are the constructor arguments
    the pickle passed (an enum member's value, a namedtuple's fields) and
    ``state`` what it set afterwards (usually the instance ``__dict__``).
    """

    qualname: str = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:  # NEWOBJ: cls.__new__(cls, *args)
        self = object.__new__(cls)
        self.args = args
        self.state = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # REDUCE: cls(*args)
        self.args = args

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        """Attribute ``name`` from the recorded state (a dict, or ``(dict, slots)``)."""
        st = self.state
        if isinstance(st, tuple) and len(st) == 2:
            st = {**(st[0] or {}), **(st[1] or {})}
        return st.get(name, default) if isinstance(st, dict) else default

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


@dataclass(frozen=True)
class _StorageRef:
    key: str
    dtype: torch.dtype


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


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    if not isinstance(storage, _StorageRef):
        raise _Refused(f"a tensor whose storage is {type(storage).__name__}, not a storage record")
    if not (
        _is_count(offset) and _is_counts(size) and _is_counts(stride) and len(size) == len(stride)
    ):
        raise _Refused(f"a tensor with malformed geometry {offset!r}, {size!r}, {stride!r}")
    return TensorRef(storage.key, storage.dtype, offset, tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None, *rest: Any) -> Any:
    if not isinstance(data, TensorRef):
        raise _Refused(f"a Parameter around {type(data).__name__}")
    return data


class _PlainTensorType:
    """``torch.Tensor`` named in a pickle: only as the type argument of
    ``_rebuild_from_type_v2``."""


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # torch.save uses this for a plain tensor that carries Python attributes
    # (DeepSpeed tags its parameters): the attributes are dropped, the tensor kept.
    if (
        new_type is not _PlainTensorType
        or func is not _rebuild_tensor
        or not isinstance(args, tuple)
    ):
        raise _Refused("a tensor subclass (torch._tensor._rebuild_from_type_v2 of another type)")
    return func(*args)


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_counts(x: Any) -> bool:
    return isinstance(x, tuple) and all(_is_count(v) for v in x)


class _Refused(Exception):
    """Raised inside the unpickler; turned into a CheckpointFormatError naming the file."""


_BUILTIN_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("collections", "OrderedDict"): OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): _PlainTensorType,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    # protocol 2 (torch.save's) names builtins the Python 2 way
    **{
        (mod, name): obj
        for mod in ("builtins", "__builtin__")
        for name, obj in (("set", set), ("frozenset", frozenset))
    },
}


class _InertUnpickler(pickle.Unpickler):
    """Unpickles containers, tensors as :class:`TensorRef` and allowed classes as :class:`Inert`;
    nothing else."""

    def __init__(
        self, file: io.BytesIO, where: str, allowed: Iterable[tuple[str, str]], storages: set[str]
    ) -> None:
        super().__init__(file)
        self.where = where
        self.allowed = frozenset(allowed)
        self.storages = storages
        self.inert: dict[tuple[str, str], type[Inert]] = {}

    def find_class(self, module: str, name: str) -> Any:
        known = _BUILTIN_GLOBALS.get((module, name))
        if known is not None:
            return known
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype):
                return obj
            if name.endswith("Storage"):
                try:
                    return _StorageType(dtype_from_pickle_storage_type(name))
                except KeyError:
                    pass
        if (module, name) in self.allowed:
            cls = self.inert.get((module, name))
            if cls is None:
                cls = type(name, (Inert,), {"qualname": f"{module}.{name}"})
                self.inert[(module, name)] = cls
            return cls
        raise _Refused(
            f"refusing to unpickle {module}.{name}: it is not one of the classes this format stores"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
        ):
            raise _Refused(
                f"refusing persistent id {pid!r}: only torch.save storage records are read"
            )
        if pid[2] not in self.storages:
            raise _Refused(
                f"the pickle refers to storage data/{pid[2]}, which the archive does not hold"
            )
        return _StorageRef(pid[2], pid[1].dtype)


@dataclass(frozen=True)
class _StorageType:
    dtype: torch.dtype


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
    allowed: Iterable[tuple[str, str]] = (),
    *,
    store: ObjectStore | None = None,
    size: int | None = None,
) -> TorchArchive:
    """Read ``path`` (a ``torch.save`` file) as inert records; see the module docstring.

    With ``store``, ``path`` is the URL of an object in it (``size``, when
    the listing gave it, saves asking): the archive is read with a few
    ranged requests (:class:`_ObjectFile`), never downloaded whole.

    Raises :class:`CheckpointFormatError` naming the file when it is not a
    ``torch.save`` zip archive, when its pickle names a class outside
    ``allowed`` (checked before anything is built), or when a storage
    record is missing, compressed or runs past the end of the file.
    """
    if store is not None:
        name = store.name_of(path)
        obj = _ObjectFile(store, name, store.size(name) if size is None else size)
        return _read_archive(obj, path, obj.size, allowed, obj.read_at, obj)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    with f:

        def read_at(offset: int, n: int) -> bytes:
            return os.pread(f.fileno(), n, offset)

        return _read_archive(f, path, os.fstat(f.fileno()).st_size, allowed, read_at, None)


def _read_archive(
    f: Any,
    path: str,
    size: int,
    allowed: Iterable[tuple[str, str]],
    read_at: Callable[[int, int], bytes],
    obj: _ObjectFile | None,
) -> TorchArchive:
    """The archive open as ``f`` (a local file, or an :class:`_ObjectFile` ``obj`` that fetches
    ahead)."""
    try:
        zf = zipfile.ZipFile(f)
        if obj is not None:
            obj.fetch_small_records(zf)
        prefix, pkl = read_pickle_record(zf, path, _MAX_PICKLE_BYTES, "too large to be state")
        infos = {
            n[len(prefix) + 5 :]: zf.getinfo(n)
            for n in zf.namelist()
            if n.startswith(prefix + "data/")
        }
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        OSError,
        EOFError,
        ValueError,
        struct.error,
    ) as e:
        if isinstance(e, StorageError):
            raise
        raise CheckpointFormatError(f"{path}: not a readable torch.save archive ({e})") from None
    unpickler = _InertUnpickler(io.BytesIO(pkl), path, allowed, set(infos))
    try:
        tree = unpickler.load()
    except _Refused as e:
        raise CheckpointFormatError(f"{path}: {e}") from None
    except Exception as e:  # truncated or garbage pickles raise all sorts
        raise CheckpointFormatError(
            f"{path}: data.pkl is not a readable pickle ({type(e).__name__}: {e})"
        ) from None
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
