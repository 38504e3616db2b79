"""The index's records (:class:`Index`, :class:`TensorRecord`, :class:`Location`, :class:`Layout`),
their JSON, and its validation (:meth:`Index.from_json`).

A tensor's chunk list is *compact* (its layout plus a run-length list of which file holds each
chunk, :class:`RunList`: the index grows with the number of tensors, not tensors x ranks) or
*explicit* (file, byte range, box and checksum per chunk). The format: docs/format.md.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, overload

import numpy as np
import torch
from torch.distributed.tensor.placement_types import Placement

from ..core.sharding import Box, Grid, layout_grid, placement_from_str
from ..core.values import dtype_name
from ..errors import CheckpointFormatError, LayoutError
from .names import FORMAT_NAME, FORMAT_VERSION, MAX_ENUMERATED_COORDS, MAX_MESH_DEVICES
from .schema import (
    MAX_INT,
    check_chunk_box,
    check_chunk_bytes,
    check_paths,
    check_relative_name,
    check_tensor_bytes,
    check_tiling,
    field_dict,
    field_digest64,
    field_dtype,
    field_int,
    field_list,
    field_shape,
    field_str,
    field_xxh3,
    is_index_list,
)

# ---------------------------------------------------------------- file runs
# Run-length lists of integers: which file holds each chunk of a regular layout (a compact
# TensorRecord's ``files``).


def encode_runs(xs: Sequence[int] | np.ndarray) -> list[list[int]]:
    """Run-length encode integers as ``[start, count, step]`` progressions.

    The file holding chunk ``i`` of a regular layout is usually an arithmetic
    progression (FSDP: chunk i in rank i's file), so this stays a few numbers
    whatever the world size. Linear in ``len(xs)`` (vectorised), whatever the
    number of runs.
    """
    a = np.asarray(xs, dtype=np.int64).reshape(-1)
    n = len(a)
    if n == 0:
        return []
    d = np.diff(a)
    # The step is constant between consecutive change points of the diffs.
    change = np.flatnonzero(d[1:] != d[:-1]) + 1
    out: list[list[int]] = []
    i = 0
    while i < n:
        if i + 1 == n:
            out.append([int(a[i]), 1, 0])
            break
        k = int(np.searchsorted(change, i, side="right"))
        j = int(change[k]) if k < len(change) else n - 1  # d[i..j-1] all equal d[i]
        out.append([int(a[i]), j - i + 1, int(d[i])])
        i = j + 1
    return out


# Bounds on a run's numbers, so that no sum or product of them overflows the
# 64-bit integers RunList computes with.
_MAX_RUN = 1 << 40


def decode_runs(runs: Any, where: str) -> RunList:
    """Inverse of :func:`encode_runs`, as a lazy :class:`RunList`; validates the runs."""
    # A plain loop: an index has a run list per tensor, and nested all()s cost several times it.
    total, ok = 0, isinstance(runs, list)
    for r in runs if ok else ():
        # ``type(x) is int``: JSON's integers, not its booleans (a subclass of int).
        if not (isinstance(r, list) and len(r) == 3 and all(type(x) is int for x in r)):
            ok = False
            break
        start, count, step = r
        if not (
            -_MAX_RUN <= start <= _MAX_RUN
            and 0 <= count <= _MAX_RUN
            and -_MAX_RUN <= step <= _MAX_RUN
        ):
            ok = False
            break
        total += count
    if not ok:
        raise CheckpointFormatError(f"{where}: malformed file runs {runs!r}"[:300])
    if total > _MAX_RUN:
        raise CheckpointFormatError(f"{where}: file runs list more than {_MAX_RUN} chunks")
    return RunList(runs)


class RunList(Sequence[int]):
    """A read-only integer sequence stored as ``[start, count, step]`` runs.

    A compact index names the file of every chunk; at 16384 ranks x 700
    tensors expanding those lists would cost millions of Python integers on
    every rank, so they stay runs and are indexed by binary search.
    """

    __slots__ = ("runs", "_ends")

    def __init__(self, runs: list[list[int]]) -> None:
        self.runs = runs
        # accumulate, not np.cumsum: a third of the time on the one-run lists most tensors have.
        self._ends = np.array(list(itertools.accumulate(r[1] for r in runs)), dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    @overload
    def __getitem__(self, i: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(n))]
        i = i.__index__()
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"run list index {i} out of range ({n})")
        if len(self.runs) == 1:  # most tensors' files: one run, no search
            start, _, step = self.runs[0]
            return start + i * step
        r = int(np.searchsorted(self._ends, i, side="right"))
        start, count, step = self.runs[r]
        return start + (i - (int(self._ends[r]) - count)) * step

    def __iter__(self) -> Iterator[int]:
        for start, count, step in self.runs:
            yield from (
                range(start, start + count * step, step) if step else (start for _ in range(count))
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    def min(self) -> int:
        """Smallest element (the ends of each run bound it)."""
        return min(min(s, s + (c - 1) * st) for s, c, st in self.runs if c)

    def max(self) -> int:
        """Largest element."""
        return max(max(s, s + (c - 1) * st) for s, c, st in self.runs if c)


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Location:
    """Where bytes live: ``nbytes`` at absolute offset ``start`` of file ``file``.

    ``xxh3`` is the checksum of those bytes ("" where the format records
    none). ``dim_order`` is empty for a chunk stored row-major; otherwise the
    chunk is stored densely in that dimension order (``chunk.permute(dim_order)``
    is row-major in the file: a transposed weight is ``(1, 0)``).
    """

    file: int
    start: int
    nbytes: int
    xxh3: str
    dim_order: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """JSON form used inside the index."""
        return {"file": self.file, "start": self.start, "nbytes": self.nbytes, "xxh3": self.xxh3}

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> Location:
        """Parse and type-check; ``where`` names the record in errors."""
        # Negative offsets parse, to be reported as a byte range outside the file.
        return Location(
            field_int(d, "file", where),
            field_int(d, "start", where, lo=-MAX_INT),
            field_int(d, "nbytes", where, lo=-MAX_INT),
            field_xxh3(d, "xxh3", where),
        )


@dataclass(frozen=True)
class Layout:
    """A DTensor layout: mesh shape and one placement name per mesh dim.

    A plain (non-DTensor) tensor has the empty layout: one chunk, the whole tensor.
    """

    mesh: tuple[int, ...] = ()
    placements: tuple[str, ...] = ()

    def chunks(self, shape: Sequence[int]) -> list[Box]:
        """The distinct non-empty chunk boxes this layout produces (O(chunks))."""
        return self.grid(shape).boxes()

    def grid(self, shape: Sequence[int]) -> Grid:
        """The chunk grid of a tensor of ``shape`` saved with this layout (cached)."""
        return _layout_grid(self, tuple(shape))

    def parsed_placements(self) -> tuple[Placement, ...]:
        """The placements, parsed (:func:`~ucp_dcp.core.sharding.placement_from_str`)."""
        return tuple(placement_from_str(p) for p in self.placements)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"mesh": list(self.mesh), "placements": list(self.placements)}

    @staticmethod
    def from_json(d: Any, where: str) -> Layout:
        """Parse and validate; ``where`` names the record in errors.

        Checks types, mesh sizes (at least 1, at most
        :data:`~ucp_dcp.format.names.MAX_MESH_DEVICES` devices in all) and
        that every placement parses; :meth:`check_dims` checks it against a shape.
        """
        if not isinstance(d, dict):
            raise CheckpointFormatError(
                f"{where}: field 'layout' must be an object or null, got {d!r}"[:300]
            )
        mesh, pl = d.get("mesh"), d.get("placements")
        if not (
            is_index_list(mesh) and isinstance(pl, list) and all(isinstance(p, str) for p in pl)
        ):
            raise CheckpointFormatError(f"{where}: malformed layout {d!r}"[:300])
        if len(mesh) != len(pl):
            raise CheckpointFormatError(
                f"{where}: layout has {len(mesh)} mesh dims but {len(pl)} placements"
            )
        if not all(mesh) or math.prod(mesh) > MAX_MESH_DEVICES:
            raise CheckpointFormatError(
                f"{where}: layout mesh {mesh} must have 1 to {MAX_MESH_DEVICES} devices, at least "
                "1 per dimension"
            )
        for p in pl:
            try:
                placement = placement_from_str(p)
            except LayoutError as e:
                raise CheckpointFormatError(f"{where}: {e}") from None
            if getattr(placement, "split_factor", 1) < 1:
                raise CheckpointFormatError(f"{where}: placement {p!r} has a split factor below 1")
        return Layout(tuple(mesh), tuple(pl))

    @staticmethod
    def from_field(d: Any, ndim: int, where: str) -> Layout | None:
        """Field ``layout`` of record ``d`` (None when absent or null), parsed and checked against a
        tensor of ``ndim`` dimensions."""
        if d.get("layout") is None:
            return None
        layout = Layout.from_json(d["layout"], where)
        layout.check_dims(ndim, where)
        return layout

    def check_dims(self, ndim: int, where: str) -> None:
        """Refuse a placement that shards a dimension a tensor of ``ndim`` dimensions does not
        have."""
        for p, placement in zip(self.placements, self.parsed_placements()):
            dim = getattr(placement, "dim", None)
            if dim is not None and dim >= ndim:
                raise CheckpointFormatError(
                    f"{where}: placement {p!r} shards dimension {dim} of a {ndim}-d tensor"
                )


@functools.lru_cache(maxsize=4096)
def _layout_grid(layout: Layout, shape: tuple[int, ...]) -> Grid:
    # A parameter and its optimizer moments share layout and shape, and so do
    # the layers of a model: the grid is computed once per distinct pair.
    if not layout.mesh:
        grid = Grid.from_boxes([Box.whole(shape)] if math.prod(shape) else [], shape)
        assert grid is not None  # one box covering the tensor, or none for an empty one
        return grid
    return layout_grid(
        shape,
        layout.mesh,
        layout.parsed_placements(),
        max_enumerated=MAX_ENUMERATED_COORDS,
    )


@dataclass(frozen=True)
class ChunkRecord:
    """One saved chunk: its box in the global tensor and, if known, its bytes."""

    box: Box
    location: Location | None  # None: look it up in the data file's header


@dataclass
class TensorRecord:
    """A logical tensor in the index."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: Layout | None  # the layout it was saved with (None: irregular / unknown)
    compact: bool  # chunks derive from ``layout``; ``files`` says which file holds each
    files: Sequence[int] = field(
        default_factory=list
    )  # compact only: file index per chunk (often a RunList)
    chunks: list[ChunkRecord] = field(default_factory=list)  # explicit only
    digest: str | None = None
    """Placement digest (16 hex digits, :mod:`ucp_dcp.core.placement_digest`); None: not
    recorded (a save without ``placement_digests``, an older checkpoint, another format)."""

    def chunk_list(self) -> list[ChunkRecord]:
        """Every chunk, expanding a compact layout (locations then unknown)."""
        if not self.compact:
            return self.chunks
        assert self.layout is not None
        return [ChunkRecord(b, None) for b in self.layout.chunks(self.shape)]

    def chunk_count(self) -> int:
        """How many chunks were saved."""
        return self._layout_grid().n_chunks if self.compact else len(self.chunks)

    def chunk_box(self, idx: int) -> Box:
        """The box of chunk ``idx`` in the global tensor."""
        return self._layout_grid().box(idx) if self.compact else self.chunks[idx].box

    def chunk_location(self, idx: int) -> Location | None:
        """Where the index records chunk ``idx``'s bytes (None: only its data file's header
        says: compact records, or an explicit chunk listed without its bytes)."""
        return None if self.compact else self.chunks[idx].location

    def chunk_file(self, idx: int) -> int | None:
        """The data file that holds chunk ``idx`` (None where the index does not say)."""
        if self.compact:
            return self.files[idx]
        loc = self.chunks[idx].location
        return None if loc is None else loc.file

    def find_chunk(self, offsets: Sequence[int]) -> int | None:
        """Position of the chunk that starts at ``offsets`` (None: no chunk starts there)."""
        if self.compact:
            return self._layout_grid().find(offsets)
        by_offsets = self.__dict__.get("_by_offsets")
        if by_offsets is None:
            by_offsets = {c.box.offsets: i for i, c in enumerate(self.chunks)}
            self.__dict__["_by_offsets"] = by_offsets
        return by_offsets.get(tuple(offsets))

    def _layout_grid(self) -> Grid:
        assert self.compact and self.layout is not None
        return self.layout.grid(self.shape)

    def grid(self) -> Grid | None:
        """The chunk grid (chunk ``k`` is ``chunk_list()[k]``), or None when
        the chunks do not form one (an irregular explicit list)."""
        if self.compact:
            return self._layout_grid()
        g = self.__dict__.get("_grid", False)
        if g is False:
            g = Grid.from_boxes([c.box for c in self.chunks], self.shape)
            self.__dict__["_grid"] = g
        return g


@dataclass(frozen=True)
class FileRecord:
    """A data file: name relative to the checkpoint directory, writing rank, size."""

    name: str
    rank: int
    size: int


@dataclass
class Index:
    """The global index of a checkpoint (``ucp_index.json``)."""

    world_size: int
    files: list[FileRecord]
    tensors: dict[str, TensorRecord]
    values: dict[str, Location]
    rank_local: dict[str, dict[int, Location]]
    version: int = FORMAT_VERSION
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    """Nesting path of the keys whose path is not their dotted name split at the dots."""

    # ------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """The JSON document written to ``ucp_index.json``."""
        tensors: dict[str, Any] = {}
        for fqn, t in self.tensors.items():
            d: dict[str, Any] = {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "layout": t.layout.to_json() if t.layout else None,
            }
            if t.compact:
                d["files"] = t.files.runs if isinstance(t.files, RunList) else encode_runs(t.files)
            else:
                d["chunks"] = [
                    {
                        "offsets": list(c.box.offsets),
                        "sizes": list(c.box.sizes),
                        **c.location.to_json(),
                    }
                    for c in t.chunks
                    if c.location is not None
                ]
            if t.digest is not None:
                d["placement_digest"] = t.digest
            tensors[fqn] = d
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "world_size": self.world_size,
            "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in self.files],
            "tensors": tensors,
            "values": {k: v.to_json() for k, v in self.values.items()},
            "rank_local": {
                k: {str(r): loc.to_json() for r, loc in v.items()}
                for k, v in self.rank_local.items()
            },
            **({"paths": {k: list(p) for k, p in self.paths.items()}} if self.paths else {}),
        }

    @staticmethod
    def from_json(doc: Any, where: str) -> Index:
        """Parse and validate an index document; ``where`` is the file for errors.

        Checks everything that does not need the data files: types and
        ranges of every field, the known version, file names inside the
        checkpoint directory, file references in range, byte ranges inside
        their files' recorded sizes, dtype names, layouts, chunk boxes inside
        their tensor and covering it, byte counts equal to the elements they
        hold, and no tensor needing more bytes than all data files hold.
        """
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointFormatError(
                f'{where}: not a ucp_dcp index (no "format": "{FORMAT_NAME}")'
            )
        version = doc.get("version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise CheckpointFormatError(
                f"{where}: unsupported format version {version!r}; this ucp_dcp reads version "
                f"{FORMAT_VERSION} (upgrade ucp_dcp to read newer checkpoints)"
            )
        world = field_int(doc, "world_size", where, lo=1)
        files: list[FileRecord] = []
        names: set[str] = set()
        for i, f in enumerate(field_list(doc, "files", where)):
            fw = f"{where}: files[{i}]"
            name = field_str(f, "name", fw)
            check_relative_name(name, fw)
            if name in names:
                raise CheckpointFormatError(f"{fw}: data file {name!r} is listed twice")
            names.add(name)
            files.append(
                FileRecord(name, field_int(f, "rank", fw, hi=world - 1), field_int(f, "size", fw))
            )
        available = sum(f.size for f in files)

        def loc(d: Any, what: str) -> Location:
            location = Location.from_json(d, what)
            _check_location(location, files, what)
            return location

        tensors = {
            fqn: _tensor_from_json(t, f"{where}: tensor {fqn!r}", files, available, loc)
            for fqn, t in field_dict(doc, "tensors", where).items()
        }
        values = {
            k: loc(v, f"{where}: value {k!r}") for k, v in field_dict(doc, "values", where).items()
        }
        rank_local: dict[str, dict[int, Location]] = {}
        for k, per_rank in field_dict(doc, "rank_local", where).items():
            if (
                not isinstance(per_rank, dict)
                or not per_rank
                or not all(_is_rank(r) for r in per_rank)
            ):
                raise CheckpointFormatError(f"{where}: rank-local value {k!r}: malformed")
            rank_local[k] = {}
            for r, v in per_rank.items():
                what = f"{where}: rank-local value {k!r} of rank {r}"
                if int(r) >= world:
                    raise CheckpointFormatError(f"{what}: rank {r} is outside world size {world}")
                rank_local[k][int(r)] = loc(v, what)
        paths = check_paths(
            doc.get("paths", {}), f"{where}: paths", {*tensors, *values, *rank_local}
        )
        return Index(world, files, tensors, values, rank_local, version, paths)


