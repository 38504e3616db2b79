"""``UCPStorageReader``: ``dcp.load`` from any source, with exact offset reads.

The checkpoint is opened as a :class:`~ucp_dcp.sources.Source` (native,
DCP's own format, a Hugging Face directory, accelerate's subfolders, ...),
whose records become DCP's metadata. Each read item then goes one way:
the source locates the saved chunk's bytes, and the range reader fills the
destination tensor in place (CPU, same dtype, row-major on disk), or through
bounded staging (a cast, a device destination, a chunk stored in another
dimension order). The reader itself knows no format.

The module ends with small functions between DCP's records and this library's: which saved chunk
a tensor read item reads and the region of it, the bytes a planner expects for a value, the save
that wrote a checkpoint, and the pause of Python's garbage collector a load runs under
(:func:`collector_paused`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import io
import math
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..byteio.engine import ChunkReads, Region
from ..byteio.location import path_arg
from ..byteio.progress import Progress
from ..byteio.rangeio import ByteSource
from ..byteio.requests import current_rank, rank_and_world
from ..byteio.transfer import ChunkRegion, check_writable, extents, needs_staging
from ..core.sharding import Box
from ..core.spans import EXACT, may_share
from ..core.values import decode_value
from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..format import TensorRecord
from ..format.names import save_id_of
from ..sources import NativeSource, Source, read_values, source_types
from ._mesh_groups import LazyChunks
from ._plan_records import LoadSourceInfo
from .load_planner import UCPLoadPlanner
from .machine import Whereabouts, machine_shared, ranks_by_machine
from .options import LoadReport, ReadOptions
from .placement import checked_placement
from .read_once import ReadOnceDecision, checkpoint_identity, coordinate, decide, shared_storage
from .read_once.exchange import LocalNeeds, run_exchange
from .read_once.first_requests import share_first_requests
from .read_once.transport import Transport, Wire, wire_for
from .slowest import LoadRun, gather_slowest, log_slowest, rank_record

__all__ = ["PlannedRead", "UCPStorageReader", "collector_paused"]

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


class UCPStorageReader(StorageReader):
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
        options: how to read (:class:`~ucp_dcp.ReadOptions`: threads, buffers, checksums,
            request policy, read-once, progress, placement checks); its defaults when None.
        storage_options: for a URL, passed to fsspec as they are
            (credentials, ``client_kwargs={"endpoint_url": ...}``).
        prefix: prepended to the tensor names of a Hugging Face model
            (``"model."`` fills ``get_state_dict`` keys).
        dcp_values: for a checkpoint in DCP's default ``.distcp`` format:
            its non-tensor values are pickles and are refused by default,
            naming the key; ``"weights_only"`` loads them with
            ``torch.load(weights_only=True)``.
        process_group: the group ``dcp.load`` runs on (default: the default
            group), for ``read_once``, ``verify_placement``, naming the slowest rank.

    What each load found is :attr:`last_load` (a :class:`~ucp_dcp.LoadReport`, replaced when the
    next load starts reading).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        options: ReadOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        prefix: str = "",
        dcp_values: str | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.options = opts = ReadOptions.given(options, "UCPStorageReader")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise InvalidArgumentTypeError(
                "UCPStorageReader: process_group must be a torch.distributed ProcessGroup or "
                f"None, got {type(process_group).__name__}"
            )
        self.process_group = process_group
        self.path = path_arg(path, "UCPStorageReader: path")
        self.storage_options = storage_options
        self._source_options = opts.source_options(dcp_values, prefix)
        self.source: Source | None = None
        self.last_load = LoadReport()
        self.load_id = uuid.uuid4().hex
        self._storage: tuple[bool, str] = (False, "")  # set by _may_exchange
        self._wire = Wire(Transport.GROUP, process_group)  # set by _may_exchange
        self._known: dict[str, bytes] | None = None
        self._buffer_bytes = opts.buffer_bytes  # tests set it below the floor: many slabs

    def provide_files(self, files: Mapping[str, bytes]) -> None:
        """Files of the checkpoint the caller has already read (file name -> bytes, e.g.
        ``{"ucp_index.json": data}``): the next opening parses these bytes instead of reading
        (or, in object storage, fetching) them again. :class:`~ucp_dcp.CheckpointManager` hands
        on the index it has checked against its commit marker, so the load parses the very
        bytes that were checked. Used once; dropped by :meth:`reset` to another checkpoint."""
        self._known = dict(files) if files else None

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's path or URL (what DCP's logging names the load by)."""
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint."""
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.path:
            self._known = None  # bytes of the checkpoint given first, not of this one
            self.path = os.fspath(checkpoint_id)
        self.source = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Open the source and describe it as DCP's metadata (nothing is unpickled but DCP's own
        records)."""
        self.source = source = self.options.open_source(
            self.path, self._source_options, self.storage_options, self._known
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
        """Say which machine this rank runs on (UCPLoadPlanner keeps its items local; see
        read_data)."""
        return dataclasses.replace(plan, storage_data=Whereabouts.here())

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
            idx = saved_chunk(src, item.storage_index)
            f = rec.chunk_file(idx)
            f = f if f is not None else src.locate(key, idx).file
            nbytes = math.prod(item.lengths) * rec.dtype.itemsize
            out.append(PlannedRead(item.dest_index.fqn, index.files[f].name, nbytes, key))
        return out

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Tell every rank how many ranks load (whether the load runs collectives) and which of
        them share its machine (its page cache: how it reads its files); each reads its own byte
        ranges."""
        machines = ranks_by_machine([p.storage_data for p in plans])
        return [
            dataclasses.replace(p, storage_data=LoadRun(len(plans), m))
            for p, m in zip(plans, machines)
        ]

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
            rank = current_rank()
            self.last_load = report = LoadReport()
            progress = Progress(f"load of {self.path}", rank, config=self.options.progress)
            with checked_placement(  # after the slowest rank's gather, on both paths
                self.options.verify_placement,
                self.source,
                planner,
                self.process_group,
                self.path,
                self.options.device_transport,
            ) as check:
                try:
                    fut = self._read_data(plan, planner, report, progress)
                except BaseException:
                    self._name_slowest(plan, rank, t0, report, progress, failing=True)
                    raise
                self._name_slowest(plan, rank, t0, report, progress, failing=False)
            report.placement = check.report
            return fut

    def _name_slowest(
        self,
        plan: LoadPlan,
        rank: int,
        t0: float,
        report: LoadReport,
        progress: Progress,
        *,
        failing: bool,
    ) -> None:
        """End the load: ``progress``'s last line (naming this rank's slowest file), the report's
        ``rank_record`` and ``slowest`` (:func:`~ucp_dcp.dcp.slowest.gather_slowest`: every rank
        of a collective load calls it, also when its load failed), the job's slowest rank logged
        by rank 0 of the group when the load ran past the progress threshold."""
        run, paths = plan.storage_data, self.source.paths if self.source is not None else []
        ranks = run.ranks if isinstance(run, LoadRun) else 1
        own = rank_record(rank, time.perf_counter() - t0, report.stats, paths)
        ran = progress.finish("" if failing else own.where())
        job = gather_slowest(own, ranks, self.process_group, paths, failing=failing)
        if ranks > 1 and not failing and dist.get_rank(self.process_group) == 0:
            log_slowest(progress.what, job, progress.config.threshold, ran)
        report.rank_record, report.slowest = own, job

    def _read_data(
        self, plan: LoadPlan, planner: LoadPlanner, report: LoadReport, progress: Progress
    ) -> Future[None]:
        src, opts = self.source, self.options
        assert src is not None
        exchanging = self._may_exchange(report)
        tensor_items, value_items = self._items(src, plan, exchanging)
        try:
            src.prepare(
                [(ri.storage_index.fqn, idx) for ri, idx in tensor_items],
                [ri.storage_index.fqn for ri in value_items],
                opts.io_threads,
            )
            parts = [chunk_part(src, ri, idx) for ri, idx in tensor_items]
        except Exception as e:
            if exchanging:  # the other ranks wait for this one's needs: say why not
                coordinate(opts.read_once, *self._storage, None, e, self._wire.group, 0)
            raise
        reader = opts.open_reader(src)
        report.stats = reader.stats
        reader.stats.progress = progress
        engine = ChunkReads(
            reader,
            src.paths,
            src.file_ranks(),
            verify=opts.verify,
            max_buffer_bytes=self._buffer_bytes,
            reread_block=opts.max_request_bytes,
        )
        try:
            items = self._exchange(src, reader, planner, tensor_items, parts, exchanging, report)
            chosen = self._plan_access(
                reader,
                plan,
                planner,
                [tensor_items[i][0] for i in items],
                [parts[i][0] for i in items],
            )
            report.file_access = {src.paths[f]: how for f, how in sorted(chosen.items())}
            for i in items:
                (ri, idx), (part, chunk_offsets) = tensor_items[i], parts[i]
                fqn = ri.storage_index.fqn
                dest = planner.resolve_tensor(ri)
                engine.add(
                    part,
                    dest,
                    name=fqn,
                    chunk_offsets=chunk_offsets,
                    sums=src.sums_to_check(fqn, idx, part.location, engine.verify),
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
            report.add_reads(reader.stats, engine.stats)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_access(
        self,
        reader: ByteSource,
        plan: LoadPlan,
        planner: LoadPlanner,
        items: list[ReadItem],
        parts: list[ChunkRegion],
    ) -> dict[int, str]:
        """How ``reader`` reads each file of ``parts`` (the regions of tensor ``items``): from this
        rank's needs, then, for a file read exactly of which it reads at least a read-ahead
        window, with the pages other ranks on its machine read (:func:`machine_shared`)."""
        src, mode, run = self.source, self.options.access, plan.storage_data
        assert src is not None
        needs = extents(parts)
        chosen = reader.plan_access(needs, mode)
        if mode != "auto" or not isinstance(run, LoadRun) or len(run.machine) < 2:
            return chosen
        files = {
            f for f, how in chosen.items() if how == EXACT and may_share(int(needs[f][1].sum()))
        }
        shared = machine_shared(src, planner, items, files, run.machine) if files else {}
        return reader.plan_access(needs, mode, shared) if shared else chosen

    def _exchange(
        self,
        src: Source,
        reader: ByteSource,
        planner: LoadPlanner,
        tensor_items: list[tuple[ReadItem, int]],
        parts: list[tuple[ChunkRegion, tuple[int, ...]]],
        exchanging: bool,
        report: LoadReport,
    ) -> list[int]:
        """Fill what the job reads once (see ``read_once``); the positions of the tensor items
        left for this rank to read itself."""
        everything, verify = list(range(len(tensor_items))), self.options.verify
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
                check_writable(dest, ri.storage_index.fqn)
                if dest.is_conj() or dest.is_neg():
                    continue  # its memory holds values conjugated or negated: the engine stages it
                fqn = ri.storage_index.fqn
                sums = src.sums_to_check(fqn, idx, part.location, verify)
                if sums is None and part.location.xxh3 and verify:
                    continue  # checked chunk by chunk only: the engine reads it whole
                if needs_staging(dest, part.dtype, part.location) and sums is None:
                    # A cast or device copy needs whole elements: only checked blocks arrive as
                    # whole ones.
                    continue
                done = functools.partial(planner.commit_tensor, ri, dest)
                regions.append(Region(part, dest, fqn, chunk_offsets, sums, done))
                taken.append(i)
            needs = LocalNeeds(regions)
        except Exception as e:  # noqa: BLE001  (every rank must reach the collective; raised there)
            failure, needs = e, None
        # Two rounds in flight, each a send and a receive buffer, and the next round's reads.
        budget = _ROUND_BYTES or max(self._buffer_bytes // 5, _MiB)
        report.read_once, rounds = coordinate(
            self.options.read_once,
            *self._storage,
            needs,
            failure,
            self._wire.group,
            budget,
            self.options.read_once_costs,
            (self.path, checkpoint_identity([(f.name, f.size) for f in src.index.files])),
        )
        if rounds is None:
            return everything
        assert needs is not None
        report.exchange = run_exchange(
            rounds, needs, reader, src.paths, src.file_ranks(), self._wire
        )
        exchanged = set(taken)
        return [i for i in everything if i not in exchanged]

    def _may_exchange(self, report: LoadReport) -> bool:
        """Whether this load takes part in a read-once exchange (then every rank of the group
        must reach :func:`~ucp_dcp.dcp.read_once.coordinate`). Looks at the storage once per
        load (``_storage``); ``"auto"`` on storage the job does not share is decided here, by
        this rank alone, before any need is listed.

        Then the transport (``_wire``, :func:`~ucp_dcp.dcp.read_once.transport.wire_for`): on a
        group that is NCCL alone, a gloo group made from its ranks the first time (collective:
        every rank of the group is here, with the same options), unless ``device_transport``
        opts in to device memory; where no host-memory group can be had, no exchange."""
        mode = self.options.read_once
        if mode is False or rank_and_world(self.process_group)[1] < 2:
            return False
        self._storage = shared, kind = shared_storage(self.path)
        if mode == "auto" and not shared:
            report.read_once = decide(mode, shared, kind, None)
            return False
        self._wire = wire_for(self.process_group, self.options.device_transport)
        report.transport = self._wire.transport
        if self._wire.transport is Transport.NONE:
            report.read_once = ReadOnceDecision(
                mode,
                False,
                "the group is NCCL alone and this torch has no gloo to move host memory with "
                "(ReadOptions(device_transport=True) exchanges in device memory)",
                kind,
                shared,
            )
            return False
        return True

    def _items(
        self, src: Source, plan: LoadPlan, exchanging: bool
    ) -> tuple[list[tuple[ReadItem, int]], list[ReadItem]]:
        """The plan's tensor items (with the position of the chunk each reads) and value items.

        Where the load may exchange, the ranks also share the data files' first requests
        (:mod:`~ucp_dcp.dcp.read_once.first_requests`): each is made by one rank, not by every
        rank that reads the file.
        """
        shares = (
            src if exchanging and src.store is not None and isinstance(src, NativeSource) else None
        )
        try:
            value_items = [ri for ri in plan.items if ri.type == LoadItemType.BYTE_IO]
            tensor_items = [
                (ri, saved_chunk(src, ri.storage_index))
                for ri in plan.items
                if ri.type != LoadItemType.BYTE_IO
            ]
            wanted: list[int] = []
            if shares is not None:
                wanted = shares.first_requests(
                    [(ri.storage_index.fqn, idx) for ri, idx in tensor_items],
                    [ri.storage_index.fqn for ri in value_items],
                )
        except Exception as e:
            if shares is not None:  # the other ranks wait for this one's files: say why not
                share_first_requests(shares, [], e, self._wire)
            elif exchanging:
                coordinate(self.options.read_once, *self._storage, None, e, self._wire.group, 0)
            raise
        if shares is not None:
            share_first_requests(shares, wanted, None, self._wire)
        return tensor_items, value_items

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a path some source format recognises."""
        path = os.fspath(checkpoint_id)
        return any(c.detect(path) for c in source_types())


