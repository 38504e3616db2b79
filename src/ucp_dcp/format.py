"""The on-disk format: safetensors data files plus a JSON index.

A checkpoint is a directory::

    ucp_index.json                 the global index, written last (atomically)
    rank00000.safetensors          one data file per writing rank
    rank00001.safetensors
    ...

Data files are standard safetensors files (``safetensors.safe_open`` opens
them). Tensor data of at least ``ALIGN`` bytes starts on an ``ALIGN``-byte
boundary, so that strided reads of large rows touch no page twice; the gaps
are filled with ``__ucp_pad__.N`` uint8 entries because safetensors requires
entries to be contiguous. The header's ``__metadata__["ucp_dcp"]`` holds a
JSON document describing every entry (logical tensor name, global shape,
global offsets, layout, xxh3-64 checksum), which is enough to rebuild the
index from the data files alone (:func:`ucp_dcp.index.rebuild_index`).

The index (``Index``) lists every tensor with its dtype, global shape and
chunks. A chunk list is stored either *compact* (the DTensor layout it was
saved with plus a run-length list of which file holds each chunk, so the
index grows with the number of tensors, not tensors x ranks; byte ranges and
checksums then come from the data file's header) or *explicit* (file, byte
range, global offsets/sizes and checksum per chunk) for irregular layouts.
Non-tensor values and rank-local values are stored as uint8 entries holding
tagged JSON (:mod:`ucp_dcp.values`).

Nothing on the load path unpickles anything.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

import numpy as np

from .sharding import Box, Grid, layout_grid, placement_from_str
from .values import dtype_from_name

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "ALIGN",
    "CheckpointFormatError",
    "Location",
    "Layout",
    "ChunkRecord",
    "TensorRecord",
    "FileRecord",
    "Index",
    "EntryMeta",
    "FileHeader",
    "chunk_entry_name",
    "value_entry_name",
    "rank_local_entry_name",
    "rank_local_key",
    "split_rank_local_key",
    "data_file_name",
    "st_dtype",
    "read_header",
    "encode_runs",
    "decode_runs",
    "RunList",
]

FORMAT_NAME = "ucp_dcp"
FORMAT_VERSION = 1
INDEX_FILE = "ucp_index.json"
ALIGN = 4096
# A safetensors header is JSON describing the entries; anything beyond this
# is a corrupt or hostile file, not a checkpoint (safetensors uses 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
VALUE_PREFIX = "__ucp_value__/"
RANK_LOCAL_PREFIX = "__ucp_rank_local__/"
PAD_PREFIX = "__ucp_pad__."


class CheckpointFormatError(ValueError):
    """The checkpoint on disk is missing, damaged or not of this format."""


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def st_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors dtype code of ``dtype``, or None (stored as raw U8 bytes)."""
    return _ST_DTYPES.get(dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``'float32'`` for ``torch.float32``: the name used in every record."""
    return str(dtype).removeprefix("torch.")


def chunk_entry_name(fqn: str, offsets: Sequence[int]) -> str:
    """Data-file entry name of a tensor chunk: ``fqn`` plus its global offsets."""
    return f"{fqn}@{','.join(map(str, offsets))}" if offsets else f"{fqn}@"


def value_entry_name(fqn: str) -> str:
    """Data-file entry name of a non-tensor value."""
    return VALUE_PREFIX + fqn


def rank_local_entry_name(fqn: str) -> str:
    """Data-file entry name of a rank-local value (each rank has its own file)."""
    return RANK_LOCAL_PREFIX + fqn


def rank_local_key(rank: int, fqn: str) -> str:
    """DCP storage key of ``rank``'s copy of rank-local value ``fqn``."""
    return f"{RANK_LOCAL_PREFIX}{rank}/{fqn}"


def split_rank_local_key(key: str) -> tuple[int, str] | None:
    """``(rank, fqn)`` of a key made by :func:`rank_local_key`, else None."""
    if not key.startswith(RANK_LOCAL_PREFIX):
        return None
    rank, _, fqn = key[len(RANK_LOCAL_PREFIX) :].partition("/")
    return int(rank), fqn


def data_file_name(rank: int, save_id: str) -> str:
    """File name of the data file written by ``rank`` in save ``save_id``.

    The save id keeps a new save from writing over the files of a committed
    checkpoint in the same directory: the old index stays valid until the new
    one replaces it.
    """
    return f"rank{rank:05d}-{save_id}.safetensors"


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Location:
    """Where bytes live: ``nbytes`` at absolute offset ``start`` of file ``file``."""

    file: int
    start: int
    nbytes: int
    xxh3: str

    def to_json(self) -> dict[str, Any]:
        """JSON form used inside the index."""
        return {"file": self.file, "start": self.start, "nbytes": self.nbytes, "xxh3": self.xxh3}

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> "Location":
        """Parse and type-check; ``where`` names the record in errors."""
        return Location(
            _int(d, "file", where), _int(d, "start", where), _int(d, "nbytes", where), _str(d, "xxh3", where)
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

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"mesh": list(self.mesh), "placements": list(self.placements)}

    @staticmethod
    def from_json(d: dict[str, Any], where: str) -> "Layout":
        """Parse and type-check; ``where`` names the record in errors."""
        mesh, pl = d.get("mesh"), d.get("placements")
        if not (_int_list(mesh) and isinstance(pl, list) and all(isinstance(p, str) for p in pl)):
            raise CheckpointFormatError(f"{where}: malformed layout {d!r}")
        if len(mesh) != len(pl):
            raise CheckpointFormatError(f"{where}: layout has {len(mesh)} mesh dims but {len(pl)} placements")
        return Layout(tuple(mesh), tuple(pl))


@functools.lru_cache(maxsize=4096)
def _layout_grid(layout: Layout, shape: tuple[int, ...]) -> Grid:
    # A parameter and its optimizer moments share layout and shape, and so do
    # the layers of a model: the grid is computed once per distinct pair.
    if not layout.mesh:
        return Grid.from_boxes([Box((0,) * len(shape), shape)] if math.prod(shape) else [], shape)  # type: ignore[return-value]
    return layout_grid(shape, layout.mesh, [placement_from_str(p) for p in layout.placements])


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
    files: Sequence[int] = field(default_factory=list)  # compact only: file index per chunk (often a RunList)
    chunks: list[ChunkRecord] = field(default_factory=list)  # explicit only

    def chunk_list(self) -> list[ChunkRecord]:
        """Every chunk, expanding a compact layout (locations then unknown)."""
        if not self.compact:
            return self.chunks
        assert self.layout is not None
        return [ChunkRecord(b, None) for b in self.layout.chunks(self.shape)]

    def grid(self) -> Grid | None:
        """The chunk grid (chunk ``k`` is ``chunk_list()[k]``), or None when
        the chunks do not form one (an irregular explicit list)."""
        if self.compact:
            assert self.layout is not None
            return self.layout.grid(self.shape)
        g = self.__dict__.get("_grid", False)
        if g is False:
            boxes = [c.box for c in self.chunks]
            g = Grid.from_boxes(boxes, self.shape) if all(b.numel for b in boxes) else None
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
                    {"offsets": list(c.box.offsets), "sizes": list(c.box.sizes), **c.location.to_json()}
                    for c in t.chunks
                    if c.location is not None
                ]
            tensors[fqn] = d
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "world_size": self.world_size,
            "files": [{"name": f.name, "rank": f.rank, "size": f.size} for f in self.files],
            "tensors": tensors,
            "values": {k: v.to_json() for k, v in self.values.items()},
            "rank_local": {k: {str(r): loc.to_json() for r, loc in v.items()} for k, v in self.rank_local.items()},
        }

    @staticmethod
    def from_json(doc: Any, where: str) -> "Index":
        """Parse and validate an index document; ``where`` is the file for errors.

        Checks everything that does not need the data files: types, known
        version, file names inside the checkpoint directory, file references
        in range, byte ranges inside their files' recorded sizes.
        """
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointFormatError(f"{where}: not a ucp_dcp index (no \"format\": \"{FORMAT_NAME}\")")
        version = doc.get("version")
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{where}: unsupported format version {version!r}; this ucp_dcp reads version "
                f"{FORMAT_VERSION} (upgrade ucp_dcp to read newer checkpoints)"
            )
        world = _int(doc, "world_size", where)
        files = []
        for i, f in enumerate(_list(doc, "files", where)):
            name = _str(f, "name", f"{where}: files[{i}]")
            _check_relative_name(name, f"{where}: files[{i}]")
            files.append(FileRecord(name, _int(f, "rank", f"{where}: files[{i}]"), _int(f, "size", f"{where}: files[{i}]")))

        def loc(d: dict[str, Any], what: str) -> Location:
            location = Location.from_json(d, what)
            _check_location(location, files, what)
            return location

        tensors: dict[str, TensorRecord] = {}
        for fqn, t in _dict(doc, "tensors", where).items():
            w = f"{where}: tensor {fqn!r}"
            try:
                dtype = dtype_from_name(_str(t, "dtype", w))
            except ValueError as e:
                raise CheckpointFormatError(f"{w}: {e}") from None
            shape = t.get("shape")
            if not _int_list(shape):
                raise CheckpointFormatError(f"{w}: malformed shape {shape!r}")
            layout = Layout.from_json(t["layout"], w) if t.get("layout") is not None else None
            if "files" in t:
                if layout is None:
                    raise CheckpointFormatError(f"{w}: compact chunk list without a layout")
                file_ids = decode_runs(t["files"], w)
                try:
                    n = layout.grid(shape).n_chunks
                except ValueError as e:
                    raise CheckpointFormatError(f"{w}: {e}") from None
                if len(file_ids) != n or (n and not (0 <= file_ids.min() and file_ids.max() < len(files))):
                    raise CheckpointFormatError(
                        f"{w}: compact chunk list names {len(file_ids)} files for {n} chunks, "
                        f"or a file outside 0..{len(files) - 1}"
                    )
                tensors[fqn] = TensorRecord(dtype, tuple(shape), layout, True, file_ids)
            else:
                chunks = []
                for i, c in enumerate(_list(t, "chunks", w)):
                    cw = f"{w} chunk {i}"
                    offs, sizes = c.get("offsets"), c.get("sizes")
                    if not (_int_list(offs) and _int_list(sizes) and len(offs) == len(sizes) == len(shape)):
                        raise CheckpointFormatError(f"{cw}: malformed offsets/sizes")
                    box = Box(tuple(offs), tuple(sizes))
                    if not Box((0,) * len(shape), tuple(shape)).contains(box):
                        raise CheckpointFormatError(f"{cw}: box {offs}+{sizes} lies outside shape {shape}")
                    location = loc(c, cw)
                    if location.nbytes != box.numel * dtype.itemsize:
                        raise CheckpointFormatError(
                            f"{cw}: {location.nbytes} bytes recorded for {box.numel} {dtype_name(dtype)} elements"
                        )
                    chunks.append(ChunkRecord(box, location))
                tensors[fqn] = TensorRecord(dtype, tuple(shape), layout, False, chunks=chunks)
        values = {k: loc(v, f"{where}: value {k!r}") for k, v in _dict(doc, "values", where).items()}
        rank_local: dict[str, dict[int, Location]] = {}
        for k, per_rank in _dict(doc, "rank_local", where).items():
            if not isinstance(per_rank, dict) or not all(r.isdigit() for r in per_rank):
                raise CheckpointFormatError(f"{where}: rank-local value {k!r}: malformed")
            rank_local[k] = {int(r): loc(v, f"{where}: rank-local value {k!r} of rank {r}") for r, v in per_rank.items()}
        return Index(world, files, tensors, values, rank_local, version)


