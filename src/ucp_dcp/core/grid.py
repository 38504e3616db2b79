"""Chunk grids of DTensor layouts: which saved chunks overlap a box, at any world size.

Sharding cuts every tensor dimension independently, so a box-shaped layout's
chunks are the cells of a grid of per-dimension intervals. :func:`layout_grid`
computes that grid with vectorised integer arithmetic and :func:`arith_box`
one mesh coordinate's box, so that nothing enumerates every rank's chunk;
layouts this arithmetic does not cover fall back to DTensor's own
(:func:`ucp_dcp.core.sharding.layout_chunks`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .._compat import StridedShard
from ..errors import LayoutError
from .sharding import Box, _tiles_grid, layout_chunks, placement_to_str

__all__ = ["Grid", "layout_grid", "arith_box"]

_EMPTY = np.zeros(0, dtype=np.int64)


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

    def box(self, k: int) -> Box:
        """The box of chunk ``k``."""
        cell = self.cell_of_chunk[k]
        return Box(
            tuple(int(o[i]) for o, i in zip(self.offsets, cell)),
            tuple(int(s[i]) for s, i in zip(self.sizes, cell)),
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
        """The grid whose chunks are ``boxes`` (numbered in that order), or
        None when they do not tile ``shape`` as a grid."""
        shape = tuple(shape)
        boxes = [b for b in boxes if b.numel]
        if not _tiles_grid(boxes, shape):
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
    mstride: dict[int, int] = {}
    acc = 1
    for m in reversed(shard_dims):
        mstride[m] = acc
        acc *= mesh_shape[m]
    offs, sizes, lin = [], [], []
    for d, n in enumerate(shape):
        o = np.zeros(1, dtype=np.int64)
        sz = np.array([n], dtype=np.int64)
        li = np.zeros(1, dtype=np.int64)
        for m in order[d]:  # torch.chunk semantics, outermost split first
            k = mesh_shape[m]
            full = -(-sz // k)
            # Piece r of an interval of size s starts at min(s, full * r) >= min(s, r):
            # pieces from r = max(sz) on are all empty, so a mesh dim far larger
            # than the tensor dim costs no more than the tensor dim.
            r = np.arange(min(k, int(sz.max())), dtype=np.int64)
            start = np.minimum(sz[:, None], full[:, None] * r)
            end = np.minimum(sz[:, None], full[:, None] * (r + 1))
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
            k, r = mesh_shape[m], coord[m]
            full = -(-sz // k)
            start, end = min(sz, full * r), min(sz, full * (r + 1))
            o, sz = o + start, end - start
        offs.append(o if sz else 0)
        sizes.append(sz)
    return Box(tuple(offs), tuple(sizes))
