"""DCP's default ``.distcp`` format: read it in place, or convert it once.

A checkpoint written by ``dcp.save`` with DCP's ``FileSystemWriter`` is a
directory holding ``.metadata`` (a pickled :class:`Metadata`) and data files
``__<rank>_<n>.distcp``. Every stored item is a complete ``torch.save`` zip
archive, written one after another into a data file; ``Metadata.storage_data``
maps each item's :class:`MetadataIndex` to its ``(relative_path, offset,
length)``.

This module makes that format readable without unpickling anything but DCP's
own metadata:

* :func:`read_dcp_metadata` loads ``.metadata`` with a restricted unpickler
  that only constructs DCP's metadata records, ``torch.Size``, dtypes,
  layouts and paths; any other class (``os.system``, say) is refused before
  it is looked up, naming it.
* A tensor item is byte-addressed without ``torch.load``: :mod:`zipfile`
  finds the storage record ``<archive>/data/<key>`` inside the item and its
  absolute start in the data file, and the item's ``data.pkl`` is
  *disassembled* with :func:`pickletools.genops` (never executed) to get the
  storage key, dtype, ``storage_offset``, size and stride. A row-major item is
  then one byte range; an item stored in another dimension order (a
  transposed weight, a ``channels_last`` convolution kernel: DCP keeps the
  strides it was given) is a byte range plus a dimension order: permuting
  the destination view alike makes those bytes row-major again, and the
  usual strided reads apply. Either way a rank reads only the bytes of the
  region it needs. Only the items a rank reads are parsed (768 bytes at each
  end of the item, more only if the archive needs it), when the load is
  planned, in parallel.
* Non-tensor values are pickles in DCP's format (``torch.save`` of the
  object). :class:`~ucp_dcp.UCPStorageReader` refuses to load them unless
  asked to with ``UCPStorageReader(path, dcp_values="weights_only")``, which
  uses ``torch.load(..., weights_only=True)`` (torch's restricted unpickler)
  and hands the value on as tagged JSON (:mod:`ucp_dcp.values`).

:func:`import_dcp` converts such a checkpoint into the universal format,
streaming slab by slab with bounded memory.

Items stored with strides that are no permutation of a dense layout (only an
``as_strided`` view with overlapping elements can produce one) cannot be
read as byte ranges: a direct load fails naming the key, :func:`import_dcp`
converts them by reading that item's storage whole. Items written with DCP's
experimental stream transforms (compression) are refused, naming the key.
Checkpoints written with ``SerializationFormat.SAFETENSORS`` or without
collectives (``__<rank>.metadata`` files) are not this format.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import pickletools
import re
import struct
import uuid
import weakref
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from .format import (
    INDEX_FILE,
    CheckpointFormatError,
    ChunkRecord,
    EntryMeta,
    FileRecord,
    Index,
    Location,
    PlannedEntry,
    TensorRecord,
    _check_relative_name,
    chunk_entry_name,
    data_file_name,
    dtype_name,
    layout_file,
    st_dtype,
    value_entry_name,
)
from .index import ChunkLocator, WrittenEntry, build_index, write_index
from .rangeio import FileHandles, RangeReader, ReadStats, Segment, storage_view
from .sharding import Box, row_major_strides, slabs
from .transfer import needs_staging, read_staged, segments_into
from .values import encode_value

__all__ = [
    "DCP_METADATA_FILE",
    "DCPValueError",
    "DCPLocation",
    "DCPCheckpoint",
    "DCPChunkLocator",
    "is_dcp_checkpoint",
    "read_dcp_metadata",
    "import_dcp",
    "permuted",
    "read_region",
]

DCP_METADATA_FILE = ".metadata"
DCP_VALUES_MODES = (None, "weights_only")
_MiB = 1024 * 1024
# Bytes read at each end of an item to parse it: the zip central directory
# (7 records of a torch.save archive) sits at the end, data.pkl and the
# storage record's local header at the start. Anything not in them is read
# on demand.
_HEAD_BYTES = 768
_TAIL_BYTES = 768
_MAX_PICKLE_BYTES = 16 * _MiB
_PLACEHOLDER = "0" * 16  # an xxh3-64 hex digest has a fixed width
_DISTCP_NAME = re.compile(r"__(\d+)_(\d+)\.distcp")


class DCPValueError(CheckpointFormatError):
    """A non-tensor value of a DCP checkpoint that cannot be loaded as asked."""


# ====================================================================== metadata


def is_dcp_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds DCP's ``.metadata`` (and no ucp_dcp index)."""
    directory = os.fspath(directory)
    return os.path.isfile(os.path.join(directory, DCP_METADATA_FILE)) and not os.path.isfile(
        os.path.join(directory, INDEX_FILE)
    )


