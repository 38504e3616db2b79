"""``UCPStorageReader``: ``dcp.load`` from any source, with exact offset reads.

The checkpoint is opened as a :class:`~ucp_dcp.sources.Source` (native,
DCP's own format, a Hugging Face directory, accelerate's subfolders, ...),
whose records become DCP's metadata. Each read item then goes one way:
the source locates the saved chunk's bytes, and the range reader fills the
destination tensor in place (CPU, same dtype, row-major on disk), or through
bounded staging (a cast, a device destination, a chunk stored in another
dimension order). The reader itself knows no format.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..byteio.engine import ChunkReads
from ..byteio.progress import Progress, ProgressConfig
from ..byteio.rangeio import IO_THREADS, ByteSource, ReadStats, check_access
from ..byteio.reqpolicy import RequestPolicy
from ..byteio.transfer import ChunkRegion, extents, needs_staging
from ..errors import InvalidArgumentError
from ..sources import Source, SourceOptions, open_source, read_values, source_types
from ..sources.distcp import DCP_VALUES_MODES
from ._directory import _Directory
from ._mesh_groups import LazyChunks
from ._plan_records import LoadSourceInfo
from ._read_items import (
    chunk_offsets,
    chunk_part,
    collector_paused,
    record_boxes,
    save_id,
    value_for,
)
from .load_planner import UCPLoadPlanner
from .placement import PlacementReport, checked_placement
from .read_once import (
    ReadOnceCosts,
    ReadOnceDecision,
    check_read_once,
    coordinate,
    decide,
    shared_storage,
)
from .read_once.exchange import ExchangeTotals, LocalNeeds, Region, run_exchange
from .read_once.first_requests import FirstRequests, share_first_requests
from .slowest import LoadRun, SlowestRecord, name_slowest, rank_record

__all__ = ["PlannedRead", "UCPStorageReader"]

_MiB = 1024 * 1024
# Bytes sent and received per rank in a read-once round; None: a fifth of max_buffer_bytes, at
# least 1 MiB. Tests set it lower to run many rounds on a small state.
_ROUND_BYTES: int | None = None


@dataclass(frozen=True)
class PlannedRead:
    """One read of a planned load (:meth:`UCPStorageReader.planned_reads`): ``nbytes`` of data
    file ``file`` (its name in the checkpoint), of the checkpoint's ``stored`` tensor or value,
    into the state dict's flattened key ``key``."""

    key: str
    file: str
    nbytes: int
    stored: str


