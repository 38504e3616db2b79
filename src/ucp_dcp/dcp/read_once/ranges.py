"""Read-once planning's arithmetic on byte ranges held as int64 arrays: intersect, group by a
key (:func:`intersect_ranges`, :func:`stable_order`, :func:`offsets`; their union is
:func:`~ucp_dcp.core.spans.merge_ranges`, their integers :func:`~ucp_dcp.core.spans.expand`); the
*segments* of a
file's needs, maximal runs of pages needed by one set of ranks, numbered by class
(:func:`segments`); and :func:`water_fill`, the balancing rule that cuts a class's segments
among its members (:mod:`~ucp_dcp.dcp.read_once.plan` builds the job's read plan from them).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ...core.spans import expand
from ...errors import InvalidArgumentError

__all__ = [
    "Segments",
    "at_least",
    "intersect_ranges",
    "offsets",
    "segments",
    "stable_order",
    "water_fill",
]

_I64 = np.int64


# ---------------------------------------------------------------- byte ranges


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


def at_least(name: str, value: int, minimum: int) -> int:
    """``value`` as an int when it is an integer (not a bool) of at least ``minimum``, else
    :class:`~ucp_dcp.errors.InvalidArgumentError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def offsets(sorted_keys: np.ndarray, n: int) -> np.ndarray:
    """Where each key ``0..n-1`` starts in ``sorted_keys`` (ascending), and its end: ``n + 1``
    int64 offsets, key ``k``'s rows at ``offsets[k]:offsets[k + 1]``."""
    return np.searchsorted(sorted_keys, np.arange(n + 1)).astype(_I64)


# ---------------------------------------------------------------- segments


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each value: fixed pseudo-random 64-bit keys, the same on every rank."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class Segments:
    """Maximal runs of pages needed by one set of ranks: ``[start, end)`` on the line;
    ``members[ptr[j]:ptr[j + 1]]`` the ranks needing segment ``j`` (ascending); ``klass``
    its class (segments of equal member sets)."""

    start: np.ndarray
    end: np.ndarray
    ptr: np.ndarray
    members: np.ndarray
    klass: np.ndarray


def segments(rank: np.ndarray, start: np.ndarray, end: np.ndarray) -> Segments:
    """Sweep the ranks' (merged, page-aligned) ranges into segments and group them by set."""
    points = np.unique(np.concatenate([start, end]))
    i0, i1 = np.searchsorted(points, start), np.searchsorted(points, end)
    delta = np.bincount(i0, minlength=len(points)) - np.bincount(i1, minlength=len(points))
    covered = np.cumsum(delta)[:-1] > 0
    seg_of = np.cumsum(covered) - 1
    elems = np.flatnonzero(covered)
    row, elem = expand(i0, i1)
    seg = seg_of[elem]
    # Rows come by (rank, start); a stable sort by segment keeps each segment's ranks ascending.
    order = np.argsort(seg, kind="stable")
    seg, members = seg[order], rank[row[order]]
    nseg = len(elems)
    ptr = np.concatenate([[0], np.cumsum(np.bincount(seg, minlength=nseg))]).astype(_I64)
    return Segments(points[elems], points[elems + 1], ptr, members, _classes(ptr, seg, members))


def _classes(ptr: np.ndarray, seg: np.ndarray, members: np.ndarray) -> np.ndarray:
    """Class number of each segment: equal member sets share one, numbered by first segment."""
    nseg = len(ptr) - 1
    if not nseg:
        return np.zeros(0, _I64)
    count = np.diff(ptr)
    # Two 64-bit sums of fixed per-rank keys find candidates; the exact check below decides.
    fp1 = np.add.reduceat(_mix(members), ptr[:-1])
    fp2 = np.add.reduceat(_mix(members + (1 << 40)), ptr[:-1])
    order = np.lexsort((fp2, fp1, count))
    new = np.ones(nseg, bool)
    new[1:] = (
        (count[order][1:] != count[order][:-1])
        | (fp1[order][1:] != fp1[order][:-1])
        | (fp2[order][1:] != fp2[order][:-1])
    )
    group = np.empty(nseg, _I64)
    group[order] = np.cumsum(new) - 1
    # The lexsort is stable: each group's first row is its lowest segment.
    rep = order[new][group]
    pos = np.arange(len(members), dtype=_I64) - ptr[seg]
    if not np.array_equal(members, members[ptr[rep[seg]] + pos]):
        rep = _exact_reps(ptr, members)
    # Number classes by their first segment, so the numbering follows file order.
    _, klass = np.unique(rep, return_inverse=True)
    return klass.reshape(-1).astype(_I64)


def _exact_reps(ptr: np.ndarray, members: np.ndarray) -> np.ndarray:
    """The first segment with the same member set, for each segment (used only if two different
    sets ever share both fingerprints)."""
    first: dict[bytes, int] = {}
    return np.array(
        [first.setdefault(members[ptr[j] : ptr[j + 1]].tobytes(), j) for j in range(len(ptr) - 1)],
        _I64,
    )


def water_fill(loads: np.ndarray, total: int, weights: np.ndarray | None = None) -> np.ndarray:
    """Shares of ``total`` bytes (summing to it) that raise the least loaded up to one level:
    ``max(0, level - load)``, the remainder bytes to the lowest-loaded first (ties: order given).

    With ``weights`` (positive integers: the ranks each entry stands for) the level is per
    weight: shares ``max(0, floor(level * weight) - load)``, lowest ``load / weight`` first;
    all ones is the unweighted rule exactly."""
    w = np.ones(len(loads), _I64) if weights is None else np.asarray(weights, _I64)
    if not len(w) or int(w.min()) == int(w.max()):
        order = np.argsort(loads, kind="stable")  # equal weights: by load
    else:  # by load / weight, exactly (ties: order given)
        order = np.array(
            sorted(range(len(loads)), key=lambda i: Fraction(int(loads[i]), int(w[i]))), _I64
        )
    low, lw = loads[order].astype(_I64), w[order]
    cw, cl = np.cumsum(lw), np.cumsum(low)
    # Lifting the i+1 lowest to entry i's level low[i] / lw[i] costs low[i] * cw[i] / lw[i] -
    # cl[i] bytes; compared with total in integers, cross-multiplied (non-decreasing in i).
    filled = int(np.count_nonzero(low * cw - cl * lw <= total * lw))
    top = total + int(cl[filled - 1])
    share = np.zeros(len(low), _I64)
    share[:filled] = (top * lw[:filled]) // int(cw[filled - 1]) - low[:filled]
    extra = total - int(share.sum())  # under ``filled``: the floors' remainders
    share[:extra] += 1
    out = np.empty_like(share)
    out[order] = share
    return out
