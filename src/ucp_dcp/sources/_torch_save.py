"""Byte addresses of tensors inside ``torch.save`` archives, without building them.

A ``torch.save`` file is a zip archive: ``<name>/data.pkl`` (the pickle that
rebuilds the object) and one uncompressed record ``<name>/data/<key>`` per
storage. :func:`parse_tensor_item` finds the storage record of a saved
tensor and its absolute start, and reads ``data.pkl`` with the library's
restricted unpickler (:mod:`._pickle`, purpose ``"distcp_item"``: only
torch's plain tensor rebuild functions, which it swaps for builders of a
:class:`~._pickle.TensorRef`) to get the storage key, dtype,
``storage_offset``, size and stride. Only the two ends
of the archive are read, more only if the archive needs it: with ``pread``
calls on a local file, with ranged requests on an object (the caller hands
in a ``pread`` of either kind, and may fetch the two ends of many items
ahead, in one batch: :func:`item_ends`).

DCP's ``.distcp`` items are such archives; so are DeepSpeed's ``.pt`` files.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, cast

import torch

from ..byteio.rangeio import ReadStats
from ..core.contiguous import row_major_strides
from ..errors import CheckpointFormatError
from ._pickle import TensorRef, unpickle
from ._torch_archive import (
    HeldBytesFile,
    archive_errors,
    read_pickle_record,
    storage_records,
    stored_record_start,
)

__all__ = [
    "StoredTensor",
    "PRead",
    "item_ends",
    "parse_tensor_item",
    "dim_order",
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


@dataclass(frozen=True)
class StoredTensor:
    """Where a ``torch.save``\\ d tensor's bytes are and how they are laid out."""

    dtype: torch.dtype
    data_start: int  # absolute offset of the storage record in the data file
    record_nbytes: int
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


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
    with archive_errors(where):
        zf = zipfile.ZipFile(cast(IO[bytes], view))  # a raw file: all zipfile uses of one
        prefix, pkl = read_pickle_record(zf, where, _MAX_PICKLE_BYTES, "not a tensor's")
        records = storage_records(zf, prefix)
        t = unpickle(pkl, where, "distcp_item", records)
        if not isinstance(t, TensorRef):
            raise CheckpointFormatError(f"{where}: the item does not hold a tensor")
        rec = records[t.storage]

        def read_at(off: int, n: int) -> bytes:
            view.seek(off)
            return view.read(n)

        start = stored_record_start(read_at, rec, where)
    if start + rec.file_size > length:
        raise CheckpointFormatError(
            f"{where}: storage record data/{t.storage} runs past the end of the item"
        )
    return StoredTensor(t.dtype, offset + start, rec.file_size, t.storage_offset, t.size, t.stride)


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
