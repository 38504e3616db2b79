"""Index records whose chunks are byte ranges inside ``torch.save`` archives.

The sources that read formats made of ``torch.save`` files (DeepSpeed's
checkpoints and Universal folders) describe each tensor as chunks, each a
byte range of one archive's storage record: the whole tensor
(:meth:`ArchiveIndex.whole`), or pieces of flat buffers laid end to end
(:meth:`ArchiveIndex.flat`, with the segments :mod:`._ds_records` computes).
Both are an :class:`ArchiveSource`: the archives (and the computed file of
merged tensors) are its data files, its values those read from the pickles.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.sharding import Box
from ..core.values import encode_value
from ..errors import CheckpointFormatError
from ..format import ChunkRecord, FileRecord, Index, Location, TensorRecord
from ._ds_merge import MERGE_FILE_NAME, MergedTensor, MergeFile, MergeOp
from ._ds_records import Segment, segment_boxes
from ._ds_tp import TPSlice
from ._pickle import TensorRef
from ._torch_archive import TorchArchive
from .base import Source

__all__ = ["ArchiveIndex", "ArchiveSource"]

_Path = tuple[str | int, ...]
"""Where a record nests in the state dict (``("optim", "state", fqn, "exp_avg")``); its key is
the components joined with dots, as the format requires
(:func:`~ucp_dcp.format.schema.check_paths`)."""


def _key(path: _Path) -> str:
    """The key of the record nested at ``path``."""
    return ".".join(map(str, path))


@dataclass(frozen=True)
class _Operand:
    """One slice of a tensor merged from all its slices: how, and the slice's chunks."""

    op: MergeOp
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: list[ChunkRecord]


