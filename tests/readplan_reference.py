"""The per-rank read plan's accessors and round schedule: a reference the tests (and
``benchmarks/bench_readplan.py``'s ``rank`` plans) check the live compact plan against.

A load plans in compact form (:func:`~ucp_dcp.dcp.read_once.rounds.plan_group_reads`, cut into
each rank's rounds by :func:`~ucp_dcp.dcp.read_once.rank_shares`); nothing here runs in one. What
is here spells the per-rank plan (:class:`~ucp_dcp.dcp.read_once.plan.JobReadPlan`) out row by
row: who sends what to whom, and every round's transfers materialised (O(ranks x rows) where one
reader sends to many ranks), so that the tests can compare the two byte by byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ucp_dcp.byteio.rangeio import Extents
from ucp_dcp.dcp.read_once.plan import JobReadPlan, Transfers
from ucp_dcp.dcp.read_once.ranges import expand, stable_order
from ucp_dcp.dcp.read_once.rounds import (
    GroupReadPlan,
    GroupTransfers,
    NeedGroups,
    fit_windows,
    needs_digest,
    stream_positions,
)

_I64 = np.int64


# ---------------------------------------------------------------- who sends what to whom


def sends(plan: JobReadPlan | GroupReadPlan, rank: int) -> Transfers | GroupTransfers:
    """The rows ``rank`` reads and sends: by (receiver, file, start) in a per-rank plan, by
    (group, at) in a compact one."""
    plan._check_rank(rank)
    lo, hi = int(plan.send_offsets[rank]), int(plan.send_offsets[rank + 1])
    return plan.transfers.take(slice(lo, hi))


def receives(plan: JobReadPlan | GroupReadPlan, rank: int) -> Transfers | GroupTransfers:
    """The rows ``rank`` receives: in a per-rank plan those other ranks read for it, by (file,
    start); in a compact one those to its group (its own reads included), by (reader, at)."""
    plan._check_rank(rank)
    key = int(plan.groups.group_of[rank]) if isinstance(plan, GroupReadPlan) else rank
    lo, hi = int(plan.recv_offsets[key]), int(plan.recv_offsets[key + 1])
    return plan.transfers.take(plan.recv_index[lo:hi])


def bytes_received_per_rank(plan: JobReadPlan) -> np.ndarray:
    """Bytes each rank receives from the per-rank plan's transfers, indexed by rank."""
    t = plan.transfers
    return np.bincount(t.receiver, weights=t.length, minlength=plan.world_size).astype(_I64)


def per_rank(plan: GroupReadPlan) -> Transfers:
    """Every row of a compact plan expanded to one per receiving rank, by (reader, receiver,
    file, start): O(ranks x rows)."""
    t = plan.transfers
    members = np.argsort(plan.groups.group_of, kind="stable").astype(_I64)
    ptr = np.concatenate([[0], np.cumsum(plan.groups.sizes)]).astype(_I64)
    row, pos = expand(ptr[t.group], ptr[t.group + 1])
    receiver = members[pos]
    order = np.lexsort((t.start[row], t.file[row], receiver, t.reader[row]))
    row, receiver = row[order], receiver[order]
    return Transfers(t.reader[row], receiver, t.file[row], t.start[row], t.length[row])


def need_groups(needs: Sequence[Extents]) -> NeedGroups:
    """The groups of per-rank ``needs`` (rank ``r``'s at ``needs[r]``), found by digest, as the
    coordinator finds them from the gathered digests."""
    digests = [needs_digest(e) for e in needs]
    first: dict[bytes, int] = {}
    for r, d in enumerate(digests):
        first.setdefault(d, r)
    return NeedGroups.from_digests(digests, {r: needs[r] for r in first.values()})


def members(groups: NeedGroups, group: int) -> np.ndarray:
    """The ranks of ``group``, ascending."""
    return np.flatnonzero(groups.group_of == group).astype(_I64)


# ---------------------------------------------------------------- rounds


def exchange_windows(plan: JobReadPlan, budget_bytes: int) -> np.ndarray:
    """Per rank, the bytes of its read stream (see
    :func:`~ucp_dcp.dcp.read_once.rounds.stream_positions`) it reads in each round of
    :func:`schedule_rounds`: rank ``q`` reads stream bytes ``[k * w[q], (k + 1) * w[q])`` in
    round ``k`` and sends them in that round (the per-rank form of
    :meth:`~ucp_dcp.dcp.read_once.rounds.GroupReadPlan.windows`: every receiver a single rank).
    Raises ``InvalidArgumentError`` when ``budget_bytes`` is under the peers a rank exchanges
    with."""
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


def schedule_rounds(plan: JobReadPlan, budget_bytes: int) -> list[Transfers]:
    """The plan's transfers in rounds: in round ``k`` each rank reads window ``k`` of its read
    stream (:func:`exchange_windows`) and sends what others need of it, so a byte read is sent
    in the round it is read, to all its receivers. Rows are split at window edges; every
    transferred byte is in exactly one round; round ``k`` of the list is window ``k`` (empty
    where no rank sends, up to the last round with a transfer). Rows in a round by (reader,
    receiver, file, start).

    Size: a row gets a piece per window it spans, so where one reader sends the same bytes to
    many ranks (full replication) the rounds hold about (pairs x rounds) rows: W^2 S / budget
    for S bytes on W ranks (why a load cuts its own rounds from windows instead).
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
