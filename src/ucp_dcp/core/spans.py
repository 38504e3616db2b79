"""Exact reads or one span read: the cost model of reading a region of a saved chunk.

A region of a row-major chunk is a set of equal-length *runs* (:func:`~ucp_dcp.core.boxes.runs`),
read either *exact* (a buffer per run, neighbours sharing ``preadv`` calls: no page without a
needed byte, but a cost per run and per call) or as one *span* (the covering byte range read into
bounded staging, then one strided copy: the cost of the gaps' pages and of the copy).
:func:`read_cost` prices both with :class:`ReadCosts`; :func:`prefer_span` picks;
:func:`span_slabs` cuts a region into sub-boxes whose span fits a staging budget;
:func:`file_access` picks how a rank reads each file as a whole; :func:`merge_ranges` is the one
union of byte ranges, and :func:`expand` the one listing of the integers of ranges, every layer
above uses. Pure arithmetic, like the rest of
:mod:`ucp_dcp.core`: the byte-moving code is :mod:`ucp_dcp.byteio.transfer`. When each wins, and
the measured prices: docs/resharding.md ("Exact reads") and docs/storage-speed.md ("The prices of
exact and span reads").
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .boxes import _contiguous_from, row_major_strides, runs, slabs
from .sharding import Box

__all__ = [
    "ReadCosts",
    "ReadCost",
    "read_cost",
    "prefer_span",
    "span_of",
    "span_slabs",
    "region_starts",
    "ACCESS_MODES",
    "SEQUENTIAL",
    "EXACT",
    "READ_AHEAD_BYTES",
    "file_access",
    "merge_ranges",
    "expand",
]

SEQUENTIAL = "sequential"
"""A file read as a stream: the kernel's read-ahead, large in-order requests, one stretch per
thread."""
EXACT = "exact"
"""A file read in exact announced requests (``POSIX_FADV_RANDOM``, ``WILLNEED`` a window ahead):
no page that holds no needed byte."""
ACCESS_MODES = ("auto", SEQUENTIAL, EXACT)
"""What a reader's ``access`` accepts: ``"auto"`` chooses per file with :func:`file_access`."""
READ_AHEAD_BYTES = 8 << 20
"""The read-ahead window :func:`file_access` assumes: how far past a run's end the kernel may read
(the development VM's ``read_ahead_kb``; 128 KiB elsewhere is common, so this errs towards
exact)."""


@dataclass(frozen=True)
class ReadCosts:
    """Prices (seconds) of the parts of a read, for comparing ways to read one region; fitted on
    the development VM with a cold page cache (measured: docs/storage-speed.md, "The prices of
    exact and span reads")."""

    call: float = 12e-6
    """One read call: a system call, its read-ahead hint, a lone page's device latency."""
    run: float = 1e-6
    """Bookkeeping of one run read exactly (segment, iovec, plan)."""
    page: float = 1.5e-6
    """One 4 KiB page pulled from storage."""
    copy_byte: float = 1e-9
    """One byte of span: staging memory touched, the strided copy out of it."""


@dataclass(frozen=True)
class ReadCost:
    """What one way of reading a region costs: ``calls`` read calls, ``pages`` pages pulled,
    ``seconds`` in all."""

    calls: int
    pages: int
    seconds: float


def region_starts(
    chunk_sizes: Sequence[int], region: Box, itemsize: int, dst_strides: Sequence[int] | None = None
) -> tuple[np.ndarray, int]:
    """Byte offsets in the chunk of the runs of ``region`` (row-major order, hence ascending) and
    their length, read into a destination of ``dst_strides`` (default: contiguous)."""
    strides = row_major_strides(region.sizes) if dst_strides is None else dst_strides
    grid = runs(chunk_sizes, region, strides, 0)
    return grid.src * itemsize, grid.count * itemsize


