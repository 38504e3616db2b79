"""The job's read plan in compact form, ranks with identical needs planned as one group, and
its rounds.

Ranks whose needs are identical form a *group* (:class:`NeedGroups`), and one row of the plan
(:class:`GroupReadPlan`, :func:`plan_group_reads`) says "reader ``q`` sends these bytes to every
rank of group ``g``": O(distinct needs + ranks) rows, where the per-rank plan of
:mod:`~ucp_dcp.dcp.read_once.plan` has O(ranks x ranges). :meth:`GroupReadPlan.windows` cuts
the rows into rounds within a budget, each byte read once. The steps, and the plan's size at
4096 ranks: docs/read-once.md, "The compact plan".
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...byteio.rangeio import Extents
from ...errors import InvalidArgumentError
from .plan import (
    DEFAULT_ALIGN,
    DEFAULT_MIN_RUN,
    Columns,
    JobReadPlan,
    ReadsByRank,
    plan_job_reads,
)
from .ranges import at_least, expand, offsets

__all__ = [
    "GroupReadPlan",
    "GroupTransfers",
    "NeedGroups",
    "fit_windows",
    "needs_digest",
    "plan_group_reads",
    "stream_positions",
]

_I64 = np.int64


def stream_positions(plan: JobReadPlan) -> np.ndarray:
    """Where each row of ``plan.transfers`` starts in its reader's *read stream*: the rank's
    reads (``plan.reads``, by file then start) laid end to end."""
    t = plan.transfers
    u0 = np.zeros(len(t), _I64)
    if not len(t):
        return u0
    read_pos = np.cumsum(plan.read_length) - plan.read_length  # over all ranks
    files = np.unique(plan.read_file)
    # One sortable key per (file, start) within a rank; else one search per (rank, file).
    wide = int((plan.read_start + plan.read_length).max()) + 1 if len(plan.read_start) else 1
    dense = len(files) < (1 << 62) // wide
    for q in np.unique(t.reader).tolist():
        rs = slice(int(plan.read_offsets[q]), int(plan.read_offsets[q + 1]))
        ts = slice(int(plan.send_offsets[q]), int(plan.send_offsets[q + 1]))
        r_file, r_start, t_file, t_start = (
            plan.read_file[rs],
            plan.read_start[rs],
            t.file[ts],
            t.start[ts],
        )
        if dense:
            r_key = np.searchsorted(files, r_file) * wide + r_start
            i = np.searchsorted(r_key, np.searchsorted(files, t_file) * wide + t_start, "right") - 1
        else:
            i = np.empty(len(t_start), _I64)
            for f in np.unique(t_file).tolist():
                rows, mine = np.flatnonzero(r_file == f), t_file == f
                i[mine] = rows[np.searchsorted(r_start[rows], t_start[mine], "right") - 1]
        base = read_pos[rs] - read_pos[rs.start]
        u0[ts] = base[i] + t_start - r_start[i]
    return u0


def fit_windows(
    reader: np.ndarray,
    receiver: np.ndarray,
    length: np.ndarray,
    at: np.ndarray,
    stream: np.ndarray,
    receiver_size: np.ndarray,
    align: int,
    budget_bytes: int,
) -> np.ndarray:
    """Per reader ``q``, its window ``w[q]``: in round ``k`` it reads bytes ``[k * w[q], (k + 1)
    * w[q])`` of its read stream (its reads laid end to end) and sends them in that round.

    Transfer rows come as columns sorted by (reader, receiver, stream position ``at``):
    ``receiver[i]`` names a set of ``receiver_size[receiver[i]]`` ranks that each get row ``i``
    whole (a group of ranks with identical needs, :func:`plan_group_reads`); ``stream[q]``: the
    bytes reader ``q`` reads. ``w[q]`` is at most ``budget_bytes``, and small enough that no
    receiver gets more than ``budget_bytes // f`` from ``q`` in a window, ``f`` being the most
    of ``q``'s fan-out (the ranks of its receiver sets) and its sets' fan-in (their readers), so
    every rank sends and receives at most ``budget_bytes`` a round; a multiple of ``align``
    where that allows, so a round's reads are whole pages. Raises :class:`InvalidArgumentError`
    when ``budget_bytes`` is under ``f``.
    """
    budget = at_least("budget_bytes", budget_bytes, 1)
    world = len(stream)
    windows = np.full(world, budget, _I64)
    if not len(reader):
        return windows
    nrecv = len(receiver_size)
    pair = reader * nrecv + receiver
    first = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
    p_reader, p_receiver = reader[first], receiver[first]
    fan_in = np.bincount(p_receiver, minlength=nrecv)
    reader_first = np.flatnonzero(np.r_[True, p_reader[1:] != p_reader[:-1]])
    readers = p_reader[reader_first]
    fan = np.maximum(
        np.add.reduceat(receiver_size[p_receiver], reader_first),
        np.maximum.reduceat(fan_in[p_receiver], reader_first),
    )
    share = budget // fan  # the most one receiver may get from the reader in a round
    if int(share.min()) == 0:
        q = int(readers[np.argmin(share)])
        raise InvalidArgumentError(
            f"budget_bytes {budget} is less than the {int(fan.max())} peers rank {q} exchanges "
            f"with in a round: each needs at least one byte of it"
        )

    def floor_align(x: np.ndarray) -> np.ndarray:
        return np.where(x >= align, x // align * align, x)

    # Start from the window the densest receiver allows on average; halve where a window of the
    # grid gives one receiver more than its share; a window of at most the share always fits.
    u0 = at
    stream = stream[readers]
    densest = np.maximum.reduceat(np.add.reduceat(length, first), reader_first)
    least = floor_align(share)
    ratio = np.minimum(stream // np.maximum(densest, 1), budget)  # bounded: no overflow below
    window = np.maximum(least, floor_align(np.minimum(budget, share * ratio)))
    pair_reader_index = np.repeat(np.arange(len(readers)), np.diff(np.r_[reader_first, len(first)]))
    row_reader_index = pair_reader_index[np.cumsum(np.r_[False, pair[1:] != pair[:-1]])]
    while True:
        # Only readers whose window exceeds their share can give a receiver too much; a row of
        # theirs over three windows or more fills one whole window for its receiver: too much.
        # The other rows meet at most two windows, so the check takes O(rows) memory.
        w = window[row_reader_index]
        first_k, last_k = u0 // w, (u0 + length - 1) // w
        risky = window[row_reader_index] > share[row_reader_index]
        over = np.zeros(len(readers), bool)
        over[row_reader_index[risky & (last_k - first_k >= 2)]] = True
        rows = np.flatnonzero(risky & (last_k - first_k < 2))
        row, k = expand(first_k[rows], last_k[rows] + 1)
        row = rows[row]
        got = np.minimum(u0[row] + length[row], (k + 1) * w[row]) - np.maximum(u0[row], k * w[row])
        # Rows come by pair, then stream position: one group per (pair, window).
        group = np.flatnonzero(np.r_[True, (pair[row][1:] != pair[row][:-1]) | (k[1:] != k[:-1])])
        if len(row):
            most = np.zeros(len(readers), _I64)
            np.maximum.at(most, row_reader_index[row[group]], np.add.reduceat(got, group))
            over |= most > share
        over &= window > least
        if not over.any():
            break
        window = np.where(over, np.maximum(least, floor_align(window // 2)), window)
    windows[readers] = window
    return windows


# ---------------------------------------------------------------- the compact plan


def needs_digest(extents: Extents) -> bytes:
    """A 16-byte digest of one rank's needs (files in order, then their starts and lengths as
    int64): ranks with equal digests are taken to need the same bytes (written the same way)."""
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(extents):
        s, n = (np.ascontiguousarray(np.asarray(a), _I64) for a in extents[f])
        h.update(np.array([int(f), len(s)], _I64).tobytes())
        h.update(s.tobytes())
        h.update(n.tobytes())
    return h.digest()


@dataclass(frozen=True, eq=False)
class NeedGroups:
    """Ranks with identical needs, each group's needs once: ``extents[g]`` is what every rank of
    group ``g`` needs; ``group_of[r]`` rank ``r``'s group. Groups are numbered by their lowest
    rank (rank 0 is in group 0)."""

    extents: tuple[Extents, ...]
    group_of: np.ndarray

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return len(self.group_of)

    @property
    def sizes(self) -> np.ndarray:
        """The number of ranks in each group."""
        return np.bincount(self.group_of, minlength=len(self.extents)).astype(_I64)

    @classmethod
    def from_digests(cls, digests: Sequence[bytes], bodies: Mapping[int, Extents]) -> NeedGroups:
        """The groups of ranks by their needs' :func:`needs_digest`, the needs of each group
        taken from ``bodies`` at its lowest rank (the only one that must send them)."""
        number: dict[bytes, int] = {}
        group_of = np.array([number.setdefault(d, len(number)) for d in digests], _I64)
        firsts = np.unique(group_of, return_index=True)[1].tolist()  # each group's lowest rank
        missing = [r for r in firsts if r not in bodies]
        if missing:
            raise InvalidArgumentError(
                f"rank {missing[0]} is the lowest rank of its group but its needs are missing"
            )
        return cls(tuple(bodies[r] for r in firsts), group_of)


@dataclass(frozen=True, eq=False)
class GroupTransfers(Columns):
    """Compact transfers: row ``i`` is bytes ``[start[i], start[i] + length[i])`` of file
    ``file[i]``, read by rank ``reader[i]`` at position ``at[i]`` of its read stream (its reads
    laid end to end), sent to every rank of group ``group[i]`` (the reader too, if it is one).
    Columns are int64 arrays of one length."""

    reader: np.ndarray
    group: np.ndarray
    file: np.ndarray
    start: np.ndarray
    length: np.ndarray
    at: np.ndarray


@dataclass(frozen=True, eq=False)
class GroupReadPlan(ReadsByRank):
    """Who reads which bytes, and which bytes go to every rank of which group (see the module).

    The reads and indices as in :class:`~ucp_dcp.dcp.read_once.plan.ReadsByRank`, receivers
    being the ``groups``; ``transfers`` sorted by (reader, group, at), ``recv_index`` the rows
    by (group, reader, at), ``recv_offsets`` per group.
    """

    groups: NeedGroups
    transfers: GroupTransfers

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.groups.world_size

    @property
    def bytes_received_per_rank(self) -> np.ndarray:
        """Bytes each rank receives from other ranks (its reads for itself left out)."""
        t, group_of = self.transfers, self.groups.group_of
        to_group = np.bincount(t.group, weights=t.length, minlength=len(self.groups.extents))
        own = t.group == group_of[t.reader]
        mine = np.bincount(t.reader[own], weights=t.length[own], minlength=self.world_size)
        return (to_group[group_of] - mine).astype(_I64)

    def windows(self, budget_bytes: int) -> np.ndarray:
        """Per rank, the bytes of its read stream it reads in each round: round ``k`` holds,
        of every row, the part in window ``k`` of its reader's stream. Every rank reads and
        sends, and receives, at most ``budget_bytes`` a round (:func:`fit_windows`)."""
        t = self.transfers
        return fit_windows(
            t.reader,
            t.group,
            t.length,
            t.at,
            self.bytes_read_per_rank,
            self.groups.sizes,
            self.align,
            budget_bytes,
        )

    def round_count(self, windows: np.ndarray) -> int:
        """The number of rounds with ``windows`` (:meth:`windows`)."""
        t = self.transfers
        if not len(t):
            return 0
        return int(((t.at + t.length - 1) // windows[t.reader]).max()) + 1


def plan_group_reads(
    groups: NeedGroups,
    *,
    align: int = DEFAULT_ALIGN,
    min_run: int = DEFAULT_MIN_RUN,
    file_sizes: Mapping[int, int] | None = None,
) -> GroupReadPlan:
    """The compact job-wide read plan of ``groups`` (its steps: docs/read-once.md, "The compact
    plan"); ``align``, ``min_run`` and ``file_sizes`` as in
    :func:`~ucp_dcp.dcp.read_once.plan.plan_job_reads`."""
    ngroups, world = len(groups.extents), groups.world_size
    if len(groups.group_of) and (
        int(groups.group_of.min()) < 0 or int(groups.group_of.max()) >= ngroups
    ):
        raise InvalidArgumentError(
            f"group_of must name groups 0..{ngroups - 1}, got {groups.group_of.tolist()}"
        )
    sizes = groups.sizes
    if ngroups and int(sizes.min()) == 0:
        raise InvalidArgumentError(f"group {int(np.argmin(sizes))} has no ranks")
    base = plan_job_reads(
        list(groups.extents),
        align=align,
        min_run=min_run,
        file_sizes=file_sizes,
        weights=sizes,
        own_reads=True,
    )
    align, min_run = base.align, base.min_run  # as plan_job_reads checked them
    # With its own reads in, a group receives exactly what each of its ranks needs.
    per_group = np.bincount(
        base.transfers.receiver, weights=base.transfers.length, minlength=ngroups
    )
    needed = int((per_group.astype(_I64) * sizes).sum())

    # Each group's stream (its reads end to end), one global line, cut per member (step 2).
    pos = np.cumsum(base.read_length) - base.read_length  # where each read starts on the line
    g0 = np.r_[pos, int(base.read_length.sum())][base.read_offsets]  # each group's origin
    length = np.diff(g0)
    k = np.clip(length // max(min_run, 1), 1, sizes) if min_run else sizes.copy()
    k = np.where(length > 0, k, 1)
    grp, i = expand(np.zeros(ngroups, _I64), k)  # (group, stretch) pairs, stretch i of k
    cut = g0[grp] + (i * length[grp]) // k[grp]
    # Snap each cut down to a page of the read it falls in (a read is whole pages but may end
    # short at a file's end), so every member's stretch is whole reads' pages.
    j = np.clip(np.searchsorted(pos, cut, side="right") - 1, 0, max(len(pos) - 1, 0))
    if len(pos):
        cut = np.where(i > 0, pos[j] + (cut - pos[j]) // align * align, g0[grp])
    cut = np.maximum.accumulate(cut) if len(cut) else cut  # snapped cuts stay in order
    members = np.argsort(groups.group_of, kind="stable").astype(_I64)
    mptr = np.concatenate([[0], np.cumsum(sizes)]).astype(_I64)
    who = members[mptr[grp] + (i * sizes[grp]) // k[grp]]  # stretches spread over the group

    reads = _split_reads(base.read_file, base.read_start, base.read_length, pos, cut, who)
    transfers = _split_transfers(base, pos, g0, cut, who)
    read_rank, read_file, read_start, read_length = reads
    recv_index = np.lexsort((transfers.at, transfers.reader, transfers.group)).astype(_I64)
    return GroupReadPlan(
        align=align,
        read_rank=read_rank,
        read_file=read_file,
        read_start=read_start,
        read_length=read_length,
        read_offsets=offsets(read_rank, world),
        send_offsets=offsets(transfers.reader, world),
        recv_index=recv_index,
        recv_offsets=offsets(transfers.group[recv_index], ngroups),
        needed_bytes=needed,
        unique_bytes=base.unique_bytes,
        groups=groups,
        transfers=transfers,
    )


def _split_reads(
    file: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    pos: np.ndarray,
    cut: np.ndarray,
    who: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The group reads (at line positions ``pos``) cut at the stretches' starts ``cut``, each
    part given to its stretch's rank ``who``: (rank, file, start, length) by rank, file, start."""
    bounds = np.union1d(np.r_[pos, pos + length], cut)
    lo, hi = bounds[:-1], bounds[1:]
    j = np.searchsorted(pos, lo, side="right") - 1
    keep = (hi > lo) & (j >= 0)
    lo, hi, j = lo[keep], hi[keep], j[keep]
    keep = lo < pos[j] + length[j]  # not a gap past a read (there are none, but be exact)
    lo, hi, j = lo[keep], hi[keep], j[keep]
    rank = who[np.searchsorted(cut, lo, side="right") - 1]
    f, s = file[j], start[j] + (lo - pos[j])
    order = np.lexsort((s, f, rank))
    return rank[order], f[order], s[order], (hi - lo)[order]


def _split_transfers(
    base: JobReadPlan, pos: np.ndarray, g0: np.ndarray, cut: np.ndarray, who: np.ndarray
) -> GroupTransfers:
    """The group-level transfers cut where the stretches meet: each part sent by its stretch's
    rank to every rank of the receiving group, ``at`` in that rank's stream."""
    t = base.transfers
    u = g0[t.reader] + stream_positions(base)  # line positions of the rows
    e = u + t.length
    first = np.searchsorted(cut, u, side="right") - 1  # the stretch each row starts in
    last = np.searchsorted(cut, e - 1, side="right") - 1
    row, s = expand(first, last + 1)
    a = np.maximum(u[row], cut[s])
    b = np.minimum(e[row], np.r_[cut[1:], np.iinfo(_I64).max][s])
    keep = b > a
    row, s, a, b = row[keep], s[keep], a[keep], b[keep]
    reader = who[s]
    out = GroupTransfers(
        reader,
        t.receiver[row],
        t.file[row],
        t.start[row] + (a - u[row]),
        b - a,
        a - cut[s],
    )
    return out.take(np.lexsort((out.at, out.group, out.reader)))