# ------------------------------------------------------------ what a load plan's read items are


def record_boxes(record: TensorRecord) -> list[Box]:
    """The boxes of every saved chunk of ``record``."""
    return [c.box for c in record.chunk_list()]


def chunk_part(src: Source, ri: ReadItem, idx: int) -> tuple[ChunkRegion, tuple[int, ...]]:
    """The region of saved chunk ``idx`` that tensor read item ``ri`` reads, and the chunk's
    offsets in the tensor."""
    fqn = ri.storage_index.fqn
    chunk = src.box(fqn, idx)
    region = Box(tuple(ri.storage_offsets), tuple(ri.lengths))
    dtype = src.index.tensors[fqn].dtype
    return ChunkRegion(src.locate(fqn, idx), chunk.sizes, region, dtype), chunk.offsets


def value_for(planner: LoadPlanner, tagged: bytes, ri: ReadItem) -> io.BytesIO:
    """What ``planner.load_bytes`` expects: the tagged JSON for UCPLoadPlanner; for any other
    planner (DCP's own, which calls ``torch.load`` on it) the decoded value re-saved with
    ``torch.save``.

    The decoded value holds only what tagged JSON can: numbers, strings,
    containers, tensors, arrays; nothing from the checkpoint is unpickled.
    """
    if isinstance(planner, UCPLoadPlanner):
        return io.BytesIO(tagged)
    buf = io.BytesIO()
    torch.save(decode_value(tagged, ri.storage_index.fqn), buf)
    buf.seek(0)
    return buf


def saved_chunk(src: Source, index: MetadataIndex) -> int:
    """The position in ``src`` of the saved chunk a tensor read item reads, found by its offsets
    (DCP's planners set them on every one)."""
    if index.offset is None:
        raise InvalidArgumentError(
            f"tensor {index.fqn!r}: the load plan reads a chunk of it without its offsets "
            "(MetadataIndex.offset); a tensor read item must name the saved chunk it reads"
        )
    return src.chunk_index(index.fqn, tuple(index.offset), index.index)


def save_id(index: Any) -> str | None:
    """The save that wrote a native checkpoint's data files (None for other formats, or a mix)."""
    ids = {save_id_of(f.name) for f in getattr(index, "files", ())}
    return ids.pop() if len(ids) == 1 else None


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) for the ``with`` block, if it was
    running."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
