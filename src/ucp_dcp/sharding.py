"""Sharding arithmetic: boxes, DTensor layouts and the byte runs of a box.

Everything here is pure integer arithmetic on shapes. It does not touch
tensors, files or process groups, so it is cheap to property-test and is the
one place where "which bytes does this rank need" is decided.

Terms:

* A *box* is a hyper-rectangle of a global tensor: per-dimension ``offsets``
  and ``sizes``. Every saved chunk and every target shard is a box.
* A *layout* is a mesh shape plus one placement per mesh dimension, the way a
  DTensor describes itself. A regular layout determines every chunk's box.
* A *run* is a maximal piece of a box that is contiguous both in the saved
  chunk (row-major) and in the destination memory (any strides), so that it
  can be read with one ``pread`` straight into place.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, _StridedShard

__all__ = [
    "Box",
    "LayoutError",
    "placement_to_str",
    "placement_from_str",
    "chunk_box",
    "layout_chunks",
    "intersect",
    "row_major_strides",
    "Run",
    "RunGrid",
    "runs",
    "slabs",
]


class LayoutError(ValueError):
    """A layout that cannot be described as boxes, or an unknown placement."""


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the box (0 for an empty shard)."""
        return math.prod(self.sizes)

    def contains(self, other: "Box") -> bool:
        """Whether ``other`` lies entirely inside this box."""
        return all(
            so <= oo and oo + os <= so + ss
            for so, ss, oo, os in zip(self.offsets, self.sizes, other.offsets, other.sizes)
        )


_PLACEMENT_RE = re.compile(r"^(R|S\((\d+)\)|SS\((\d+),(\d+)\))$")


def placement_to_str(p: Placement) -> str:
    """Compact, JSON-safe name of a placement: ``R``, ``S(d)`` or ``SS(d,k)``.

    ``Partial`` is refused: a partial sum is not a value that can be saved;
    the caller must reduce it (``redistribute`` or ``full_tensor``) first.
    """
    if isinstance(p, _StridedShard):  # must precede Shard: it is a subclass
        return f"SS({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        raise LayoutError(
            "Partial placement cannot be checkpointed: reduce the DTensor first "
            "(dtensor.redistribute(placements=[Replicate()...]) or .full_tensor())"
        )
    raise LayoutError(f"unsupported DTensor placement {p!r}")


def placement_from_str(s: str) -> Placement:
    """Inverse of :func:`placement_to_str`."""
    m = _PLACEMENT_RE.match(s)
    if not m:
        raise LayoutError(f"unknown placement {s!r}; expected 'R', 'S(dim)' or 'SS(dim,split)'")
    if m.group(1) == "R":
        return Replicate()
    if m.group(2) is not None:
        return Shard(int(m.group(2)))
    return _StridedShard(int(m.group(3)), split_factor=int(m.group(4)))


def chunk_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[Placement],
) -> Box:
    """The box held by mesh coordinate ``coord``.

    Delegates to DTensor's own arithmetic so that uneven shards (torch.chunk
    rounding, empty trailing shards) and ``_StridedShard`` agree with what
    DTensor actually stores.
    """
    sizes, offsets = _compute_local_shape_and_global_offset(
        tuple(global_shape), tuple(mesh_shape), list(coord), list(placements)
    )
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))