def _check_relative_name(name: str, where: str) -> None:
    # A hostile index must not make the reader open files outside the
    # checkpoint: only plain names, no absolute paths, no '..', no separators.
    if not name or os.path.isabs(name) or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise CheckpointFormatError(
            f"{where}: data file name {name!r} is absolute or leaves the checkpoint directory; "
            "only plain file names inside the checkpoint are allowed"
        )


def _check_location(loc: Location, files: Sequence[FileRecord], where: str) -> None:
    if not 0 <= loc.file < len(files):
        raise CheckpointFormatError(f"{where}: file index {loc.file} out of range (index lists {len(files)} files)")
    f = files[loc.file]
    if loc.start < 0 or loc.nbytes < 0 or loc.start + loc.nbytes > f.size:
        raise CheckpointFormatError(
            f"{where}: byte range [{loc.start}, {loc.start + loc.nbytes}) lies outside {f.name} "
            f"({f.size} bytes)"
        )


def _int(d: Any, k: str, where: str) -> int:
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool):
        raise CheckpointFormatError(f"{where}: field {k!r} must be an integer, got {v!r}")
    return v


def _str(d: Any, k: str, where: str) -> str:
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, str):
        raise CheckpointFormatError(f"{where}: field {k!r} must be a string, got {v!r}")
    return v


