"""Where each parameter's elements are in ZeRO's flat partitions (arithmetic only).

DeepSpeed ZeRO keeps fp32 master weights and optimizer moments as flat 1-D
buffers, one per rank and group, in which parameters are laid end to end:

* **ZeRO-1/2**: per parameter group, the parameters are concatenated in
  order (``param_shapes``), padded at the end, and the result is cut into one
  contiguous partition per rank. A parameter may straddle partitions.
* **ZeRO-3**: every parameter is padded to ``ceil(numel / W) * W`` and cut
  into ``W`` equal slices; rank ``r`` holds slice ``r`` of every parameter,
  laid end to end in parameter order, and that per-rank buffer is split into
  sub-groups (``fp32_flat_groups``), which may cut a parameter's slice.

:func:`zero12_segments` and :func:`zero3_segments` say, for each parameter,
which element range of which rank's which buffer holds which of its
elements; :func:`segment_boxes` turns one such range into boxes of the
parameter's shape (a flat range of a row-major tensor is a few boxes), each
a contiguous run of the buffer.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.sharding import Box, flat_range_boxes
from ..errors import LayoutError

__all__ = ["Segment", "zero12_segments", "zero3_segments", "segment_boxes"]


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, stop)`` of a parameter (row-major, flattened), stored at
    element ``offset`` of buffer ``buffer`` of rank ``rank``."""

    rank: int
    buffer: int
    offset: int
    start: int
    stop: int


def zero12_segments(
    numels: Sequence[int], partition_sizes: Sequence[int], buffer: int = 0
) -> list[list[Segment]]:
    """Segments of each parameter of one ZeRO-1/2 group.

    ``numels`` are the group's parameters in flat order; ``partition_sizes``
    the length of each rank's partition of the group (rank order). The
    parameters must fit: ``sum(numels) <= sum(partition_sizes)`` (the rest
    is padding). ``buffer`` is recorded in every segment (the group index).
    """
    if sum(numels) > sum(partition_sizes):
        raise LayoutError(
            f"{sum(numels)} parameter elements do not fit in partitions of {sum(partition_sizes)}"
        )
    bounds = list(itertools.accumulate(partition_sizes, initial=0))
    out: list[list[Segment]] = []
    o = 0
    for n in numels:
        out.append(_split(o, o + n, bounds, lambda k: k, o, buffer))
        o += n
    return out


def _held_by(rank: int) -> Callable[[int], int]:
    """``rank_of`` for buffers all held by ``rank``."""
    return lambda _buffer: rank


def _split(
    a: int,
    b: int,
    bounds: Sequence[int],
    rank_of: Callable[[int], int],
    base: int,
    buffer: int | None,
    first: int = 0,
) -> list[Segment]:
    """Cut positions ``[a, b)`` of concatenated buffers (``bounds``: their cumulative starts) at
    buffer ends.

    Element ``pos`` is parameter element ``pos - base + first``; segment ``k``
    goes to rank ``rank_of(k)`` and buffer ``buffer`` (or ``k`` when None).
    """
    segs = []
    while a < b:
        k = bisect.bisect_right(bounds, a) - 1
        e = min(b, bounds[k + 1])
        buf = k if buffer is None else buffer
        segs.append(Segment(rank_of(k), buf, a - bounds[k], a - base + first, e - base + first))
        a = e
    return segs


def zero3_segments(
    numels: Sequence[int], world_size: int, buffer_sizes: Sequence[int]
) -> list[list[Segment]]:
    """Segments of each parameter of a ZeRO-3 model.

    ``numels`` are all trainable parameters in order (every group's, as in
    ``param_shapes``); ``buffer_sizes`` the lengths of one rank's
    sub-group buffers (equal on every rank). Each parameter is padded to a
    multiple of ``world_size``; its slices must fit in the buffers.
    """
    bounds = list(itertools.accumulate(buffer_sizes, initial=0))
    total = sum(math.ceil(n / world_size) for n in numels)
    if total > bounds[-1]:
        raise LayoutError(
            f"parameter slices of {total} elements per rank do not fit in buffers of {bounds[-1]}"
        )
    out: list[list[Segment]] = []
    q = 0  # where this parameter's slice starts in each rank's concatenated buffers
    for n in numels:
        ps = math.ceil(n / world_size)
        segs: list[Segment] = []
        for r in range(world_size):
            a, b = r * ps, min((r + 1) * ps, n)
            if a < b:
                segs += _split(q, q + b - a, bounds, _held_by(r), q, None, a)
        out.append(segs)
        q += ps
    return out


def segment_boxes(shape: Sequence[int], seg: Segment) -> list[tuple[Box, int]]:
    """Boxes of a parameter of ``shape`` held by ``seg``, each with its element offset in the
    buffer."""
    out = []
    off = seg.offset
    for box in flat_range_boxes(shape, seg.start, seg.stop):
        out.append((box, off))
        off += box.numel
    return out
