"""Boxes of a global tensor, and the row-major arithmetic of their elements.

A *box* is a hyper-rectangle of a global tensor: per-dimension ``offsets`` and ``sizes``. Every
saved chunk and every target shard is one. The rest of :mod:`ucp_dcp.core` builds on this module
and it on nothing: :mod:`.sharding` turns layouts into boxes.

A *run* is a maximal piece of a region that is contiguous both in the saved
chunk (row-major) and in the destination memory (any strides), so that it can
be read with one ``pread`` straight into place (:func:`runs`). :func:`slabs`
cuts a box into pieces that fit a bounded staging buffer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Box", "intersect", "row_major_strides", "Run", "RunGrid", "runs", "slabs"]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        """The box of a whole tensor of ``shape``: zero offsets, sizes ``shape``."""
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        """Number of elements in the box (0 for an empty shard)."""
        return math.prod(self.sizes)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether the box is one of a tensor of ``shape``: as many dimensions, inside it."""
        return len(self.offsets) == len(self.sizes) == len(shape) and all(
            o >= 0 and o + k <= n for o, k, n in zip(self.offsets, self.sizes, shape)
        )


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


_EMPTY = np.zeros(0, dtype=np.int64)


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
    lengths: Sequence[int], itemsize: int, budget: int, strides: Sequence[int] | None = None
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box of ``lengths`` into sub-boxes of at most ``budget`` bytes.

    Yields ``(offsets, sizes)`` relative to the box, outermost dims first, so
    that a bounded staging buffer can carry any box, however large. Only the
    outermost dim that has to be cut is cut in several places; the dims
    before it are taken one index at a time. ``strides``: the bytes per index
    of each dim where the box lies (a region of a larger row-major chunk,
    :func:`~ucp_dcp.core.spans.span_slabs`); then what is bounded is each
    sub-box's span there, from its first byte to its last. A single element
    more than ``budget`` is a sub-box of its own.
    """
    ndim = len(lengths)
    if strides is None:
        strides = [s * itemsize for s in row_major_strides(lengths)]

    def span(d: int) -> int:
        """Span in bytes of one index of dims ``<= d`` and all of dims ``> d``."""
        return sum((lengths[i] - 1) * strides[i] for i in range(d + 1, ndim)) + itemsize

    if ndim == 0 or math.prod(lengths) == 0 or span(-1) <= budget:
        yield (0,) * ndim, tuple(lengths)
        return
    d = 0
    while d < ndim - 1 and span(d) > budget:
        d += 1
    rest = span(d)
    step = max(1, (budget - rest) // strides[d] + 1) if budget >= rest else 1
    tail = tuple(lengths[d + 1 :])
    for outer in itertools.product(*(range(n) for n in lengths[:d])):
        for start in range(0, lengths[d], step):
            yield (
                tuple(outer) + (start,) + (0,) * len(tail),
                (1,) * d + (min(step, lengths[d] - start),) + tail,
            )