def _list(d: Any, k: str, where: str) -> list[Any]:
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, list):
        raise CheckpointFormatError(f"{where}: field {k!r} must be a list")
    return v


def _dict(d: Any, k: str, where: str) -> dict[str, Any]:
    v = d.get(k) if isinstance(d, dict) else None
    if not isinstance(v, dict):
        raise CheckpointFormatError(f"{where}: field {k!r} must be an object")
    return v


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


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


def decode_runs(runs: Any, where: str) -> "RunList":
    """Inverse of :func:`encode_runs`, as a lazy :class:`RunList`."""
    if not isinstance(runs, list) or not all(
        isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        and r[1] >= 0 for r in runs
    ):
        raise CheckpointFormatError(f"{where}: malformed file runs {runs!r}")
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
        self._ends = np.cumsum([r[1] for r in runs], dtype=np.int64) if runs else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getitem__(self, i: int) -> int:  # type: ignore[override]
        n = len(self)
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(n))]  # type: ignore[return-value]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"run list index {i} out of range ({n})")
        r = int(np.searchsorted(self._ends, i, side="right"))
        start, count, step = self.runs[r]
        return start + (i - (int(self._ends[r]) - count)) * step

    def __iter__(self):  # type: ignore[no-untyped-def]
        for start, count, step in self.runs:
            yield from range(start, start + count * step, step) if step else (start for _ in range(count))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and len(other) == len(self) and list(self) == list(other)

    def min(self) -> int:
        """Smallest element (the ends of each run bound it)."""
        return min(min(s, s + (c - 1) * st) for s, c, st in self.runs if c)

    def max(self) -> int:
        """Largest element."""
        return max(max(s, s + (c - 1) * st) for s, c, st in self.runs if c)


