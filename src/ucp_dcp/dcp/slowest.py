"""The slow rank named: each rank's time in a load or save, its slowest file, the job's slowest.

Every rank knows how long its own reads (or writes) took and, from its byte
reader's :class:`~ucp_dcp.byteio.rangeio.ReadStats`, which file its requests
spent the most time on: a :class:`SlowestRecord`. The job's slowest rank is
the record with the most seconds. A load learns it with one small gather at
its end, only where DCP already runs collectives for it (:func:`gather_slowest`);
a save needs none, since each rank's record travels to the coordinator with
its write results.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..byteio.progress import log as progress_log
from ..byteio.progress import mb
from ..byteio.rangeio import ReadStats
from ..byteio.requests import rank_and_world
from .read_once.transport import Transport, choose_transport, group_backend, wire_device

__all__ = [
    "SlowestRecord",
    "rank_record",
    "slowest_of",
    "gather_slowest",
    "log_slowest",
    "LoadRun",
]


@dataclass(frozen=True)
class SlowestRecord:
    """One rank's time in a load (or save) and the file it spent the most of it on.

    As the job's slowest (``LoadReport.slowest``): the rank whose reads took longest.
    """

    rank: int
    """The rank (global)."""
    file: str
    """Its slowest file: the one its requests took the most seconds on ('' if it read none)."""
    seconds: float
    """The rank's seconds in the load's ``read_data`` (the save's ``write_data``)."""
    bytes: int
    """Bytes the rank requested from (wrote to) storage, gaps included."""
    file_seconds: float = 0.0
    """Seconds of requests on ``file`` (summed over the rank's threads; see
    :attr:`~ucp_dcp.byteio.rangeio.ReadStats.file_seconds`)."""
    file_bytes: int = 0
    """Bytes requested from ``file``."""

    def where(self) -> str:
        """``'slowest file /ckpt/rank00003.safetensors (9.0 s, 800.0 MB)'`` ('' if none)."""
        if not self.file:
            return ""
        return f"slowest file {self.file} ({self.file_seconds:.1f} s, {mb(self.file_bytes)})"

    def describe(self) -> str:
        """``'rank 3: 12.0 s, 1200.0 MB; slowest file ...'`` (:meth:`where`)."""
        where = self.where()
        return f"rank {self.rank}: {self.seconds:.1f} s, {mb(self.bytes)}" + (
            f"; {where}" if where else ""
        )


@dataclass(frozen=True)
class LoadRun:
    """What ``UCPStorageReader.prepare_global_plan`` tells each rank (``LoadPlan.storage_data``):
    how many ranks DCP planned the load for (1 where it runs no collectives), and the global
    ranks of the load on this rank's machine, itself included (empty where unknown)."""

    ranks: int
    machine: tuple[int, ...] = ()


def rank_record(rank: int, seconds: float, stats: ReadStats, paths: Sequence[str]) -> SlowestRecord:
    """This rank's record from its reader's ``stats`` (file numbers index ``paths``)."""
    f = stats.slowest_file()
    if f is None:
        return SlowestRecord(rank, "", seconds, stats.bytes)
    return SlowestRecord(
        rank, paths[f], seconds, stats.bytes, stats.file_seconds[f], stats.file_bytes[f]
    )


def slowest_of(records: Iterable[SlowestRecord | None]) -> SlowestRecord | None:
    """The record with the most seconds (the lowest rank breaks a tie); None if there is none."""
    real = [r for r in records if r is not None]
    return max(real, key=lambda r: (r.seconds, -r.rank)) if real else None


# A record on the wire: global rank, seconds, bytes, file number (-1: none), the file's seconds
# and bytes. Float64 holds every count below 2**53 exactly.
def _encode(own: SlowestRecord, paths: Sequence[str]) -> list[float]:
    f = paths.index(own.file) if own.file in paths else -1
    return [own.rank, own.seconds, own.bytes, f, own.file_seconds, own.file_bytes]


def _decode(row: list[float], paths: Sequence[str]) -> SlowestRecord:
    rank, seconds, nbytes, f, file_seconds, file_bytes = row
    file = paths[int(f)] if 0 <= f < len(paths) else ""
    return SlowestRecord(int(rank), file, seconds, int(nbytes), file_seconds, int(file_bytes))


def _wire_device(group: dist.ProcessGroup | None) -> torch.device | None:
    """Where ``group`` gathers a tensor: host memory where its backend moves it, the current CUDA
    device for NCCL alone (48 bytes a rank, where ``all_gather_object`` would go too), None for
    a backend that does neither."""
    transport = choose_transport(group_backend(group), allow_device=True, gloo=False)
    if transport is Transport.NONE or (
        transport is Transport.DEVICE and not torch.cuda.is_available()
    ):
        return None
    return wire_device(transport)


def gather_slowest(
    own: SlowestRecord,
    ranks: int,
    group: dist.ProcessGroup | None,
    paths: Sequence[str] = (),
    *,
    failing: bool = False,
) -> SlowestRecord | None:
    """The job's slowest rank: one ``all_gather`` over ``group`` of every rank's record, as six
    numbers (its file as a position in ``paths``, the load's data files: the same list on every
    rank), not ``all_gather_object``'s two rounds and pickles: on 4 ranks of a 2-core machine
    3.9 ms against 8.0 ms a call, at the end of every load.

    Only where the load runs collectives over that group: DCP planned it for ``ranks`` > 1
    ranks, and ``group`` has that many (a load on a subgroup the reader was not told of gathers
    nothing, rather than wait on ranks that do not load). Every rank must call it, a rank whose
    load failed too (``failing``: then an error of the gather itself is dropped, so that the
    load's own error is the one raised). Elsewhere ``own``.
    """
    if ranks < 2 or rank_and_world(group)[1] != ranks:
        return own
    try:
        device = _wire_device(group)
        if device is None:  # a backend of its own: let torch pick the objects' device
            objs: list[SlowestRecord | None] = [None] * ranks
            dist.all_gather_object(objs, own, group=group)
            return slowest_of(objs)
        vec = torch.tensor(_encode(own, paths), dtype=torch.float64, device=device)
        got = [torch.empty_like(vec) for _ in range(ranks)]
        dist.all_gather(got, vec, group=group)
    except Exception:
        if failing:
            return own
        raise
    return slowest_of(_decode(t.tolist(), paths) for t in got)


def log_slowest(
    what: str, job: SlowestRecord | None, threshold: float, seconds: float | None = None
) -> None:
    """Name the job's slowest rank ``job`` on the ``ucp_dcp.progress`` logger (``what``: the
    operation, as its progress lines name it) when the run took at least the progress lines'
    ``threshold``: ``seconds``, else the slowest rank's own. The caller logs it on one rank of a
    job of several."""
    if job is not None and (job.seconds if seconds is None else seconds) >= threshold:
        progress_log.info("%s: slowest rank %s", what, job.describe())
