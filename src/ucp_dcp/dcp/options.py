"""How a checkpoint is read (:class:`ReadOptions`) and what one load found (:class:`LoadReport`).

Every reading entry point takes the same :class:`ReadOptions`:
:class:`~ucp_dcp.UCPStorageReader`, :class:`~ucp_dcp.Checkpoint`,
:func:`~ucp_dcp.load_state_dict`, :func:`~ucp_dcp.export_hf` and
:func:`~ucp_dcp.convert`, so each knob has one name and one default. What
names the checkpoint (its path, ``storage_options`` for a URL, the ``prefix``
of a Hugging Face model's names, ``dcp_values`` for a DCP checkpoint's
pickled values) is an argument of each entry point itself;
:meth:`ReadOptions.source_options` checks those once for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..byteio.engine import ReadTotals
from ..byteio.progress import ProgressConfig
from ..byteio.rangeio import IO_THREADS, MAX_REQUEST_BYTES, ByteSource, ReadStats, check_access
from ..byteio.requests import RequestPolicy
from ..errors import InvalidArgumentError
from ..sources import Source, SourceOptions, open_source
from ..sources.distcp import DCP_VALUES_MODES
from .placement import PlacementReport
from .read_once import ReadOnceCosts, ReadOnceDecision, check_read_once
from .read_once.exchange import ExchangeTotals
from .read_once.transport import Transport
from .slowest import SlowestRecord

__all__ = ["ReadOptions", "LoadReport"]

_MiB = 1024 * 1024


@dataclass(frozen=True)
class ReadOptions:
    """How a checkpoint is read: the same fields, names and defaults for every entry point.

    A field that an entry point has no use for is ignored there (``Checkpoint``, the hand-off
    functions and the converters read in one process: they use ``io_threads``,
    ``max_buffer_bytes``, ``gap_bytes``, ``max_request_bytes``, ``requests``, ``verify`` and
    ``tp_rules``; the rest are about ``dcp.load``).

    Attributes:
        io_threads: threads of each rank issuing reads in parallel (default
            :data:`~ucp_dcp.byteio.rangeio.IO_THREADS`, 2: enough to keep one local disk busy
            with 1-4 ranks per machine; more helps storage that serves many reads at once).
        max_buffer_bytes: bound on staging memory, at least 1 MiB (default 64 MiB): dtype
            casts, non-CPU destinations, chunks stored in another dimension order, regions read
            as spans (:mod:`ucp_dcp.core.spans`) and ``convert``'s copy buffer; other CPU
            tensors are filled in place. With ``verify`` it includes the block verifier's
            scratch memory (16 MiB). A read-once load sends and receives at most a fifth of it
            per rank and round.
        gap_bytes: neighbouring byte ranges closer than this are read with one call. None (the
            default): one page less a byte on local files, which never pulls in a page that
            holds no needed byte by itself, and 32 KiB on object storage (less than a request's
            round trip costs); regions of many short runs may still be read as covering spans
            where that is cheaper. ``0`` reads exactly the needed bytes: no gap is merged and
            no span with a gap is read.
        max_request_bytes: largest single read (default
            :data:`~ucp_dcp.byteio.rangeio.MAX_REQUEST_BYTES`, 16 MiB), so that big tensors are
            read by several threads at once.
        verify: check every byte a read uses against the checksums recorded at save (default
            True), raising :class:`~ucp_dcp.ChecksumError` (naming tensor, chunk, block, file
            and writing rank) on a mismatch. Native checkpoints record an xxh3-64 of every
            4 KiB block of every chunk: each block a read touches is hashed once it is in
            memory (in the destination, or, at the edges of a read, in scratch memory filled
            by the same ``preadv`` calls), so a partial read of a chunk costs no second read.
            Checkpoints written before block checksums are checked chunk by chunk: a read that
            fills a whole chunk into contiguous CPU memory is checked by hashing that memory,
            any other reads the whole chunk again. Values are always checked; formats without
            checksums (DCP's, Hugging Face's) have nothing to check. False skips the checks of
            tensor data.
        requests: for a URL, each request's deadline, hedged reads, the bound on requests in
            flight and the pause after throttling (:class:`~ucp_dcp.RequestPolicy`; its
            defaults when None; see docs/object-storage.md). For local files, the deadline of
            each read the I/O threads make: a read past it fails with a ``StorageError``
            naming the file, the byte range and the rank.
        access: how each local data file is read, chosen once per load from every byte range
            the rank's plan reads there: ``"auto"`` (the default) streams a file the rank reads
            whole, in long stretches or in pieces that leave no page out (``"sequential"``: the
            kernel's read-ahead, in-order requests, one stretch per thread) and reads pieces with
            whole pages between them exactly (``"exact"``: no read-ahead, each request announced
            to the kernel ahead of reading it). Pages that ranks of the load on the same machine
            read do not count as between: the page cache they share reads each page once (see
            :func:`~ucp_dcp.core.spans.file_access`). ``"sequential"`` or ``"exact"`` forces
            that way for every file. :attr:`LoadReport.file_access` says what was chosen.
        read_once: read each needed byte from storage once for the whole job (see
            :mod:`ucp_dcp.dcp.read_once`): one rank reads it and sends it to the others that
            need it over the load's process group, each piece checked against its block
            checksums where it is received. True always does, False never does (each rank reads
            its own bytes), ``"auto"`` (the default) does where the storage is shared by the
            job (an object store, a network file system), the ranks' needs overlap by more than
            5% and ``read_once_costs`` estimates the exchange faster. Received bytes land in the
            destinations directly (whole checked blocks, so native checkpoints only); chunks
            stored in another dimension order, casts and device copies of formats without block
            checksums, and values are read by each rank itself. Every rank of the group must
            load with the same setting. :attr:`LoadReport.read_once` says what a load decided
            and why, :attr:`LoadReport.exchange` what it moved.
        read_once_costs: the cost model ``"auto"`` weighs an exchange with
            (:class:`~ucp_dcp.ReadOnceCosts`: the storage's bandwidth for the job, the
            interconnect's per rank, a round's fixed cost); None: its defaults.
        device_transport: on a process group that is NCCL alone, move read-once's messages and
            the placement check's sums through device memory on that group (default False:
            they move in host memory on a gloo group made once from the group's ranks and
            reused). Not yet verified on multi-GPU. A group with a CPU backend (gloo,
            ``"cpu:gloo,cuda:nccl"``) is always used as it is, in host memory.
            :attr:`LoadReport.transport` says which was used.
        progress: when a long load logs its progress, per rank, on the ``ucp_dcp.progress``
            logger (:class:`~ucp_dcp.ProgressConfig`: after 5 s, every 10 s by default; a line
            says the bytes read and the rate).
        verify_placement: prove every element landed where the save found it, or raise
            :class:`~ucp_dcp.errors.PlacementError` on every rank naming the tensor (also for a
            checkpoint without digests); default False. :attr:`LoadReport.placement` says what
            the load checked.
        tp_rules: the tensor-parallel partitioning of a DeepSpeed checkpoint that does not
            record it, or records it wrong (a ``LayoutSpec`` or a list of
            ``Shard``/``VocabPad``/``Replicated`` rules; see
            :class:`~ucp_dcp.sources.base.SourceOptions`); default None.

    Raises :class:`~ucp_dcp.errors.InvalidArgumentError` for an ``access`` or ``read_once``
    that is none of its choices.
    """

    io_threads: int = IO_THREADS
    max_buffer_bytes: int = 64 * _MiB
    gap_bytes: int | None = None
    max_request_bytes: int = MAX_REQUEST_BYTES
    verify: bool = True
    requests: RequestPolicy | None = None
    access: str = "auto"
    read_once: bool | str = "auto"
    read_once_costs: ReadOnceCosts | None = None
    device_transport: bool = False
    progress: ProgressConfig = ProgressConfig()
    verify_placement: bool = False
    tp_rules: object = None

    def __post_init__(self) -> None:
        check_access(self.access)
        check_read_once(self.read_once)

    @property
    def buffer_bytes(self) -> int:
        """``max_buffer_bytes``, raised to the 1 MiB every reader needs at least."""
        return max(self.max_buffer_bytes, _MiB)

    def source_options(self, dcp_values: str | None, prefix: str) -> SourceOptions:
        """What an entry point opens its checkpoint with: its ``dcp_values`` and ``prefix`` and
        these options' ``tp_rules``; :class:`~ucp_dcp.errors.InvalidArgumentError` for a
        ``dcp_values`` that is none of its choices (checked before anything is opened)."""
        if dcp_values not in DCP_VALUES_MODES:
            raise InvalidArgumentError(
                f"dcp_values must be one of {DCP_VALUES_MODES}, got {dcp_values!r}"
            )
        return SourceOptions(dcp_values=dcp_values, prefix=prefix, tp_rules=self.tp_rules)

    def open_source(
        self,
        path: str,
        options: SourceOptions,
        storage_options: dict[str, Any] | None,
        known_files: Mapping[str, bytes] | None = None,
    ) -> Source:
        """The checkpoint at ``path`` opened (:func:`~ucp_dcp.sources.open_source`) with
        ``options`` (:meth:`source_options`), its object-store requests under these options'
        policy: the one place every entry point opens it."""
        return open_source(
            path,
            options,
            storage_options=storage_options,
            known_files=known_files,
            requests=self.requests,
        )

    def open_reader(self, source: Source) -> ByteSource:
        """``source``'s byte reader with these options' threads, gaps, request sizes, deadlines
        and verification: the one place every entry point opens it."""
        return source.open_reader(
            threads=self.io_threads,
            gap_bytes=self.gap_bytes,
            max_request_bytes=self.max_request_bytes,
            requests=self.requests,
            verify=self.verify,
        )


@dataclass
class LoadReport:
    """What one load of a :class:`~ucp_dcp.UCPStorageReader` found
    (``reader.last_load``, replaced when each load starts reading).

    Attributes:
        rank_record: this rank's time in the load, its bytes, and the file its requests spent
            the most time on.
        slowest: the same of the job's slowest rank, learnt with one small gather at the end of
            a load that runs collectives over the process group (elsewhere this rank's own).
        bytes_requested: bytes this rank asked of storage, merged gaps included.
        read_calls: read calls (or requests) this rank made.
        verified_bytes: bytes hashed to check them against the recorded checksums.
        verify_seconds: seconds spent hashing them.
        file_access: each local data file read, and the way it was read (``"sequential"`` or
            ``"exact"``; empty on object storage, which has one way).
        read_once: what the read-once policy decided and why (None where it did not run: one
            rank, ``read_once=False``).
        exchange: what a read-once exchange moved (None where none ran).
        transport: how read-once's messages travelled, or would have (``"group"``: host memory
            on the load's group; ``"gloo"``: host memory on a gloo group made from the ranks of
            a group that is NCCL alone; ``"device"``: device memory, opted in with
            ``ReadOptions(device_transport=True)``; ``"none"``: no exchange, the group moves no
            host memory and torch has no gloo), a
            :class:`~ucp_dcp.dcp.read_once.transport.Transport`; None where read-once did not
            get that far (one rank, ``read_once=False``, ``"auto"`` on local storage).
        placement: what the placement check found (None without ``verify_placement``).
        stats: the byte reader's own statistics (per file: what ``rank_record`` is made from).
    """

    rank_record: SlowestRecord | None = None
    slowest: SlowestRecord | None = None
    bytes_requested: int = 0
    read_calls: int = 0
    verified_bytes: int = 0
    verify_seconds: float = 0.0
    file_access: dict[str, str] = field(default_factory=dict)
    read_once: ReadOnceDecision | None = None
    exchange: ExchangeTotals | None = None
    transport: Transport | None = None
    placement: PlacementReport | None = None
    stats: ReadStats = field(default_factory=ReadStats, repr=False, compare=False)

    def add_reads(self, stats: ReadStats, totals: ReadTotals) -> None:
        """Count a byte reader's requests and an engine's checks into this load."""
        self.bytes_requested += stats.bytes
        self.read_calls += stats.calls
        self.verified_bytes += totals.verified_bytes
        self.verify_seconds += totals.verify_seconds
