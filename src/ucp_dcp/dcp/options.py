"""How a checkpoint is read (:class:`ReadOptions`) and what one load found (:class:`LoadReport`).

:class:`~ucp_dcp.UCPStorageReader`, :class:`~ucp_dcp.Checkpoint`,
:func:`~ucp_dcp.load_state_dict`, :func:`~ucp_dcp.export_hf` and :func:`~ucp_dcp.convert` take
the same :class:`ReadOptions`, so each knob has one name and one default. What names the
checkpoint (its path, ``storage_options``, ``prefix``, ``dcp_values``) is an argument of each
entry point; :meth:`ReadOptions.source_options` checks those once for all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..byteio.engine import ReadTotals
from ..byteio.progress import ProgressConfig
from ..byteio.rangeio import IO_THREADS, MAX_REQUEST_BYTES, ByteSource, ReadStats, check_access
from ..byteio.requests import RequestPolicy
from ..errors import InvalidArgumentTypeError
from ..format.schema import check_count, check_field_types
from ..sources import Source, SourceOptions, open_source
from ..sources.distcp import check_dcp_values
from .placement import PlacementReport
from .read_once import ReadOnceCosts, ReadOnceDecision, check_read_once
from .read_once.exchange import ExchangeTotals
from .read_once.transport import Transport
from .slowest import SlowestRecord

__all__ = ["ReadOptions", "LoadReport"]

_MiB = 1024 * 1024


@dataclass(frozen=True)
class ReadOptions:
    """How a checkpoint is read. A field an entry point has no use for is ignored there: those
    that read in one process (``Checkpoint``, the hand-off functions, ``convert``) say which
    they use; the rest are about ``dcp.load``.

    Attributes:
        io_threads: threads per rank issuing reads (default
            :data:`~ucp_dcp.byteio.rangeio.IO_THREADS`, 2; more helps storage that serves many
            reads at once).
        max_buffer_bytes: bound on staging memory, at least 1 MiB (default 64 MiB): casts,
            device destinations, chunks stored in another dimension order, spans
            (:mod:`ucp_dcp.core.spans`), ``convert``'s copy buffer, the block verifier's 16 MiB
            of scratch with ``verify``; a fifth of it per rank and read-once round.
        gap_bytes: neighbouring byte ranges closer than this are read with one call. None (the
            default): a page less a byte on local files, 32 KiB on object storage; ``0`` reads
            exactly the needed bytes (no gap merged, no span with a gap).
        max_request_bytes: largest single read (default
            :data:`~ucp_dcp.byteio.rangeio.MAX_REQUEST_BYTES`, 16 MiB), so that threads share
            big tensors.
        verify: check every byte a read uses against the checksums recorded at save (default
            True; block by block, :mod:`ucp_dcp.byteio.blocksums`), raising
            :class:`~ucp_dcp.ChecksumError` naming tensor, chunk, block, file and writing rank.
            Values are always checked; False skips the checks of tensor data.
        requests: each object-store request's deadline, hedging, bound in flight and pause
            after throttling, and each local read's deadline (:class:`~ucp_dcp.RequestPolicy`;
            its defaults when None).
        access: how each local data file is read: ``"auto"`` (the default) chooses per file
            from every range the rank reads there (:func:`~ucp_dcp.core.spans.file_access`);
            ``"sequential"`` or ``"exact"`` forces one way
            (:data:`~ucp_dcp.core.spans.ACCESS_MODES`). :attr:`LoadReport.file_access` says which.
        read_once: read each needed byte from storage once for the whole job and send it to the
            ranks that need it: True, False or ``"auto"`` (the default: on shared storage, where
            it pays; the policy: :func:`ucp_dcp.dcp.read_once.decide`), the same on every rank.
            :attr:`LoadReport.read_once` says what it decided.
        read_once_costs: the cost model ``"auto"`` weighs an exchange with
            (:class:`~ucp_dcp.ReadOnceCosts`); None: its defaults.
        device_transport: let read-once's messages and the placement check's sums move through
            device memory on a group that is NCCL alone (default False: host memory, on a gloo
            group made from its ranks; :class:`~ucp_dcp.dcp.read_once.transport.Transport`).
            Not yet verified on multi-GPU.
        progress: when a long load logs its progress on the ``ucp_dcp.progress`` logger, per
            rank (:class:`~ucp_dcp.ProgressConfig`).
        verify_placement: prove every element landed where the save found it
            (:mod:`ucp_dcp.dcp.placement`), or raise :class:`~ucp_dcp.errors.PlacementError` on
            every rank naming the tensor, also for a checkpoint without digests (default False).
        tp_rules: the tensor-parallel partitioning of a DeepSpeed checkpoint that does not
            record it, or records it wrong (:class:`~ucp_dcp.sources.base.SourceOptions`);
            default None.

    Raises :class:`~ucp_dcp.errors.InvalidArgumentError` for an ``access`` or ``read_once``
    that is none of its choices or a count out of its range, and
    :class:`~ucp_dcp.errors.InvalidArgumentTypeError` for a field of the wrong type, naming the
    field: when the options are made, not deep in a load.
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
        check_field_types(self)
        check_count("ReadOptions", "io_threads", self.io_threads, 1)
        check_count("ReadOptions", "max_buffer_bytes", self.max_buffer_bytes, 0)
        if self.gap_bytes is not None:
            check_count("ReadOptions", "gap_bytes", self.gap_bytes, 0)
        check_count("ReadOptions", "max_request_bytes", self.max_request_bytes, 1)
        check_access(self.access)
        check_read_once(self.read_once)

    @classmethod
    def given(cls, options: object, who: str) -> ReadOptions:
        """``options`` as an entry point ``who`` takes them: its defaults for None, else a
        :class:`ReadOptions` (:class:`~ucp_dcp.errors.InvalidArgumentTypeError` naming ``who``
        for anything else, such as a dict)."""
        if options is None:
            return cls()
        if not isinstance(options, cls):
            raise InvalidArgumentTypeError(
                f"{who}: options must be a ReadOptions, got {type(options).__name__}"
            )
        return options

    @property
    def buffer_bytes(self) -> int:
        """``max_buffer_bytes``, raised to the 1 MiB every reader needs at least."""
        return max(self.max_buffer_bytes, _MiB)

    def source_options(self, dcp_values: str | None, prefix: str) -> SourceOptions:
        """What an entry point opens its checkpoint with: its ``dcp_values`` and ``prefix`` and
        these options' ``tp_rules``; :class:`~ucp_dcp.errors.InvalidArgumentError` for a
        ``dcp_values`` that is none of its choices (checked before anything is opened)."""
        check_dcp_values(dcp_values)
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
        transport: how read-once's messages travelled, or would have
            (:class:`~ucp_dcp.dcp.read_once.transport.Transport`); None where read-once did not
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