_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("collections", "OrderedDict"),
    *((mod, cls) for mod in ("pathlib", "pathlib._local") for cls in ("PosixPath", "PurePosixPath")),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else.

    ``find_class`` is the only way a pickle reaches code; it hands out DCP's
    metadata records, ``torch.Size``, torch dtypes / layouts / memory formats
    and path objects, and refuses anything else before importing it.
    """

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and not name.startswith("_"):
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise CheckpointFormatError(
            f"{self.where}: refusing to unpickle {module}.{name} from .metadata: only DCP's own metadata "
            "records (and torch.Size, dtypes, layouts) are loaded; this file is damaged, hostile, or was "
            "written by a planner that stores its own classes in the metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"{self.where}: refusing persistent id {pid!r} in .metadata")


def read_dcp_metadata(directory: str | os.PathLike[str]) -> Metadata:
    """Load DCP's ``.metadata`` of ``directory`` with the restricted unpickler.

    Raises :class:`CheckpointFormatError` naming the file when it is missing,
    not a DCP metadata pickle, or refers to any class outside the allow-list.
    """
    path = os.path.join(os.fspath(directory), DCP_METADATA_FILE)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise CheckpointFormatError(f"{os.fspath(directory)}: not a DCP checkpoint (no {DCP_METADATA_FILE})") from None
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated / garbage pickles raise all sorts
        raise CheckpointFormatError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(f"{path}: DCP metadata without state_dict_metadata/storage_data")
    return md


# ====================================================================== item parsing


class _Global(NamedTuple):
    module: str
    name: str


class _Call(NamedTuple):
    func: Any
    args: Any


class _PersId(NamedTuple):
    pid: Any


_PUSH_ARG = frozenset(
    "INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT STRING BINSTRING SHORT_BINSTRING "
    "UNICODE BINUNICODE SHORT_BINUNICODE BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8".split()
)


def _disassemble(data: bytes, where: str) -> Any:
    """Evaluate a pickle *symbolically*: globals, calls and persistent ids become records.

    Nothing is imported or called. Only the opcodes of ``torch.save``'s
    ``data.pkl`` of a tensor are understood; anything else is refused.
    """
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[Any, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            n = op.name
            if n in ("PROTO", "FRAME"):
                continue
            if n == "STOP":
                break
            if n in _PUSH_ARG:
                stack.append(arg)
            elif n == "NONE":
                stack.append(None)
            elif n in ("NEWTRUE", "NEWFALSE"):
                stack.append(n == "NEWTRUE")
            elif n == "MARK":
                marks.append(len(stack))
            elif n == "GLOBAL":
                mod, _, name = arg.partition(" ")
                stack.append(_Global(mod, name))
            elif n == "STACK_GLOBAL":
                name, mod = stack.pop(), stack.pop()
                stack.append(_Global(str(mod), str(name)))
            elif n in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif n == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif n in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo[arg])
            elif n == "EMPTY_TUPLE":
                stack.append(())
            elif n in ("TUPLE1", "TUPLE2", "TUPLE3"):
                k = int(n[-1])
                items = tuple(stack[-k:])
                del stack[-k:]
                stack.append(items)
            elif n in ("TUPLE", "LIST", "DICT"):
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                stack.append(tuple(items) if n == "TUPLE" else items if n == "LIST" else dict(zip(items[::2], items[1::2])))
            elif n == "EMPTY_LIST":
                stack.append([])
            elif n == "EMPTY_DICT":
                stack.append({})
            elif n == "APPEND":
                v = stack.pop()
                stack[-1].append(v)
            elif n == "APPENDS":
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                stack[-1].extend(items)
            elif n == "SETITEM":
                v, k = stack.pop(), stack.pop()
                stack[-1][k] = v
            elif n == "SETITEMS":
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                stack[-1].update(zip(items[::2], items[1::2]))
            elif n == "BINPERSID":
                stack.append(_PersId(stack.pop()))
            elif n == "REDUCE":
                args = stack.pop()
                stack.append(_Call(stack.pop(), args))
            elif n == "BUILD":
                stack.pop()  # state of the object below: irrelevant to where the bytes are
            else:
                raise CheckpointFormatError(f"{where}: unexpected pickle opcode {n} in a tensor item")
    except CheckpointFormatError:
        raise
    except Exception as e:  # malformed pickle: stack underflow, bad memo, unhashable key...
        raise CheckpointFormatError(f"{where}: malformed data.pkl ({type(e).__name__}: {e})") from None
    if not stack:
        raise CheckpointFormatError(f"{where}: empty data.pkl")
    return stack[-1]


@dataclass(frozen=True)
class _StoredTensor:
    """Where a ``torch.save``\\ d tensor's bytes are and how they are laid out."""

    dtype: torch.dtype
    data_start: int  # absolute offset of the storage record in the data file
    record_nbytes: int
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _int_tuple(x: Any) -> bool:
    return isinstance(x, tuple) and all(_is_int(v) for v in x)


