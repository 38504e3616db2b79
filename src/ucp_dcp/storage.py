"""DCP storage layer: each rank writes one safetensors file; reads are exact byte ranges.

``UCPStorageWriter`` lays out the rank's file (aligned, self-describing),
hashes every entry while writing it, and the coordinator commits the save by
writing the JSON index last. ``UCPStorageReader`` serves DCP's read items
with offset reads straight into the destination tensors (through a bounded
staging buffer only for casts and non-CPU destinations).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import io
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import distcp
from .compact import LazyChunks, compact_records
from .format import (
    ALIGN,
    INDEX_FILE,
    CheckpointFormatError,
    EntryMeta,
    FileRecord,
    Index,
    Location,
    PlannedEntry,
    TensorRecord,
    chunk_entry_name,
    data_file_name,
    dtype_name,
    layout_file,
    rank_local_entry_name,
    split_rank_local_key,
    st_dtype,
    value_entry_name,
)
from .index import ChunkLocator, WrittenEntry, build_index, load_index, write_index
from .integrity import ChunkVerifier
from .planners import UCPLoadPlanner, UCPSavePlanner
from .rangeio import RangeReader, Segment, tensor_view
from .sharding import Box
from .transfer import StagingBuffers, needs_staging, read_checked, read_staged, segments_into

__all__ = ["UCPStorageWriter", "UCPStorageReader"]

_PLACEHOLDER = "0" * 16  # an xxh3-64 hex digest has a fixed width
_MiB = 1024 * 1024


@dataclass(frozen=True)
class _WriteRecord:
    """What one rank reports to the coordinator (one WriteResult per file).

    Chunks of mesh-planned tensors are only counted: the coordinator knows
    which rank wrote which chunk, and their byte ranges and checksums are in
    the file's header. Reporting them one by one would send millions of
    records to the coordinator at scale.
    """

    file: str
    file_size: int
    entries: list[WrittenEntry]  # values, rank-local values, per-chunk-planned tensors
    compact: int  # chunks of mesh-planned tensors written


# Every data-file write goes through this name (looked up at call time), so
# tests can inject failures such as ENOSPC by monkeypatching it.
_pwrite = os.pwrite


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = _pwrite(fd, data, offset)
        if n <= 0:  # never for a regular file, but a zero would spin forever
            raise OSError(errno.EIO, f"pwrite wrote nothing at offset {offset}")
        data, offset = data[n:], offset + n


def _restated(e: OSError, msg: str) -> OSError:
    """A new OSError with message ``msg`` and ``e``'s errno (so callers can still test for ENOSPC)."""
    return OSError(e.errno, msg) if e.errno is not None else OSError(msg)


def _remove_quietly(path: str) -> None:
    """Remove ``path`` if it exists; best effort (we are already reporting another error)."""
    try:
        os.remove(path)
    except OSError:
        pass


