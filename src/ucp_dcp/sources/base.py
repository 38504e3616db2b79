"""The seam every checkpoint format implements: :class:`Source`.

A source presents a checkpoint, whatever wrote it, as the same three things:

* **records**: an :class:`~ucp_dcp.format.Index` listing every tensor (dtype,
  global shape, saved chunks as boxes of the global tensor, and the layout
  when it is known), every non-tensor value and every rank-local value, and
  the data files they live in (``paths``, numbered as ``Location.file``);
* **byte locations**: :meth:`Source.locate` says where the bytes of one
  saved chunk are, row-major or in another dimension order
  (``Location.dim_order``), with a checksum when the format records one;
* **values**: :meth:`Source.value_location` and :meth:`Source.decode_value`
  turn a stored value into the tagged JSON :mod:`ucp_dcp.core.values` reads.

Everything that reads (``UCPStorageReader`` for ``dcp.load``, ``Checkpoint``,
the hand-off functions, the CLI, ``convert``) goes through this seam and
contains no format test of its own. A format opens from a directory view
(:class:`~ucp_dcp.byteio.location.ModelDir`, local or in object storage;
:meth:`Source.open` takes a path too). Adding a format: see docs/sources.md
("Adding a format").
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from ..byteio.blocksums import BlockSums
from ..byteio.integrity import read_checked_many, value_what
from ..byteio.location import ModelDir, view_of
from ..byteio.objrange import OBJECT_GAP_BYTES, ObjectRangeReader
from ..byteio.objstore import ObjectStore, local_path
from ..byteio.rangeio import MAX_REQUEST_BYTES, ByteSource, RangeReader
from ..byteio.requests import RequestPolicy
from ..core.sharding import Box, Grid
from ..errors import CheckpointFormatError
from ..format import ChunkRecord, Index, Location, split_rank_local_key
from ..format.schema import check_field_types

__all__ = ["Source", "SourceOptions", "register", "source_types", "read_values"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class SourceOptions:
    """How to open a checkpoint; each field matters to some formats only."""

    dcp_values: str | None = None
    """DCP's default format stores non-tensor values as pickles: ``None`` refuses
    them (naming the key), ``"weights_only"`` loads them with
    ``torch.load(weights_only=True)``, torch's restricted unpickler."""

    prefix: str = ""
    """Prepended to every tensor name of a source that has no naming
    convention of its own (a Hugging Face directory): ``"model."`` makes its
    names those of ``get_state_dict(model, optim)``."""

    tp_rules: object = None
    """Tensor-parallel partitioning of a DeepSpeed checkpoint whose
    ``universal_checkpoint_info`` is missing or wrong: a ``LayoutSpec``, a list
    of layout rules (``Shard``, ``VocabPad``, ``Replicated``, ``Averaged``,
    ``Fused``) or their JSON (``Rule.to_json()``), searched (``re.search``) in
    DeepSpeed's parameter names; the first match wins over the checkpoint's
    patterns, which still place the parameters no rule matches. None: the
    checkpoint's patterns only."""

    def __post_init__(self) -> None:
        check_field_types(self)


class ComputedFile(Protocol):
    """A data file whose bytes a reader computes from the other files' (the mean of
    tensor-parallel slices: :class:`~ucp_dcp.sources._ds_merge.MergeFile`)."""

    def wrap(self, base: ByteSource, verify: bool = True) -> ByteSource:
        """A reader of the real files (``base``) that also serves this file's bytes (``verify``:
        check what it computes them from, where it can)."""
        ...