def layout_chunks(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> list[Box]:
    """Distinct non-empty boxes of a layout, in mesh-coordinate order.

    Replicas (coordinates that differ only along replicated mesh dims) give
    the same box and appear once. Raises :class:`LayoutError` when the boxes
    do not tile the tensor exactly (a strided layout that is not box-shaped).
    """
    seen: dict[Box, None] = {}
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        box = chunk_box(global_shape, mesh_shape, coord, placements)
        if box.numel:
            seen.setdefault(box, None)
    boxes = list(seen)
    if not _tiles_grid(boxes, global_shape):
        raise LayoutError(
            f"layout mesh={list(mesh_shape)} placements={[placement_to_str(p) for p in placements]} "
            f"of a tensor of shape {list(global_shape)} does not split it into disjoint boxes; "
            "save it as a plain tensor or with a layout whose shards are hyper-rectangles"
        )
    return boxes


def _tiles_grid(boxes: Sequence[Box], global_shape: Sequence[int]) -> bool:
    """Whether ``boxes`` are the cells of a grid that tiles ``global_shape``.

    Sharding by ``Shard``/``_StridedShard`` cuts each dimension independently,
    so a box-shaped layout is a grid: per dimension the distinct intervals
    tile ``[0, n)``, and every combination of intervals is one box. This check
    is linear in the number of boxes (a pairwise overlap test would not be).
    """
    if math.prod(global_shape) == 0:
        return not boxes
    per_dim: list[set[tuple[int, int]]] = [set() for _ in global_shape]
    for b in boxes:
        for d, (o, n) in enumerate(zip(b.offsets, b.sizes)):
            per_dim[d].add((o, n))
    for d, intervals in enumerate(per_dim):
        end = 0
        for o, n in sorted(intervals):
            if o != end:
                return False
            end = o + n
        if end != global_shape[d]:
            return False
    return len(boxes) == math.prod(len(i) for i in per_dim)


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when it is empty."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major array of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Run:
    """``count`` elements, contiguous at element ``src`` of the saved chunk
    and at element ``dst`` of the destination storage."""

    src: int
    dst: int
    count: int


@dataclass(frozen=True)
class RunGrid:
    """All runs of a region: equal length ``count``, start offsets as arrays.

    Strided regions have tens of thousands of runs; numpy arrays of their
    offsets cost a few bytes each, where per-run Python objects would cost
    microseconds and hundreds of bytes.
    """

    count: int
    src: np.ndarray  # int64 element offsets into the saved chunk
    dst: np.ndarray  # int64 element offsets into the destination storage

    def __len__(self) -> int:
        return len(self.src)

    def __iter__(self) -> Iterator[Run]:
        for s, d in zip(self.src.tolist(), self.dst.tolist()):
            yield Run(s, d, self.count)


def _contiguous_from(lengths: Sequence[int], strides: Sequence[int]) -> int:
    """Smallest dim ``j`` such that dims ``j..`` of a ``lengths`` region laid
    out with ``strides`` form one contiguous block of memory.

    Dims of length 1 never break contiguity (their stride is irrelevant).
    """
    j = len(lengths)
    expected = 1
    for d in range(len(lengths) - 1, -1, -1):
        if lengths[d] != 1 and strides[d] != expected:
            break
        j = d
        expected *= lengths[d]
    return j


_EMPTY = np.zeros(0, dtype=np.int64)


def runs(
    chunk_sizes: Sequence[int],
    region: Box,
    dst_strides: Sequence[int],
    dst_offset: int,
) -> RunGrid:
    """Split ``region`` (offsets relative to the saved chunk) into runs.

    ``chunk_sizes`` is the shape of the saved chunk, stored row-major.
    ``dst_strides``/``dst_offset`` address the destination region in element
    units of its storage (``tensor.stride()``/``tensor.storage_offset()`` of
    the destination view, whose shape is ``region.sizes``).

    Runs come in row-major order of the region; every run has the same
    length. An empty region has no run.
    """
    lengths = region.sizes
    if math.prod(lengths) == 0:
        return RunGrid(0, _EMPTY, _EMPTY)
    src_strides = row_major_strides(chunk_sizes)
    src0 = sum(o * s for o, s in zip(region.offsets, src_strides))
    # The region is contiguous in the chunk from the first dim after which it
    # spans the chunk's full extent; ``_contiguous_from`` with the chunk's own
    # strides computes exactly that. j == ndim (a transposed destination, say)
    # means single-element runs.
    j = max(_contiguous_from(lengths, src_strides), _contiguous_from(lengths, dst_strides))
    src = np.array([src0], dtype=np.int64)
    dst = np.array([dst_offset], dtype=np.int64)
    for d in range(j):
        steps = np.arange(lengths[d], dtype=np.int64)
        src = (src[:, None] + steps * src_strides[d]).reshape(-1)
        dst = (dst[:, None] + steps * dst_strides[d]).reshape(-1)
    return RunGrid(math.prod(lengths[j:]), src, dst)


def slabs(
    lengths: Sequence[int], itemsize: int, budget: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box of ``lengths`` into sub-boxes of at most ``budget`` bytes.

    Yields ``(offsets, sizes)`` relative to the box, outermost dims first, so
    that a bounded staging buffer can carry any box, however large. Only the
    outermost dim that has to be cut is cut in several places; the dims
    before it are taken one index at a time.
    """
    ndim = len(lengths)
    if ndim == 0 or math.prod(lengths) * itemsize <= budget:
        yield (0,) * ndim, tuple(lengths)
        return
    d = 0
    while d < ndim - 1 and math.prod(lengths[d + 1 :]) * itemsize > budget:
        d += 1
    inner = math.prod(lengths[d + 1 :]) * itemsize
    step = max(1, budget // inner)
    rest = tuple(lengths[d + 1 :])
    for outer in itertools.product(*(range(n) for n in lengths[:d])):
        for start in range(0, lengths[d], step):
            yield (
                tuple(outer) + (start,) + (0,) * len(rest),
                (1,) * d + (min(step, lengths[d] - start),) + rest,
            )
