"""Read-once loads, the moving half: rounds of reads and one ``all_to_all_single`` each.

:mod:`ucp_dcp.dcp.read_once` plans who reads which byte of the job's needs;
this module runs one rank's share, with :mod:`~ucp_dcp.dcp._landing`
(where received bytes go) and :mod:`~ucp_dcp.dcp._piece_check` (their
checks). A rank's share comes as one :class:`RankRounds`, the same number
of rounds on every rank: in each round
the rank reads the pieces it sends (to itself too; each byte once however
many peers get it), one ``all_to_all_single`` on the load's process group
moves them, and every received piece is checked block by block against the
chunk's block checksums before its bytes are copied into the destination
tensors. Nothing is committed (no ``done`` callback runs) until every round
succeeded on every rank.

Every message opens with a status word, so a rank whose read or check failed
tells every other rank in the next round (or in the closing gather): all
ranks stop after the same round and raise the same error, and none is left
waiting in a collective.

Messages are host memory on a group with a CPU backend (gloo, or
``"cpu:gloo,cuda:nccl"``) and device memory on a group that is NCCL alone
(copied there and back: the checks and copies into place run on the host).
A round's messages travel while the previous round's are checked and put
in place, and the next round's are read: at most two rounds are in flight,
each in a send and a receive buffer of at most the round's budget, so a
load of any size streams through about five budgets of memory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..byteio.blockverify import BlockVerifier
from ..byteio.rangeio import ByteSource, Segment
from ..core.ranges import merge_ranges
from ..errors import ReadOnceError
from ._landing import LocalNeeds
from ._piece_check import PieceChecker

__all__ = [
    "STATUS_BYTES",
    "ExchangeRound",
    "ExchangeTotals",
    "RankRounds",
    "run_exchange",
    "wire_device",
]

STATUS_BYTES = 8
"""Bytes of the status word that opens every message (int64: 0 ok, 1 failed)."""


@dataclass(frozen=True)
class ExchangeRound:
    """One rank's part of one round: per peer (by group rank, this rank included), the pieces of
    the checkpoint's files it sends there and receives from there, as ``(k, 3)`` int64 arrays of
    ``(file, start, length)`` in the order they travel."""

    sends: tuple[np.ndarray, ...]
    recvs: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class RankRounds:
    """One rank's share of an exchange of ``count`` rounds, described by windows rather than
    listed round by round (its size is this rank's transfers, whatever the number of rounds).

    ``sends``: ``(n, 5)`` int64 array of ``(group, file, start, length, at)``, the transfers
    this rank reads and sends to every rank of a group (its own group too: then itself among
    them; ``group_of[r]`` is rank ``r``'s group, :class:`~ucp_dcp.core.group_plan.NeedGroups`);
    ``recvs``: ``(n, 5)`` of ``(reader, file, start, length, at)``, those it receives (its own
    reads for itself included). ``at`` is where the transfer starts in its reader's *stream*
    (the reader's reads laid end to end); ``windows[q]``: the bytes of its stream reader ``q``
    handles per round. Round ``k`` holds, of every transfer, the part in window ``k`` of its
    reader's stream: both ends of a message cut the same rows the same way.
    """

    count: int
    sends: np.ndarray
    recvs: np.ndarray
    windows: np.ndarray
    group_of: np.ndarray

    def round(self, k: int, me: int, world: int) -> ExchangeRound:
        """Round ``k``: per peer, the pieces this rank sends there and receives from there (the
        ranks of one group share one array of pieces)."""
        groups = int(self.group_of.max()) + 1 if len(self.group_of) else 0
        by_group = _window(self.sends, self.windows[me], k, groups)
        return ExchangeRound(
            tuple(by_group[g] for g in self.group_of.tolist()),
            _window(self.recvs, self.windows[self.recvs[:, 0]], k, world),
        )


def _window(
    rows: np.ndarray, w: np.ndarray | np.integer, k: int, world: int
) -> tuple[np.ndarray, ...]:
    """The parts of ``rows`` in window ``k`` of their readers' streams (``w`` bytes a window),
    per peer (``world`` of them: ranks, or groups of ranks), each as ``(file, start, length)``
    rows by (file, start)."""
    peer, file, start, length, at = rows.T
    lo, hi = k * w, (k + 1) * w
    a, b = np.maximum(at, lo), np.minimum(at + length, hi)
    keep = a < b
    peer, file = peer[keep], file[keep]
    start = (start + a - at)[keep]
    length = (b - a)[keep]
    order = np.lexsort((start, file, peer))
    part = np.stack([file, start, length], axis=1)[order]
    cuts = np.searchsorted(peer[order], np.arange(world + 1)).tolist()
    return tuple(part[cuts[p] : cuts[p + 1]] for p in range(world))


@dataclass
class ExchangeTotals:
    """What :func:`run_exchange` did on this rank: ``rounds``; bytes ``read`` from storage,
    ``sent`` and ``received`` over the group (its own pieces left out), ``copied`` into
    destinations; ``checked``: bytes hashed; ``seconds`` in all."""

    rounds: int = 0
    read: int = 0
    sent: int = 0
    received: int = 0
    copied: int = 0
    checked: int = 0
    seconds: float = 0.0


@dataclass
class _InFlight:
    """A round whose ``all_to_all_single`` may still be running: its work, buffers and pieces."""

    work: dist.Work
    send: torch.Tensor  # kept alive until the collective is done with it
    recv: torch.Tensor
    rnd: ExchangeRound
    recv_sizes: list[int]

    def finish(
        self,
        me: int,
        needs: LocalNeeds,
        checker: PieceChecker,
        totals: ExchangeTotals,
        error: BaseException | None,
    ) -> tuple[bool, BaseException | None]:
        """Wait for the round, then check and place what it brought (unless this rank already
        failed); whether any rank said it failed, and this rank's error so far."""
        self.work.wait()
        data = self.recv.cpu().numpy()  # no copy for a CPU group
        peer_failed, at = False, 0
        for p, (pieces, size) in enumerate(zip(self.rnd.recvs, self.recv_sizes)):
            if data[at : at + STATUS_BYTES].any():
                peer_failed = True
            elif error is None:
                try:
                    _unpack(pieces, data[at + STATUS_BYTES : at + size], p, needs, checker, totals)
                except Exception as e:  # noqa: BLE001  (raised after the closing gather)
                    error = e
            if p != me:
                totals.received += size - STATUS_BYTES
            at += size
        return peer_failed, error


def run_exchange(
    rounds: RankRounds,
    needs: LocalNeeds,
    source: ByteSource,
    paths: Sequence[str],
    ranks: Sequence[int | None],
    group: dist.ProcessGroup | None,
) -> ExchangeTotals:
    """Run this rank's ``rounds`` and then its regions' ``done`` callbacks.

    Collective: every rank of ``group`` calls it with its own rounds, the
    same number on every rank. Raises the first error any rank met, on
    every rank (this rank's own where it has one).
    """
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    wire = wire_device(group)
    verifier = BlockVerifier(paths, ranks)
    checker = PieceChecker(needs, verifier)
    totals = ExchangeTotals()
    t0 = time.perf_counter()
    # Any exception, not just the library's, is kept and raised after the closing gather: a rank
    # leaving the rounds early would leave the others waiting in the next collective.
    error: BaseException | None = None
    flight: _InFlight | None = None
    for k in range(rounds.count):
        rnd = rounds.round(k, me, world)
        # Round k's messages go out while round k-1's are placed: reading, sending and checking
        # overlap (the collective runs on the group's own thread).
        send_sizes, recv_sizes = _sizes(rnd.sends), _sizes(rnd.recvs)
        send = torch.zeros(sum(send_sizes), dtype=torch.uint8)
        if error is None:
            try:
                _pack(rnd, source, send.numpy(), send_sizes, me, totals)
            except Exception as e:  # noqa: BLE001
                error = e
        if error is not None:  # tell every rank, in messages of the agreed sizes
            for at in np.cumsum([0, *send_sizes[:-1]]).tolist():
                send[at : at + STATUS_BYTES] = 1  # messages need not start 8-byte aligned
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=wire)
        if wire.type != "cpu":  # an NCCL group moves device memory only
            send = send.pin_memory().to(wire, non_blocking=True)
        work = dist.all_to_all_single(
            recv, send, recv_sizes, send_sizes, group=group, async_op=True
        )
        totals.rounds += 1
        stop = False
        if flight is not None:
            # Every rank launched round k before any looks at round k-1's statuses, and all see
            # the same ones: all stop after the same round, with round k still to be waited for.
            stop, error = flight.finish(me, needs, checker, totals, error)
        flight = _InFlight(work, send, recv, rnd, recv_sizes)
        if stop:
            break
    if flight is not None:
        _, error = flight.finish(me, needs, checker, totals, error)
    totals.seconds = time.perf_counter() - t0
    totals.checked = verifier.bytes
    if error is None and checker.pending:
        file, start = next(iter(checker.pending))
        error = ReadOnceError(
            f"{paths[file]}: the checksum block at byte {start} was only partly received: the "
            "read-once plan left part of a block this rank needs unsent"
        )
    errors: list[BaseException | None] = [None] * world
    dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    if first is not None:
        raise first
    for r in needs.regions:
        if r.done is not None:
            r.done()
    return totals


def wire_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the messages must be for ``group``'s collectives: the current CUDA device for a
    group that is NCCL alone, else host memory (gloo, or a group with a CPU backend too)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sizes(pieces: Sequence[np.ndarray]) -> list[int]:
    """Bytes of the message to or from each peer: the status word and the pieces."""
    return [STATUS_BYTES + (int(p[:, 2].sum()) if len(p) else 0) for p in pieces]


def _pack(
    rnd: ExchangeRound,
    source: ByteSource,
    out: np.ndarray,
    sizes: Sequence[int],
    me: int,
    totals: ExchangeTotals,
) -> None:
    """Read what this rank sends this round (each byte once, however many peers get it) and lay
    it out in ``out``, one message per peer, each opening with a zero status word."""
    held: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    # The ranks of a group share one array of pieces: read them once.
    sent = list({id(p): p for p in rnd.sends if len(p)}.values())
    if sent:
        every = np.concatenate(sent)
        segs: list[Segment] = []
        for f in np.unique(every[:, 0]).tolist():
            sel = every[:, 0] == f
            a, b = merge_ranges(every[sel, 1], every[sel, 1] + every[sel, 2])
            offs = np.concatenate([[0], np.cumsum(b - a)])
            buf = np.empty(int(offs[-1]), dtype=np.uint8)
            segs += [
                Segment(f, s, buf[o : o + e - s].data)
                for s, e, o in zip(a.tolist(), b.tolist(), offs[:-1].tolist())
            ]
            held[f] = (a, offs, buf)
            totals.read += int(offs[-1])
        source.read(segs)
    at = 0
    for p, (pieces, size) in enumerate(zip(rnd.sends, sizes)):
        w = at + STATUS_BYTES
        for f, s, n in pieces.tolist():
            a, offs, buf = held[f]
            i = int(np.searchsorted(a, s, "right")) - 1
            o = int(offs[i]) + s - int(a[i])
            out[w : w + n] = buf[o : o + n]
            w += n
        if p != me:
            totals.sent += size - STATUS_BYTES
        at += size


def _unpack(
    pieces: np.ndarray,
    data: np.ndarray,
    sender: int,
    needs: LocalNeeds,
    checker: PieceChecker,
    totals: ExchangeTotals,
) -> None:
    """Check and place the pieces of one received message."""
    at = 0
    for f, s, n in pieces.tolist():
        for start, mem in checker.verified(f, s, data[at : at + n], sender):
            totals.copied += needs.copy_in(f, start, mem)
        at += n
