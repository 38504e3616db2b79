"""Read-once loads, one rank's part: moving the bytes, where they land, checking them.

:mod:`ucp_dcp.dcp.read_once` plans who reads which byte of the job's needs; this module runs
one rank's share, one :class:`RankRounds`, the same number of rounds on every rank. In each
round the rank reads the pieces it sends, one ``all_to_all_single`` on the load's group (a
:class:`~ucp_dcp.dcp.read_once.transport.Wire`) moves them, and every received piece is checked
(:class:`PieceChecker`) before its bytes are copied into place (:class:`LocalNeeds`). Every
message opens with a status word (:func:`framed`), so a rank that fails tells the others in the
next round: all stop after the same round, raise the same error, and commit nothing. The
design, its memory bound and its failure rules: docs/read-once.md, "Rounds" to "Failure on every
rank".
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from ...byteio.blocksums import BlockVerifier, ChunkCheck
from ...byteio.engine import Region
from ...byteio.rangeio import ByteSource, storage_view
from ...byteio.segments import Segment
from ...core.boxes import runs
from ...core.spans import merge_ranges
from ...errors import ReadOnceError
from ...format import Location
from .ranges import offsets
from .transport import Wire

__all__ = [
    "STATUS_BYTES",
    "message_sizes",
    "framed",
    "mark_failed",
    "ExchangeRound",
    "ExchangeTotals",
    "first_failure",
    "LocalNeeds",
    "PieceChecker",
    "RankRounds",
    "raise_gathered",
    "run_exchange",
]

STATUS_BYTES = 8
"""Bytes of the status word that opens every message (all zero: ok; any byte set: failed)."""


def message_sizes(payloads: Iterable[int]) -> list[int]:
    """Bytes of each message, given the bytes of its payload: the status word, then the payload."""
    return [STATUS_BYTES + n for n in payloads]


def framed(buf: np.ndarray, sizes: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The messages laid end to end in ``buf`` (``sizes`` bytes each), as views of their status
    word and payload: to fill a send buffer, or to read a received one."""
    at = 0
    for size in sizes:
        yield buf[at : at + STATUS_BYTES], buf[at + STATUS_BYTES : at + size]
        at += size


def mark_failed(buf: np.ndarray, sizes: Sequence[int]) -> None:
    """Set the status word of every message in ``buf``: this rank failed, and the messages keep
    the sizes the receivers expect (they stop at the status)."""
    for status, _ in framed(buf, sizes):
        status[:] = 1  # bytes, not an int64: messages need not start 8-byte aligned


def first_failure(gathered: Sequence[object]) -> ReadOnceError | None:
    """What every rank raises when a rank could not take part in a read-once collective: the
    first rank whose entry of ``gathered`` (one per rank) is the error that kept it; None when
    no entry is an error."""
    for rank, error in enumerate(gathered):
        if isinstance(error, BaseException):
            return ReadOnceError(
                f"rank {rank} could not take part in the read-once load: "
                f"{type(error).__name__}: {error}"
            )
    return None


