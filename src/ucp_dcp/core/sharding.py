"""Sharding arithmetic: boxes, placements and the chunk boxes of DTensor layouts.

Everything here is pure integer arithmetic on shapes. It does not touch
tensors, files or process groups, so it is cheap to property-test and is the
one place where "which bytes does this rank need" is decided.

Terms:

* A *box* is a hyper-rectangle of a global tensor: per-dimension ``offsets``
  and ``sizes``. Every saved chunk and every target shard is a box.
* A *layout* is a mesh shape plus one placement per mesh dimension, the way a
  DTensor describes itself. A regular layout determines every chunk's box.

The chunk grids of layouts (vectorised, for any world size) are in
:mod:`ucp_dcp.core.grid`; the contiguous runs of a box (what one ``pread``
can read straight into place) are in :mod:`ucp_dcp.core.boxes`.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement

from .._compat import StridedShard, compute_shard_box_on_mesh_shape
from ..errors import LayoutError
from .boxes import Box, intersect, row_major_strides

__all__ = [
    "Box",
    "LayoutError",
    "placement_to_str",
    "placement_from_str",
    "chunk_box",
    "layout_chunks",
    "intersect",
    "flat_range_boxes",
]


_PLACEMENT_RE = re.compile(r"^(R|S\((\d+)\)|SS\((\d+),(\d+)\))$")


def placement_to_str(p: Placement) -> str:
    """Compact, JSON-safe name of a placement: ``R``, ``S(d)`` or ``SS(d,k)``.

    ``Partial`` is refused: a partial sum is not a value that can be saved;
    the caller must reduce it (``redistribute`` or ``full_tensor``) first.
    """
    if isinstance(p, StridedShard):  # must precede Shard: it is a subclass
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
    return StridedShard(int(m.group(3)), split_factor=int(m.group(4)))


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
    sizes, offsets = compute_shard_box_on_mesh_shape(
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
            f"layout mesh={list(mesh_shape)} "
            f"placements={[placement_to_str(p) for p in placements]} "
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


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a row-major tensor of ``shape``.

    A flat range of a row-major tensor (a ZeRO/FSDP1 rank's slice of one
    parameter) is not one box, but it is a few: a partial innermost row, then
    ever larger blocks, then partial rows again, at most ``2 * ndim - 1`` in
    all. The boxes are returned in flat order, and each one covers a
    contiguous flat range, so its data is a contiguous slice of the rank's
    buffer reshaped to the box's sizes.
    """
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise LayoutError(
            f"flat range [{start}, {stop}) is outside a tensor of shape {list(shape)} ({total} "
            "elements)"
        )
    if start == stop:
        return []
    if not shape:
        return [Box((), ())]
    strides = row_major_strides(shape)
    out: list[Box] = []

    def walk(dim: int, base: tuple[int, ...], a: int, b: int) -> None:
        # [a, b) is relative to the sub-tensor at index ``base`` (dims < dim).
        s = strides[dim]
        i0, r0 = divmod(a, s)
        i1, r1 = divmod(b, s)
        if dim == len(shape) - 1:  # s == 1: one run of the innermost dim
            out.append(Box(base + (a,), (1,) * dim + (b - a,)))
            return
        if i0 == i1:  # inside one index of this dim
            walk(dim + 1, base + (i0,), r0, r1)
            return
        if r0:
            walk(dim + 1, base + (i0,), r0, s)
            i0 += 1
        if i1 > i0:
            out.append(
                Box(
                    base + (i0,) + (0,) * (len(shape) - dim - 1),
                    (1,) * dim + (i1 - i0,) + shape[dim + 1 :],
                )
            )
        if r1:
            walk(dim + 1, base + (i1,), 0, r1)

    walk(0, (), start, stop)
    return out
