"""Boxes of a global tensor, and the row-major arithmetic of their elements.

A *box* is a hyper-rectangle of a global tensor: per-dimension ``offsets`` and ``sizes``. Every
saved chunk and every target shard is one. The rest of :mod:`ucp_dcp.core` builds on this module
and it on nothing: :mod:`.sharding` turns layouts into boxes, :mod:`.contiguous` boxes into runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Box", "intersect", "row_major_strides"]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the box (0 for an empty shard)."""
        return math.prod(self.sizes)

    def contains(self, other: Box) -> bool:
        """Whether ``other`` lies entirely inside this box."""
        return all(
            so <= oo and oo + os <= so + ss
            for so, ss, oo, os in zip(self.offsets, self.sizes, other.offsets, other.sizes)
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