class Source(ABC):
    """A checkpoint of some format: records, byte locations and values (see the module docstring).

    Attributes:
        path: what was opened (a directory, or a file for single-file formats).
        index: the records. Chunk locations in it may be None: call
            :meth:`locate`, which is the only way to get a chunk's bytes.
        paths: absolute path of each data file, indexed by ``Location.file``.
    """

    format: ClassVar[str] = ""
    """Short name of the format, shown by ``ucp-dcp inspect``."""
    store: ObjectStore | None = None
    """The object store the checkpoint is in; None for a local checkpoint (``paths`` are files)."""
    computed: ComputedFile | None = None
    """A last data file whose bytes are computed from the others' (its path names no storage),
    or None."""
    checksums: bool = False
    """Whether the format records a checksum of every chunk and value."""
    title: ClassVar[str] = ""
    """The format's name for people ("Hugging Face"), in the error for a path no format
    recognises."""
    looks_for: ClassVar[str] = ""
    """What :meth:`detect_dir` looks for, in a few words ("ucp_index.json"), in the same error."""
    opens_files: ClassVar[bool] = False
    """Whether a location naming one file (not a directory) may be of this format."""
    detect_order: ClassVar[int] = 80
    """Where :func:`source_types` puts the format (lowest first; registration order among equals):
    the built-in formats are 10-60, subfolders read as one last (100)."""

    def __init__(self, path: str, index: Index, paths: Sequence[str]) -> None:
        self.path = path
        self.index = index
        self.paths = list(paths)
        self._chunk_lists: dict[str, list[ChunkRecord]] = {}

    # ------------------------------------------------------------ opening
    @classmethod
    def detect(cls, where: str | os.PathLike[str] | ModelDir) -> bool:
        """Whether ``where`` (a local path, or a directory view) is a checkpoint of this format.

        Cheap: names and sizes only (and, in object storage, a small file
        opening reads anyway). A location naming a file is offered only to
        formats that can be one file (:attr:`opens_files`).
        """
        if not isinstance(where, ModelDir) and not os.path.exists(local_path(where)):
            return False
        d = view_of(where)
        return (d.named is None or cls.opens_files) and cls.detect_dir(d)

    @classmethod
    def open(cls, where: str | os.PathLike[str] | ModelDir, options: SourceOptions) -> Source:
        """Open ``where`` (which :meth:`detect` accepted), reading its metadata only."""
        return cls.open_dir(view_of(where), options)

    @classmethod
    @abstractmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """Whether the directory (or the file :attr:`~ModelDir.named`) of view ``d`` is a
        checkpoint of this format."""

    @classmethod
    @abstractmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> Source:
        """Open the checkpoint of view ``d`` (which :meth:`detect_dir` accepted)."""

    def open_reader(
        self,
        *,
        threads: int,
        gap_bytes: int | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        requests: RequestPolicy | None = None,
        verify: bool = True,
    ) -> ByteSource:
        """The byte reader of ``paths``: ``preadv`` calls for files, ranged requests for objects.

        ``gap_bytes=None`` takes the storage's default: merge gaps within a
        page on a file system, up to :data:`~ucp_dcp.byteio.objrange.OBJECT_GAP_BYTES`
        on object storage, where a request costs a round trip. ``requests``: the deadlines of
        local reads (object stores keep the policy they were opened with). ``verify``: a
        :attr:`computed` file checks what it computes from (bytes read are checked by the
        load's own checksums either way).
        """
        real = len(self.paths) - (self.computed is not None)
        reader: ByteSource
        if self.store is None:
            gap = _PAGE - 1 if gap_bytes is None else gap_bytes
            reader = RangeReader(
                self.paths[:real],
                threads=threads,
                gap_bytes=gap,
                max_request_bytes=max_request_bytes,
                requests=requests,
            )
        else:
            gap = OBJECT_GAP_BYTES if gap_bytes is None else gap_bytes
            names = [self.store.name_of(p) for p in self.paths[:real]]
            reader = ObjectRangeReader(
                self.store,
                names,
                sizes=[f.size for f in self.index.files[:real]],
                gap_bytes=gap,
                max_request_bytes=max_request_bytes,
            )
            for file, head in self.held_heads().items():
                reader.hold(file, 0, head)
        return reader if self.computed is None else self.computed.wrap(reader, verify)

    def held_heads(self) -> dict[int, memoryview]:
        """The first bytes of data files (index in :attr:`paths` -> bytes from offset 0) that
        the source already holds, handed to every object-store reader it opens so that what a
        load reads inside them costs no request. None here; a native source in object storage
        holds its data files' first requests
        (:meth:`~ucp_dcp.sources.native.NativeSource.prepare`)."""
        return {}

    # ------------------------------------------------------------ records
    def chunks(self, fqn: str) -> list[ChunkRecord]:
        """The chunk list of tensor ``fqn`` (cached; O(chunks): for tools, not planners)."""
        cl = self._chunk_lists.get(fqn)
        if cl is None:
            cl = self.index.tensors[fqn].chunk_list()
            self._chunk_lists[fqn] = cl
        return cl

    def grid(self, fqn: str) -> Grid | None:
        """The chunk grid of tensor ``fqn`` (None for an irregular chunk list)."""
        return self.index.tensors[fqn].grid()

    def box(self, fqn: str, idx: int) -> Box:
        """The box of chunk ``idx`` of tensor ``fqn``."""
        return self.index.tensors[fqn].chunk_box(idx)

    def chunk_index(self, fqn: str, offsets: tuple[int, ...], hint: int | None) -> int:
        """Position of the chunk of ``fqn`` that starts at ``offsets`` (``hint`` is tried first)."""
        rec = self.index.tensors[fqn]
        n = rec.chunk_count()
        if hint is not None and 0 <= hint < n and rec.chunk_box(hint).offsets == offsets:
            return hint
        found = rec.find_chunk(offsets)
        if found is None:
            raise CheckpointFormatError(
                f"{self.path}: tensor {fqn!r} has no saved chunk at offsets {list(offsets)}"
            )
        return found

    def file_rank(self, file: int) -> int | None:
        """The rank that wrote data file ``file`` (None where the format does not say)."""
        return self.index.files[file].rank

    def file_ranks(self) -> list[int | None]:
        """:meth:`file_rank` of every file in :attr:`paths`, in order."""
        return [self.file_rank(i) for i in range(len(self.paths))]

    # ------------------------------------------------------------ bytes
    def locate(self, fqn: str, idx: int) -> Location:
        """Where the bytes of chunk ``idx`` of tensor ``fqn`` are.

        The default serves formats whose index lists every chunk's location;
        others override it. Raises :class:`CheckpointFormatError` naming the
        file and key when they cannot be read as byte ranges.
        """
        loc = self.index.tensors[fqn].chunks[idx].location
        if loc is None:
            raise CheckpointFormatError(
                f"{self.path}: no byte location recorded for chunk {idx} of {fqn!r}"
            )
        return loc

    def block_sums(self, fqn: str, idx: int, location: Location) -> BlockSums | None:
        """The block checksums of chunk ``idx`` of ``fqn`` stored at ``location`` (from
        :meth:`locate`).

        None where the format records none (then a verified read checks the
        chunk's whole checksum, if there is one).
        """
        return None

    def sums_to_check(
        self, fqn: str, idx: int, location: Location, verify: bool
    ) -> BlockSums | None:
        """What a read that checks what it reads (``verify``) checks chunk ``idx`` of ``fqn``
        against block by block: :meth:`block_sums`; None, nothing looked up, when not ``verify``."""
        return self.block_sums(fqn, idx, location) if verify else None

    def chunk_origin(self, fqn: str, idx: int) -> tuple[int, int]:
        """``(file, byte offset)`` where chunk ``idx`` of ``fqn`` is stored, to group and order
        chunks by file."""
        loc = self.locate(fqn, idx)
        return loc.file, loc.start

    def prepare(
        self, chunks: Sequence[tuple[str, int]], values: Sequence[str], threads: int = 4
    ) -> None:
        """Called with everything one load will read, before any byte is read.

        A format refuses here what it will not read (so nothing is half
        loaded) and may locate the chunks ahead of time, in parallel.
        """
        return None  # the default refuses nothing and locates chunks when they are read

    def materialize(self, reader: ByteSource, fqn: str, idx: int) -> torch.Tensor:
        """Chunk ``idx`` of ``fqn`` as a tensor, for chunks :meth:`locate` cannot address.

        Only :func:`~ucp_dcp.tools.convert.convert` calls it, after ``locate``
        failed; formats whose chunks are always byte ranges keep the default.
        """
        return self._raise_unaddressable(fqn, idx)

    def _raise_unaddressable(self, fqn: str, idx: int) -> Any:
        self.locate(fqn, idx)  # raises, naming the problem
        raise CheckpointFormatError(f"{self.path}: chunk {idx} of {fqn!r} cannot be read")

    # ------------------------------------------------------------ values
    def value_location(self, key: str) -> Location:
        """Where value ``key`` is stored (``key`` may be a rank-local key, see
        :func:`~ucp_dcp.format.rank_local_key`)."""
        rl = split_rank_local_key(key)
        try:
            return self.index.rank_local[rl[1]][rl[0]] if rl else self.index.values[key]
        except KeyError:
            raise CheckpointFormatError(f"{self.path}: no saved value for {key!r}") from None

    def decode_value(self, key: str, raw: bytes) -> bytes:
        """The stored bytes of value ``key`` as tagged JSON (:mod:`ucp_dcp.core.values`)."""
        return raw

    # ------------------------------------------------------------ checking
    def check_files(self) -> list[str]:
        """Problems with the data files that checksums cannot show (sizes, headers); one line
        each."""
        return []

    def checksummed_records(self) -> list[tuple[str, Location]]:
        """Checksummed bytes that are neither chunks nor values (block checksums), as ``(what,
        location)``."""
        return []

    def close(self) -> None:
        """Release open files (reopened if needed)."""
        return None  # the default holds no open files


def read_values(source: Source, reader: ByteSource, keys: Sequence[str]) -> list[bytes]:
    """Values ``keys`` of ``source`` as tagged JSON, each checked against its checksum, read with
    one ``reader.read`` call (values lie together at the end of a data file: one request for all
    of them on object storage)."""
    reads = []
    for key in keys:
        loc = source.value_location(key)
        reads.append((loc, source.paths[loc.file], value_what(key), source.file_rank(loc.file)))
    raws = read_checked_many(reader, reads)
    return [source.decode_value(key, raw) for key, raw in zip(keys, raws)]


_REGISTRY: list[type[Source]] = []


def register(cls: type[Source]) -> type[Source]:
    """Class decorator: make :func:`~ucp_dcp.sources.open_source` try ``cls`` (in the order of
    :attr:`Source.detect_order`, then of registration)."""
    _REGISTRY.append(cls)
    return cls


def source_types() -> list[type[Source]]:
    """The registered source classes, in the order :func:`~ucp_dcp.sources.open_source` tries
    them: by :attr:`Source.detect_order` (not by import order), then registration order."""
    return sorted(_REGISTRY, key=lambda c: c.detect_order)
