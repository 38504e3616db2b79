"""Byte ranges as integer arrays: merge, intersect, enumerate; integer arguments checked.

Pure arithmetic on ``[start, end)`` ranges held as int64 arrays, for the
job-wide read plan (:mod:`~ucp_dcp.core.readplan`), its exchange rounds and
the exchange itself.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["at_least", "expand", "intersect_ranges", "merge_ranges", "stable_order"]

_I64 = np.int64


def merge_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of ``[starts[i], ends[i])`` as sorted, disjoint ranges (touching ones merge)."""
    starts, ends = np.asarray(starts, _I64), np.asarray(ends, _I64)
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def intersect_ranges(
    a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The intersection of two lists of sorted, disjoint ranges ``[a0, a1)`` and ``[b0, b1)``,
    sorted."""
    # Range i of a meets the b ranges from the first that ends after a0[i] to the last that
    # starts before a1[i].
    lo = np.searchsorted(b1, a0, "right")
    hi = np.searchsorted(b0, a1, "left")
    ia, ib = expand(lo, np.maximum(hi, lo))
    ia = np.asarray(ia, _I64)
    s = np.maximum(a0[ia], b0[ib])
    e = np.minimum(a1[ia], b1[ib])
    keep = s < e
    return s[keep], e[keep]


def stable_order(key: np.ndarray) -> np.ndarray:
    """A stable argsort of non-negative integers: numpy's radix sort when they fit 16 bits."""
    if len(key) and int(key.max()) < (1 << 15):
        return np.argsort(key.astype(np.int16), kind="stable")
    return np.argsort(key, kind="stable")


def expand(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row ``i`` the integers ``lo[i]..hi[i]-1``: (row of each, the integer)."""
    count = np.maximum(hi - lo, 0)
    row = np.repeat(np.arange(len(lo), dtype=_I64), count)
    first = np.cumsum(count) - count
    return row, lo[row] + np.arange(len(row), dtype=_I64) - first[row]


def at_least(name: str, value: int, minimum: int) -> int:
    """``value`` as an int when it is an integer (not a bool) of at least ``minimum``, else
    :class:`~ucp_dcp.errors.InvalidArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)