# ---------------------------------------------------------------- data-file headers


@dataclass(frozen=True)
class EntryMeta:
    """What a data file records about one entry, beyond safetensors' own fields."""

    kind: str  # "tensor" | "value" | "rank_local"
    fqn: str
    dtype: str  # torch dtype name of the logical tensor ("uint8" for values)
    shape: tuple[int, ...]  # global shape (tensors), byte length (values)
    offsets: tuple[int, ...]  # global offsets of this chunk (tensors)
    sizes: tuple[int, ...]  # size of this chunk per dim (tensors)
    xxh3: str
    layout: Layout | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON form stored in the file header."""
        d: dict[str, Any] = {"kind": self.kind, "fqn": self.fqn, "xxh3": self.xxh3}
        if self.kind == "tensor":
            d.update(
                dtype=self.dtype, shape=list(self.shape), offsets=list(self.offsets), sizes=list(self.sizes)
            )
            if self.layout is not None:
                d["layout"] = self.layout.to_json()
        return d


@dataclass
class FileHeader:
    """A parsed data-file header: per entry, its absolute byte range and metadata."""

    path: str
    size: int
    rank: int
    world_size: int
    save_id: str
    ranges: dict[str, tuple[int, int]]  # entry name -> (start, nbytes), absolute
    shapes: dict[str, tuple[int, ...]]  # entry name -> shape of the stored chunk
    meta: dict[str, EntryMeta]  # entry name -> ucp metadata (pads have none)


def read_header(path: str, fd: int | None = None) -> FileHeader:
    """Read and validate the safetensors header of data file ``path``.

    Raises :class:`CheckpointFormatError` naming the file when it is
    truncated, not safetensors, not written by ucp_dcp, or has an entry
    outside the file.
    """
    own = fd is None
    if own:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointFormatError(f"data file {path} is missing") from None
        if hasattr(os, "posix_fadvise"):
            # Without this the header read leaves read-ahead marks in the page
            # cache, and a later exact read of a marked page makes the kernel
            # stream in the rest of the file: other ranks' bytes.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise CheckpointFormatError(f"{path}: truncated ({size} bytes; a safetensors file starts with 8)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointFormatError(
                f"{path}: header length {n} exceeds the file ({size} bytes): truncated or not safetensors"
            )
        raw = os.pread(fd, n, 8)
    finally:
        if own:
            os.close(fd)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    data_start = 8 + n
    md = doc.pop("__metadata__", None) or {}
    try:
        ucp = json.loads(md["ucp_dcp"])
        entries_meta = ucp["entries"]
        rank = int(ucp["rank"])
        world_size = int(ucp["world_size"])
        save_id = str(ucp["save_id"])
    except (KeyError, TypeError, ValueError, json.JSONDecodeError):
        raise CheckpointFormatError(f"{path}: safetensors file without ucp_dcp metadata") from None
    if ucp.get("version") != FORMAT_VERSION:
        raise CheckpointFormatError(f"{path}: unsupported format version {ucp.get('version')!r}")
    ranges: dict[str, tuple[int, int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    end_of_data = data_start
    for name, e in doc.items():
        try:
            b, en = e["data_offsets"]
            shape = tuple(int(x) for x in e["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: entry {name!r} is malformed") from None
        if not (isinstance(b, int) and isinstance(en, int) and 0 <= b <= en):
            raise CheckpointFormatError(f"{path}: entry {name!r} has bad data_offsets {e['data_offsets']!r}")
        ranges[name] = (data_start + b, en - b)
        shapes[name] = shape
        end_of_data = max(end_of_data, data_start + en)
    if end_of_data > size:
        raise CheckpointFormatError(
            f"{path}: truncated: entries need {end_of_data} bytes but the file has {size}"
        )
    meta: dict[str, EntryMeta] = {}
    for name, m in entries_meta.items():
        if name not in ranges:
            raise CheckpointFormatError(f"{path}: metadata names entry {name!r} that the file does not hold")
        try:
            layout = Layout.from_json(m["layout"], f"{path}: {name}") if m.get("layout") else None
            meta[name] = EntryMeta(
                m["kind"], m["fqn"], m.get("dtype", "uint8"), tuple(m.get("shape", ())),
                tuple(m.get("offsets", ())), tuple(m.get("sizes", ())), m["xxh3"], layout,
            )
        except (KeyError, TypeError) as e:
            raise CheckpointFormatError(f"{path}: metadata of entry {name!r} is malformed ({e})") from None
    return FileHeader(path, size, rank, world_size, save_id, ranges, shapes, meta)


@dataclass
class PlannedEntry:
    """An entry to write: name, safetensors dtype and shape, byte length, metadata."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    nbytes: int
    meta: EntryMeta | None  # None for padding