class ArchiveIndex:
    """Collects tensor records whose chunks are byte ranges of the archives, and values already
    decoded.

    The archives are the data files, numbered in the order they are given
    or added. Values (read from the pickles when the source was opened) are
    kept as objects: their index locations are empty, and the source's
    ``decode_value`` encodes :attr:`values` instead of bytes.
    """

    def __init__(self, archives: list[TorchArchive]) -> None:
        self.archives: list[TorchArchive] = []
        self.file_of: dict[int, int] = {}
        self.tensors: dict[str, TensorRecord] = {}
        self.values: dict[str, Any] = {}
        self.paths: dict[str, _Path] = {}
        # The tensors merged from all their slices: key -> tensor-parallel rank -> its slice.
        self.operands: dict[str, dict[int, _Operand]] = {}
        self.merges: MergeFile | None = None
        for a in archives:
            self.add_archive(a)

    def add_archive(self, archive: TorchArchive) -> None:
        """Make ``archive`` the next data file."""
        assert self.merges is None, "the computed file comes after every archive"
        self.file_of[id(archive)] = len(self.archives)
        self.archives.append(archive)

    def alias(self, path: _Path, owner: _Path) -> None:
        """The key at ``path`` has the same bytes as ``owner``'s (a tied parameter), unless
        recorded itself."""
        key, owner_key = _key(path), _key(owner)
        if owner_key in self.tensors and key not in self.tensors:
            self.tensors[key] = self.tensors[owner_key]
            self.paths[key] = path

    def value(self, path: _Path, obj: Any) -> None:
        """The key at ``path`` is the value ``obj``."""
        self.values[_key(path)] = obj
        self.paths[_key(path)] = path

    def index(self, world_size: int, root: str, ranks: Sequence[int]) -> Index:
        """The records: one file per archive (named relative to ``root``, written by
        ``ranks[i]``)."""
        files = [
            FileRecord(_relative(a.path, root), r, a.size) for a, r in zip(self.archives, ranks)
        ]
        if self.merges is not None:
            files.append(FileRecord(MERGE_FILE_NAME, 0, self.merges.size))
        values = {k: Location(0, 0, 0, "") for k in self.values}
        return Index(world_size, files, self.tensors, values, {}, paths=dict(self.paths))

    def location(
        self, archive: TorchArchive, t: TensorRef, elem: int, numel: int, what: str
    ) -> Location:
        start, nbytes = archive.byte_range(t, what)
        size = t.dtype.itemsize
        if elem + numel > t.numel:
            raise CheckpointFormatError(
                f"{archive.path}: {what} needs elements [{elem}, {elem + numel}) of a buffer of "
                f"{t.numel}"
            )
        return Location(self.file_of[id(archive)], start + elem * size, numel * size, "")

    def whole(
        self,
        path: _Path,
        archive: TorchArchive,
        t: TensorRef,
        shape: tuple[int, ...],
        what: str,
        place: TPSlice | None = None,
    ) -> None:
        """The key at ``path`` is tensor ``t`` itself (viewed as ``shape``).

        With ``place`` (a tensor-parallel slice, laid out as ``place.local``), ``t`` is put
        where it says in its full tensor, added to the chunks other slices gave the key.
        """
        if place is not None:
            shape = place.local
        chunks = self._chunk(archive, t, Box.whole(shape), 0, what, place)
        self._record(path, t.dtype, shape, chunks, place, archive.path)

    def flat(
        self,
        path: _Path,
        shape: tuple[int, ...],
        segs: list[Segment],
        buffer_of: Callable[[Segment], tuple[TorchArchive, TensorRef]],
        what: str,
        place: TPSlice | None = None,
    ) -> None:
        """The key at ``path``, of ``shape``, lies in flat buffers: ``buffer_of(seg)`` gives
        ``(archive, tensor)`` of a segment.

        With ``place`` (a tensor-parallel slice of ``shape``, laid out as ``place.local``: the
        same elements), the boxes go where it puts them in its full tensor, added to the chunks
        other slices gave the key.
        """
        if place is not None:
            shape = place.local
        chunks: list[ChunkRecord] = []
        dtype = None
        first = ""  # the file of the first segment, to name the slice in an error
        for seg in segs:
            archive, t = buffer_of(seg)
            first = first or archive.path
            dtype = t.dtype if dtype is None else dtype
            if t.dtype != dtype:
                raise CheckpointFormatError(
                    f"{archive.path}: {what} is stored as both {dtype} and {t.dtype}"
                )
            for box, off in segment_boxes(shape, seg):
                chunks += self._chunk(archive, t, box, off, what, place)
        # An empty parameter has no element stored anywhere, and no chunks.
        self._record(path, dtype or torch.float32, shape, chunks, place, first)

    def _record(
        self,
        path: _Path,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        chunks: list[ChunkRecord],
        place: TPSlice | None,
        where: str,
    ) -> None:
        """``chunks`` of the key at ``path`` (of ``shape``): the whole tensor, or with ``place`` a
        slice's, added to the chunks other slices gave the key; where the key is merged from all
        its slices (``place.merge``), the chunks (boxes of the slice) are slice ``place.rank``'s
        operand, recorded by :meth:`finish_merges`. ``where``: the file the slice is read from
        (for an error)."""
        if place is None:
            self.add(path, dtype, shape, chunks)
        elif place.merge:
            self.operands.setdefault(_key(path), {})[place.rank] = _Operand(
                place.merge, dtype, tuple(place.local), chunks
            )
            self.paths[_key(path)] = path
        else:
            self._extend(path, dtype, place.full_shape, chunks, place.rank, where)

    def finish_merges(self, degree: int, where: str) -> None:
        """Record each merged tensor (computed from its ``degree`` slices) as a byte range of
        the computed file that comes after the archives (:mod:`._ds_merge`)."""
        if not self.operands:
            return
        file = len(self.archives)
        tensors, offset = [], 0
        for key in sorted(self.operands):
            slices = self.operands[key]
            gone = sorted(set(range(degree)) - set(slices))
            if gone:
                raise CheckpointFormatError(
                    f"{where}: {key} is merged from its tensor-parallel slices, but "
                    f"tensor-parallel rank(s) {gone} hold none"
                )
            kinds = {(o.op, o.dtype, o.shape) for o in slices.values()}
            if len(kinds) != 1:
                raise CheckpointFormatError(
                    f"{where}: {key} is merged from its tensor-parallel slices, which are "
                    f"{sorted(f'{op} of {d} {list(s)}' for op, d, s in kinds)}: not one rule, "
                    "dtype and shape"
                )
            op, dtype, shape = kinds.pop()
            ops = tuple(
                tuple((c.box, c.location) for c in slices[r].chunks if c.location is not None)
                for r in range(degree)
            )
            merged = MergedTensor(key, offset, dtype, shape, op, ops)
            tensors.append(merged)
            box = Box.whole(shape)
            loc = Location(file, offset, merged.nbytes, "")
            chunks = [ChunkRecord(box, loc)] if merged.nbytes else []
            self.add(self.paths[key], dtype, shape, chunks)
            offset += merged.nbytes
        self.merges = MergeFile(file, tensors, where)

    def _chunk(
        self,
        archive: TorchArchive,
        t: TensorRef,
        box: Box,
        off: int,
        what: str,
        place: TPSlice | None,
    ) -> list[ChunkRecord]:
        if place is None or place.merge:  # an operand keeps the slice's boxes
            return [ChunkRecord(box, self.location(archive, t, off, box.numel, what))]
        return [
            ChunkRecord(full, self.location(archive, t, off + at, full.numel, what))
            for at, full in place.place(box)
            if full.numel
        ]

    def _extend(
        self,
        path: _Path,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        chunks: list[ChunkRecord],
        rank: int,
        where: str,
    ) -> None:
        """Add ``chunks`` (tensor-parallel rank ``rank``'s slice, read from file ``where``) to the
        key at ``path`` (recorded with ``dtype`` and ``shape`` if new)."""
        key = _key(path)
        rec = self.tensors.get(key)
        if rec is None:
            self.add(path, dtype, shape, chunks)
            return
        if rec.dtype != dtype or tuple(rec.shape) != tuple(shape):
            raise CheckpointFormatError(
                f"{where or key}: tensor-parallel rank {rank}'s slice of {key} is {dtype}, merged "
                f"shape {tuple(shape)}; other ranks' slices are {rec.dtype}, merged shape "
                f"{tuple(rec.shape)}"
            )
        rec.chunks.extend(chunks)

    def add(
        self,
        path: _Path,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        chunks: list[ChunkRecord],
    ) -> None:
        self.tensors[_key(path)] = TensorRecord(dtype, tuple(shape), None, False, chunks=chunks)
        self.paths[_key(path)] = path


