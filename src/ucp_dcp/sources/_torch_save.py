"""Byte addresses of tensors inside ``torch.save`` archives, without unpickling them.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (the pickle that
rebuilds the object) and one uncompressed record ``<name>/data/<key>`` per
storage. :func:`parse_tensor_item` finds the storage record of a saved
tensor and its absolute start, and *disassembles* ``data.pkl`` with
:func:`pickletools.genops` (never executed, nothing imported) to get the
storage key, dtype, ``storage_offset``, size and stride. Only the two ends
of the archive are read, more only if the archive needs it: with ``pread``
calls on a local file, with ranged requests on an object (the caller hands
in a ``pread`` of either kind, and may fetch the two ends of many items
ahead, in one batch: :func:`item_ends`).

DCP's ``.distcp`` items are such archives; so are DeepSpeed's ``.pt`` files.
"""

from __future__ import annotations

import pickletools
import struct
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .._compat import dtype_from_pickle_storage_type
from ..byteio.rangeio import ReadStats
from ..core.sharding import row_major_strides
from ..errors import CheckpointFormatError, StorageError
from ._torch_archive import HeldBytesFile, read_pickle_record, stored_record_start

__all__ = [
    "StoredTensor",
    "PRead",
    "item_ends",
    "parse_tensor_item",
    "dim_order",
    "is_nonneg_int",
    "is_index_tuple",
]

PRead = Callable[[int, int], bytes]
"""``pread(n, offset)``: up to ``n`` bytes of a file at ``offset`` (fewer only at its end)."""

_MiB = 1024 * 1024
# Bytes read at each end of an item to parse it: the zip central directory
# (7 records of a torch.save archive) sits at the end, data.pkl and the
# storage record's local header at the start. Anything not in them is read
# on demand.
_HEAD_BYTES = 768
_TAIL_BYTES = 768
_MAX_PICKLE_BYTES = 16 * _MiB


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
                stack.append(
                    tuple(items)
                    if n == "TUPLE"
                    else items
                    if n == "LIST"
                    else dict(zip(items[::2], items[1::2]))
                )
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
                raise CheckpointFormatError(
                    f"{where}: unexpected pickle opcode {n} in a tensor item"
                )
    except CheckpointFormatError:
        raise
    except Exception as e:  # malformed pickle: stack underflow, bad memo, unhashable key...
        raise CheckpointFormatError(
            f"{where}: malformed data.pkl ({type(e).__name__}: {e})"
        ) from None
    if not stack:
        raise CheckpointFormatError(f"{where}: empty data.pkl")
    return stack[-1]


@dataclass(frozen=True)
class StoredTensor:
    """Where a ``torch.save``\\ d tensor's bytes are and how they are laid out."""

    dtype: torch.dtype
    data_start: int  # absolute offset of the storage record in the data file
    record_nbytes: int
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


def is_nonneg_int(x: Any) -> bool:
    """Whether ``x`` is an int >= 0 (and not a bool): a size, offset or stride."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def is_index_tuple(x: Any) -> bool:
    """Whether ``x`` is a tuple of :func:`is_nonneg_int` values."""
    return isinstance(x, tuple) and all(is_nonneg_int(v) for v in x)


def _tensor_from_pickle(
    obj: Any, where: str
) -> tuple[str, torch.dtype, int, tuple[int, ...], tuple[int, ...]]:
    """``(storage key, dtype, storage_offset, size, stride)`` of a disassembled tensor pickle."""
    if not (
        isinstance(obj, _Call) and isinstance(obj.func, _Global) and isinstance(obj.args, tuple)
    ):
        raise CheckpointFormatError(f"{where}: the item does not hold a tensor")
    f, args = obj.func, obj.args
    if f == ("torch._utils", "_rebuild_tensor_v2") and len(args) >= 6:
        dtype = None
    elif f == ("torch._utils", "_rebuild_tensor_v3") and len(args) >= 7:
        d = args[6]
        dtype = (
            getattr(torch, d.name, None) if isinstance(d, _Global) and d.module == "torch" else None
        )
        if not isinstance(dtype, torch.dtype):
            raise CheckpointFormatError(f"{where}: unknown tensor dtype {d!r}")
    else:
        raise CheckpointFormatError(
            f"{where}: the item is rebuilt with {f.module}.{f.name}; only plain dense CPU-saveable "
            "tensors (torch._utils._rebuild_tensor_v2/v3) can be read without unpickling"
        )
    storage, offset, size, stride = args[:4]
    pid = storage.pid if isinstance(storage, _PersId) else None
    if not (
        isinstance(pid, tuple)
        and len(pid) == 5
        and pid[0] == "storage"
        and isinstance(pid[1], _Global)
        and isinstance(pid[2], str)
    ):
        raise CheckpointFormatError(
            f"{where}: the tensor's storage reference is malformed: {pid!r}"
        )
    stype = pid[1]
    if dtype is None:  # v2: a typed storage names the dtype
        if stype.module != "torch":
            raise CheckpointFormatError(
                f"{where}: unknown storage type {stype.module}.{stype.name}"
            )
        try:
            dtype = dtype_from_pickle_storage_type(stype.name)
        except KeyError:
            raise CheckpointFormatError(
                f"{where}: unknown storage type torch.{stype.name}"
            ) from None
    elif stype not in (("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage")):
        raise CheckpointFormatError(f"{where}: unexpected storage type {stype.module}.{stype.name}")
    if not (
        is_nonneg_int(offset)
        and is_index_tuple(size)
        and is_index_tuple(stride)
        and len(size) == len(stride)
    ):
        raise CheckpointFormatError(
            f"{where}: malformed tensor geometry {offset!r}, {size!r}, {stride!r}"
        )
    return pid[2], dtype, offset, size, stride


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
    if length <= _HEAD_BYTES + _TAIL_BYTES:
        return [(offset, offset + length)]
    return [(offset, offset + _HEAD_BYTES), (offset + length - _TAIL_BYTES, offset + length)]


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

    ``pread`` reads the file; ``ends``, when given, are the bytes of
    :func:`item_ends` already read (counted by whoever read them).
    """
    ranges = item_ends(offset, length)
    if ends is None:
        ends = [_pread_exact(pread, e - s, s, stats) for s, e in ranges]
    pieces = [(s - offset, data) for (s, _), data in zip(ranges, ends)]
    if sum(len(p) for _, p in pieces) < min(length, _HEAD_BYTES + _TAIL_BYTES):
        raise CheckpointFormatError(f"{where}: truncated: the data file ends inside the item")
    view = _ItemView(pread, offset, length, pieces, stats)
    try:
        zf = zipfile.ZipFile(view)  # type: ignore[arg-type]
        prefix, pkl = read_pickle_record(zf, where, _MAX_PICKLE_BYTES, "not a tensor's")
        key, dtype, soff, size, stride = _tensor_from_pickle(_disassemble(pkl, where), where)
        try:
            rec = zf.getinfo(f"{prefix}data/{key}")
        except KeyError:
            raise CheckpointFormatError(f"{where}: storage record data/{key} is missing") from None

        def read_at(off: int, n: int) -> bytes:
            view.seek(off)
            return view.read(n)

        start = stored_record_start(read_at, rec, where)
    except (
        StorageError
    ):  # a store that failed to answer: no finding about the archive (it is an OSError too)
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
    if start + rec.file_size > length:
        raise CheckpointFormatError(
            f"{where}: storage record data/{key} runs past the end of the item"
        )
    return StoredTensor(dtype, offset + start, rec.file_size, soff, tuple(size), tuple(stride))


def dim_order(size: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
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
