"""DCP's default ``.distcp`` format (what ``dcp.save`` writes with ``FileSystemWriter`` or
``FsspecWriter``), read in place.

``.metadata`` (a pickled :class:`Metadata`, loaded by :func:`read_dcp_metadata` with the
restricted unpickler, :mod:`._pickle`) maps each stored item to its byte range in a
``__<rank>_<n>.distcp`` data file; every item is a complete ``torch.save`` archive. A tensor
item is byte-addressed without ``torch.load`` (:func:`~._torch_archive.parse_tensor_item`): a
byte range, plus a dimension order where DCP kept the strides of a transposed or
``channels_last`` tensor. Only the items a rank reads are parsed, when the load is planned, in
parallel. Non-tensor values are pickles, refused unless ``dcp_values="weights_only"``
(:meth:`DCPSource.decode_value`). What is read and what is refused, locally and in object
storage: see docs/sources.md ("DCP's FileSystemWriter format").
"""

from __future__ import annotations

import io
import math
import os
import re
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..byteio.location import ModelDir, view_of
from ..byteio.rangeio import ByteSource, FileHandles, ReadStats, storage_view
from ..byteio.segments import Segment
from ..core.sharding import Box
from ..core.values import encode_value
from ..errors import CheckpointFormatError, DCPValueError, InvalidArgumentError
from ..format import ChunkRecord, FileRecord, Index, Location, TensorRecord, dtype_name
from ..format.schema import (
    check_paths,
    check_relative_name,
    check_tensor_bytes,
    check_tiling,
    is_index_list,
)
from ._pickle import unpickle
from ._torch_archive import PRead, StoredTensor, dim_order, item_ends, parse_tensor_item
from .base import Source, SourceOptions, register

__all__ = [
    "DCPSource",
    "DCP_METADATA_FILE",
    "DCP_VALUES_MODES",
    "check_dcp_values",
    "read_dcp_metadata",
]

DCP_METADATA_FILE = ".metadata"
DCP_VALUES_MODES = (None, "weights_only")
_DISTCP_NAME = re.compile(r"__(\d+)_(\d+)\.distcp")


def check_dcp_values(dcp_values: str | None) -> None:
    """:class:`~ucp_dcp.errors.InvalidArgumentError` for a ``dcp_values`` that is none of
    :data:`DCP_VALUES_MODES`."""
    if dcp_values not in DCP_VALUES_MODES:
        raise InvalidArgumentError(
            f"dcp_values must be one of {DCP_VALUES_MODES}, got {dcp_values!r}"
        )


def read_dcp_metadata(directory: str | os.PathLike[str] | ModelDir) -> Metadata:
    """Load DCP's ``.metadata`` of ``directory`` (a local path, or a directory view) with the
    restricted unpickler (purpose ``"dcp_metadata"``).

    The unpickler constructs only DCP's own metadata records, the plan records
    Megatron-core attaches to it (``all_local_plans``: ``SavePlan``,
    ``WriteItem``, ``TensorWriteData``, ``WriteItemType``), ``torch.Size``,
    dtypes, layouts and paths. The file is read as bytes (from object
    storage: one request) and only then unpickled. Raises
    :class:`CheckpointFormatError` naming the file when it is missing, not a
    DCP metadata pickle, or refers to any class outside the allow-list
    (refused before it is imported, naming it).
    """
    d = view_of(directory)
    path = d.path_of(DCP_METADATA_FILE)
    if not d.is_file(DCP_METADATA_FILE):
        raise CheckpointFormatError(f"{d.where}: not a DCP checkpoint (no {DCP_METADATA_FILE})")
    md = unpickle(d.read(DCP_METADATA_FILE), path, "dcp_metadata")
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(
            f"{path}: DCP metadata without state_dict_metadata/storage_data"
        )
    return md