def _tensor_from_pickle(obj: Any, where: str) -> tuple[str, torch.dtype, int, tuple[int, ...], tuple[int, ...]]:
    """``(storage key, dtype, storage_offset, size, stride)`` of a disassembled tensor pickle."""
    if not (isinstance(obj, _Call) and isinstance(obj.func, _Global) and isinstance(obj.args, tuple)):
        raise CheckpointFormatError(f"{where}: the item does not hold a tensor")
    f, args = obj.func, obj.args
    if f == ("torch._utils", "_rebuild_tensor_v2") and len(args) >= 6:
        dtype = None
    elif f == ("torch._utils", "_rebuild_tensor_v3") and len(args) >= 7:
        d = args[6]
        dtype = getattr(torch, d.name, None) if isinstance(d, _Global) and d.module == "torch" else None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"{where}: unknown tensor dtype {d!r}")
    else:
        raise CheckpointFormatError(
            f"{where}: the item is rebuilt with {f.module}.{f.name}; only plain dense CPU-saveable "
            "tensors (torch._utils._rebuild_tensor_v2/v3) can be read without unpickling"
        )
    storage, offset, size, stride = args[:4]
    pid = storage.pid if isinstance(storage, _PersId) else None
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Global)
            and isinstance(pid[2], str)):
        raise CheckpointFormatError(f"{where}: the tensor's storage reference is malformed: {pid!r}")
    stype = pid[1]
    if dtype is None:  # v2: a typed storage names the dtype
        if stype.module != "torch":
            raise CheckpointFormatError(f"{where}: unknown storage type {stype.module}.{stype.name}")
        try:
            dtype = torch.storage._get_dtype_from_pickle_storage_type(stype.name)
        except KeyError:
            raise CheckpointFormatError(f"{where}: unknown storage type torch.{stype.name}") from None
    elif stype not in (("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage")):
        raise CheckpointFormatError(f"{where}: unexpected storage type {stype.module}.{stype.name}")
    if not (_is_int(offset) and _int_tuple(size) and _int_tuple(stride) and len(size) == len(stride)):
        raise CheckpointFormatError(f"{where}: malformed tensor geometry {offset!r}, {size!r}, {stride!r}")
    return pid[2], dtype, offset, size, stride


class _ItemView(io.RawIOBase):
    """A read-only, seekable view of ``[base, base + length)`` of a file.

    Reads that fall inside the pieces read up front are served from them;
    anything else is read with ``pread`` and counted in ``stats``.
    """

    def __init__(self, fd: int, base: int, length: int, pieces: list[tuple[int, bytes]], stats: ReadStats) -> None:
        super().__init__()
        self._fd, self._base, self._len, self._pieces, self._stats = fd, base, length, pieces, stats
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the item")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        left = self._len - self._pos
        n = left if n is None or n < 0 else min(n, left)
        if n <= 0:
            return b""
        pos = self._pos
        for start, data in self._pieces:
            if start <= pos and pos + n <= start + len(data):
                self._pos += n
                return data[pos - start : pos - start + n]
        out = _pread_exact(self._fd, n, self._base + pos, self._stats)
        self._pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def _pread_exact(fd: int, n: int, offset: int, stats: ReadStats) -> bytes:
    parts, calls, got = [], 0, 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        calls += 1
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    stats.add(calls, got)
    return b"".join(parts)


def _parse_tensor_item(fd: int, offset: int, length: int, where: str, stats: ReadStats) -> _StoredTensor:
    """Find a ``torch.save``\\ d tensor's storage bytes inside ``[offset, offset + length)``."""
    if length <= _HEAD_BYTES + _TAIL_BYTES:
        pieces = [(0, _pread_exact(fd, length, offset, stats))]
    else:
        pieces = [(0, _pread_exact(fd, _HEAD_BYTES, offset, stats)),
                  (length - _TAIL_BYTES, _pread_exact(fd, _TAIL_BYTES, offset + length - _TAIL_BYTES, stats))]
    if sum(len(p) for _, p in pieces) < min(length, _HEAD_BYTES + _TAIL_BYTES):
        raise CheckpointFormatError(f"{where}: truncated: the data file ends inside the item")
    view = _ItemView(fd, offset, length, pieces, stats)
    try:
        zf = zipfile.ZipFile(view)  # type: ignore[arg-type]
        pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise CheckpointFormatError(f"{where}: not a torch.save archive (no data.pkl)")
        prefix = pkls[0][: -len("data.pkl")]
        info = zf.getinfo(pkls[0])
        if info.file_size > _MAX_PICKLE_BYTES:
            raise CheckpointFormatError(f"{where}: data.pkl of {info.file_size} bytes is not a tensor's")
        pkl = zf.read(info)
        if prefix + "byteorder" in zf.namelist() and zf.read(prefix + "byteorder") != b"little":
            raise CheckpointFormatError(f"{where}: big-endian tensor data is not supported")
        key, dtype, soff, size, stride = _tensor_from_pickle(_disassemble(pkl, where), where)
        try:
            rec = zf.getinfo(f"{prefix}data/{key}")
        except KeyError:
            raise CheckpointFormatError(f"{where}: storage record data/{key} is missing") from None
        if rec.compress_type != zipfile.ZIP_STORED or rec.flag_bits & 0x1 or rec.compress_size != rec.file_size:
            raise CheckpointFormatError(f"{where}: storage record data/{key} is compressed or encrypted")
        view.seek(rec.header_offset)
        local = view.read(30)
        if len(local) != 30 or local[:4] != b"PK\x03\x04":
            raise CheckpointFormatError(f"{where}: bad local header for data/{key}")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        start = rec.header_offset + 30 + name_len + extra_len
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, struct.error) as e:
        raise CheckpointFormatError(f"{where}: not a readable torch.save archive ({e})") from None
    if start + rec.file_size > length:
        raise CheckpointFormatError(f"{where}: storage record data/{key} runs past the end of the item")
    return _StoredTensor(dtype, offset + start, rec.file_size, soff, tuple(size), tuple(stride))


