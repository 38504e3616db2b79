"""The one writer of native data files (``UCPStorageWriter``, ``convert``): :class:`DataFileWriter`
writes at offsets, :func:`stream_data_file` the same bytes front to back (for uploads).

A file is laid out first (:func:`layout`), each entry is hashed as it is written (its xxh3-64 and
its block checksums), and the block checksums and the header are written last (the header keeps
its length: a checksum has a fixed width). With ``threads > 1`` writer threads ``pwrite`` stable
data in :data:`PIECE_BYTES` pieces, each piece's writeback started at once
(:func:`~ucp_dcp.byteio.durable.start_writeback`) so that the final ``fsync`` finds little left,
while the caller's thread hashes the same bytes in order. The format, and why the bytes are those
of a one-thread write: docs/format.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import InvalidArgumentError
from ..format import (
    ALIGN,
    BLOCK_BYTES,
    BLOCK_SUMS_ENTRY,
    EntryMeta,
    Layout,
    PlannedEntry,
    chunk_entry_name,
    dtype_name,
    has_block_sums,
    layout_file,
    rank_local_entry_name,
    split_rank_local_key,
    st_dtype,
    value_entry_name,
)
from .blocksums import BlockHasher
from .durable import remove_quietly, start_writeback, write_all
from .progress import Progress

__all__ = [
    "PLACEHOLDER",
    "PIECE_BYTES",
    "DataFileWriter",
    "layout",
    "stream_data_file",
    "value_entry",
    "chunk_entry",
]

PIECE_BYTES = 8 << 20
"""Writer threads write stable data in pieces of this size (large enough that a call's cost is
noise, small enough that every thread has work and the storage starts early)."""
# Pieces queued or being written at once, per writer thread: bounds the memory held
# (views of the caller's tensors) while the caller hashes ahead.
_QUEUED_PER_THREAD = 2

PLACEHOLDER = "0" * 16
"""The checksum laid out before the data is hashed (an xxh3-64 hex digest has a fixed width)."""


def layout(
    entries: Sequence[PlannedEntry],
    rank: int,
    world_size: int,
    save_id: str,
    align: int = ALIGN,
    *,
    block: int | None = None,
    block_sums_xxh3: str = PLACEHOLDER,
) -> tuple[bytes, list[int], int]:
    """:func:`~ucp_dcp.format.layout_file` of a data file holding ``entries`` and their block
    checksums.

    The block checksums' entry (one uint64 per ``block`` bytes of every
    tensor chunk) comes first, right after the header, and is left out when
    no entry has any. Returns ``(header, offsets of entries, file size)``.
    """
    block = block or BLOCK_BYTES
    nsums = sum(-(-e.nbytes // block) for e in entries if has_block_sums(e.meta, e.nbytes))
    if not nsums:
        return layout_file(entries, rank, world_size, save_id, align)
    sums = PlannedEntry(BLOCK_SUMS_ENTRY, "U64", (nsums,), 8 * nsums, None)
    header, starts, size = layout_file(
        [sums, *entries], rank, world_size, save_id, align, block_sums=(block, block_sums_xxh3)
    )
    return header, starts[1:], size


class _Hashes:
    """The checksums of a data file's entries, hashed as their bytes go by: an xxh3-64 of each
    entry (``whole``), and of every ``block`` bytes of each tensor chunk (``blocks``, by entry
    number)."""

    def __init__(self, entries: Sequence[PlannedEntry], block: int) -> None:
        self.block = block
        self.whole = [xxhash.xxh3_64() for _ in entries]
        self.blocks = {
            i: BlockHasher(e.nbytes, block)
            for i, e in enumerate(entries)
            if has_block_sums(e.meta, e.nbytes)
        }

    def update(self, i: int, view: memoryview) -> None:
        """Entry ``i``'s next bytes."""
        self.whole[i].update(view)
        blocks = self.blocks.get(i)
        if blocks is not None:
            blocks.update(view)