@register
class DCPSource(Source):
    """A checkpoint in DCP's default format, described as a ucp_dcp :class:`Index`.

    Opening it reads ``.metadata`` (restricted unpickler) and the sizes of the
    data files, nothing else. ``index`` lists every tensor with its chunk
    boxes (explicit chunk lists; the DTensor layout is not recorded by DCP,
    so ``layout`` is None) and every value with its item's byte range. Chunk
    locations are None in the index: :meth:`locate` parses the item that
    holds a chunk when it is first needed. Checksums are unknown (DCP keeps
    none) and recorded as ``""``.

    ``parse_stats`` counts the reads spent parsing items. Non-tensor values
    are refused or loaded as ``dcp_values`` says (:class:`SourceOptions`).
    """

    format = "dcp"
    title = "DCP"
    looks_for = DCP_METADATA_FILE
    detect_order = 20

    def __init__(self, d: ModelDir, dcp_values: str | None = None) -> None:
        """The checkpoint in directory view ``d`` (local or in a store; :meth:`open` takes a
        path)."""
        check_dcp_values(dcp_values)
        self.directory = d.where
        self.dcp_values = dcp_values
        self.metadata = md = read_dcp_metadata(d)
        mdpath = d.path_of(DCP_METADATA_FILE)
        infos: dict[MetadataIndex, Any] = {}
        for k, v in md.storage_data.items():
            if not (
                isinstance(k, MetadataIndex)
                and all(hasattr(v, a) for a in ("relative_path", "offset", "length"))
                and isinstance(v.relative_path, str)
            ):
                raise CheckpointFormatError(
                    f"{mdpath}: storage_data entry {k!r} -> {v!r} is malformed"
                )
            infos[k] = v
        names: dict[str, int] = {}
        for v in infos.values():
            if v.relative_path not in names:
                check_relative_name(v.relative_path, f"{mdpath}: storage_data")
                names[v.relative_path] = -1
        ordered = sorted(names, key=_file_sort_key)
        files: list[FileRecord] = []
        for i, name in enumerate(ordered):
            names[name] = i
            size = d.size(name)  # on a store, from the listing: no request per file
            if size is None:
                raise CheckpointFormatError(
                    f"data file {d.path_of(name)} is missing (named by {mdpath})"
                )
            m = _DISTCP_NAME.fullmatch(name)
            files.append(FileRecord(name, int(m[1]) if m else 0, size))
        paths = [d.path_of(f.name) for f in files]

        def item(key: MetadataIndex, what: str) -> tuple[int, Any]:
            info = infos.get(key)
            if info is None:
                raise CheckpointFormatError(f"{mdpath}: no stored item for {what}")
            if not is_index_list([info.offset, info.length]):
                raise CheckpointFormatError(
                    f"{mdpath}: {what}: malformed byte range {info.offset!r}+{info.length!r}"
                )
            fi = names[info.relative_path]
            if info.offset + info.length > files[fi].size:
                raise CheckpointFormatError(
                    f"{mdpath}: {what}: byte range [{info.offset}, {info.offset + info.length}) "
                    "lies outside "
                    f"{files[fi].name} ({files[fi].size} bytes): truncated data file"
                )
            return fi, info

        available = sum(f.size for f in files)
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
                raise CheckpointFormatError(
                    f"{mdpath}: {fqn!r} has unknown storage metadata {type(smd).__name__}"
                )
            dims = list(smd.size) if isinstance(smd.size, (tuple, list)) else None
            dtype = getattr(smd.properties, "dtype", None)
            if not (
                is_index_list(dims)
                and isinstance(dtype, torch.dtype)
                and isinstance(smd.chunks, list)
            ):
                raise CheckpointFormatError(f"{mdpath}: malformed tensor metadata for {fqn!r}")
            shape = tuple(dims)
            check_tensor_bytes(shape, dtype, available, f"{mdpath}: tensor {fqn!r}")
            empty_tensor = math.prod(shape) == 0
            chunks, items = [], []
            seen: set[Box] = set()
            for c in smd.chunks:
                offs, sizes = (
                    list(getattr(c, "offsets", None) or ()),
                    list(getattr(c, "sizes", None) or ()),
                )
                if not (is_index_list(offs) and is_index_list(sizes, len(offs))):
                    raise CheckpointFormatError(f"{mdpath}: malformed chunk of {fqn!r}")
                box = Box(tuple(offs), tuple(sizes))
                if not box.fits(shape):
                    raise CheckpointFormatError(
                        f"{mdpath}: chunk {list(box.offsets)}+{list(box.sizes)} of {fqn!r} "
                        f"lies outside shape {list(shape)}"
                    )
                if box.numel == 0 and not empty_tensor:
                    continue  # an empty shard of an uneven split holds no bytes
                if box in seen:
                    continue  # listed again (a replica): one stored item per offsets, read once
                seen.add(box)
                items.append(
                    item(MetadataIndex(fqn, c.offsets), f"chunk {list(box.offsets)} of {fqn!r}")
                )
                chunks.append(ChunkRecord(box, None))
            check_tiling([c.box for c in chunks], shape, f"{mdpath}: tensor {fqn!r}")
            tensors[fqn] = TensorRecord(dtype, shape, None, False, chunks=chunks)
            self._tensor_items[fqn] = items
        world = max((f.rank for f in files), default=0) + 1
        index = Index(
            world, files, tensors, values, {}, paths=_nesting_paths(md.planner_data, mdpath, md)
        )
        super().__init__(self.directory, index, paths)
        self.store = d.store
        self.parse_stats = ReadStats()
        self._locations: dict[tuple[str, int], Location] = {}
        # Both ends of items fetched ahead by prepare() on a store, taken by the item's first parse.
        self._ends: dict[tuple[str, int], list[bytes]] = {}
        self._fds = FileHandles(self.paths if self.store is None else [])
        weakref.finalize(self, FileHandles.close, self._fds)

    def close(self) -> None:
        """Close the data files (they are reopened if needed)."""
        self._fds.close()

    # ------------------------------------------------------------ tensors
    def _where(self, fqn: str, idx: int) -> str:
        fi, info = self._tensor_items[fqn][idx]
        box = self.index.tensors[fqn].chunks[idx].box
        return (
            f"{self.paths[fi]}: item of {fqn!r} chunk {list(box.offsets)} at "
            f"[{info.offset}, {info.offset + info.length})"
        )

    def _stored(self, fqn: str, idx: int) -> StoredTensor:
        fi, info = self._tensor_items[fqn][idx]
        where = self._where(fqn, idx)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointFormatError(
                f"{where}: written with DCP stream transforms {list(info.transform_descriptors)} "
                "(e.g. compression); such items cannot be byte-addressed and are not supported"
            )
        st = parse_tensor_item(
            self._pread(fi),
            info.offset,
            info.length,
            where,
            self.parse_stats,
            self._ends.pop((fqn, idx), None),
        )
        rec = self.index.tensors[fqn]
        box = rec.chunks[idx].box
        if st.dtype != rec.dtype or st.size != box.sizes:
            raise CheckpointFormatError(
                f"{where}: holds a {dtype_name(st.dtype)}{list(st.size)} tensor, but .metadata "
                "says "
                f"{dtype_name(rec.dtype)}{list(box.sizes)}"
            )
        es = rec.dtype.itemsize
        if box.numel:
            if st.span * es > st.record_nbytes:
                raise CheckpointFormatError(
                    f"{where}: the tensor runs past its storage ({st.record_nbytes} bytes)"
                )
        return st

    def _pread(self, fi: int) -> PRead:
        """``pread(n, offset)`` of data file ``fi``: a local ``pread``, or a ranged request (never
        past the size listed at open: an object shorter than that fails its read, naming it)."""
        store = self.store
        if store is None:
            fd = self._fds.get(fi)
            return lambda n, off: os.pread(fd, n, off)
        name, size = self.index.files[fi].name, self.index.files[fi].size
        return lambda n, off: store.read(name, off, min(off + n, size)) if off < size else b""

    def _fetch_ends(self, todo: Sequence[tuple[str, int]]) -> None:
        """On a store, read both ends of the items of ``todo`` in batches of concurrent ranged
        requests."""
        assert self.store is not None
        batch = 4096
        for b in range(0, len(todo), batch):
            keys: list[tuple[str, int]] = []
            ranges: list[tuple[str, int, int]] = []
            counts: list[int] = []
            for fqn, idx in todo[b : b + batch]:
                fi, info = self._tensor_items[fqn][idx]
                if getattr(info, "transform_descriptors", None) or not info.length:
                    continue  # refused by its parse, naming it
                r = item_ends(info.offset, info.length)
                keys.append((fqn, idx))
                counts.append(len(r))
                ranges.extend((self.index.files[fi].name, s, e) for s, e in r)
            got = self.store.read_ranges(ranges)
            self.parse_stats.add(len(got), sum(len(g) for g in got))
            k = 0
            for key, n in zip(keys, counts):
                self._ends[key] = got[k : k + n]
                k += n

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory holding DCP's ``.metadata``."""
        return d.is_file(DCP_METADATA_FILE)

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> DCPSource:
        """Read ``.metadata`` (restricted unpickler) and the data files' sizes: in a store,
        ``.metadata`` in one request, sizes from the view's one listing."""
        return cls(d, options.dcp_values)

    def locate(self, fqn: str, idx: int) -> Location:
        """Byte location of chunk ``idx`` of ``fqn`` (parses its item the first time).

        ``dim_order`` is set when the item is stored in another dimension
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
        order = dim_order(st.size, st.stride) if numel else tuple(range(len(st.size)))
        if order is None:
            raise CheckpointFormatError(
                f"{self._where(fqn, idx)}: stored with overlapping strides {list(st.stride)} for "
                "size "
                f"{list(st.size)}; it cannot be read as byte ranges. Convert the checkpoint with "
                "`ucp-dcp convert SRC DST`, which handles it"
            )
        start = st.data_start + st.storage_offset * es
        identity = order == tuple(range(len(order)))
        loc = Location(fi, start, numel * es, "", () if identity else order)
        self._locations[(fqn, idx)] = loc
        return loc

    def chunk_origin(self, fqn: str, idx: int) -> tuple[int, int]:
        """The item's file and offset from ``.metadata`` (no parsing, and for unaddressable items
        too)."""
        fi, info = self._tensor_items[fqn][idx]
        return fi, info.offset

    def prepare(
        self, chunks: Sequence[tuple[str, int]], values: Sequence[str], threads: int = 4
    ) -> None:
        """Refuse pickled values unless opted in, then parse the items of ``chunks`` in parallel."""
        if values and self.dcp_values is None:
            raise _refusal(self.directory, values[0])
        todo = sorted({c for c in chunks if c not in self._locations})
        if self.store is not None and todo:
            self._fetch_ends(todo)  # one batch of requests, not two round trips per item
        if len(todo) <= 1 or threads <= 1:
            for fqn, idx in todo:
                self.locate(fqn, idx)
            return
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucp-dcp-parse") as pool:
            for _ in pool.map(lambda c: self.locate(*c), todo):
                pass

    def materialize(self, reader: ByteSource, fqn: str, idx: int) -> torch.Tensor:
        """An item no dimension order makes dense: read the span of storage it uses and let torch
        gather it."""
        st = self._stored(fqn, idx)
        if st.size and math.prod(st.size) != 0 and dim_order(st.size, st.stride) is not None:
            return self._raise_unaddressable(fqn, idx)
        es = st.dtype.itemsize
        raw = torch.empty(st.span * es, dtype=torch.uint8)
        fi = self._tensor_items[fqn][idx][0]
        reader.read([Segment(fi, st.data_start, storage_view(raw))])
        return raw.view(st.dtype).as_strided(st.size, st.stride, st.storage_offset).contiguous()

    # ------------------------------------------------------------ values
    def decode_value(self, key: str, raw: bytes) -> bytes:
        """Value ``key`` (a ``torch.save`` pickle) loaded with ``torch.load(weights_only=True)``, as
        tagged JSON.

        torch's restricted unpickler builds only tensors, primitive types and
        containers (plus what ``torch.serialization.add_safe_globals`` allows);
        anything else fails, naming the key. Refused unless ``dcp_values="weights_only"``.
        """
        if self.dcp_values is None:
            raise _refusal(self.directory, key)
        info = self._value_items.get(key)
        transforms = getattr(info, "transform_descriptors", None)
        if transforms:
            raise CheckpointFormatError(
                f"{self.directory}: value {key!r} was written with DCP stream transforms "
                f"{list(transforms)}; not supported"
            )
        try:
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as e:
            loc = self.index.values[key]
            raise DCPValueError(
                f"{self.paths[loc.file]}: value {key!r} cannot be loaded with "
                "torch.load(weights_only=True) "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). If you trust "
                "the checkpoint, "
                "allow its classes with torch.serialization.add_safe_globals"
            ) from None
        return encode_value(value, key)

    def check_files(self) -> list[str]:
        """Every tensor item parses as a ``torch.save`` archive lying inside its data file."""
        problems = []
        for fqn, rec in self.index.tensors.items():
            for idx in range(len(rec.chunks)):
                try:
                    self._stored(fqn, idx)
                except CheckpointFormatError as e:
                    problems.append(str(e))
        return problems


def _nesting_paths(planner_data: Any, mdpath: str, md: Any) -> dict[str, tuple[str | int, ...]]:
    """The nesting paths DCP's default planner records in ``planner_data`` (key -> path), the
    non-trivial ones."""
    if not isinstance(planner_data, dict):
        return {}
    doc = {
        k: list(p)
        for k, p in planner_data.items()
        if isinstance(k, str) and isinstance(p, (tuple, list)) and tuple(p) != tuple(k.split("."))
    }
    return check_paths(doc, f"{mdpath}: planner_data", md.state_dict_metadata)


def _refusal(directory: str, key: str) -> DCPValueError:
    hint = "UCPStorageReader(path, dcp_values='weights_only')"
    return DCPValueError(
        f"{directory}: value {key!r} is stored by DCP as a pickle (torch.save), and "
        "UCPStorageReader does not unpickle checkpoint data by default. Pass "
        f"{hint} to load it with torch.load(weights_only=True), torch's restricted unpickler, "
        "or convert the checkpoint once with `ucp-dcp convert SRC DST`"
    ).with_option("dcp_values", "weights_only", hint)


def _file_sort_key(name: str) -> tuple[int, int, str]:
    m = _DISTCP_NAME.fullmatch(name)
    return (int(m[1]), int(m[2]), name) if m else (1 << 62, 0, name)