class UCPStorageReader(_Directory, StorageReader):
    """Reads a checkpoint of any supported format from ``path`` (see :mod:`ucp_dcp.sources`).

    Args:
        path: the checkpoint: a universal checkpoint directory, a DCP
            ``FileSystemWriter`` directory (Megatron-core ``torch_dist``
            included), a Hugging Face safetensors model, or a directory whose
            subfolders are checkpoints (accelerate). Or an fsspec URL of a
            universal checkpoint, a DCP checkpoint (``FsspecWriter``'s
            format) or a Hugging Face safetensors model in object storage
            (``s3://bucket/ckpt``, ``gs://``, ``memory://``...): each rank
            fetches only the byte ranges it needs, with many ranged requests
            in flight.
        storage_options: for a URL, passed to fsspec as they are
            (credentials, ``client_kwargs={"endpoint_url": ...}``).
        requests: for a URL, each request's deadline, hedged reads, the
            bound on requests in flight and the pause after throttling
            (:class:`~ucp_dcp.byteio.reqpolicy.RequestPolicy`; its defaults
            when None). See docs/object-storage.md. For local files, the
            deadline of each read the I/O threads make (its floor, cap and
            factor): a read past it fails the load with a ``StorageError``
            naming the file, the byte range and the rank.
        io_threads: threads of each rank issuing reads in parallel (default 2,
            enough to keep one local disk busy with 1-4 ranks per machine; more
            helps storage that serves many reads at once).
        max_buffer_bytes: bound on staging memory (used for dtype casts,
            non-CPU destinations, chunks stored in another dimension order
            and regions read as spans, see :mod:`ucp_dcp.core.spans`; other
            CPU tensors are filled in place). With ``verify`` it includes the
            block verifier's scratch memory (16 MiB).
        gap_bytes: neighbouring byte ranges closer than this are read with
            one call. The default, one page less a byte, never pulls in a
            page that holds no needed byte by itself (on object storage:
            32 KiB, less than a request's round trip costs); regions of many short
            runs may still be read as covering spans where that is cheaper
            (:mod:`ucp_dcp.core.spans`). ``gap_bytes=0`` reads exactly the
            needed bytes: no gap is merged and no span with a gap is read.
        max_request_bytes: largest single read, so big tensors are read by
            several threads at once.
        dcp_values: for a checkpoint in DCP's default ``.distcp`` format:
            its non-tensor values are pickles and are refused by default,
            naming the key; ``"weights_only"`` loads them with
            ``torch.load(weights_only=True)``.
        prefix: prepended to the tensor names of a Hugging Face model
            (``"model."`` fills ``get_state_dict`` keys).
        tp_rules: the tensor-parallel partitioning of a DeepSpeed checkpoint
            that does not record it, or records it wrong (a ``LayoutSpec`` or a
            list of ``Shard``/``VocabPad``/``Replicated`` rules; see
            :class:`~ucp_dcp.sources.base.SourceOptions`).
        verify: check every byte this rank's reads use against checksums
            recorded at save (on by default), raising
            :class:`~ucp_dcp.ChecksumError` (naming tensor, chunk, block, file
            and writing rank) on a mismatch. Native checkpoints record an
            xxh3-64 of every 4 KiB block of every chunk: each block a read
            touches is hashed once it is in memory (in the destination, or,
            at the edges of a read, in scratch memory filled by the same
            ``preadv`` calls), so a partial read of a chunk costs no second
            read. Checkpoints written before block checksums are checked
            chunk by chunk against the chunk's xxh3-64: a read that fills a
            whole chunk into contiguous CPU memory is checked by hashing that
            memory, any other reads the whole chunk again. ``verified_bytes``
            / ``verify_seconds`` add up the bytes hashed and the time spent.
            Values are always checked. Formats without checksums (DCP's,
            Hugging Face's) have nothing to check. ``verify=False`` skips
            the checks of tensor data.
        access: how each local data file is read, chosen once per load from
            every byte range this rank's plan reads there: ``"auto"`` (the
            default) streams a file the rank reads whole or in long
            stretches (``"sequential"``: the kernel's read-ahead, in-order
            requests, one stretch per thread) and reads scattered pieces
            exactly (``"exact"``: no read-ahead, each request announced to
            the kernel ahead of reading it; see
            :func:`~ucp_dcp.core.spans.file_access`). ``"sequential"`` or
            ``"exact"`` forces that way for every file. ``file_access`` maps
            each file the last load read to the way chosen (empty on object
            storage, which has one way).
        known_files: files of the checkpoint the caller has already read (file
            name -> bytes, e.g. ``{"ucp_index.json": data}``): the first load
            opens the checkpoint from these bytes instead of reading (or, in
            object storage, fetching) them again. :class:`~ucp_dcp.CheckpointManager`
            hands on the index it has checked against its commit marker, so the
            load parses the very bytes that were checked. Dropped by
            :meth:`reset` to another checkpoint.
        read_once: read each needed byte from storage once for the whole
            job (see :mod:`ucp_dcp.dcp.read_once`): one rank reads it and
            sends it to the others that need it over ``process_group``, in
            rounds of at most a fifth of ``max_buffer_bytes`` sent and
            received per rank (two rounds in flight), each piece checked against its block
            checksums where it is received. ``True`` always does, ``False``
            never does (each rank reads its own bytes), ``"auto"`` (the
            default) does where the storage is shared by the job (an object
            store, a network file system) and the ranks' needs overlap by
            more than 5% and ``read_once_costs``
            (:class:`~ucp_dcp.dcp.read_once.ReadOnceCosts`: the storage's
            bandwidth for the job, the interconnect's per rank) estimates
            the exchange faster. Received bytes land in the destinations directly, cast and
            copied to the device where they must be (whole checked blocks,
            so native checkpoints only); chunks stored in another dimension
            order, casts and device copies of formats without block
            checksums, and values are read by each rank itself. ``read_once_decision``
            says what the last load decided and why, ``exchange_totals``
            what it moved. Every rank of the group must load with the same
            setting.
        process_group: the group ``dcp.load`` runs on (default: the default
            group), for ``read_once``, ``verify_placement``, naming the slowest rank.
        progress: when a long load logs its progress, per rank, on the
            ``ucp_dcp.progress`` logger (:class:`~ucp_dcp.ProgressConfig`:
            after 5 s, every 10 s by default; a line says the bytes read and the
            rate). After a load, ``rank_record`` (a :class:`~ucp_dcp.SlowestRecord`)
            says how long this rank read, how many bytes, and which file its
            requests spent the most time on; ``slowest`` says the same of the
            job's slowest rank, learnt with one small gather at the end of a load
            that runs collectives over ``process_group`` (elsewhere it is this
            rank's own record).
        verify_placement: prove every element landed where the save found it, or raise
            :class:`~ucp_dcp.errors.PlacementError` on every rank naming the tensor (also for
            a checkpoint without digests); ``placement_report`` says what the load checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        io_threads: int = IO_THREADS,
        max_buffer_bytes: int = 64 * _MiB,
        gap_bytes: int | None = None,
        max_request_bytes: int = 16 * _MiB,
        dcp_values: str | None = None,
        prefix: str = "",
        tp_rules: object = None,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        requests: RequestPolicy | None = None,
        access: str = "auto",
        known_files: Mapping[str, bytes] | None = None,
        read_once: bool | str = "auto",
        process_group: dist.ProcessGroup | None = None,
        read_once_costs: ReadOnceCosts | None = None,
        progress: ProgressConfig | None = None,
        verify_placement: bool = False,
    ) -> None:
        super().__init__()
        self.verify_placement = verify_placement
        self.placement_report: PlacementReport | None = None
        self.access = check_access(access)
        self.read_once = check_read_once(read_once)
        self.process_group = process_group
        self.read_once_costs = read_once_costs
        self.read_once_decision: ReadOnceDecision | None = None
        self._storage: tuple[bool, str] = (False, "")  # set by _may_exchange
        self.exchange_totals: ExchangeTotals | None = None
        self.file_access: dict[str, str] = {}
        self.progress = progress if progress is not None else ProgressConfig()
        self.rank_record: SlowestRecord | None = None
        self.slowest: SlowestRecord | None = None
        self._stats = ReadStats()  # the last load's byte reader's
        self._progress: Progress | None = None
        if dcp_values not in DCP_VALUES_MODES:
            raise InvalidArgumentError(
                f"dcp_values must be one of {DCP_VALUES_MODES}, got {dcp_values!r}"
            )
        self.path = os.fspath(path)
        self.options = SourceOptions(dcp_values=dcp_values, prefix=prefix, tp_rules=tp_rules)
        self.source: Source | None = None
        self.io_threads = io_threads
        self.max_buffer_bytes = max(max_buffer_bytes, _MiB)
        self.gap_bytes = gap_bytes  # None: the storage's default (Source.open_reader)
        self.storage_options = storage_options
        self.requests = requests
        self.max_request_bytes = max_request_bytes
        self.bytes_requested = 0
        self.read_calls = 0
        self.verify = verify
        self.verified_bytes = 0
        self.verify_seconds = 0.0
        self.load_id = uuid.uuid4().hex
        self._known = dict(known_files) if known_files else None

    @property
    def index(self) -> Any:
        """The open source's records (None before :meth:`read_metadata`)."""
        return self.source.index if self.source is not None else None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._known = None  # bytes of the checkpoint given first, not of this one
        self._set_path(checkpoint_id)
        self.source = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Open the source and describe it as DCP's metadata (nothing is unpickled but DCP's own
        records)."""
        self.source = source = open_source(
            self.path,
            self.options,
            storage_options=self.storage_options,
            known_files=self._known,
            requests=self.requests,
        )
        self._known = None  # used once: a later opening reads the files as they are then
        index = source.index
        md: dict[str, Any] = {}
        for fqn, t in index.tensors.items():
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=t.dtype),
                torch.Size(t.shape),
                LazyChunks(functools.partial(record_boxes, t)),
            )
        for fqn in [*index.values, *index.rank_local]:
            md[fqn] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=md,
            planner_data=LoadSourceInfo(
                world_size=index.world_size,
                rank_local={k: sorted(v) for k, v in index.rank_local.items()},
                # In-process only (load metadata is never sent between ranks):
                # lets UCPLoadPlanner find overlaps without listing chunks.
                chunk_grid=source.grid,
                keys=frozenset(md),
                paths=index.paths,
            ),
            storage_meta=StorageMeta(
                checkpoint_id=self.path, save_id=save_id(index), load_id=self.load_id
            ),
            # The version of DCP's metadata conventions these keys follow: a
            # DCP checkpoint's own (None before torch 2.4, which DCP's planners
            # treat as the older flattening), else the current one.
            version=getattr(getattr(source, "metadata", None), "version", CURRENT_DCP_VERSION),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Make sure the source is open (DCP may hand us metadata read elsewhere)."""
        if self.source is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add per rank (UCPLoadPlanner keeps its items local; see read_data)."""
        return plan

    def files_to_read(self, state_dict: dict[str, Any]) -> list[str]:
        """The data files (names relative to the checkpoint) that this rank's ``dcp.load`` of
        ``state_dict`` with a :class:`~ucp_dcp.UCPLoadPlanner` reads (see
        :meth:`planned_reads`)."""
        return sorted({r.file for r in self.planned_reads(state_dict)})

    def planned_reads(self, state_dict: dict[str, Any]) -> list[PlannedRead]:
        """What this rank's ``dcp.load`` of ``state_dict`` with a
        :class:`~ucp_dcp.UCPLoadPlanner` reads, planned as that load plans, from the index
        alone (no data file need be present: a node fetches what it lacks before it loads):
        one record per read item. Not collective; ``state_dict`` is not changed."""
        md = self.read_metadata()
        planner = UCPLoadPlanner()
        planner.set_up_planner(dict(state_dict), md, False)
        plan = planner.finish_plan(planner.create_local_plan())
        src = self.source
        assert src is not None
        index, out = src.index, []
        for item in plan.items:
            key = item.storage_index.fqn
            rec = index.tensors.get(key)
            if rec is None:
                loc = Source.value_location(src, key)  # from the index: no file is read
                name = index.files[loc.file].name
                out.append(PlannedRead(item.dest_index.fqn, name, loc.nbytes, key))
                continue
            offsets = tuple(item.storage_index.offset or ())
            idx = src.chunk_index(key, offsets, item.storage_index.index)
            f = rec.chunk_file(idx)
            f = f if f is not None else src.locate(key, idx).file
            nbytes = math.prod(item.lengths) * rec.dtype.itemsize
            out.append(PlannedRead(item.dest_index.fqn, index.files[f].name, nbytes, key))
        return out

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Tell every rank how many ranks load (whether the load runs collectives); each reads
        its own byte ranges."""
        return [dataclasses.replace(p, storage_data=LoadRun(len(plans))) for p in plans]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the tensors ``planner`` resolves."""
        # A strided load makes tens of thousands of short-lived read segments,
        # and each burst of allocations sets off Python's cyclic garbage
        # collector, which walks every live object: a third to a half of the
        # CPU time of such a load on 2 cores, falling on loads at random.
        # Nothing a load allocates forms reference cycles, so the collector
        # waits until it is done.
        with collector_paused():
            t0 = time.perf_counter()
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._stats, self.rank_record, self.slowest = ReadStats(), None, None
            self._progress = Progress(f"load of {self.path}", rank, config=self.progress)
            with checked_placement(  # after the slowest rank's gather, on both paths
                self.verify_placement, self.source, planner, self.process_group, self.path
            ) as check:
                try:
                    fut = self._read_data(plan, planner)
                except BaseException:
                    self._name_slowest(plan, rank, t0, failing=True)
                    raise
                self._name_slowest(plan, rank, t0, failing=False)
            self.placement_report = check.report
            return fut

    def _name_slowest(self, plan: LoadPlan, rank: int, t0: float, *, failing: bool) -> None:
        """Fill ``rank_record`` and ``slowest`` (every rank of a collective load calls it, also
        when its load failed: the gather waits for all)."""
        run, paths = plan.storage_data, self.source.paths if self.source is not None else []
        assert self._progress is not None
        self.rank_record, self.slowest = name_slowest(
            rank_record(rank, time.perf_counter() - t0, self._stats, paths),
            self._progress,
            run.ranks if isinstance(run, LoadRun) else 1,
            self.process_group,
            failing=failing,
        )

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        src = self.source
        assert src is not None
        self.read_once_decision = self.exchange_totals = None
        exchanging = self._may_exchange()
        tensor_items, value_items = self._items(src, plan, exchanging)
        try:
            src.prepare(
                [(ri.storage_index.fqn, idx) for ri, idx in tensor_items],
                [ri.storage_index.fqn for ri in value_items],
                self.io_threads,
            )
            parts = [chunk_part(src, ri, idx) for ri, idx in tensor_items]
        except Exception as e:
            if exchanging:  # the other ranks wait for this one's needs: say why not
                coordinate(self.read_once, *self._storage, None, e, self.process_group, 0)
            raise
        reader = src.open_reader(
            threads=self.io_threads,
            gap_bytes=self.gap_bytes,
            max_request_bytes=self.max_request_bytes,
            requests=self.requests,
            verify=self.verify,
        )
        self._stats = reader.stats
        reader.stats.progress = self._progress
        engine = ChunkReads(
            reader,
            src.paths,
            [src.file_rank(i) for i in range(len(src.paths))],
            verify=self.verify,
            max_buffer_bytes=self.max_buffer_bytes,
            reread_block=self.max_request_bytes,
        )
        try:
            items = self._exchange(src, reader, planner, tensor_items, parts, exchanging)
            chosen = reader.plan_access(extents([parts[i][0] for i in items]), self.access)
            self.file_access = {src.paths[f]: how for f, how in sorted(chosen.items())}
            for i in items:
                (ri, idx), (part, chunk_offsets) = tensor_items[i], parts[i]
                fqn = ri.storage_index.fqn
                dest = planner.resolve_tensor(ri)
                engine.add(
                    part,
                    dest,
                    name=fqn,
                    chunk_offsets=chunk_offsets,
                    sums=src.block_sums(fqn, idx, part.location) if engine.verify else None,
                    # Committed once filled and checked (planners may move the data on).
                    done=functools.partial(planner.commit_tensor, ri, dest),
                )
            engine.flush()
            raws = read_values(src, reader, [ri.storage_index.fqn for ri in value_items])
            for ri, raw in zip(value_items, raws):
                planner.load_bytes(ri, value_for(planner, raw, ri))
        finally:
            engine.close()
            reader.close()
            totals = engine.stats
            self.bytes_requested += reader.stats.bytes
            self.read_calls += reader.stats.calls
            self.verified_bytes += totals.verified_bytes
            self.verify_seconds += totals.verify_seconds
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _exchange(
        self,
        src: Source,
        reader: ByteSource,
        planner: LoadPlanner,
        tensor_items: list[tuple[ReadItem, int]],
        parts: list[tuple[ChunkRegion, tuple[int, ...]]],
        exchanging: bool,
    ) -> list[int]:
        """Fill what the job reads once (see ``read_once``); the positions of the tensor items
        left for this rank to read itself."""
        everything = list(range(len(tensor_items)))
        if not exchanging:
            return everything
        regions: list[Region] = []
        taken: list[int] = []
        failure: BaseException | None = None
        try:
            for i, ((ri, idx), (part, chunk_offsets)) in enumerate(zip(tensor_items, parts)):
                if part.location.dim_order:
                    continue  # stored in another dimension order: the engine stages it
                dest = planner.resolve_tensor(ri)
                fqn = ri.storage_index.fqn
                sums = src.block_sums(fqn, idx, part.location)
                if sums is None and part.location.xxh3 and self.verify:
                    continue  # checked chunk by chunk only: the engine reads it whole
                if needs_staging(dest, part.dtype, part.location) and (
                    sums is None or not self.verify
                ):
                    continue  # a cast or device copy needs whole elements: checked blocks are
                if not self.verify:
                    sums = None
                done = functools.partial(planner.commit_tensor, ri, dest)
                regions.append(Region(part, dest, fqn, chunk_offsets, sums, done))
                taken.append(i)
            needs = LocalNeeds(regions)
        except Exception as e:  # noqa: BLE001  (every rank must reach the collective; raised there)
            failure, needs = e, None
        # Two rounds in flight, each a send and a receive buffer, and the next round's reads.
        budget = _ROUND_BYTES or max(self.max_buffer_bytes // 5, _MiB)
        decision, rounds = coordinate(
            self.read_once,
            *self._storage,
            needs,
            failure,
            self.process_group,
            budget,
            self.read_once_costs,
        )
        self.read_once_decision = decision
        if rounds is None:
            return everything
        assert needs is not None
        paths = src.paths
        ranks = [src.file_rank(i) for i in range(len(paths))]
        self.exchange_totals = run_exchange(rounds, needs, reader, paths, ranks, self.process_group)
        exchanged = set(taken)
        return [i for i in everything if i not in exchanged]

    def _may_exchange(self) -> bool:
        """Whether this load takes part in a read-once exchange (then every rank of the group
        must reach :func:`~ucp_dcp.dcp.read_once.coordinate`). Looks at the storage once per
        load (``_storage``); ``"auto"`` on storage the job does not share is decided here, by
        this rank alone, before any need is listed."""
        if self.read_once is False or not dist.is_available() or not dist.is_initialized():
            return False
        if dist.get_world_size(self.process_group) < 2:
            return False
        self._storage = shared, kind = shared_storage(self.path)
        if self.read_once == "auto" and not shared:
            self.read_once_decision = decide(self.read_once, shared, kind, None)
            return False
        return True

    def _items(
        self, src: Source, plan: LoadPlan, exchanging: bool
    ) -> tuple[list[tuple[ReadItem, int]], list[ReadItem]]:
        """The plan's tensor items (with the position of the chunk each reads) and value items.

        Where the load may exchange, the ranks also share the data files' first requests
        (:mod:`~ucp_dcp.dcp._first_requests`): each is made by one rank, not by every rank that
        reads the file.
        """
        shares = (
            src if exchanging and src.store is not None and isinstance(src, FirstRequests) else None
        )
        try:
            value_items = [ri for ri in plan.items if ri.type == LoadItemType.BYTE_IO]
            tensor_items = [
                (ri, src.chunk_index(si.fqn, chunk_offsets(si), si.index))
                for ri in plan.items
                if ri.type != LoadItemType.BYTE_IO
                for si in (ri.storage_index,)
            ]
            wanted: list[int] = []
            if shares is not None:
                wanted = shares.first_requests(
                    [(ri.storage_index.fqn, idx) for ri, idx in tensor_items],
                    [ri.storage_index.fqn for ri in value_items],
                )
        except Exception as e:
            if shares is not None:  # the other ranks wait for this one's files: say why not
                share_first_requests(shares, [], e, self.process_group)
            elif exchanging:
                coordinate(self.read_once, *self._storage, None, e, self.process_group, 0)
            raise
        if shares is not None:
            share_first_requests(shares, wanted, None, self.process_group)
        return tensor_items, value_items

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a path some source format recognises."""
        path = os.fspath(checkpoint_id)
        return any(c.detect(path) for c in source_types())
