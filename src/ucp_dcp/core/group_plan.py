"""The job-wide read plan in compact form: ranks with identical needs planned as one group.

A fully replicated target (every rank needs every byte, DDP style) gives the per-rank plan of
:mod:`~ucp_dcp.core.readplan` a row for every (needed range, rank) and a transfer for every
(piece, receiver): O(ranks x ranges) rows, 16.8 M transfers for Llama-2-70B on 4096 ranks. Here
the ranks whose needs are identical form a *group* (:class:`NeedGroups`: the whole job for full
replication, the replicas of one shard for HSDP, single ranks elsewhere), each group's needs
are given once, and the plan (:class:`GroupReadPlan`) says "reader ``q`` sends these bytes to
every rank of group ``g``" in one row. Its size is O(distinct needs + ranks), whatever the
number of ranks sharing them.

How (:func:`plan_group_reads`):

1. The groups are planned as if each were one rank (:func:`~ucp_dcp.core.readplan.
   plan_job_reads` over the groups' needs, with each group's reads for itself added,
   :func:`~ucp_dcp.core.exchange_rounds.with_own_reads`): every needed page read by one group
   that needs it; every group receives exactly its needs, from itself or from other groups.
2. Each group's reads, laid end to end (its *stream*), are cut into stretches of equal bytes
   (to a page) for ``k`` of its members, ``k`` the group's size or fewer so that no stretch is
   under ``min_run``: every member reads a contiguous part of the group's stream.
3. Every group-level transfer is cut where the stretches meet: each part is sent by the member
   that reads it to every rank of the receiving group (the reader itself included when that is
   its own group: it reads what it needs once, as with ``with_own_reads``).

So every needed byte has exactly one reader, and every rank receives, from all the rows to its
group, exactly what it needs. Balance: within a group to a page per member; between groups, as
:mod:`~ucp_dcp.core.readplan` balances ranks, that is by bytes per group, not per member (a
group of many ranks sharing bytes with a small group takes half of them, not more).

Rounds: :meth:`GroupReadPlan.windows` cuts the transfers into rounds as
:func:`~ucp_dcp.core.exchange_rounds.exchange_windows` does, a reader's fan-out counting the
ranks of the groups it sends to.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from .exchange_rounds import fit_windows, stream_positions, with_own_reads
from .ranges import at_least, expand
from .readplan import (
    DEFAULT_ALIGN,
    DEFAULT_MIN_RUN,
    Extents,
    JobReadPlan,
    ReadsByRank,
    Transfers,
    plan_job_reads,
)

__all__ = ["GroupReadPlan", "GroupTransfers", "NeedGroups", "needs_digest", "plan_group_reads"]

_I64 = np.int64


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

    def members(self, group: int) -> np.ndarray:
        """The ranks of ``group``, ascending."""
        return np.flatnonzero(self.group_of == group).astype(_I64)

    @classmethod
    def of(cls, needs: Sequence[Extents]) -> NeedGroups:
        """The groups of per-rank ``needs`` (rank ``r``'s at ``needs[r]``), found by digest."""
        digests = [needs_digest(e) for e in needs]
        return cls.from_digests(digests, {r: needs[r] for r in _first_ranks(digests)})

    @classmethod
    def from_digests(cls, digests: Sequence[bytes], bodies: Mapping[int, Extents]) -> NeedGroups:
        """The groups of ranks by their needs' :func:`needs_digest`, the needs of each group
        taken from ``bodies`` at its lowest rank (the only one that must send them)."""
        number: dict[bytes, int] = {}
        group_of = np.array([number.setdefault(d, len(number)) for d in digests], _I64)
        firsts = _first_ranks(digests)
        missing = [r for r in firsts if r not in bodies]
        if missing:
            raise InvalidArgumentError(
                f"rank {missing[0]} is the lowest rank of its group but its needs are missing"
            )
        return cls(tuple(bodies[r] for r in firsts), group_of)


def _first_ranks(digests: Sequence[bytes]) -> list[int]:
    """The lowest rank with each digest, in order of first appearance."""
    seen: dict[bytes, int] = {}
    for r, d in enumerate(digests):
        seen.setdefault(d, r)
    return list(seen.values())


@dataclass(frozen=True, eq=False)
class GroupTransfers:
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

    def __len__(self) -> int:
        return len(self.reader)

    def take(self, index: np.ndarray | slice) -> GroupTransfers:
        """The rows at ``index`` (a slice gives views)."""
        return GroupTransfers(
            self.reader[index],
            self.group[index],
            self.file[index],
            self.start[index],
            self.length[index],
            self.at[index],
        )


@dataclass(frozen=True, eq=False)
class GroupReadPlan(ReadsByRank):
    """Who reads which bytes, and which bytes go to every rank of which group (see the module).

    ``read_*``: every rank's reads, sorted by (rank, file, start), ``read_offsets`` per rank as
    in :class:`~ucp_dcp.core.readplan.JobReadPlan`; ``transfers`` sorted by (reader, group,
    at), ``send_offsets`` per reader; ``recv_index`` the rows by (group, reader, at),
    ``recv_offsets`` per group. ``needed_bytes``: the bytes every rank needs, summed;
    ``unique_bytes``: the bytes at least one rank needs.
    """

    groups: NeedGroups
    align: int
    read_rank: np.ndarray
    read_file: np.ndarray
    read_start: np.ndarray
    read_length: np.ndarray
    read_offsets: np.ndarray
    transfers: GroupTransfers
    send_offsets: np.ndarray
    recv_index: np.ndarray
    recv_offsets: np.ndarray
    needed_bytes: int
    unique_bytes: int

    @property
    def world_size(self) -> int:
        """The number of ranks."""
        return self.groups.world_size

    def sends(self, rank: int) -> GroupTransfers:
        """The rows ``rank`` reads and sends, by (group, at)."""
        lo, hi = self._span(rank)
        return self.transfers.take(slice(int(self.send_offsets[lo]), int(self.send_offsets[hi])))

    def receives(self, rank: int) -> GroupTransfers:
        """The rows ``rank`` receives (those to its group, its own reads included), by (reader,
        at)."""
        self._span(rank)
        g = int(self.groups.group_of[rank])
        lo, hi = int(self.recv_offsets[g]), int(self.recv_offsets[g + 1])
        return self.transfers.take(self.recv_index[lo:hi])

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
        sends, and receives, at most ``budget_bytes`` a round (as
        :func:`~ucp_dcp.core.exchange_rounds.exchange_windows`)."""
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

    def per_rank(self) -> Transfers:
        """Every row expanded to one per receiving rank, by (reader, receiver, file, start):
        O(ranks x rows), for tests and comparisons only."""
        t = self.transfers
        members = np.argsort(self.groups.group_of, kind="stable").astype(_I64)
        ptr = np.concatenate([[0], np.cumsum(self.groups.sizes)]).astype(_I64)
        row, pos = expand(ptr[t.group], ptr[t.group + 1])
        receiver = members[pos]
        order = np.lexsort((t.start[row], t.file[row], receiver, t.reader[row]))
        row, receiver = row[order], receiver[order]
        return Transfers(t.reader[row], receiver, t.file[row], t.start[row], t.length[row])

    def _span(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise InvalidArgumentError(
                f"rank {rank} is not in 0..{self.world_size - 1} of this read plan"
            )
        return rank, rank + 1


def plan_group_reads(
    groups: NeedGroups,
    *,
    align: int = DEFAULT_ALIGN,
    min_run: int = DEFAULT_MIN_RUN,
    file_sizes: Mapping[int, int] | None = None,
) -> GroupReadPlan:
    """The compact job-wide read plan of ``groups`` (see the module); ``align``, ``min_run`` and
    ``file_sizes`` as in :func:`~ucp_dcp.core.readplan.plan_job_reads`."""
    align = at_least("align", align, 1)
    min_run = at_least("min_run", min_run, 0)
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
        list(groups.extents), align=align, min_run=min_run, file_sizes=file_sizes, weights=sizes
    )
    base = with_own_reads(base, list(groups.extents))
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
    read_offsets = np.searchsorted(reads[0], np.arange(world + 1)).astype(_I64)
    send_offsets = np.searchsorted(transfers.reader, np.arange(world + 1)).astype(_I64)
    recv_index = np.lexsort((transfers.at, transfers.reader, transfers.group)).astype(_I64)
    recv_offsets = np.searchsorted(transfers.group[recv_index], np.arange(ngroups + 1)).astype(_I64)
    return GroupReadPlan(
        groups,
        align,
        *reads,
        read_offsets,
        transfers,
        send_offsets,
        recv_index,
        recv_offsets,
        needed,
        base.unique_bytes,
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