class _Directory:
    """A checkpoint that is a local directory (``checkpoint_id`` is its path)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    def _set_path(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)


# ====================================================================== writer


class UCPStorageWriter(_Directory, StorageWriter):
    """Writes a universal checkpoint into directory ``path``.

    Args:
        path: checkpoint directory (created if needed).
        overwrite: allow saving into a directory that already holds a
            committed checkpoint. The old checkpoint stays loadable until the
            new index replaces it; its data files are removed after that.
        sync_files: fsync data files and the index before the save returns.
        align: byte alignment of tensor data in the data files.

    A rank whose write fails (``ENOSPC``, an I/O error) removes its partial
    data file and raises an ``OSError`` that keeps the errno and names the
    file and the rank; DCP then never calls :meth:`finish`, so no index is
    written. A failed index write leaves the previous index in place.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        sync_files: bool = True,
        align: int = ALIGN,
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.align = align
        self.save_id = ""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, optionally into another directory."""
        self._set_path(checkpoint_id)
        self.save_id = ""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank commits the checkpoint, and its rank."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)

    def storage_meta(self) -> StorageMeta | None:
        """Tell DCP where this checkpoint goes."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id or None)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add per rank."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check the target directory and name every rank's file."""
        index = os.path.join(self.path, INDEX_FILE)
        if os.path.exists(index) and not self.overwrite:
            raise FileExistsError(
                f"{self.path} already holds a committed checkpoint ({INDEX_FILE}); refusing to replace it. "
                "Save into a new directory, or pass UCPStorageWriter(path, overwrite=True)"
            )
        os.makedirs(self.path, exist_ok=True)
        save_id = uuid.uuid4().hex[:8]
        return [
            dataclasses.replace(
                p, storage_data={"file": data_file_name(r, save_id), "world_size": len(plans), "save_id": save_id}
            )
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's file: layout, data (hashed as written), header, fsync."""
        fut: Future[list[WriteResult]] = Future()
        layout = self._lay_out(plan, planner)
        if layout is None:
            fut.set_result([])
            return fut
        name, world, save_id, entries, values, header, starts, size = layout
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise self._write_error(path, e, removed=False) from e
        try:
            try:
                os.ftruncate(fd, size)  # padding stays a hole: reads as zeros, costs no writes
                for i, (item, entry, start) in enumerate(zip(plan.items, entries, starts)):
                    if i in values:
                        _write_all(fd, memoryview(values[i]), start)
                        continue
                    t = planner.resolve_data(item)
                    if t.device.type != "cpu":
                        t = t.cpu()
                    view = tensor_view(t.contiguous())
                    entries[i] = dataclasses.replace(
                        entry, meta=dataclasses.replace(entry.meta, xxh3=xxhash.xxh3_64_hexdigest(view))
                    )
                    _write_all(fd, view, start)
                    del t, view
                final, _, _ = layout_file(entries, self.rank, world, save_id, self.align)
                if len(final) != len(header):  # cannot happen: checksums are fixed-width
                    raise AssertionError(f"{path}: header length changed while writing")
                _write_all(fd, memoryview(final), 0)
                if self.sync_files:
                    os.fsync(fd)  # may be where a full disk shows (delayed allocation, NFS)
            finally:
                os.close(fd)  # so can this (NFS reports write errors at close)
        except BaseException as e:
            # A half-written file is no use to anyone and holds space a full
            # disk needs back; no index will name it (DCP skips finish()).
            _remove_quietly(path)
            if isinstance(e, OSError):
                raise self._write_error(path, e, removed=True) from e
            raise
        fut.set_result(self._results(plan, planner, name, size, entries, starts))
        return fut

    def _write_error(self, path: str, e: OSError, *, removed: bool) -> OSError:
        """``e`` restated with the file, this rank and what to do; errno kept for callers."""
        gone = "; its partial file was removed" if removed else ""
        msg = (
            f"rank {self.rank} could not write checkpoint data file {path}: {e.strerror or e}{gone}. "
            "The save is not committed and a previous checkpoint is untouched: free space (or save "
            "elsewhere) and save again"
        )
        return _restated(e, msg)

    def planned_results(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """What :meth:`write_data` would report for ``plan``, without writing anything.

        Checksums are placeholders. The scale simulator (``benchmarks/``)
        uses this to build the index of thousands of virtual ranks.
        """
        layout = self._lay_out(plan, planner)
        if layout is None:
            return []
        name, _, _, entries, _, _, starts, size = layout
        return self._results(plan, planner, name, size, entries, starts)

    @staticmethod
    def _results(
        plan: SavePlan, planner: SavePlanner, name: str, size: int, entries: list[PlannedEntry], starts: list[int]
    ) -> list[WriteResult]:
        assert isinstance(planner, UCPSavePlanner)
        explicit = []
        compact = 0
        for item, e, s in zip(plan.items, entries, starts):
            if item.type != WriteItemType.BYTE_IO and planner.is_compact(item.index.fqn):
                compact += 1
            else:
                explicit.append(WrittenEntry(e.name, e.meta, s, e.nbytes))
        return [WriteResult(MetadataIndex(name), size, _WriteRecord(name, size, explicit, compact))]

    def _lay_out(
        self, plan: SavePlan, planner: SavePlanner
    ) -> tuple[str, int, str, list[PlannedEntry], dict[int, bytes], bytes, list[int], int] | None:
        """This rank's file name, entries, encoded values, header, entry offsets and size."""
        if not isinstance(planner, UCPSavePlanner):
            raise TypeError(
                "UCPStorageWriter needs planner=UCPSavePlanner(): other planners pickle non-tensor values"
            )
        if not plan.items:
            return None
        name = plan.storage_data["file"]
        world = plan.storage_data["world_size"]
        save_id = plan.storage_data["save_id"]
        entries: list[PlannedEntry] = []
        values: dict[int, bytes] = {}
        for i, item in enumerate(plan.items):
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item).getvalue()
                values[i] = data
                rl = split_rank_local_key(fqn)
                kind, key = ("rank_local", rl[1]) if rl else ("value", fqn)
                ename = rank_local_entry_name(key) if rl else value_entry_name(key)
                meta = EntryMeta(kind, key, "uint8", (len(data),), (), (), xxhash.xxh3_64_hexdigest(data))
                entries.append(PlannedEntry(ename, "U8", (len(data),), len(data), meta))
            else:
                td = item.tensor_data
                dtype = td.properties.dtype
                sizes = tuple(td.chunk.sizes)
                nbytes = td.chunk.sizes.numel() * dtype.itemsize
                st = st_dtype(dtype)
                meta = EntryMeta(
                    "tensor", fqn, dtype_name(dtype), tuple(td.size), tuple(td.chunk.offsets), sizes,
                    _PLACEHOLDER, planner.layout_of(fqn),
                )
                shape = sizes if st else (nbytes,)
                entries.append(PlannedEntry(chunk_entry_name(fqn, td.chunk.offsets), st or "U8", shape, nbytes, meta))
        header, starts, size = layout_file(entries, self.rank, world, save_id, self.align)
        return name, world, save_id, entries, values, header, starts, size

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: build and commit the index, then drop files of older saves."""
        files: list[FileRecord] = []
        written: list[list[WrittenEntry]] = []
        counts: dict[int, int] = {}
        for rank, res in enumerate(results):
            if not res:
                continue
            rec: _WriteRecord = res[0].storage_data
            files.append(FileRecord(rec.file, rank, rec.file_size))
            written.append(rec.entries)
            counts[rank] = rec.compact
        pdata = metadata.planner_data or {}
        compact = compact_records(pdata.get("owners", {}), pdata.get("positions", {}), files, counts)
        index = build_index(pdata.get("world_size", len(results)), files, written, pdata.get("layouts"), compact)
        try:
            write_index(self.path, index)
        except OSError as e:
            self._remove_index_temps()
            msg = (
                f"could not commit checkpoint {self.path} (writing {INDEX_FILE}): {e.strerror or e}. "
                "The save is not committed and a previous checkpoint in this directory, if any, is "
                "intact. Free space (or save elsewhere) and save again; the next save that commits "
                "here removes this one's data files"
            )
            raise _restated(e, msg) from e
        keep = {f.name for f in files}
        for name in os.listdir(self.path):
            # Only our own data files: never delete anything else a user keeps here.
            if name.startswith("rank") and name.endswith(".safetensors") and name not in keep:
                os.remove(os.path.join(self.path, name))

    def _remove_index_temps(self) -> None:
        """After a failed index write: remove its temp file (best effort).

        Only the coordinator of a save into this directory writes index temp
        files, so any left here are ours. The new data files stay: an error
        (an NFS timeout, say) may be reported after the rename went through,
        and then they are the committed checkpoint.
        """
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if name.startswith(f".{INDEX_FILE}.") and name.endswith(".tmp"):
                _remove_quietly(os.path.join(self.path, name))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path can receive a checkpoint."""
        return isinstance(checkpoint_id, (str, os.PathLike))


# ====================================================================== reader


def _record_boxes(record: TensorRecord) -> list[Box]:
    return [c.box for c in record.chunk_list()]



class UCPStorageReader(_Directory, StorageReader):
    """Reads a universal checkpoint from directory ``path``.

    Args:
        path: checkpoint directory.
        io_threads: threads issuing reads in parallel.
        max_buffer_bytes: bound on staging memory (used for dtype casts and
            non-CPU destinations; CPU tensors are filled in place).
        gap_bytes: neighbouring byte ranges closer than this are read with
            one call. The default, one page less a byte, never pulls in a
            page that holds no needed byte.
        max_request_bytes: largest single read, so big tensors are read by
            several threads at once.
        dcp_values: for a checkpoint in DCP's default ``.distcp`` format
            (read directly, see :mod:`ucp_dcp.distcp`): its non-tensor values
            are pickles and are refused by default, naming the key;
            ``"weights_only"`` loads them with ``torch.load(weights_only=True)``.
        verify: check every saved chunk this rank's reads touch against its
            recorded xxh3-64 (each chunk once per ``read_data``), raising
            :class:`~ucp_dcp.integrity.ChecksumError` (naming tensor, chunk,
            file and writing rank) on a mismatch. A read that fills a whole
            chunk into contiguous CPU memory is checked by hashing that
            memory; any other (a reshard reading part of a chunk, a cast, a
            device destination) reads the whole chunk again to hash it.
            ``verified_bytes`` / ``verify_seconds`` add up the bytes hashed
            and the time spent (the extra reads also count in
            ``bytes_requested``). Values are always checked.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        io_threads: int = 4,
        max_buffer_bytes: int = 64 * _MiB,
        gap_bytes: int | None = None,
        max_request_bytes: int = 16 * _MiB,
        dcp_values: str | None = None,
        verify: bool = False,
    ) -> None:
        super().__init__()
        if dcp_values not in distcp.DCP_VALUES_MODES:
            raise ValueError(f"dcp_values must be one of {distcp.DCP_VALUES_MODES}, got {dcp_values!r}")
        self.path = os.fspath(path)
        self.dcp_values = dcp_values
        self.dcp: distcp.DCPCheckpoint | None = None  # set when reading DCP's default format
        self.io_threads = io_threads
        self.max_buffer_bytes = max(max_buffer_bytes, _MiB)
        self.gap_bytes = (os.sysconf("SC_PAGE_SIZE") - 1) if gap_bytes is None else gap_bytes
        self.max_request_bytes = max_request_bytes
        self.index: Index | None = None
        self.bytes_requested = 0
        self.read_calls = 0
        self.verify = verify
        self.verified_bytes = 0
        self.verify_seconds = 0.0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another directory."""
        self._set_path(checkpoint_id)
        self.index = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Parse the JSON index into DCP's metadata (no unpickling).

        A directory in DCP's default format (``.metadata``, no index) is read
        through :class:`ucp_dcp.distcp.DCPCheckpoint`: only DCP's metadata is
        unpickled, with a restricted unpickler.
        """
        self.dcp = distcp.DCPCheckpoint(self.path) if distcp.is_dcp_checkpoint(self.path) else None
        if self.dcp is not None:
            self.index = index = self.dcp.index
            self._locator: ChunkLocator = self.dcp.locator()
        else:
            self.index = index = load_index(self.path)
            self._locator = ChunkLocator(self.path, index)
        md: dict[str, Any] = {}
        for fqn, t in index.tensors.items():
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=t.dtype), torch.Size(t.shape), LazyChunks(functools.partial(_record_boxes, t))
            )
        for fqn in [*index.values, *index.rank_local]:
            md[fqn] = BytesStorageMetadata()
        return Metadata(
            state_dict_metadata=md,
            planner_data={
                "world_size": index.world_size,
                "rank_local": {k: sorted(v) for k, v in index.rank_local.items()},
                # In-process only (load metadata is never sent between ranks):
                # lets UCPLoadPlanner find overlaps without listing chunks.
                "chunk_grid": self._locator.grid,
            },
            storage_meta=StorageMeta(checkpoint_id=self.path),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Make sure the index is loaded (DCP may hand us metadata read elsewhere)."""
        if self.index is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to add per rank (UCPLoadPlanner keeps its items local; see read_data)."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to coordinate: every rank reads its own byte ranges."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the tensors ``planner`` resolves."""
        assert self.index is not None
        if not isinstance(planner, UCPLoadPlanner) and any(ri.type == LoadItemType.BYTE_IO for ri in plan.items):
            raise TypeError("UCPStorageReader needs planner=UCPLoadPlanner() to decode non-tensor values")
        loc = self._locator
        if self.dcp is not None:  # refuse pickled values unless opted in; parse the items needed
            self.dcp.check_plan(plan, self.dcp_values, self.io_threads)
        reader = RangeReader(
            loc.paths, threads=self.io_threads, gap_bytes=self.gap_bytes, max_request_bytes=self.max_request_bytes
        )
        verifier = (
            ChunkVerifier(reader, loc.paths, [f.rank for f in self.index.files], block=self.max_request_bytes)
            if self.verify
            else None
        )
        try:
            segments: list[Segment] = []
            pending: list[tuple[ReadItem, torch.Tensor]] = []
            staged: list[tuple[ReadItem, torch.Tensor, Location, Box, torch.dtype]] = []
            value_items: list[ReadItem] = []
            for ri in plan.items:
                if ri.type == LoadItemType.BYTE_IO:
                    value_items.append(ri)
                    continue
                fqn = ri.storage_index.fqn
                src_dtype = self.index.tensors[fqn].dtype
                idx = loc.chunk_index(fqn, tuple(ri.storage_index.offset), ri.storage_index.index)
                location = loc.locate(fqn, idx)
                chunk = loc.box(fqn, idx)
                dest = planner.resolve_tensor(ri)
                region = Box(tuple(ri.storage_offsets), tuple(ri.lengths))
                if getattr(location, "dim_order", None):  # a DCP item stored transposed (distcp.py)
                    distcp.read_region(reader, location, chunk.sizes, region, src_dtype, dest, self.max_buffer_bytes)
                    if verifier is not None:
                        verifier.add(location, fqn, chunk.offsets)
                    planner.commit_tensor(ri, dest)
                    continue
                if needs_staging(dest, src_dtype):
                    staged.append((ri, dest, location, chunk, src_dtype))
                    continue
                if verifier is not None:
                    # The destination holds exactly the chunk's bytes after
                    # the read: hash it there. Otherwise read the chunk again.
                    whole = region == Box((0,) * len(chunk.sizes), chunk.sizes) and dest.is_contiguous()
                    verifier.add(location, fqn, chunk.offsets, dest if whole else None)
                segments.extend(segments_into(location, chunk.sizes, region, dest))
                pending.append((ri, dest))
                if len(segments) >= 16384:  # bound the bookkeeping memory, not just the data
                    self._flush(reader, segments, pending, planner, verifier)
            self._flush(reader, segments, pending, planner, verifier)
            # One staging buffer for all staged items (pinned, double-buffered
            # for CUDA targets); close() waits for the last device copies.
            largest = max((torch.Size(ri.lengths).numel() * sd.itemsize for ri, *_, sd in staged), default=0)
            with StagingBuffers(self.max_buffer_bytes, largest_bytes=largest) as staging_buffers:
                for ri, dest, location, chunk, src_dtype in staged:
                    self._read_staged(reader, ri, dest, location, chunk, src_dtype, planner, staging_buffers)
                    if verifier is not None:  # a cast or device copy: the chunk is read again
                        verifier.add(location, ri.storage_index.fqn, chunk.offsets)
                        verifier.check()  # right after the read: its pages are likely still cached
            for ri in value_items:
                planner.load_bytes(ri, io.BytesIO(self._read_value(reader, ri.storage_index.fqn)))
        finally:
            reader.close()
            self.bytes_requested += reader.stats.bytes
            self.read_calls += reader.stats.calls
            if verifier is not None:
                self.verified_bytes += verifier.bytes
                self.verify_seconds += verifier.seconds
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _flush(
        reader: RangeReader,
        segments: list[Segment],
        pending: list[tuple[ReadItem, torch.Tensor]],
        planner: LoadPlanner,
        verifier: ChunkVerifier | None = None,
    ) -> None:
        reader.read(segments)
        if verifier is not None:
            verifier.check()  # before commit: planners may move the data on
        for ri, dest in pending:
            planner.commit_tensor(ri, dest)
        segments.clear()
        pending.clear()

    def _read_staged(
        self,
        reader: RangeReader,
        ri: ReadItem,
        dest: torch.Tensor,
        location: Location,
        chunk: Box,
        src_dtype: torch.dtype,
        planner: LoadPlanner,
        staging: StagingBuffers | None = None,
    ) -> None:
        region = Box(tuple(ri.storage_offsets), tuple(ri.lengths))
        read_staged(reader, location, chunk.sizes, region, src_dtype, dest, self.max_buffer_bytes, buffers=staging)
        # A CUDA dest may still be receiving (on its current stream, which
        # orders any device work commit_tensor does after the copies).
        planner.commit_tensor(ri, dest)

    def _read_value(self, reader: RangeReader, key: str) -> bytes:
        assert self.index is not None
        if self.dcp is not None:  # DCP's default format: a pickle, refused unless opted in
            return self.dcp.read_value(reader, key, self.dcp_values)
        rl = split_rank_local_key(key)
        try:
            location = self.index.rank_local[rl[1]][rl[0]] if rl else self.index.values[key]
        except KeyError:
            raise CheckpointFormatError(f"{self.path}: no saved value for {key!r}") from None
        record = self.index.files[location.file]
        return read_checked(reader, location, os.path.join(self.path, record.name), f"value {key!r}", record.rank)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a directory holding a ucp_dcp index or DCP's ``.metadata``."""
        return os.path.isfile(os.path.join(os.fspath(checkpoint_id), INDEX_FILE)) or distcp.is_dcp_checkpoint(
            checkpoint_id
        )