def _dim_order(size: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The dimension order in which ``size``/``stride`` is dense row-major, or None.

    Identity for a row-major tensor; ``(1, 0)`` for a transposed matrix;
    ``(0, 2, 3, 1)`` for ``channels_last``. None when no order makes it dense
    (overlapping or gapped strides). Size-1 dims may have any stride.
    """
    nd = len(size)
    big = [d for d in range(nd) if size[d] > 1]
    ident = tuple(range(nd))
    rm = row_major_strides(size)
    if all(stride[d] == rm[d] for d in big):
        return ident
    order = sorted(big, key=lambda d: -stride[d]) + [d for d in range(nd) if size[d] <= 1]
    expect = row_major_strides([size[d] for d in order])
    if all(stride[d] == e for d, e in zip(order, expect) if size[d] > 1):
        return tuple(order)
    return None


# ====================================================================== locations


@dataclass(frozen=True)
class DCPLocation(Location):
    """A DCP tensor item stored densely but not row-major.

    Its bytes are ``[start, start + nbytes)``, holding the chunk permuted by
    ``dim_order`` (``chunk.permute(dim_order)`` is row-major there).
    """

    dim_order: tuple[int, ...] = ()


def permuted(
    location: Location, chunk_sizes: Sequence[int], region: Box, dest: torch.Tensor
) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """``(chunk_sizes, region, dest)`` as seen in the stored dimension order.

    For a :class:`DCPLocation` the chunk, the region and the destination
    (a view: same memory, permuted strides) are permuted alike, so that the
    stored bytes are row-major in them and :mod:`ucp_dcp.transfer`'s reads
    work unchanged. Other locations are returned as they are.
    """
    order = getattr(location, "dim_order", None)
    if not order:
        return tuple(chunk_sizes), region, dest
    return (
        tuple(chunk_sizes[d] for d in order),
        Box(tuple(region.offsets[d] for d in order), tuple(region.sizes[d] for d in order)),
        dest.permute(order),
    )


def read_region(
    reader: RangeReader,
    location: Location,
    chunk_sizes: Sequence[int],
    region: Box,
    src_dtype: torch.dtype,
    dest: torch.Tensor,
    max_buffer_bytes: int,
) -> None:
    """Read ``region`` of a saved chunk into ``dest`` now, whatever the stored dimension order.

    A row-major item is read in place into a CPU destination of the saved
    dtype. An item stored in another order goes through
    :func:`~ucp_dcp.transfer.read_staged`'s bounded staging buffer, laid out
    in the *stored* order so that every read is as long as the region allows
    (reading straight into a row-major destination would make one read per
    element of a transposed matrix); torch then copies it into place.
    """
    sizes, region, target = permuted(location, chunk_sizes, region, dest)
    if target is not dest or needs_staging(dest, src_dtype):
        read_staged(reader, location, sizes, region, src_dtype, target, max_buffer_bytes)
    else:
        reader.read(list(segments_into(location, sizes, region, target)))


# ====================================================================== the checkpoint


class DCPCheckpoint:
    """A checkpoint in DCP's default format, described as a ucp_dcp :class:`Index`.

    Opening it reads ``.metadata`` (restricted unpickler) and the sizes of the
    data files, nothing else. ``index`` lists every tensor with its chunk
    boxes (explicit chunk lists; the DTensor layout is not recorded by DCP,
    so ``layout`` is None) and every value with its item's byte range. Chunk
    locations are None in the index: :meth:`locate` parses the item that
    holds a chunk when it is first needed. Checksums are unknown (DCP keeps
    none) and recorded as ``""``.

    ``parse_stats`` counts the reads spent parsing items.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        self.metadata = md = read_dcp_metadata(self.directory)
        mdpath = os.path.join(self.directory, DCP_METADATA_FILE)
        infos: dict[MetadataIndex, Any] = {}
        for k, v in md.storage_data.items():
            if not (isinstance(k, MetadataIndex) and all(hasattr(v, a) for a in ("relative_path", "offset", "length"))
                    and isinstance(v.relative_path, str)):
                raise CheckpointFormatError(f"{mdpath}: storage_data entry {k!r} -> {v!r} is malformed")
            infos[k] = v
        names: dict[str, int] = {}
        for v in infos.values():
            if v.relative_path not in names:
                _check_relative_name(v.relative_path, f"{mdpath}: storage_data")
                names[v.relative_path] = -1
        ordered = sorted(names, key=_file_sort_key)
        files: list[FileRecord] = []
        for i, name in enumerate(ordered):
            names[name] = i
            path = os.path.join(self.directory, name)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                raise CheckpointFormatError(f"data file {path} is missing (named by {mdpath})") from None
            m = _DISTCP_NAME.fullmatch(name)
            files.append(FileRecord(name, int(m[1]) if m else 0, size))
        self.paths = [os.path.join(self.directory, f.name) for f in files]

        def item(key: MetadataIndex, what: str) -> tuple[int, Any]:
            info = infos.get(key)
            if info is None:
                raise CheckpointFormatError(f"{mdpath}: no stored item for {what}")
            if not (_is_int(info.offset) and _is_int(info.length)):
                raise CheckpointFormatError(f"{mdpath}: {what}: malformed byte range {info.offset!r}+{info.length!r}")
            fi = names[info.relative_path]
            if info.offset + info.length > files[fi].size:
                raise CheckpointFormatError(
                    f"{mdpath}: {what}: byte range [{info.offset}, {info.offset + info.length}) lies outside "
                    f"{files[fi].name} ({files[fi].size} bytes): truncated data file"
                )
            return fi, info

        tensors: dict[str, TensorRecord] = {}
        values: dict[str, Location] = {}
        self._tensor_items: dict[str, list[tuple[int, Any]]] = {}
        self._value_items: dict[str, Any] = {}
        for fqn, smd in md.state_dict_metadata.items():
            if isinstance(smd, BytesStorageMetadata):
                fi, info = item(MetadataIndex(fqn), f"value {fqn!r}")
                values[fqn] = Location(fi, info.offset, info.length, "")
                self._value_items[fqn] = info
                continue
            if not isinstance(smd, TensorStorageMetadata):
                raise CheckpointFormatError(f"{mdpath}: {fqn!r} has unknown storage metadata {type(smd).__name__}")
            shape = tuple(smd.size) if isinstance(smd.size, (tuple, list)) else None
            dtype = getattr(smd.properties, "dtype", None)
            if not (_int_tuple(shape) and isinstance(dtype, torch.dtype) and isinstance(smd.chunks, list)):
                raise CheckpointFormatError(f"{mdpath}: malformed tensor metadata for {fqn!r}")
            whole = Box((0,) * len(shape), shape)
            empty_tensor = math.prod(shape) == 0
            chunks, items = [], []
            for c in smd.chunks:
                offs, sizes = tuple(getattr(c, "offsets", None) or ()), tuple(getattr(c, "sizes", None) or ())
                if not (_int_tuple(offs) and _int_tuple(sizes) and len(offs) == len(sizes)):
                    raise CheckpointFormatError(f"{mdpath}: malformed chunk of {fqn!r}")
                box = Box(offs, sizes)
                if len(box.offsets) != len(shape) or not whole.contains(box):
                    raise CheckpointFormatError(f"{mdpath}: chunk {list(box.offsets)}+{list(box.sizes)} of {fqn!r} "
                                                f"lies outside shape {list(shape)}")
                if box.numel == 0 and not empty_tensor:
                    continue  # an empty shard of an uneven split holds no bytes
                items.append(item(MetadataIndex(fqn, c.offsets), f"chunk {list(box.offsets)} of {fqn!r}"))
                chunks.append(ChunkRecord(box, None))
            tensors[fqn] = TensorRecord(dtype, shape, None, False, chunks=chunks)
            self._tensor_items[fqn] = items
        world = max((f.rank for f in files), default=0) + 1
        self.index = Index(world, files, tensors, values, {})
        self.parse_stats = ReadStats()
        self._locations: dict[tuple[str, int], Location] = {}
        self._fds = FileHandles(self.paths)
        weakref.finalize(self, FileHandles.close, self._fds)

    def close(self) -> None:
        """Close the data files (they are reopened if needed)."""
        self._fds.close()

    # ------------------------------------------------------------ tensors
    def _where(self, fqn: str, idx: int) -> str:
        fi, info = self._tensor_items[fqn][idx]
        box = self.index.tensors[fqn].chunks[idx].box
        return f"{self.paths[fi]}: item of {fqn!r} chunk {list(box.offsets)} at [{info.offset}, {info.offset + info.length})"

    def _stored(self, fqn: str, idx: int) -> _StoredTensor:
        fi, info = self._tensor_items[fqn][idx]
        where = self._where(fqn, idx)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(
                f"{where}: written with DCP stream transforms {list(info.transform_descriptors)} "
                "(e.g. compression); such items cannot be byte-addressed and are not supported"
            )
        st = _parse_tensor_item(self._fds.get(fi), info.offset, info.length, where, self.parse_stats)
        rec = self.index.tensors[fqn]
        box = rec.chunks[idx].box
        if st.dtype != rec.dtype or st.size != box.sizes:
            raise CheckpointFormatError(
                f"{where}: holds a {dtype_name(st.dtype)}{list(st.size)} tensor, but .metadata says "
                f"{dtype_name(rec.dtype)}{list(box.sizes)}"
            )
        es = rec.dtype.itemsize
        if box.numel:
            last = st.storage_offset + sum((n - 1) * s for n, s in zip(st.size, st.stride)) + 1
            if last * es > st.record_nbytes:
                raise CheckpointFormatError(f"{where}: the tensor runs past its storage ({st.record_nbytes} bytes)")
        return st

    def locate(self, fqn: str, idx: int) -> Location:
        """Byte location of chunk ``idx`` of ``fqn`` (parses its item the first time).

        A :class:`DCPLocation` when the item is stored in another dimension
        order. Raises naming the key when the item cannot be read as a byte
        range (overlapping strides) or is not a plain tensor.
        """
        loc = self._locations.get((fqn, idx))
        if loc is not None:
            return loc
        st = self._stored(fqn, idx)
        fi = self._tensor_items[fqn][idx][0]
        es = st.dtype.itemsize
        numel = math.prod(st.size)
        order = _dim_order(st.size, st.stride) if numel else tuple(range(len(st.size)))
        if order is None:
            raise CheckpointFormatError(
                f"{self._where(fqn, idx)}: stored with overlapping strides {list(st.stride)} for size "
                f"{list(st.size)}; it cannot be read as byte ranges. Convert the checkpoint with "
                "`ucp-dcp import-dcp` (ucp_dcp.distcp.import_dcp), which handles it"
            )
        start = st.data_start + st.storage_offset * es
        if order == tuple(range(len(order))):
            loc = Location(fi, start, numel * es, "")
        else:
            loc = DCPLocation(fi, start, numel * es, "", order)
        self._locations[(fqn, idx)] = loc
        return loc

    def prefetch(self, chunks: Iterable[tuple[str, int]], threads: int = 4) -> None:
        """Parse the items of ``chunks`` (``(fqn, idx)`` pairs) in parallel, ahead of reading."""
        todo = sorted({c for c in chunks if c not in self._locations})
        if len(todo) <= 1 or threads <= 1:
            for fqn, idx in todo:
                self.locate(fqn, idx)
            return
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucp-dcp-parse") as pool:
            for _ in pool.map(lambda c: self.locate(*c), todo):
                pass

    def locator(self) -> "DCPChunkLocator":
        """A :class:`ChunkLocator` for :class:`~ucp_dcp.UCPStorageReader`'s read path."""
        return DCPChunkLocator(self)

    def check_plan(self, plan: LoadPlan, dcp_values: str | None, threads: int = 4) -> None:
        """Before any byte is read: refuse values unless opted in; parse the items the plan reads."""
        if dcp_values not in DCP_VALUES_MODES:
            raise ValueError(f"dcp_values must be one of {DCP_VALUES_MODES}, got {dcp_values!r}")
        wanted = []
        for ri in plan.items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                if dcp_values is None:
                    raise DCPValueError(_refusal(self.directory, fqn))
                continue
            rec = self.index.tensors.get(fqn)
            if rec is None:
                continue
            offs = tuple(ri.storage_index.offset)
            idx = ri.storage_index.index
            if idx is None or not 0 <= idx < len(rec.chunks) or rec.chunks[idx].box.offsets != offs:
                idx = next((i for i, c in enumerate(rec.chunks) if c.box.offsets == offs), None)
            if idx is not None:
                wanted.append((fqn, idx))
        self.prefetch(wanted, threads)

    # ------------------------------------------------------------ values
    def load_value(self, key: str, reader: RangeReader) -> Any:
        """Value ``key``, loaded with ``torch.load(..., weights_only=True)``.

        torch's restricted unpickler builds only tensors, primitive types and
        containers (plus what ``torch.serialization.add_safe_globals`` allows);
        anything else fails, naming the key.
        """
        info = self._value_items.get(key)
        if info is None:
            raise CheckpointFormatError(f"{self.directory}: no saved value for {key!r}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(
                f"{self.directory}: value {key!r} was written with DCP stream transforms "
                f"{list(info.transform_descriptors)}; not supported"
            )
        loc = self.index.values[key]
        buf = bytearray(loc.nbytes)
        reader.read([Segment(loc.file, loc.start, memoryview(buf))])
        try:
            return torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True)
        except Exception as e:
            raise DCPValueError(
                f"{self.paths[loc.file]}: value {key!r} cannot be loaded with torch.load(weights_only=True) "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If you trust the checkpoint, "
                "allow its classes with torch.serialization.add_safe_globals"
            ) from None

    def read_value(self, reader: RangeReader, key: str, dcp_values: str | None) -> bytes:
        """Value ``key`` as the tagged JSON :class:`~ucp_dcp.UCPLoadPlanner` decodes."""
        if dcp_values is None:
            raise DCPValueError(_refusal(self.directory, key))
        return encode_value(self.load_value(key, reader), key)