def raise_gathered(error: BaseException | None, group: dist.ProcessGroup | None) -> None:
    """Collective: every rank's ``error`` (None: none) gathered; this rank's own raised where it
    has one, else the first any rank had, so that no rank carries on alone."""
    errors: list[BaseException | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    if error is not None:
        raise error
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


# ---------------------------------------------------------------- where received bytes land


class _InPlace:
    """A CPU destination of the saved dtype: bytes copied into its storage."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.view = storage_view(dest)
        self.es = dest.element_size()

    def put(self, elem: int, data: np.ndarray) -> None:
        d = elem * self.es
        self.view[d : d + len(data)] = data.data


class _Converted:
    """Any other destination (another dtype, a device): whole elements of the saved dtype copied
    (and cast) into the destination's storage, run by run."""

    def __init__(self, dest: torch.Tensor, saved: torch.dtype) -> None:
        st = dest.untyped_storage()
        flat = torch.empty(0, dtype=dest.dtype, device=dest.device)
        self.flat = flat.set_(st, 0, (st.nbytes() // dest.element_size(),), (1,))
        self.saved = saved

    def put(self, elem: int, data: np.ndarray) -> None:
        src = torch.frombuffer(data, dtype=self.saved)  # no copy; unaligned is fine
        self.flat[elem : elem + len(src)].copy_(src)


@dataclass
class LocalNeeds:
    """The byte ranges of the files this rank's regions need, and where each lands.

    :meth:`needs` rounds each run out to whole checksum blocks of its chunk
    (a received piece is checked before any of it is used) and merges them
    per file: what this rank asks the job for. The destination runs are
    kept sorted by file and start, to find by bisection where a received
    piece goes: into the destination's storage directly (a CPU tensor of the
    saved dtype) or cast and copied run by run (another dtype, a device; such
    regions need block checksums, whose checked blocks are whole elements).
    """

    regions: Sequence[Region]
    file: np.ndarray = field(init=False)
    start: np.ndarray = field(init=False)
    length: np.ndarray = field(init=False)
    region: np.ndarray = field(init=False)
    dst: np.ndarray = field(init=False)  # element offset in the destination's storage
    reach: np.ndarray = field(init=False)
    sinks: list[_InPlace | _Converted] = field(init=False)

    def __post_init__(self) -> None:
        cols: list[list[np.ndarray]] = [[], [], [], [], []]
        self.sinks = []
        for i, r in enumerate(self.regions):
            es = r.part.dtype.itemsize
            grid = runs(
                r.part.chunk_sizes, r.part.region, r.dest.stride(), int(r.dest.storage_offset())
            )
            in_place = r.dest.device.type == "cpu" and r.dest.dtype == r.part.dtype
            self.sinks.append(_InPlace(r.dest) if in_place else _Converted(r.dest, r.part.dtype))
            k = len(grid.src)
            if not k or not grid.count:
                continue
            cols[0].append(np.full(k, r.part.location.file, np.int64))
            cols[1].append(grid.src * es + r.part.location.start)
            cols[2].append(np.full(k, grid.count * es, np.int64))
            cols[3].append(np.full(k, i, np.int64))
            cols[4].append(grid.dst)
        file, start, length, region, dst = (
            np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols
        )
        order = np.lexsort((start, file))
        self.file, self.start, self.length = file[order], start[order], length[order]
        self.region, self.dst = region[order], dst[order]
        # Per file, the running maximum of the runs' ends (see copy_in).
        ends = self.start + self.length
        self.reach = np.empty_like(ends)
        for f in np.unique(self.file).tolist():
            sel = np.flatnonzero(self.file == f)
            self.reach[sel] = np.maximum.accumulate(ends[sel])

    def needs(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per file, the merged ``(starts, lengths)`` this rank needs, runs rounded out to whole
        blocks of their chunks."""
        # Each run's chunk start, size and block (0: no checksums, the run kept as it is), so
        # that every run is rounded in one pass, whatever the number of regions.
        locs = [r.part.location for r in self.regions]
        base = np.array([loc.start for loc in locs], np.int64)[self.region]
        size = np.array([loc.nbytes for loc in locs], np.int64)[self.region]
        bs = np.array([r.sums.block if r.sums else 0 for r in self.regions], np.int64)[self.region]
        starts, ends = self.start.copy(), self.start + self.length
        on = bs > 0
        b = bs[on]
        starts[on] = base[on] + (starts[on] - base[on]) // b * b
        ends[on] = base[on] + np.minimum(-(-(ends[on] - base[on]) // b) * b, size[on])
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        cuts = np.flatnonzero(np.diff(self.file)) + 1  # runs are sorted by file
        for f, s, e in zip(np.split(self.file, cuts), np.split(starts, cuts), np.split(ends, cuts)):
            if len(f):
                a, z = merge_ranges(s, e)
                out[int(f[0])] = (a, z - a)
        return out

    def copy_in(self, file: int, start: int, data: np.ndarray) -> int:
        """Copy ``data`` (bytes ``[start, start + len(data))`` of ``file``) into every destination
        run it overlaps; the bytes copied."""
        end = start + len(data)
        copied = 0
        # By the running maximum of the runs' ends: two read items may read the same bytes.
        for k in _rows_meeting(self.file, self.start, self.reach, file, start, end):
            a = max(int(self.start[k]), start)
            b = min(int(self.start[k] + self.length[k]), end)
            if a < b:
                r = int(self.region[k])
                es = self.regions[r].part.dtype.itemsize
                if (a - int(self.start[k])) % es or (b - a) % es:
                    raise ReadOnceError(
                        f"{self.regions[r].name}: bytes [{a}, {b}) of file {file} arrived cut "
                        f"inside an element of {es} bytes"
                    )
                elem = int(self.dst[k]) + (a - int(self.start[k])) // es
                self.sinks[r].put(elem, data[a - start : b - start])
                copied += b - a
        return copied


def _rows_meeting(
    files: np.ndarray, starts: np.ndarray, ends: np.ndarray, file: int, start: int, end: int
) -> range:
    """The rows that may meet bytes ``[start, end)`` of ``file``, of rows sorted by (file, start)
    whose ``ends`` do not decrease within a file: one slice, found by bisection."""
    lo = int(np.searchsorted(files, file, "left"))
    hi = int(np.searchsorted(files, file, "right"))
    first = lo + int(np.searchsorted(ends[lo:hi], start, "right"))
    return range(first, lo + int(np.searchsorted(starts[lo:hi], end, "left")))


# ---------------------------------------------------------------- checks


class PieceChecker:
    """Checks received pieces against the block checksums of this rank's chunks.

    A block a piece holds whole is hashed where it was received; a block
    split between pieces (a balancing cut inside a small chunk) is gathered
    in ``pending`` until complete. :meth:`verified` returns the parts of a
    piece that may be copied into place now.
    """

    def __init__(self, needs: LocalNeeds, verifier: BlockVerifier) -> None:
        self.verifier = verifier
        chunks: dict[tuple[int, int], Region] = {}
        for r in needs.regions:
            if r.sums is not None:
                chunks.setdefault((r.part.location.file, r.part.location.start), r)
        keys = sorted(chunks)
        self._chunks = [chunks[k] for k in keys]
        self._file = np.array([k[0] for k in keys], np.int64)
        self._start = np.array([k[1] for k in keys], np.int64)
        self._end = np.array([k[1] + chunks[k].part.location.nbytes for k in keys], np.int64)
        self.pending: dict[tuple[int, int], tuple[bytearray, int]] = {}

    def verified(
        self, file: int, start: int, data: np.ndarray, sender: int
    ) -> list[tuple[int, np.ndarray]]:
        """Check every block of this rank's chunks that the piece completes; the parts of the
        piece ready to copy, as ``(file offset, bytes)``."""
        end = start + len(data)
        ready: list[tuple[int, np.ndarray]] = []
        cursor = start  # the bytes before it are handed out or held
        for k in _rows_meeting(self._file, self._start, self._end, file, start, end):
            r = self._chunks[k]
            loc, sums = r.part.location, r.sums
            assert sums is not None
            bs = sums.block
            a, b = max(start, loc.start), min(end, loc.start + loc.nbytes)
            if cursor < a:  # bytes of no checked chunk of this rank's
                ready.append((cursor, data[cursor - start : a - start]))
            rel_a, rel_b = a - loc.start, b - loc.start
            first = -(-rel_a // bs)  # the first block that starts in the piece
            last = rel_b // bs if rel_b < loc.nbytes else -(-rel_b // bs)  # past its last whole one
            check = ChunkCheck(
                self.verifier, sums, f"{r.name} (read by rank {sender})", r.chunk_offsets
            )
            if first < last:
                at, stop = first * bs, min(last * bs, loc.nbytes)
                mem = data[loc.start + at - start : loc.start + stop - start]
                self.verifier.check_span(
                    check, loc, mem, at, np.arange(first, last, dtype=np.int64)
                )
                ready.append((loc.start + at, mem))
            else:
                first = last = rel_a // bs  # no whole block: the piece lies inside one
            for ea, eb in ((rel_a, min(first * bs, rel_b)), (max(last * bs, rel_a), rel_b)):
                if ea < eb:  # part of an edge block: held until the block is complete
                    held = self._hold(
                        check, loc, ea, data[loc.start + ea - start : loc.start + eb - start]
                    )
                    if held is not None:
                        ready.append(held)
            cursor = b
        if cursor < end:
            ready.append((cursor, data[cursor - start :]))
        return ready

    def _hold(
        self, check: ChunkCheck, loc: Location, rel: int, part: np.ndarray
    ) -> tuple[int, np.ndarray] | None:
        """Keep ``part`` (bytes from ``rel`` of the chunk, inside one block); once its block is
        complete, check it and return it as ``(file offset, bytes)``."""
        bs = check.sums.block
        k = rel // bs
        width = min(bs, loc.nbytes - k * bs)
        key = (loc.file, loc.start + k * bs)
        buf, got = self.pending.pop(key, (bytearray(width), 0))
        buf[rel - k * bs : rel - k * bs + len(part)] = part.data
        got += len(part)
        if got < width:
            self.pending[key] = (buf, got)
            return None
        block = np.frombuffer(buf, dtype=np.uint8)
        self.verifier.check_span(check, loc, block, k * bs, np.array([k], np.int64))
        return loc.start + k * bs, block


# ---------------------------------------------------------------- rounds


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
    them; ``group_of[r]`` is rank ``r``'s group,
    :class:`~ucp_dcp.dcp.read_once.rounds.NeedGroups`); ``recvs``: ``(n, 5)`` of ``(reader,
    file, start, length, at)``, those it receives (its own reads for itself included). ``at``
    is where the transfer starts in its reader's *stream* (the reader's reads laid end to end);
    ``windows[q]``: the bytes of its stream reader ``q`` handles per round. Round ``k`` holds,
    of every transfer, the part in window ``k`` of its reader's stream: both ends of a message
    cut the same rows the same way.
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
    cuts = offsets(peer[order], world).tolist()
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
        peer_failed = False
        messages = framed(data, self.recv_sizes)
        for p, (pieces, (status, payload)) in enumerate(zip(self.rnd.recvs, messages)):
            if status.any():
                peer_failed = True
            elif error is None:
                try:
                    _unpack(pieces, payload, p, needs, checker, totals)
                except Exception as e:  # noqa: BLE001  (raised after the closing gather)
                    error = e
            if p != me:
                totals.received += len(payload)
        return peer_failed, error


def run_exchange(
    rounds: RankRounds,
    needs: LocalNeeds,
    source: ByteSource,
    paths: Sequence[str],
    ranks: Sequence[int | None],
    on: Wire,
) -> ExchangeTotals:
    """Run this rank's ``rounds`` and then its regions' ``done`` callbacks.

    Collective: every rank of the group ``on`` names (:func:`wire_for`) calls it with its own
    rounds, the same number on every rank. Raises the first error any rank met, on every rank
    (this rank's own where it has one).
    """
    group = on.group
    me = dist.get_rank(group)
    world = dist.get_world_size(group)
    wire = on.device
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
            mark_failed(send.numpy(), send_sizes)
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=wire)
        if wire.type != "cpu":  # opted in to device memory on an NCCL group
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
    raise_gathered(error, group)
    for r in needs.regions:
        if r.done is not None:
            r.done()
    return totals


def _sizes(pieces: Sequence[np.ndarray]) -> list[int]:
    """Bytes of the message to or from each peer, whose payload is ``pieces``."""
    return message_sizes(int(p[:, 2].sum()) if len(p) else 0 for p in pieces)


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
    for p, (pieces, (_, payload)) in enumerate(zip(rnd.sends, framed(out, sizes))):
        w = 0
        for f, s, n in pieces.tolist():
            a, offs, buf = held[f]
            i = int(np.searchsorted(a, s, "right")) - 1
            o = int(offs[i]) + s - int(a[i])
            payload[w : w + n] = buf[o : o + n]
            w += n
        if p != me:
            totals.sent += len(payload)


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
