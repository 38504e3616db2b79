"""Sharding arithmetic: placements, and the chunk boxes and grids of DTensor layouts.

Pure integer arithmetic on shapes: it does not touch tensors, files or process groups, so it is
cheap to property-test and is the one place where "which bytes does this rank need" is decided. A
*layout* is a mesh shape plus one placement per mesh dimension, as a DTensor describes itself; a
regular layout's chunks (boxes: :mod:`ucp_dcp.core.boxes`) are the cells of a :class:`Grid`, which
:func:`layout_grid` computes (and :func:`arith_box` one mesh coordinate's box) without enumerating
every rank's chunk; layouts this arithmetic does not cover fall back to DTensor's own
(:func:`layout_chunks`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, Placement

from .._compat import StridedShard, compute_shard_box_on_mesh_shape
from ..errors import LayoutError
from .boxes import _EMPTY, Box, intersect, row_major_strides

__all__ = [
    "Box",
    "LayoutError",
    "placement_to_str",
    "placement_from_str",
    "chunk_box",
    "layout_chunks",
    "intersect",
    "flat_range_boxes",
    "Grid",
    "layout_grid",
    "arith_box",
    "tiles",
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


@functools.lru_cache(maxsize=256)
def placement_from_str(s: str) -> Placement:
    """Inverse of :func:`placement_to_str` (cached: an index names a few placements many times,
    and placements are immutable)."""
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
    # Each box is a combination of the intervals; as many distinct boxes as combinations is each
    # combination once (a box listed twice would stand in for one never listed).
    return len(set(boxes)) == len(boxes) == math.prod(len(i) for i in per_dim)


def tiles(boxes: Sequence[Box], shape: Sequence[int]) -> bool:
    """Whether ``boxes`` (empty ones aside) hold every element of a tensor of ``shape`` exactly
    once: a grid (linear check), or boxes as many elements as the tensor, no two overlapping."""
    boxes = [b for b in boxes if b.numel]
    if sum(b.numel for b in boxes) != math.prod(shape):
        return False
    if _tiles_grid(boxes, shape) or len(boxes) < 2:
        return True
    lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    hi = lo + np.array([b.sizes for b in boxes], dtype=np.int64).reshape(len(boxes), len(shape))
    for i in range(0, len(boxes), 512):  # pairs in blocks: bounded memory for irregular lists
        meet = (lo[i : i + 512, None] < hi[None]) & (lo[None] < hi[i : i + 512, None])
        both: np.ndarray = np.asarray(meet.all(axis=2))
        both[np.arange(both.shape[0]), np.arange(i, i + both.shape[0])] = False  # itself
        if both.any():
            return False
    return True


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
        return [Box.whole(shape)]
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


# ---------------------------------------------------------------- chunk grids


@dataclass(frozen=True, eq=False)
class Grid:
    """The chunks of a box-shaped layout, as a grid of per-dimension intervals.

    Sharding cuts every tensor dimension independently, so the non-empty
    chunks of a layout are the cells of a grid: along dimension ``d`` the
    intervals ``offsets[d][i], sizes[d][i]`` (sorted, tiling ``[0, n)``), and
    ``chunk_of_cell[i0, i1, ...]`` is the number of the chunk in that cell.
    Chunks are numbered in mesh-coordinate order (the order of
    :func:`layout_chunks`, which the index's compact file lists follow).

    Everything a planner asks (which chunks overlap this box, where does
    chunk ``k`` start) is a binary search per dimension, so it costs the
    same at 64 ranks and at 16384: nothing enumerates every rank's chunk.
    """

    shape: tuple[int, ...]
    offsets: tuple[np.ndarray, ...]  # per dim: interval starts, ascending
    sizes: tuple[np.ndarray, ...]  # per dim: interval lengths (all > 0)
    chunk_of_cell: np.ndarray  # int64 array of shape (len(offsets[d]) for d)
    cell_of_chunk: np.ndarray  # int64 array (n_chunks, ndim): the inverse
    # Per chunk, its row-major position over the layout's sharding mesh dims
    # (so the mesh coordinates that hold it); None for grids built from boxes.
    mesh_lin: np.ndarray | None = None

    @property
    def n_chunks(self) -> int:
        """Number of non-empty chunks."""
        return len(self.cell_of_chunk)

    @functools.cached_property
    def _lists(self) -> tuple[list[list[int]], list[list[int]]]:
        # Planners ask box() once or more per chunk they touch; reading numpy scalars one by one
        # costs several times these plain lists, made once per grid (grids are cached per layout).
        return [o.tolist() for o in self.offsets], [s.tolist() for s in self.sizes]

    def box(self, k: int) -> Box:
        """The box of chunk ``k``."""
        offsets, sizes = self._lists
        cell = self.cell_of_chunk[k].tolist()
        return Box(
            tuple(o[i] for o, i in zip(offsets, cell)), tuple(s[i] for s, i in zip(sizes, cell))
        )

    def boxes(self) -> list[Box]:
        """Every chunk's box, in chunk order (O(chunks): for tools, not planners)."""
        return [self.box(k) for k in range(self.n_chunks)]

    def overlapping(self, box: Box) -> np.ndarray:
        """Numbers of the chunks that overlap ``box`` (row-major over the grid)."""
        sel = []
        for o, s, a, n in zip(self.offsets, self.sizes, box.offsets, box.sizes):
            if n == 0:
                return _EMPTY
            lo = int(np.searchsorted(o + s, a, side="right"))
            hi = int(np.searchsorted(o, a + n, side="left"))
            if hi <= lo:
                return _EMPTY
            sel.append(slice(lo, hi))
        return self.chunk_of_cell[tuple(sel)].reshape(-1)

    def find(self, offsets: Sequence[int]) -> int | None:
        """Number of the chunk that starts at ``offsets``, or None."""
        cell = []
        for o, a in zip(self.offsets, offsets):
            i = int(np.searchsorted(o, a))
            if i >= len(o) or o[i] != a:
                return None
            cell.append(i)
        return int(self.chunk_of_cell[tuple(cell)]) if cell else (0 if self.n_chunks else None)

    @staticmethod
    def from_boxes(boxes: Sequence[Box], shape: Sequence[int]) -> Grid | None:
        """The grid whose chunk ``k`` is ``boxes[k]`` for every ``k``, or None when the boxes do not
        tile ``shape`` as a grid or one is empty (it would have no cell, and the chunks after it
        would be renumbered)."""
        shape = tuple(shape)
        if not all(b.numel for b in boxes) or not _tiles_grid(boxes, shape):
            return None
        offs, sizes, pos = [], [], []
        for d in range(len(shape)):
            ivs = sorted({(b.offsets[d], b.sizes[d]) for b in boxes})
            offs.append(np.array([o for o, _ in ivs], dtype=np.int64))
            sizes.append(np.array([n for _, n in ivs], dtype=np.int64))
            pos.append({o: i for i, (o, _) in enumerate(ivs)})
        cells = np.array(
            [[pos[d][b.offsets[d]] for d in range(len(shape))] for b in boxes], dtype=np.int64
        ).reshape(len(boxes), len(shape))
        return _grid(shape, offs, sizes, cells)


def _grid(
    shape: tuple[int, ...], offs: list[np.ndarray], sizes: list[np.ndarray], cells: np.ndarray
) -> Grid:
    chunk_of_cell = np.full(tuple(len(o) for o in offs), -1, dtype=np.int64)
    if len(cells) and shape:
        chunk_of_cell[tuple(cells.T)] = np.arange(len(cells), dtype=np.int64)
    elif len(cells):  # a 0-dim tensor: one cell
        chunk_of_cell[()] = 0
    return Grid(shape, tuple(offs), tuple(sizes), chunk_of_cell, cells)


def layout_grid(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    max_enumerated: int | None = None,
) -> Grid:
    """The chunk grid of a layout, numbered like :func:`layout_chunks`.

    Layouts of ``Shard`` and ``Replicate`` placements (and ``_StridedShard`` in the form FSDP2
    produces on top of tensor parallelism) are computed with vectorised integer arithmetic, in time
    proportional to the number of chunks; anything else goes through :func:`layout_chunks`
    (DTensor's own arithmetic, one mesh coordinate at a time), which ``max_enumerated`` bounds: a
    layout of more mesh coordinates than that raises instead (a layout read from a file is
    untrusted). Raises :class:`LayoutError` like :func:`layout_chunks`.
    """
    shape = tuple(int(n) for n in global_shape)
    order = _application_order(shape, mesh_shape, placements)
    if order is None and max_enumerated is not None and math.prod(mesh_shape) > max_enumerated:
        raise LayoutError(
            f"layout mesh={list(mesh_shape)} "
            f"placements={[placement_to_str(p) for p in placements]} is irregular "
            f"and has {math.prod(mesh_shape)} mesh coordinates, more than the {max_enumerated} "
            "enumerated one by one"
        )
    if order is None:
        grid = Grid.from_boxes(layout_chunks(shape, mesh_shape, placements), shape)
        assert grid is not None  # layout_chunks checked the tiling
        return grid
    if math.prod(shape) == 0:
        empty = _grid(
            shape, [_EMPTY] * len(shape), [_EMPTY] * len(shape), np.zeros((0, len(shape)), np.int64)
        )
        return dataclasses.replace(empty, mesh_lin=_EMPTY)
    # Row-major strides over the sharding mesh dims (in mesh order): the
    # position of a chunk's first replica in mesh-coordinate order.
    shard_dims = [m for m, p in enumerate(placements) if isinstance(p, (Shard, StridedShard))]
    mstride = dict(zip(shard_dims, row_major_strides([mesh_shape[m] for m in shard_dims])))
    offs, sizes, lin = [], [], []
    for d, n in enumerate(shape):
        o = np.zeros(1, dtype=np.int64)
        sz = np.array([n], dtype=np.int64)
        li = np.zeros(1, dtype=np.int64)
        for m in order[d]:  # torch.chunk semantics, outermost split first
            k = mesh_shape[m]
            # Piece r of an interval of size s starts at min(s, ceil(s / k) * r) >= min(s, r):
            # pieces from r = max(sz) on are all empty, so a mesh dim far larger
            # than the tensor dim costs no more than the tensor dim.
            r = np.arange(min(k, int(sz.max())), dtype=np.int64)
            start, end = _chunk_bounds(sz[:, None], k, r)
            o = (o[:, None] + start).reshape(-1)
            sz = (end - start).reshape(-1)
            li = (li[:, None] + r * mstride[m]).reshape(-1)
            keep = sz > 0  # an empty interval only splits into empty ones
            o, sz, li = o[keep], sz[keep], li[keep]
        keep = sz > 0  # non-empty intervals, already in ascending order
        offs.append(o[keep])
        sizes.append(sz[keep])
        lin.append(li[keep])
    # Every combination of non-empty intervals is a chunk; number them by
    # the mesh-coordinate order of their first replica.
    total: np.ndarray = np.zeros(tuple(len(x) for x in lin), dtype=np.int64)
    for d, li in enumerate(lin):
        total = total + li.reshape((1,) * d + (-1,) + (1,) * (len(lin) - d - 1))
    flat = total.reshape(-1)
    order_ = np.argsort(flat, kind="stable")
    chunk_of_cell = np.empty_like(flat)
    chunk_of_cell[order_] = np.arange(len(flat), dtype=np.int64)
    chunk_of_cell = chunk_of_cell.reshape(total.shape)
    cells = (
        np.stack(np.unravel_index(order_, total.shape), axis=1).astype(np.int64)
        if len(flat)
        else np.zeros((0, len(shape)), np.int64)
    )
    return Grid(
        shape,
        tuple(offs),
        tuple(sizes),
        chunk_of_cell,
        cells.reshape(len(flat), len(shape)),
        flat[order_],
    )


def _chunk_bounds(
    size: int | np.ndarray, k: int, r: int | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of piece ``r`` when ``torch.chunk`` splits ``size`` elements into ``k``
    (pieces of ``ceil(size / k)``, the last ones short or empty); element-wise on arrays."""
    full = -(-size // k)
    return np.minimum(size, full * r), np.minimum(size, full * (r + 1))


def _application_order(
    shape: tuple[int, ...], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> list[list[int]] | None:
    """Per tensor dim, the mesh dims that split it, outermost first; None
    when the layout is not a nesting of ``torch.chunk`` splits.

    ``Shard`` placements split left to right. ``_StridedShard(d, sf)`` is
    FSDP2's mark for "this split applies inside the later splits of dim
    ``d`` whose sizes multiply to ``sf``"; with even sizes that is the same
    as moving it after them when the dim splits into ``sf`` equal pieces.
    Other strided layouts are left to DTensor.
    """
    order: list[list[int]] = [[] for _ in shape]
    pending: dict[int, list[int]] = {}  # dim -> [strided mesh dim, remaining split factor]
    for m, p in enumerate(placements):
        if isinstance(p, StridedShard):
            # Only the FSDP2-over-TP form: the first split of its dim, whose
            # ``sf`` pieces are equal (then the strided pieces line up with
            # the later splits exactly, whatever the inner rounding).
            sf = int(p.split_factor)  # typed int | SymInt; a layout's is a plain int
            if p.dim >= len(shape) or p.dim in pending or order[p.dim] or shape[p.dim] % sf:
                return None
            pending[p.dim] = [m, sf]
        elif isinstance(p, Shard):
            if p.dim >= len(shape):
                return None
            order[p.dim].append(m)
            ss = pending.get(p.dim)
            if ss is not None:
                if ss[1] % mesh_shape[m]:
                    return None
                ss[1] //= mesh_shape[m]
                if ss[1] == 1:
                    order[p.dim].append(ss[0])
                    del pending[p.dim]
        elif not isinstance(p, Replicate):
            return None
    if pending:
        return None
    return order


def arith_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> Box | None:
    """The box held by mesh coordinate ``coord``, by the arithmetic of
    :func:`layout_grid`; None when the layout needs DTensor's own.

    DTensor computes a ``_StridedShard`` shard by splitting an index tensor
    into as many pieces as the mesh dim has ranks, which costs time
    proportional to the world size on every rank; this costs a few integer
    operations. An empty shard gets offset 0 in its empty dims.
    """
    shape = tuple(int(n) for n in global_shape)
    order = _application_order(shape, mesh_shape, placements)
    if order is None:
        return None
    offs, sizes = [], []
    for d, n in enumerate(shape):
        o, sz = 0, n
        for m in order[d]:
            start, end = (int(x) for x in _chunk_bounds(sz, mesh_shape[m], coord[m]))
            o, sz = o + start, end - start
        offs.append(o if sz else 0)
        sizes.append(sz)
    return Box(tuple(offs), tuple(sizes))