def _refusal(directory: str, key: str) -> str:
    return (
        f"{directory}: value {key!r} is stored by DCP as a pickle (torch.save), and UCPStorageReader does not "
        "unpickle checkpoint data by default. Pass UCPStorageReader(path, dcp_values='weights_only') to load it "
        "with torch.load(weights_only=True), torch's restricted unpickler, or convert the checkpoint once with "
        "`ucp-dcp import-dcp SRC DST`"
    )


def _file_sort_key(name: str) -> tuple[int, int, str]:
    m = _DISTCP_NAME.fullmatch(name)
    return (int(m[1]), int(m[2]), name) if m else (1 << 62, 0, name)


class DCPChunkLocator(ChunkLocator):
    """:class:`ChunkLocator` over a DCP checkpoint: locations come from parsing items."""

    def __init__(self, ckpt: DCPCheckpoint) -> None:
        super().__init__(ckpt.directory, ckpt.index)
        self.ckpt = ckpt

    def locate(self, fqn: str, idx: int) -> Location:
        """Location of chunk ``idx`` of tensor ``fqn`` (see :meth:`DCPCheckpoint.locate`)."""
        return self.ckpt.locate(fqn, idx)


# ====================================================================== import


def import_dcp(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    overwrite: bool = False,
    sync_files: bool = True,
    buffer_bytes: int = 64 * _MiB,
    io_threads: int = 4,
) -> Index:
    """Convert the DCP default-format checkpoint ``src`` into a universal checkpoint at ``dst``.

    Every key, value and chunk box is kept: each source data file
    ``__<rank>_<n>.distcp`` becomes one data file of rank ``<rank>`` holding
    the same chunks, so the saved sharding is preserved (DCP records no
    DTensor layout, so chunk lists are explicit in the index). Tensor bytes
    are copied slab by slab through one buffer of at most ``buffer_bytes``
    (reading only each item's storage bytes, never ``torch.load``\\ ing a
    tensor item) and hashed on the way; non-tensor values are loaded with
    ``torch.load(..., weights_only=True)`` (torch's restricted unpickler: a
    value it refuses fails the import naming the key) and re-encoded as
    tagged JSON. The index is written last, atomically. ``progress(done,
    total)`` is called with byte counts after every entry. ``dst`` may be
    ``src`` itself (the DCP files are left alone; the universal index takes
    precedence when loading). A directory that already holds a ucp_dcp
    checkpoint is refused unless ``overwrite=True``.

    Returns the index written.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    ckpt = DCPCheckpoint(src)
    try:
        return _import(ckpt, dst, progress, overwrite, sync_files, max(buffer_bytes, _MiB), io_threads)
    finally:
        ckpt.close()


def _import(
    ckpt: DCPCheckpoint,
    dst: str,
    progress: Callable[[int, int], None] | None,
    overwrite: bool,
    sync_files: bool,
    budget: int,
    io_threads: int,
) -> Index:
    index = ckpt.index
    if os.path.exists(os.path.join(dst, INDEX_FILE)) and not overwrite:
        raise FileExistsError(
            f"{dst} already holds a committed ucp_dcp checkpoint ({INDEX_FILE}); refusing to replace it. "
            "Import into a new directory, or pass overwrite=True"
        )
    os.makedirs(dst, exist_ok=True)
    save_id = uuid.uuid4().hex[:8]
    # What each source file holds, in file order: ("t", fqn, idx) or ("v", key).
    per_file: dict[int, list[tuple[int, tuple[Any, ...]]]] = {}
    total = 0
    for fqn, rec in index.tensors.items():
        for idx, c in enumerate(rec.chunks):
            fi, info = ckpt._tensor_items[fqn][idx]
            per_file.setdefault(fi, []).append((info.offset, ("t", fqn, idx)))
            total += c.box.numel * rec.dtype.itemsize
    for key, loc in index.values.items():
        per_file.setdefault(loc.file, []).append((loc.start, ("v", key)))
        total += loc.nbytes
    done = 0
    files: list[FileRecord] = []
    written: list[list[WrittenEntry]] = []
    reader = RangeReader(ckpt.paths, threads=io_threads, gap_bytes=os.sysconf("SC_PAGE_SIZE") - 1)
    buf = torch.empty(budget, dtype=torch.uint8)
    bview = storage_view(buf)
    per_rank: dict[int, int] = {}
    try:
        for fi in sorted(per_file):
            src_rec = index.files[fi]
            n = per_rank.get(src_rec.rank, 0)
            per_rank[src_rec.rank] = n + 1
            name = data_file_name(src_rec.rank, save_id if n == 0 else f"{save_id}-{n}")
            items = [what for _, what in sorted(per_file[fi], key=lambda x: x[0])]
            entries: list[PlannedEntry] = []
            payload: dict[int, bytes] = {}
            weights: list[int] = []
            for what in items:
                if what[0] == "v":
                    key = what[1]
                    data = encode_value(ckpt.load_value(key, reader), key)
                    payload[len(entries)] = data
                    meta = EntryMeta("value", key, "uint8", (len(data),), (), (), xxhash.xxh3_64_hexdigest(data))
                    entries.append(PlannedEntry(value_entry_name(key), "U8", (len(data),), len(data), meta))
                    weights.append(index.values[key].nbytes)
                else:
                    _, fqn, idx = what
                    rec = index.tensors[fqn]
                    box = rec.chunks[idx].box
                    nbytes = box.numel * rec.dtype.itemsize
                    st = st_dtype(rec.dtype)
                    meta = EntryMeta("tensor", fqn, dtype_name(rec.dtype), rec.shape, box.offsets, box.sizes, _PLACEHOLDER)
                    entries.append(PlannedEntry(chunk_entry_name(fqn, box.offsets), st or "U8",
                                                box.sizes if st else (nbytes,), nbytes, meta))
                    weights.append(nbytes)
            header, starts, size = layout_file(entries, src_rec.rank, index.world_size, save_id)
            path = os.path.join(dst, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, size)
                for i, (what, entry, start, weight) in enumerate(zip(items, entries, starts, weights)):
                    if i in payload:
                        _pwrite_all(fd, memoryview(payload.pop(i)), start)
                    else:
                        digest = _copy_chunk(ckpt, reader, what[1], what[2], fd, start, buf, bview)
                        entries[i] = PlannedEntry(entry.name, entry.st_dtype, entry.shape, entry.nbytes,
                                                  _with_xxh3(entry.meta, digest))
                    done += weight
                    if progress is not None:
                        progress(done, total)
                final, _, _ = layout_file(entries, src_rec.rank, index.world_size, save_id)
                if len(final) != len(header):  # cannot happen: checksums are fixed-width
                    raise AssertionError(f"{path}: header length changed while writing")
                _pwrite_all(fd, memoryview(final), 0)
                if sync_files:
                    os.fsync(fd)
            finally:
                os.close(fd)
            files.append(FileRecord(name, src_rec.rank, size))
            written.append([WrittenEntry(e.name, e.meta, s, e.nbytes) for e, s in zip(entries, starts)])
    finally:
        reader.close()
    out = build_index(index.world_size, files, written)
    missing = sorted(set(ckpt.metadata.state_dict_metadata) - set(out.tensors) - set(out.values))
    if missing:
        raise CheckpointFormatError(f"{ckpt.directory}: keys with no stored data: {missing[:20]}")
    write_index(dst, out)
    keep = {f.name for f in files}
    for name in os.listdir(dst):
        # Data files of an earlier ucp_dcp checkpoint here (overwrite=True); nothing else.
        if name.startswith("rank") and name.endswith(".safetensors") and name not in keep:
            os.remove(os.path.join(dst, name))
    return out


def _with_xxh3(meta: EntryMeta | None, digest: str) -> EntryMeta:
    assert meta is not None
    return EntryMeta(meta.kind, meta.fqn, meta.dtype, meta.shape, meta.offsets, meta.sizes, digest, meta.layout)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _copy_chunk(
    ckpt: DCPCheckpoint,
    reader: RangeReader,
    fqn: str,
    idx: int,
    fd: int,
    start: int,
    buf: torch.Tensor,
    bview: memoryview,
) -> str:
    """Copy chunk ``idx`` of ``fqn`` row-major to ``start`` of ``fd``; its xxh3-64 digest."""
    rec = ckpt.index.tensors[fqn]
    box = rec.chunks[idx].box
    dtype, es = rec.dtype, rec.dtype.itemsize
    h = xxhash.xxh3_64()
    if box.numel == 0:
        return h.hexdigest()
    try:
        location = ckpt.locate(fqn, idx)
    except CheckpointFormatError:
        st = ckpt._stored(fqn, idx)
        if _dim_order(st.size, st.stride) is not None:
            raise
        return _copy_overlapping(ckpt, reader, fqn, idx, st, fd, start, h)
    pos = start
    # An item stored in another dimension order is read through a staging
    # buffer as well (read_region): give each half of the budget.
    budget = buf.numel() // 2 if getattr(location, "dim_order", None) else buf.numel()
    for offs, sizes in slabs(box.sizes, es, budget):
        n = math.prod(sizes) * es
        slab = buf[:n].view(dtype).view(sizes)
        read_region(reader, location, box.sizes, Box(tuple(offs), tuple(sizes)), dtype, slab, budget)
        h.update(bview[:n])
        _pwrite_all(fd, bview[:n], pos)
        pos += n
    return h.hexdigest()


def _copy_overlapping(
    ckpt: DCPCheckpoint, reader: RangeReader, fqn: str, idx: int, st: _StoredTensor, fd: int, start: int, h: Any
) -> str:
    # An item no dimension order makes dense: read the span of storage it
    # uses (one chunk's worth, bounded by the item) and let torch gather it.
    es = st.dtype.itemsize
    span = st.storage_offset + sum((n - 1) * s for n, s in zip(st.size, st.stride)) + 1
    raw = torch.empty(span * es, dtype=torch.uint8)
    fi = ckpt._tensor_items[fqn][idx][0]
    reader.read([Segment(fi, st.data_start, storage_view(raw))])
    t = raw.view(st.dtype).as_strided(st.size, st.stride, st.storage_offset).contiguous()
    data = memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    h.update(data)
    _pwrite_all(fd, data, start)
    return h.hexdigest()