class ArchiveSource(Source):
    """A source whose data files are the archives of an :class:`ArchiveIndex`, then its computed
    file of merged tensors (:attr:`computed`, where there is one); its values are those the
    pickles held when it was opened."""

    computed: MergeFile | None = None
    """The tensors merged from all their tensor-parallel slices (``ds_to_universal``'s
    ``parameter_to_average_patterns`` and ``tp_replicated_parameter_patterns``); its ``equal``
    lists the averaged ones whose slices a load found bit-equal."""

    def __init__(self, path: str, b: ArchiveIndex, world_size: int, ranks: Sequence[int]) -> None:
        """Records of ``b`` (``ranks[i]``: the rank that wrote archive ``i``)."""
        paths = [a.path for a in b.archives] + ([MERGE_FILE_NAME] if b.merges is not None else [])
        super().__init__(path, b.index(world_size, path, ranks), paths)
        self.computed = b.merges
        self._values = b.values

    def decode_value(self, key: str, raw: bytes) -> bytes:
        """Values live in the pickles, read when the checkpoint was opened."""
        return encode_value(self._values[key], key)

    def check_files(self) -> list[str]:
        """One line per data file that is missing or not the size it was when opened (local or
        in its store)."""
        problems = []
        store = self.store
        for p, f in zip(self.paths, self.index.files):
            if f.name == MERGE_FILE_NAME:
                continue  # computed, in no storage
            try:
                size = store.size(store.name_of(p)) if store is not None else os.path.getsize(p)
            except OSError as e:  # a StorageError too: it names the URL
                problems.append(str(e) if store is not None else f"{p}: {e.strerror or e}")
                continue
            if size != f.size:
                where = "in the store" if store is not None else "on disk"
                problems.append(f"{p}: {size} bytes {where}, {f.size} when opened")
        return problems


def _relative(path: str, root: str) -> str:
    """``path`` relative to ``root``: a URL (``s3://b/ck/tag/f``) by its prefix, a local path by
    ``os.path``."""
    prefix = root.rstrip("/") + "/"
    if "://" in root and path.startswith(prefix):
        return path[len(prefix) :]
    return os.path.relpath(path, root)