def _is_rank(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) <= 18


def _tensor_from_json(
    t: Any, w: str, files: Sequence[FileRecord], available: int, loc: Callable[[Any, str], Location]
) -> TensorRecord:
    if not isinstance(t, dict):
        raise CheckpointFormatError(f"{w}: must be an object, got {t!r}"[:300])
    dtype = field_dtype(t, "dtype", w)
    shape = field_shape(t, "shape", w)
    check_tensor_bytes(shape, dtype, available, w)
    layout = Layout.from_field(t, len(shape), w)
    # Optional: indexes written without placement digests have none.
    digest = field_digest64(t, "placement_digest", w) if "placement_digest" in t else None
    if "files" in t:
        if layout is None:
            raise CheckpointFormatError(f"{w}: compact chunk list without a layout")
        file_ids = decode_runs(t["files"], w)
        try:
            n = layout.grid(shape).n_chunks
        except Exception as e:  # DTensor's arithmetic on an arbitrary layout raises all sorts
            raise CheckpointFormatError(
                f"{w}: layout {layout.to_json()} does not apply to shape {list(shape)}: {e}"
            ) from None
        if len(file_ids) != n or (n and not (0 <= file_ids.min() and file_ids.max() < len(files))):
            raise CheckpointFormatError(
                f"{w}: compact chunk list names {len(file_ids)} files for {n} chunks, "
                f"or a file outside 0..{len(files) - 1}"
            )
        return TensorRecord(dtype, shape, layout, True, file_ids, digest=digest)
    chunks = []
    for i, c in enumerate(field_list(t, "chunks", w)):
        cw = f"{w} chunk {i}"
        offs, sizes = (c.get("offsets"), c.get("sizes")) if isinstance(c, dict) else (None, None)
        box = check_chunk_box(offs, sizes, shape, cw)
        location = loc(c, cw)
        check_chunk_bytes(box, dtype, location.nbytes, cw)
        chunks.append(ChunkRecord(box, location))
    check_tiling([c.box for c in chunks], shape, w)
    return TensorRecord(dtype, shape, layout, False, chunks=chunks, digest=digest)


def _check_location(loc: Location, files: Sequence[FileRecord], where: str) -> None:
    if not 0 <= loc.file < len(files):
        raise CheckpointFormatError(
            f"{where}: file index {loc.file} out of range (index lists {len(files)} files)"
        )
    f = files[loc.file]
    if loc.start < 0 or loc.nbytes < 0 or loc.start + loc.nbytes > f.size:
        raise CheckpointFormatError(
            f"{where}: byte range [{loc.start}, {loc.start + loc.nbytes}) lies outside {f.name} "
            f"({f.size} bytes)"
        )