def layout_file(
    entries: Iterable[PlannedEntry], rank: int, world_size: int, save_id: str, align: int = ALIGN
) -> tuple[bytes, list[int], int]:
    """Lay out a data file: its header bytes and each entry's absolute offset.

    Entries of at least ``align`` bytes start on an ``align`` boundary;
    padding entries fill the gaps. Returns ``(header, offsets, file_size)``;
    the header contains the checksums already in ``meta`` (callers that hash
    while writing lay out twice: a checksum has a fixed width, so the header
    length does not change).
    """
    entries = list(entries)
    # Data offsets are relative to the data section, which starts right after
    # the header; the header is padded with spaces so that the data section
    # itself starts on an alignment boundary.
    rel: list[int] = []
    layout: list[PlannedEntry] = []
    pos = 0
    npad = 0
    for e in entries:
        if e.nbytes >= align and pos % align:
            pad = align - pos % align
            layout.append(PlannedEntry(f"{PAD_PREFIX}{npad}", "U8", (pad,), pad, None))
            npad += 1
            pos += pad
        rel.append(pos)
        layout.append(e)
        pos += e.nbytes
    header: dict[str, Any] = {}
    p = 0
    for e in layout:
        header[e.name] = {"dtype": e.st_dtype, "shape": list(e.shape), "data_offsets": [p, p + e.nbytes]}
        p += e.nbytes
    header["__metadata__"] = {
        "ucp_dcp": json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "rank": rank,
                "world_size": world_size,
                "save_id": save_id,
                "entries": {e.name: e.meta.to_json() for e in entries if e.meta is not None},
            },
            separators=(",", ":"),
        )
    }
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    total = 8 + len(raw)
    padded = -(-total // align) * align if pos else -(-total // 8) * 8
    raw += b" " * (padded - total)
    data_start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, [data_start + r for r in rel], data_start + pos
