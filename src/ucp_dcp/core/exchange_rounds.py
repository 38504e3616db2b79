"""The exchange rounds of a job-wide read plan: bounded memory, each byte read once.

:func:`schedule_rounds` puts the transfers of a
:class:`~ucp_dcp.core.readplan.JobReadPlan` in rounds for an ``all_to_all``:
in round ``k`` every rank reads window ``k`` of its reads laid end to end
(:func:`stream_positions`, :func:`exchange_windows`) and sends each byte of
it, in that round, to every rank that needs it. A reader holds one window,
and every rank reads, sends and receives at most the budget in a round.
:func:`with_own_reads` first adds each rank's reads for itself to the
transfers (reader == receiver), so that the rounds also hold them: a byte a
rank needs itself and sends to others is read once, in one round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .ranges import at_least, expand, intersect_ranges, merge_ranges, stable_order
from .readplan import JobReadPlan, Transfers

__all__ = [
    "exchange_windows",
    "fit_windows",
    "schedule_rounds",
    "stream_positions",
    "with_own_reads",
]

_I64 = np.int64


def with_own_reads(
    plan: JobReadPlan, needs: Sequence[Mapping[int, tuple[np.ndarray, np.ndarray]]]
) -> JobReadPlan:
    """``plan`` with each rank's reads for itself (its ``plan.reads`` within its ``needs``) added
    to the transfers as rows with reader == receiver, sorted and indexed like the others."""
    cols: list[list[np.ndarray]] = [[], [], [], [], []]
    for r, mine in enumerate(needs):
        reads = plan.reads(r)
        for f, (ns, nl) in sorted(mine.items()):
            if f not in reads:
                continue
            rs, rl = reads[f]
            a, b = intersect_ranges(rs, rs + rl, *merge_ranges(ns, ns + nl))
            k = len(a)
            for c, v in zip(cols, (np.full(k, r), np.full(k, r), np.full(k, f), a, b - a)):
                c.append(np.asarray(v, _I64))
    t = plan.transfers
    own = [np.concatenate(c) if c else np.zeros(0, _I64) for c in cols]
    reader, receiver, file, start, length = (
        np.concatenate([x, y])
        for x, y in zip((t.reader, t.receiver, t.file, t.start, t.length), own)
    )
    order = np.lexsort((start, file, receiver, reader))
    every = Transfers(reader[order], receiver[order], file[order], start[order], length[order])
    world = plan.world_size
    recv_index = np.lexsort((every.start, every.file, every.receiver)).astype(_I64)
    return JobReadPlan(
        world,
        plan.align,
        plan.min_run,
        plan.read_rank,
        plan.read_file,
        plan.read_start,
        plan.read_length,
        plan.read_offsets,
        every,
        np.searchsorted(every.reader, np.arange(world + 1)).astype(_I64),
        recv_index,
        np.searchsorted(every.receiver[recv_index], np.arange(world + 1)).astype(_I64),
        plan.needed_bytes,
        plan.unique_bytes,
    )


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


def exchange_windows(plan: JobReadPlan, budget_bytes: int) -> np.ndarray:
    """Per rank, the bytes of its read stream (see :func:`stream_positions`) it reads in each
    round of :func:`schedule_rounds`: rank ``q`` reads stream bytes ``[k * w[q], (k + 1) *
    w[q])`` in round ``k`` and sends them in that round.

    ``w[q]`` is at most ``budget_bytes``, and small enough that no receiver gets more than
    ``budget_bytes // f`` from ``q`` in a window, ``f`` being the most of ``q``'s receivers'
    readers and of ``q``'s receivers (so every rank sends and receives at most ``budget_bytes``
    a round); a multiple of the plan's ``align`` where that allows, so a round's reads are whole
    pages. Raises :class:`InvalidArgumentError` when ``budget_bytes`` is under ``f``.
    """
    t = plan.transfers
    stream = np.bincount(plan.read_rank, weights=plan.read_length, minlength=plan.world_size)
    return fit_windows(
        t.reader,
        t.receiver,
        t.length,
        stream_positions(plan) if len(t) else np.zeros(0, _I64),
        stream.astype(_I64),
        np.ones(plan.world_size, _I64),
        plan.align,
        budget_bytes,
    )


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
    """The windows of :func:`exchange_windows` for transfer rows given as columns, sorted by
    (reader, receiver, stream position ``at``): ``receiver[i]`` names a set of
    ``receiver_size[receiver[i]]`` ranks that each get row ``i`` whole (a single rank where the
    sizes are ones; a group of ranks with identical needs in
    :mod:`~ucp_dcp.core.group_plan`); ``stream[q]``: the bytes reader ``q`` reads. A reader's
    fan-out counts the ranks of its receiver sets, a set's fan-in its readers."""
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


def schedule_rounds(plan: JobReadPlan, budget_bytes: int) -> list[Transfers]:
    """The plan's transfers in rounds for an all_to_all with bounded memory: in round ``k``
    each rank reads window ``k`` of its read stream (:func:`exchange_windows`) and sends what
    others need of it, so a byte read is sent in the round it is read, to all its receivers.
    In every round a rank reads and sends at most ``budget_bytes`` and receives at most
    ``budget_bytes``; rows are split at window edges; every transferred byte is in exactly one
    round; the same rounds on every rank; round ``k`` of the list is window ``k`` (empty where
    no rank sends, up to the last round with a transfer). Rows in a round by (reader,
    receiver, file, start). Raises :class:`InvalidArgumentError` when ``budget_bytes`` is less
    than the number of peers one rank exchanges with.

    Size: a row gets a piece per window it spans, so where one reader sends the same bytes to
    many ranks (full replication) the rounds hold about (pairs x rounds) rows: W^2 S / budget
    for S bytes on W ranks. :func:`exchange_windows` and :func:`stream_positions` describe the
    same schedule in O(rows), for a rank to cut its own sends and receives round by round.
    """
    windows = exchange_windows(plan, budget_bytes)
    t = plan.transfers
    if not len(t):
        return []
    u0 = stream_positions(plan)
    w = windows[t.reader]
    row, k = expand(u0 // w, (u0 + t.length - 1) // w + 1)
    keyed = stable_order(k)  # pieces come by row, each row's rounds ascending
    row, k = row[keyed], k[keyed]
    lo = np.maximum(u0[row], k * w[row])
    hi = np.minimum(u0[row] + t.length[row], (k + 1) * w[row])
    pieces = Transfers(
        t.reader[row], t.receiver[row], t.file[row], t.start[row] + (lo - u0[row]), hi - lo
    )
    # Round k is window k on every rank, so a round with nothing to send stays in, empty.
    edges = np.searchsorted(k, np.arange(int(k[-1]) + 2))
    return [pieces.take(slice(a, b)) for a, b in zip(edges[:-1].tolist(), edges[1:].tolist())]