def span_of(
    chunk_sizes: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], itemsize: int
) -> tuple[int, int]:
    """``[first, end)``: the bytes of the chunk from the first to the last byte of the box
    (non-empty)."""
    strides = row_major_strides(chunk_sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = first + sum((n - 1) * s for n, s in zip(sizes, strides))
    return first * itemsize, (last + 1) * itemsize


def _pages(starts: np.ndarray, length: int, page: int) -> int:
    """Distinct pages that ``[s, s + length)`` for ascending ``starts`` (non-empty) touch."""
    first = starts // page
    last = (starts + length - 1) // page
    total = int((last - first + 1).sum())
    # A run starting in the page the previous one ended in shares that page.
    return total - int(np.count_nonzero(first[1:] == last[:-1]))


def read_cost(
    starts: np.ndarray,
    length: int,
    *,
    base: int = 0,
    gap_bytes: int = 4095,
    page: int = 4096,
    request_bytes: int = 16 << 20,
    iov_max: int = 1024,
    costs: ReadCosts = ReadCosts(),
    mapped: bool = False,
) -> tuple[ReadCost, ReadCost]:
    """``(exact, span)``: the cost of reading runs of ``length`` bytes at ascending chunk offsets
    ``starts`` of a chunk that begins at file offset ``base``, run by run or as one covering
    span.

    ``mapped``: the span is copied out of the file mapped into memory: its pages are asked for
    all the same, but only the needed bytes are copied (no staging copy of the span)."""
    n = len(starts)
    if not n or length <= 0:
        zero = ReadCost(0, 0, 0.0)
        return zero, zero
    s = starts + base
    gaps = s[1:] - (s[:-1] + length)
    # Runs closer than gap_bytes share a call, up to iov_max buffers (a gap takes one too).
    calls = 1 + int(np.count_nonzero(gaps > gap_bytes))
    calls = max(calls, -(-(2 * n) // iov_max))
    pages = _pages(s, length, page)
    exact = ReadCost(calls, pages, calls * costs.call + n * costs.run + pages * costs.page)
    first, end = int(s[0]), int(s[-1]) + length
    span_bytes = end - first
    span_pages = (end - 1) // page - first // page + 1
    span_calls = -(-span_bytes // request_bytes)
    if mapped:
        span_bytes = n * length
    span = ReadCost(
        span_calls,
        span_pages,
        span_calls * costs.call + span_pages * costs.page + span_bytes * costs.copy_byte,
    )
    return exact, span


def prefer_span(
    chunk_sizes: Sequence[int],
    region: Box,
    itemsize: int,
    *,
    base: int = 0,
    gap_bytes: int = 4095,
    page: int = 4096,
    costs: ReadCosts = ReadCosts(),
    min_runs: int = 8,
    dst_strides: Sequence[int] | None = None,
    mapped: bool = False,
) -> bool:
    """Whether ``region`` of a chunk at file offset ``base`` is cheaper to read as spans than run by
    run into a destination of ``dst_strides`` (default: contiguous; a run must be contiguous in
    both). ``mapped``: spans are copied out of the file mapped into memory (see
    :func:`read_cost`).

    Regions of fewer than ``min_runs`` runs are always read exactly (the
    per-run cost is noise there, and staging would copy for nothing). With
    ``gap_bytes <= 0`` (a reader asked for exactly the needed bytes) a span
    that would read any byte between the runs is never chosen.
    """
    if region.numel == 0:
        return False
    # The run count decides first, before any array is built: whole-row regions are one or a few
    # runs.
    j = _contiguous_from(region.sizes, row_major_strides(chunk_sizes))
    if dst_strides is not None:
        j = max(j, _contiguous_from(region.sizes, dst_strides))
    if math.prod(region.sizes[:j]) < min_runs:
        return False
    # As many runs as counted above: region_starts splits at the same dimension j.
    starts, length = region_starts(chunk_sizes, region, itemsize, dst_strides)
    if gap_bytes <= 0 and int(starts.max()) + length - int(starts.min()) > len(starts) * length:
        return False  # gap_bytes=0 asks for exactly the needed bytes: no span that reads a gap
    exact, span = read_cost(
        starts, length, base=base, gap_bytes=gap_bytes, page=page, costs=costs, mapped=mapped
    )
    return span.seconds < exact.seconds


def span_slabs(
    chunk_sizes: Sequence[int], region: Box, itemsize: int, budget: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split ``region`` into sub-boxes (``(offsets, sizes)`` relative to it) whose span in the chunk
    is at most ``budget`` bytes, or a single element where even that is more: the slabs of
    :func:`~ucp_dcp.core.boxes.slabs` with the chunk's strides. An empty region has none."""
    if region.numel == 0:
        return iter(())
    strides = [s * itemsize for s in row_major_strides(chunk_sizes)]
    return slabs(region.sizes, itemsize, budget, strides)


def file_access(
    starts: Sequence[int] | np.ndarray,
    lengths: Sequence[int] | np.ndarray,
    file_size: int,
    *,
    window: int = READ_AHEAD_BYTES,
    max_waste: float = 0.25,
    page: int = 4096,
    shared: tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray] | None = None,
) -> str:
    """How a rank should read one file, given every byte range ``[start, start + length)`` it
    plans to read there: :data:`SEQUENTIAL` or :data:`EXACT` (docs/resharding.md, "Streamed or
    exact, per file").

    The ranges are merged into runs, read in ascending order. Read as a stream, the kernel may read
    ahead past each run's end by up to ``window`` bytes, but never past the next run's start (those
    bytes are needed anyway) or the file's end: that overshoot, counted in whole pages of ``page``
    bytes (the rest of a page that holds a needed byte is read either way), is the waste of reading
    the file sequentially. Sequential wins when the waste is at most ``max_waste`` of the bytes
    needed. No ranges at all: exact (nothing to stream).

    ``shared``: ranges ``(starts, lengths)`` of the file that other ranks on this machine read
    too. Read-ahead into their pages is no waste (the page cache the ranks share reads each page
    once), where :func:`may_share` says so.
    """
    s, e = _nonempty(starts, lengths)
    if not s.size:
        return EXACT
    run_starts, run_ends = merge_ranges(s, e)
    needed = int((run_ends - run_starts).sum())
    # The pages of each run, and the whole pages from its last to the next run's first (or to
    # the file's end): what read-ahead can pull in that no needed byte is on.
    first_pages = run_starts // page * page
    past_pages = -(-run_ends // page) * page
    end = -(-max(int(file_size), int(run_ends[-1])) // page) * page
    following = np.r_[first_pages[1:], end]
    pulled_to = np.minimum(following, past_pages + window)
    waste = int(np.maximum(pulled_to - past_pages, 0).sum())
    if shared is not None and waste and may_share(needed, window):
        waste -= _covered(past_pages, pulled_to, shared, page)
    return SEQUENTIAL if waste <= max_waste * needed else EXACT


def may_share(needed: int, window: int = READ_AHEAD_BYTES) -> bool:
    """Whether other ranks' pages count for a file this rank needs ``needed`` bytes of
    (:func:`file_access`'s ``shared``): only where it reads at least a read-ahead ``window`` of
    it. For a few small reads a stream gains nothing, and its read-ahead would pull the other
    ranks' pages in early, in the way of their own streams (a same-layout restart's reads of the
    others' step counters)."""
    return needed >= window


def _nonempty(
    starts: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The ranges ``[start, start + length)`` that are not empty, as int64 starts and ends."""
    s = np.asarray(starts, dtype=np.int64).reshape(-1)
    n = np.asarray(lengths, dtype=np.int64).reshape(-1)
    keep = n > 0
    return s[keep], s[keep] + n[keep]


def merge_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of ``[starts[i], ends[i])`` as sorted, disjoint int64 ranges (overlapping and
    touching ones merge)."""
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def expand(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row ``i`` the integers ``lo[i]..hi[i]-1``: (row of each, the integer)."""
    count = np.maximum(hi - lo, 0)
    row = np.repeat(np.arange(len(lo), dtype=np.int64), count)
    first = np.cumsum(count) - count
    return row, lo[row] + np.arange(len(row), dtype=np.int64) - first[row]


def _covered(
    lo: np.ndarray,
    hi: np.ndarray,
    ranges: tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray],
    page: int,
) -> int:
    """Bytes of the intervals ``[lo, hi)`` (disjoint) that lie on pages of ``ranges``."""
    s, e = _nonempty(*ranges)
    if not s.size:
        return 0
    a, b = merge_ranges(s // page * page, -(-e // page) * page)
    before = np.r_[0, np.cumsum(b - a)]  # bytes of the runs before each run

    def below(x: np.ndarray) -> np.ndarray:
        """Bytes of the runs under each ``x``."""
        last = np.searchsorted(a, x, side="right") - 1  # the last run starting at or before x
        at = np.maximum(last, 0)
        return np.where(last >= 0, before[at] + np.clip(x - a[at], 0, b[at] - a[at]), 0)

    return int(np.maximum(below(hi) - below(lo), 0).sum())
