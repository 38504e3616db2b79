"""Run-length lists of integers: which file holds each chunk of a regular layout."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, SupportsIndex, overload

import numpy as np

from ..errors import CheckpointFormatError


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
    if not isinstance(runs, list) or not all(
        isinstance(r, list)
        and len(r) == 3
        and all(
            isinstance(x, int) and not isinstance(x, bool) and -_MAX_RUN <= x <= _MAX_RUN for x in r
        )
        and r[1] >= 0
        for r in runs
    ):
        raise CheckpointFormatError(f"{where}: malformed file runs {runs!r}"[:300])
    if sum(r[1] for r in runs) > _MAX_RUN:
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
        self._ends = (
            np.cumsum([r[1] for r in runs], dtype=np.int64) if runs else np.zeros(0, np.int64)
        )

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