class DataFileWriter:
    """Writes the entries of one native data file at ``path``.

    Use as a context manager: ``write(i, data)`` any number of times per
    entry, in order, until each entry has its ``nbytes``; leaving the block
    without an exception commits the header and fsyncs (``sync``), with one
    removes the file and re-raises. ``entries`` afterwards carry their
    checksums, and ``starts``/``size`` give each entry's offset and the
    file's size. Tensor chunks also get block checksums (every
    :data:`~ucp_dcp.format.BLOCK_BYTES` bytes), stored in the file's block checksums' entry.

    ``threads``: writer threads for data written with ``stable=True``
    (1: every write happens in the caller's thread, as it comes).

    Attributes:
        created: the file was created (an ``OSError`` after this removed it).
    """

    def __init__(
        self,
        path: str,
        entries: Sequence[PlannedEntry],
        *,
        rank: int,
        world_size: int,
        save_id: str,
        align: int = ALIGN,
        sync: bool = True,
        threads: int = 1,
    ) -> None:
        self.path = path
        self.entries = list(entries)
        self._args = (rank, world_size, save_id, align)
        self.block = BLOCK_BYTES  # looked up here, so tests can make blocks small
        self.header, self.starts, self.size = layout(self.entries, *self._args, block=self.block)
        self.sync = sync
        self.created = False
        self._fd = -1
        self._hashes = _Hashes(self.entries, self.block)
        self._written = [0] * len(self.entries)
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(self.threads * _QUEUED_PER_THREAD)
        self._failed: BaseException | None = None  # the first error of a writer thread

    def __enter__(self) -> DataFileWriter:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.created = True
        try:
            # Padding stays a hole: reads as zeros, costs no writes.
            os.ftruncate(self._fd, self.size)
        except BaseException:
            self._abort()
            raise
        return self

    def write(self, i: int, data: Any, *, stable: bool = False) -> None:
        """Append ``data`` (bytes-like) to entry ``i``, hashing it.

        ``stable``: the caller leaves ``data`` unchanged (and does not reuse
        its memory) until the writer is closed, so writer threads may write
        it after this returns. Otherwise it is written before this returns.
        """
        view = memoryview(data).cast("B")
        done = self._written[i]
        if done + len(view) > self.entries[i].nbytes:
            raise InvalidArgumentError(
                f"{self.path}: entry {self.entries[i].name!r} gets more than its "
                f"{self.entries[i].nbytes} bytes"
            )
        self._raise_failed()
        at = self.starts[i] + done
        if stable and self.threads > 1:
            # Queue the pieces first, so the threads copy them into the page
            # cache while this thread hashes the same bytes.
            for o in range(0, len(view), PIECE_BYTES):
                self._queue(view[o : o + PIECE_BYTES], at + o)
        else:
            write_all(self._fd, view, at)
        self._hashes.update(i, view)
        self._written[i] = done + len(view)

    def _queue(self, piece: memoryview, at: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ucp-write")
        self._slots.acquire()  # blocks while enough pieces wait: bounded memory
        self._raise_failed()
        try:
            self._pool.submit(self._write_piece, piece, at)
        except BaseException:
            self._slots.release()
            raise

    def _write_piece(self, piece: memoryview, at: int) -> None:
        try:
            if self._failed is None:  # after a failure the file is removed anyway
                write_all(self._fd, piece, at)
                if self.sync:
                    start_writeback(self._fd, at, len(piece))
        except BaseException as e:
            if self._failed is None:
                self._failed = e
        finally:
            self._slots.release()

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _drain(self) -> None:
        """Wait for every queued piece and stop the writer threads (before the descriptor is
        closed)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            self._abort()
            return
        try:
            self._drain()
            self._raise_failed()
            short = [e.name for e, n in zip(self.entries, self._written) if n != e.nbytes]
            if short:
                raise InvalidArgumentError(
                    f"{self.path}: entries {short[:5]} were not written in full"
                )
            self.entries, final, raw = _finished(self.entries, self._hashes, self._args)
            if raw is not None:
                # The block checksums' entry is the first one, right after the header.
                write_all(self._fd, raw, len(self.header))
            write_all(self._fd, final, 0)
            if self.sync:
                os.fsync(self._fd)  # may be where a full disk shows (delayed allocation, NFS)
            fd, self._fd = self._fd, -1
            os.close(fd)  # so can this (NFS reports write errors at close)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        # A half-written file is no use to anyone and holds space a full disk
        # needs back; no index will name it. The writer threads stop first:
        # none may write through a descriptor number that is closed (or reused).
        self._drain()
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        remove_quietly(self.path)


def _finished(
    entries: list[PlannedEntry],
    hashes: _Hashes,
    args: tuple[int, int, str, int],
) -> tuple[list[PlannedEntry], bytes, memoryview | None]:
    """Once every entry is hashed: the entries with their checksums, the final header (as long as
    the first: every checksum in it is 16 hex digits, as its placeholder was), the block
    checksums' bytes."""
    entries = [
        dataclasses.replace(e, meta=dataclasses.replace(e.meta, xxh3=h.hexdigest()))
        if e.meta
        else e
        for e, h in zip(entries, hashes.whole)
    ]
    raw = None
    sums_xxh3 = PLACEHOLDER
    blocks = hashes.blocks
    if blocks:
        sums = np.concatenate([blocks[i].digests() for i in sorted(blocks)]).astype("<u8")
        raw = sums.data.cast("B")
        sums_xxh3 = xxhash.xxh3_64_hexdigest(raw)
    final, _, _ = layout(entries, *args, block=hashes.block, block_sums_xxh3=sums_xxh3)
    return entries, final, raw


def stream_data_file(
    out: Any,
    entries: Sequence[PlannedEntry],
    datas: Sequence[Any],
    *,
    path: str,
    rank: int,
    world_size: int,
    save_id: str,
    align: int = ALIGN,
    progress: Progress | None = None,
) -> tuple[list[PlannedEntry], list[int], int]:
    """Write a native data file front to back into the file-like ``out`` (an object being uploaded).

    The same bytes as :class:`DataFileWriter` writes, for storage that
    cannot write at an offset: every entry's data (``datas[i]``, bytes-like,
    all in memory) is hashed first, then the header with its checksums, the
    block checksums, and the entries with their alignment padding are
    written in file order. ``path`` names the file in messages; ``progress``,
    if given, is fed the bytes of every write. Returns
    ``(entries with checksums, their offsets, file size)``.
    """
    block = BLOCK_BYTES
    entries = list(entries)
    args = (rank, world_size, save_id, align)
    header, starts, size = layout(entries, *args, block=block)
    hashes = _Hashes(entries, block)
    views = []
    for i, (e, data) in enumerate(zip(entries, datas)):
        view = memoryview(data).cast("B")
        if len(view) != e.nbytes:
            raise InvalidArgumentError(
                f"{path}: entry {e.name!r} has {len(view)} bytes, not {e.nbytes}"
            )
        hashes.update(i, view)
        views.append(view)
    entries, final, raw = _finished(entries, hashes, args)
    at = 0

    def emit(data: Any) -> None:
        nonlocal at
        for o in range(0, len(data), PIECE_BYTES):
            piece = data[o : o + PIECE_BYTES]
            out.write(piece)
            if progress is not None:
                progress.add(len(piece))
        at += len(data)

    def pad_to(offset: int) -> None:
        while at < offset:
            emit(bytes(min(offset - at, PIECE_BYTES)))

    emit(final)
    if raw is not None:
        emit(raw)
    for start, view in sorted(zip(starts, views), key=lambda sv: sv[0]):
        pad_to(start)
        emit(view)
    pad_to(size)
    return entries, starts, size


def value_entry(key: str, nbytes: int) -> PlannedEntry:
    """The entry of a non-tensor value (tagged JSON, ``nbytes`` long) saved under DCP storage key
    ``key``: a rank-local value's key (:func:`~ucp_dcp.format.rank_local_key`) names its rank."""
    rl = split_rank_local_key(key)
    fqn = rl[1] if rl else key
    meta = EntryMeta("rank_local" if rl else "value", fqn, "uint8", (nbytes,), (), (), PLACEHOLDER)
    name = rank_local_entry_name(fqn) if rl else value_entry_name(fqn)
    return PlannedEntry(name, "U8", (nbytes,), nbytes, meta)


def chunk_entry(
    fqn: str,
    dtype: torch.dtype,
    shape: Sequence[int],
    offsets: Sequence[int],
    sizes: Sequence[int],
    layout: Layout | None = None,
) -> PlannedEntry:
    """The entry of the chunk of tensor ``fqn`` (global ``shape``) at ``offsets`` with ``sizes``.

    Dtypes safetensors has no code for are stored as raw ``U8`` bytes; the
    metadata keeps the real dtype.
    """
    sizes = tuple(sizes)
    nbytes = math.prod(sizes) * dtype.itemsize
    st = st_dtype(dtype)
    meta = EntryMeta(
        "tensor", fqn, dtype_name(dtype), tuple(shape), tuple(offsets), sizes, PLACEHOLDER, layout
    )
    return PlannedEntry(
        chunk_entry_name(fqn, offsets), st or "U8", sizes if st else (nbytes,), nbytes, meta
    )
