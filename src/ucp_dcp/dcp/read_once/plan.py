"""The job-wide read plan: every needed byte of a checkpoint read from storage by one rank.

Input: every rank's needed byte ranges per file (:data:`~ucp_dcp.byteio.rangeio.Extents`,
``file -> (starts, lengths)``). Output (:class:`JobReadPlan`): what each rank reads from
storage and, for every (reader, receiver) pair, the pieces the reader sends
(:class:`Transfers`). Pure arithmetic on integer arrays, the same on every rank for the same
input (sorts on integer keys only; no hash or dict order decides anything): no file is read and
no process group is used here.

The rules, in terms of *pages* (``align``-byte blocks of a file, offset a multiple of
``align``; a rank *needs a page* when it needs any byte in it):

1. Every page some rank needs is read by exactly one rank, its *reader*, which needs that page
   itself. So no rank reads more than the pages it needs (what it would read on its own).
2. The file is cut into *segments*: maximal runs of pages needed by the same set of ranks.
   A segment needed by one rank is read by it.
3. Segments needed by the same set of ranks (a *class*, e.g. a replica group) are laid end to end
   in file order and cut into one contiguous stretch per member, sized by water-filling:
   members with fewer bytes to read so far take more, up to a common level (classes in
   order of fewer members first, then file order). Each exact cut moves down to the largest
   point at or below it that is an end of its segment ``[a, b)`` or a page boundary at least
   ``min_run`` inside both ends; then, going up each segment, a cut less than ``min_run``
   above the last one kept moves down onto it. So a segment is cut only to balance, and every
   reader's piece of it is either all of it or at least ``min_run`` bytes.
4. A receiver gets exactly the bytes it needs that another rank reads: never alignment
   padding, never a byte it reads itself. The transfers to ``r`` and ``reads(r)`` together
   cover the bytes rank ``r`` needs, without overlap. (With ``own_reads``, what an exchange
   runs, the bytes it reads itself are transfers too, from itself: then the transfers to ``r``
   alone cover its needs.)

Balance. A cut moves down by less than ``min_run + align`` in the first step when its
segment has an allowed page boundary inside, by less than the segment's length (under
``2 * min_run + align``) when it has none, and by less than ``min_run`` more when thinned
(only in the first case). So every member reads less than ``2 * min_run + align`` more than
its water-filling target. When the classes' member sets are disjoint (full replication, HSDP
replica groups, any target where the ranks sharing a page form one group of a partition of
the ranks), a target is at most ``T*`` rounded up, ``T*`` being the optimum (the least
possible maximum read by any rank, among plans whose readers need what they read; it is the
largest, over sets ``S`` of ranks, of the bytes of pages needed only by ranks in ``S``,
over ``|S|``)::

    max bytes read by a rank < T* + 1 + 2 * min_run + align

(A plan that never gives a reader less than ``min_run`` of a shared segment cannot promise
much better: a segment just under ``2 * min_run`` long is read whole by one of its ranks.)

When classes overlap (partial overlaps), the plan keeps rule 1's bound: no rank reads more
than the pages it needs.

Cost: ``O((N + I) log (N + I))`` for ``N`` input ranges and ``I`` (segment, needing rank)
pairs, which is ``O(N)`` for replicated, HSDP and sharded targets, plus the transfers
themselves; one Python step per class of two or more ranks.

This module holds the plan's records, its input and :func:`plan_job_reads`; the segments and
rule 3's :func:`~ucp_dcp.dcp.read_once.ranges.water_fill` are
:mod:`~ucp_dcp.dcp.read_once.ranges`'s, and a load plans groups of ranks with identical needs
as one input (:mod:`~ucp_dcp.dcp.read_once.rounds`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from ...byteio.rangeio import Extents
from ...core.spans import merge_ranges
from ...errors import InvalidArgumentError
from .ranges import (
    Segments,
    at_least,
    expand,
    offsets,
    segments,
    stable_order,
    water_fill,
)

__all__ = [
    "DEFAULT_ALIGN",
    "DEFAULT_MIN_RUN",
    "Columns",
    "JobReadPlan",
    "ReadsByRank",
    "Transfers",
    "plan_job_reads",
]

DEFAULT_ALIGN = 4096
"""Reads start and end on multiples of this within a file: whole pages, whole 4 KiB checksum
blocks of chunks that start on a page."""
DEFAULT_MIN_RUN = 1 << 20
"""A segment shared by several ranks is not cut into pieces shorter than this."""

_I64 = np.int64


# ---------------------------------------------------------------- records

_C = TypeVar("_C", bound="Columns")


class Columns:
    """Rows held as int64 arrays of one length, one array per field of the dataclass: the
    transfers of the per-rank plan (:class:`Transfers`) and of the compact one."""

    if TYPE_CHECKING:  # a dataclass's, for dataclasses.fields
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    def __len__(self) -> int:
        return len(getattr(self, dataclasses.fields(self)[0].name))

    def take(self: _C, index: np.ndarray | slice) -> _C:
        """The rows at ``index`` (a slice gives views)."""
        return type(self)(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


@dataclass(frozen=True, eq=False)
class Transfers(Columns):
    """Pieces of files sent from a reader to a receiver: row ``i`` is bytes ``[start[i],
    start[i] + length[i])`` of file ``file[i]``, read by ``reader[i]``, sent to ``receiver[i]``.
    Columns are int64 arrays of one length."""

    reader: np.ndarray
    receiver: np.ndarray
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray

    @property
    def nbytes(self) -> int:
        """Bytes in all the rows."""
        return int(self.length.sum())


@dataclass(frozen=True, eq=False)
class ReadsByRank:
    """What both forms of a job read plan hold, the per-rank :class:`JobReadPlan` and the
    compact :class:`~ucp_dcp.dcp.read_once.rounds.GroupReadPlan` (each adds its transfers).

    ``read_*``: every rank's reads, sorted by (rank, file, start), merged (no two touch);
    ``read_offsets[r]:read_offsets[r + 1]`` are rank ``r``'s. ``send_offsets``: the rows of
    the transfers per reader; ``recv_index`` lists the rows per receiver in order,
    ``recv_offsets`` per receiver. ``needed_bytes``: the sum over ranks of the bytes each
    needs; ``unique_bytes``: the bytes at least one rank needs. Reads start and end on
    multiples of ``align`` (a file's last page may end at its size).
    """

    align: int
    read_rank: np.ndarray
    read_file: np.ndarray
    read_start: np.ndarray
    read_length: np.ndarray
    read_offsets: np.ndarray
    send_offsets: np.ndarray
    recv_index: np.ndarray
    recv_offsets: np.ndarray
    needed_bytes: int
    unique_bytes: int

    if TYPE_CHECKING:  # a field of JobReadPlan, a property of the group plan

        @property
        def world_size(self) -> int:
            """The number of ranks."""

    @property
    def bytes_read_per_rank(self) -> np.ndarray:
        """Bytes each rank reads from storage (alignment padding included), indexed by rank."""
        return np.bincount(
            self.read_rank, weights=self.read_length, minlength=self.world_size
        ).astype(_I64)

    @property
    def read_bytes(self) -> int:
        """Bytes read from storage by the whole job."""
        return int(self.read_length.sum())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(
                f"rank {rank} is not in 0..{self.world_size - 1} of this read plan"
            )


@dataclass(frozen=True, eq=False)
class JobReadPlan(ReadsByRank):
    """Who reads which bytes of which file, and who sends what to whom (see the module's rules).

    The reads and indices as in :class:`ReadsByRank`; ``transfers`` sorted by (reader,
    receiver, file, start), ``recv_index`` lists them per receiver in (file, start) order.
    ``min_run``: the least piece of a shared segment given to one reader.
    """

    world_size: int
    min_run: int
    transfers: Transfers

    def reads(self, rank: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """What ``rank`` reads from storage, as :data:`Extents` (sorted, non-overlapping)."""
        self._check_rank(rank)
        lo, hi = int(self.read_offsets[rank]), int(self.read_offsets[rank + 1])
        files, starts, lengths = (
            self.read_file[lo:hi],
            self.read_start[lo:hi],
            self.read_length[lo:hi],
        )
        cuts = np.flatnonzero(np.diff(files)) + 1
        return {
            int(f[0]): (s, n)
            for f, s, n in zip(
                np.split(files, cuts), np.split(starts, cuts), np.split(lengths, cuts)
            )
            if len(f)
        }


# ---------------------------------------------------------------- input


@dataclass(frozen=True)
class _Line:
    """Files laid end to end on one integer line (each at a multiple of ``align``, one page
    apart, so no range of one file touches another's): ``files[i]`` starts at ``base[i]``
    and its pages end at ``clip[i]`` (its size where known)."""

    files: np.ndarray
    base: np.ndarray
    clip: np.ndarray

    def to_file(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """File numbers and offsets of line positions."""
        idx = np.searchsorted(self.base, pos, side="right") - 1
        return self.files[idx], pos - self.base[idx]


def _gather(
    needs: Sequence[Extents], file_sizes: Mapping[int, int] | None, align: int
) -> tuple[_Line, np.ndarray, np.ndarray, np.ndarray]:
    """Every non-empty range as (rank, line start, line end), checked, and the line."""
    numbers = sorted({int(f) for extents in needs for f in extents})
    index = {f: i for i, f in enumerate(numbers)}
    top = np.zeros(len(numbers), _I64)  # the end of the last needed byte of each file
    ranks: list[np.ndarray] = []
    fidxs: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for who, extents in enumerate(needs):
        for f in sorted(extents):
            s, n = (np.asarray(a) for a in extents[f])
            if s.shape != n.shape or s.ndim != 1:
                raise InvalidArgumentError(
                    f"rank {who}, file {f}: starts and lengths must be 1-D arrays of one length, "
                    f"got shapes {s.shape} and {n.shape}"
                )
            if not len(s):
                continue
            if not (np.issubdtype(s.dtype, np.integer) and np.issubdtype(n.dtype, np.integer)):
                raise InvalidArgumentError(
                    f"rank {who}, file {f}: starts and lengths must be integer arrays, "
                    f"got {s.dtype} and {n.dtype}"
                )
            if int(f) < 0 or int(s.min()) < 0 or int(n.min()) < 0:
                raise InvalidArgumentError(
                    f"rank {who}, file {f}: file numbers, starts and lengths must be >= 0, got "
                    f"file {f}, least start {int(s.min())}, least length {int(n.min())}"
                )
            s, n = s.astype(_I64), n.astype(_I64)
            keep = n > 0
            s, e = s[keep], s[keep] + n[keep]
            if not len(s):
                continue
            i = index[int(f)]
            top[i] = max(int(top[i]), int(e.max()))
            ranks.append(np.full(len(s), who, _I64))
            fidxs.append(np.full(len(s), i, _I64))
            starts.append(s)
            ends.append(e)
    rank, fidx, start, end = (
        np.concatenate(xs) if xs else np.zeros(0, _I64) for xs in (ranks, fidxs, starts, ends)
    )
    size = -(-top // align) * align
    for i, f in enumerate(numbers):
        if file_sizes is not None and f in file_sizes:
            known = int(file_sizes[f])
            if top[i] > known:
                bad = int(np.flatnonzero((fidx == i) & (end > known))[0])
                raise InvalidArgumentError(
                    f"rank {int(rank[bad])}, file {f}: range [{int(start[bad])}, {int(end[bad])}) "
                    f"ends past the file's size {known}"
                )
            size[i] = known
    # One free page between files, so neither ranges nor pages of two files ever touch.
    stride = -(-size // align) * align + align
    base = np.concatenate([[0], np.cumsum(stride)[:-1]]).astype(_I64)
    line = _Line(np.array(numbers, _I64), base, base + size)
    return line, rank, base[fidx] + start, base[fidx] + end


def _merge(
    rank: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's ranges as sorted, disjoint, non-touching ranges (by rank, then start):
    :func:`~ucp_dcp.core.spans.merge_ranges` of every rank's ranges at once."""
    if not len(rank):
        return rank, start, end
    span = int(end.max()) + 1
    if int(rank.max()) + 1 < (1 << 62) // span:
        # Rank r's ranges moved up by r * span: no two ranks' ranges meet, one merge does all.
        s, e = merge_ranges(rank * span + start, rank * span + end)
        r = s // span
        return r, s - r * span, e - r * span
    order = np.argsort(rank, kind="stable")  # else one merge per rank
    rank, start, end = rank[order], start[order], end[order]
    cuts = np.flatnonzero(np.diff(rank)) + 1
    merged = [merge_ranges(s, e) for s, e in zip(np.split(start, cuts), np.split(end, cuts))]
    ranks = np.repeat(rank[np.r_[0, cuts]], [len(s) for s, _ in merged])
    return ranks, np.concatenate([s for s, _ in merged]), np.concatenate([e for _, e in merged])


# ---------------------------------------------------------------- planning


def plan_job_reads(
    needs: Sequence[Extents],
    *,
    align: int = DEFAULT_ALIGN,
    min_run: int = DEFAULT_MIN_RUN,
    file_sizes: Mapping[int, int] | None = None,
    weights: np.ndarray | None = None,
    own_reads: bool = False,
) -> JobReadPlan:
    """The job-wide read plan for ``needs[r]``, rank ``r``'s needed ranges (see the module).

    Ranges of one rank may overlap or touch. ``align``: reads start and end on multiples of it
    (a file's last page ends at its size where ``file_sizes`` gives it, else on a multiple of
    ``align``: a read there may come back short at the end of the file). ``min_run``: the least
    piece of a shared segment given to one reader. ``weights[r]`` (positive integers, default
    all ones): the ranks input ``r`` stands for (:mod:`~ucp_dcp.dcp.read_once.rounds`),
    shared bytes balanced by bytes per weight. ``own_reads``: each rank's reads for itself (its
    reads within its needs) among the transfers too, as rows with reader == receiver. Raises
    :class:`InvalidArgumentError` for negative numbers, arrays of other shapes or kinds, ranges
    past a known file size.
    """
    align = at_least("align", align, 1)
    min_run = at_least("min_run", min_run, 0)
    world = len(needs)
    line, rank, start, end = _gather(needs, file_sizes, align)
    rank, start, end = _merge(rank, start, end)
    needed = int((end - start).sum())
    ms, me = merge_ranges(start, end)
    unique = int((me - ms).sum())

    fidx = np.searchsorted(line.base, start, side="right") - 1
    page_start = start // align * align
    page_end = np.minimum(-(-end // align) * align, line.clip[fidx])
    segs = segments(*_merge(rank, page_start, page_end))
    if weights is not None:
        weights = np.asarray(weights, _I64)
        if weights.shape != (world,) or (world and int(weights.min()) < 1):
            raise InvalidArgumentError(
                f"weights must be {world} positive integers, one per rank, got {weights.tolist()}"
            )
    piece_reader, piece_start, piece_end = _assign(segs, world, align, min_run, weights)

    read_rank, read_file, read_start, read_length = _reads(
        line, piece_reader, piece_start, piece_end
    )
    transfers, recv_index, recv_offsets = _transfers(
        line, world, rank, start, end, piece_reader, piece_start, piece_end, own_reads
    )
    return JobReadPlan(
        align=align,
        read_rank=read_rank,
        read_file=read_file,
        read_start=read_start,
        read_length=read_length,
        read_offsets=offsets(read_rank, world),
        send_offsets=offsets(transfers.reader, world),
        recv_index=recv_index,
        recv_offsets=recv_offsets,
        needed_bytes=needed,
        unique_bytes=unique,
        world_size=world,
        min_run=min_run,
        transfers=transfers,
    )


def _assign(
    segs: Segments, world: int, align: int, min_run: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces (reader, start, end) covering every segment, sorted by start."""
    size = segs.end - segs.start
    count = np.diff(segs.ptr)
    alone = count == 1
    loads = np.bincount(
        segs.members[segs.ptr[:-1][alone]], weights=size[alone], minlength=world
    ).astype(_I64)

    # Shared classes, fewest members first, then by first segment (class numbers follow it).
    shared = np.flatnonzero(~alone)
    nclass = int(segs.klass.max()) + 1 if len(segs.klass) else 0
    class_count = np.zeros(nclass, _I64)
    class_count[segs.klass] = count
    class_rep = np.unique(segs.klass, return_index=True)[1].astype(_I64)  # first segment of each
    class_bytes = np.bincount(segs.klass, weights=size, minlength=nclass).astype(_I64)
    todo = np.flatnonzero(class_count > 1)
    todo = todo[np.lexsort((todo, class_count[todo]))]

    cuts: list[np.ndarray] = []
    member_lists: list[np.ndarray] = []
    for c in todo.tolist():
        rep = int(class_rep[c])
        members = segs.members[segs.ptr[rep] : segs.ptr[rep + 1]]
        share = water_fill(
            loads[members], int(class_bytes[c]), None if weights is None else weights[members]
        )
        loads[members] += share
        cuts.append(np.cumsum(share)[:-1])
        member_lists.append(members)

    # Lay the shared segments end to end, class by class in ``todo`` order (file order inside).
    rank_of_class = np.empty(nclass, _I64)
    rank_of_class[todo] = np.arange(len(todo))
    seg_order = shared[np.lexsort((shared, rank_of_class[segs.klass[shared]]))]
    s_len = size[seg_order]
    s_pos = np.concatenate([[0], np.cumsum(s_len)]).astype(_I64)  # stream positions
    class_pos = s_pos[np.searchsorted(rank_of_class[segs.klass[seg_order]], np.arange(len(todo)))]

    ncut = np.array([len(c) for c in cuts], _I64)
    cut = (
        np.concatenate(cuts).astype(_I64) + np.repeat(class_pos, ncut)
        if cuts
        else np.zeros(0, _I64)
    )
    cut = _snap(cut, s_pos, segs.start[seg_order], segs.end[seg_order], align, min_run)
    bounds = np.union1d(s_pos, cut)
    lo, hi = bounds[:-1], bounds[1:]
    lo, hi = lo[hi > lo], hi[hi > lo]
    j = np.searchsorted(s_pos, lo, side="right") - 1
    klass = rank_of_class[segs.klass[seg_order[j]]]
    cuts_before = np.concatenate([[0], np.cumsum(ncut)]).astype(_I64)
    member_ptr = np.concatenate([[0], np.cumsum(ncut + 1)]).astype(_I64)
    which = np.searchsorted(cut, lo, side="right") - cuts_before[klass]
    flat_members = np.concatenate(member_lists) if member_lists else np.zeros(0, _I64)
    reader = flat_members[member_ptr[klass] + which]
    offset = segs.start[seg_order[j]] - s_pos[j]

    single = np.flatnonzero(alone)
    reader = np.concatenate([segs.members[segs.ptr[single]], reader])
    start = np.concatenate([segs.start[single], lo + offset])
    end = np.concatenate([segs.end[single], hi + offset])
    order = np.argsort(start, kind="stable")
    return reader[order], start[order], end[order]


def _snap(
    cut: np.ndarray,
    s_pos: np.ndarray,
    seg_start: np.ndarray,
    seg_end: np.ndarray,
    align: int,
    min_run: int,
) -> np.ndarray:
    """Stream positions of the cuts moved down to allowed cuts (rule 3): first each to the
    largest allowed point of its segment ``[a, b)`` at or below it (``a``, ``b``, or a page
    boundary at least ``min_run`` inside both ends), then, going up a segment, a cut less than
    ``min_run`` above the last one kept down onto it. Monotone: sorted cuts stay sorted."""
    if not len(cut):
        return cut
    j = np.minimum(np.searchsorted(s_pos, cut, side="right") - 1, len(seg_start) - 1)
    a, b = seg_start[j], seg_end[j]
    pos = a + (cut - s_pos[j])
    first = -(-(a + min_run) // align) * align
    last = (b - min_run) // align * align
    page = pos // align * align
    pos = np.where(
        pos >= b, b, np.where((first <= last) & (page >= first), np.minimum(page, last), a)
    )
    # Two different interior cuts of one segment closer than min_run: thin them, in order (a
    # Python step per cut, only in the segments that need it).
    gap = np.diff(pos)
    close = (j[1:] == j[:-1]) & (gap > 0) & (gap < min_run) & (pos[1:] < b[1:])
    for seg in np.unique(j[1:][close]).tolist():
        # Cuts are sorted, so a segment's are one slice of them.
        lo, hi = np.searchsorted(j, seg, side="left"), np.searchsorted(j, seg, side="right")
        kept, end = int(seg_start[seg]), int(seg_end[seg])
        for i in range(int(lo), int(hi)):
            v = int(pos[i])
            if v == end or v - kept >= min_run:
                kept = v
            pos[i] = kept
    return s_pos[j] + (pos - a)


def _reads(
    line: _Line, reader: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's pieces merged: (rank, file, start, length)."""
    rank, start, end = _merge(reader, start, end)
    file, offset = line.to_file(start)
    return rank, file, offset, end - start


def _transfers(
    line: _Line,
    world: int,
    rank: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    p_reader: np.ndarray,
    p_start: np.ndarray,
    p_end: np.ndarray,
    own: bool = False,
) -> tuple[Transfers, np.ndarray, np.ndarray]:
    """What each rank needs (merged ``rank, start, end``) of the pieces others read (``own``:
    and of those it reads itself): the transfers, ``recv_index`` and ``recv_offsets`` (see
    :class:`ReadsByRank`)."""
    lo = np.searchsorted(p_end, start, side="right")
    hi = np.searchsorted(p_start, end, side="left")
    row, piece = expand(lo, hi)
    reader = p_reader[piece]
    if not own:
        keep = reader != rank[row]
        row, piece, reader = row[keep], piece[keep], reader[keep]
    receiver = rank[row]
    t_start = np.maximum(start[row], p_start[piece])
    t_end = np.minimum(end[row], p_end[piece])
    # In (receiver, start) order, one reader's adjacent pieces of one needed range touch: merge.
    new = np.ones(len(row), bool)
    new[1:] = (
        (receiver[1:] != receiver[:-1]) | (reader[1:] != reader[:-1]) | (t_start[1:] != t_end[:-1])
    )
    first = np.flatnonzero(new)
    receiver, reader, t_start = receiver[first], reader[first], t_start[first]
    t_end = np.maximum.reduceat(t_end, first) if len(first) else t_end[first]
    recv_offsets = offsets(receiver, world)
    # Rows come by (receiver, start): a stable sort by reader makes that (reader, receiver, start).
    order = stable_order(reader)
    recv_index = np.empty(len(order), _I64)
    recv_index[order] = np.arange(len(order), dtype=_I64)
    file, offset = line.to_file(t_start[order])
    transfers = Transfers(reader[order], receiver[order], file, offset, (t_end - t_start)[order])
    return transfers, recv_index, recv_offsets
