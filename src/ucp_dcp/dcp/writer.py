"""``UCPStorageWriter``: each rank writes one native data file; the coordinator commits the index.

The writer holds one location (:func:`~ucp_dcp.byteio.location.location_at`:
a local directory or an object store, as DCP's ``FsspecWriter`` holds ``fs``)
and never asks which. The rank's file is laid out and written by the one
data-file writer (aligned, self-describing, every entry hashed while it is
written). The coordinator commits the save by writing the JSON index last
(:func:`~ucp_dcp.byteio.location.commit_index`).
"""

from __future__ import annotations

import dataclasses
import io
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..byteio.datafile import chunk_entry, layout, value_entry
from ..byteio.durable import write_remedy
from ..byteio.location import (
    DataFileSpec,
    ModelDir,
    commit_index,
    location_at,
    path_arg,
    write_error,
)
from ..byteio.progress import Progress, ProgressConfig
from ..byteio.rangeio import tensor_view
from ..byteio.requests import RequestPolicy, current_rank
from ..core.placement_digest import MASK64, box_share, combine, digest_hex
from ..errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    StorageError,
)
from ..format import (
    ALIGN,
    INDEX_FILE,
    FileRecord,
    Index,
    PlannedEntry,
    WrittenEntry,
    build_index,
    data_file_name,
)
from ..format.schema import check_flags, is_int
from ._mesh_groups import compact_records
from ._plan_records import SaveSummary, tensor_data
from .save_planner import UCPSavePlanner, resolved_as, saved_form
from .slowest import SlowestRecord, log_slowest, slowest_of

__all__ = ["UCPStorageWriter", "DEFAULT_WRITE_THREADS"]

DEFAULT_WRITE_THREADS = 2
"""Writer threads per rank: two keep the storage busy while one thread copies into the page
cache and the rank's own thread hashes (measured in docs/resharding.md, "Saves")."""


@dataclass(frozen=True)
class _FileAssignment:
    """What the coordinator tells each rank (``SavePlan.storage_data``): its file and the save."""

    file: str
    world_size: int
    save_id: str


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
    mesh_chunks: int  # chunks of mesh-planned tensors written
    timing: SlowestRecord | None = None  # how long the rank took: the coordinator names the slowest
    shares: dict[str, int] = dataclasses.field(default_factory=dict)
    """Tensor -> the placement-digest share of the chunks this rank wrote (with
    ``placement_digests``): the coordinator adds the ranks' shares up."""


class UCPStorageWriter(StorageWriter):
    """Writes a universal checkpoint into directory ``path``.

    Args:
        path: checkpoint directory (created if needed).
        overwrite: save into a directory that already holds a committed
            checkpoint, replacing it (DCP's default). It is atomic: the old
            checkpoint stays loadable until the new index replaces it, and
            its data files are removed only after that. ``False`` refuses
            such a save, naming the directory, and changes nothing.
        sync_files: fsync data files and the index before the save returns.
        align: byte alignment of tensor data in the data files.
        threads: writer threads per rank for its one data file (disjoint
            byte ranges, ``pwrite``; writeback started piece by piece, so the
            final fsync has little left). The file's bytes and checksums are
            the same for every thread count; 1 writes in the rank's thread.
        storage_options: for an fsspec URL ``path`` (``s3://bucket/ckpt``,
            ``gs://``, ``memory://``...), passed to fsspec as they are. Each
            rank streams its data file to the store (a multipart upload on
            S3, no local copy); the coordinator commits by writing the index
            last, one PUT, so a save that fails or is killed midway leaves no
            index and a committed checkpoint at the same URL stays loadable.
        requests: for a URL, each part upload's deadline, the bound on
            requests in flight and the pause after throttling
            (:class:`~ucp_dcp.byteio.requests.RequestPolicy`; its defaults
            when None).
        progress: when a long save logs its progress, per rank, on the
            ``ucp_dcp.progress`` logger (:class:`~ucp_dcp.ProgressConfig`).
            After a save, ``rank_record`` (a :class:`~ucp_dcp.SlowestRecord`)
            says how long this rank's ``write_data`` took and how many bytes
            its file holds; on the coordinator, ``slowest`` names the job's
            slowest rank. Elsewhere ``slowest`` is the rank's own.
        placement_digests: record every tensor's placement digest in the
            index, so that a load can prove it put every element in its place
            (``ReadOptions(verify_placement=True)``, ``Checkpoint.verify_loaded``).
            Off by default: it hashes at about 1.6 GB/s of fp32 per rank, a large
            part of a save's time (docs/format.md, "Placement digests").

    A rank whose write fails (``ENOSPC``, an I/O error) removes its partial
    data file and raises :class:`~ucp_dcp.errors.CheckpointWriteError` (an
    ``OSError``) that keeps the errno and names the file and the rank; DCP
    then never calls :meth:`finish`, so no index is written. A failed index
    write leaves the previous index in place.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = True,
        sync_files: bool = True,
        align: int = ALIGN,
        threads: int = DEFAULT_WRITE_THREADS,
        storage_options: dict[str, Any] | None = None,
        requests: RequestPolicy | None = None,
        progress: ProgressConfig | None = None,
        placement_digests: bool = False,
    ) -> None:
        super().__init__()
        self.placement_digests = placement_digests
        if not is_int(threads) or threads < 1:
            raise InvalidArgumentError(
                f"UCPStorageWriter(threads={threads!r}): needs a whole number of writer threads, "
                "at least 1"
            )
        # The alignment pads every entry's start: it must be a positive whole number of bytes
        # (a negative one once wrote a header no reader accepts, then committed it).
        if not is_int(align) or not 1 <= align <= 1 << 30:
            raise InvalidArgumentError(
                f"UCPStorageWriter(align={align!r}): needs a whole number of bytes from 1 to 2**30"
            )
        if progress is not None and not isinstance(progress, ProgressConfig):
            raise InvalidArgumentTypeError(
                "UCPStorageWriter(progress=...) takes a ProgressConfig, got "
                f"{type(progress).__name__}"
            )
        if requests is not None and not isinstance(requests, RequestPolicy):
            raise InvalidArgumentTypeError(
                "UCPStorageWriter(requests=...) takes a RequestPolicy, got "
                f"{type(requests).__name__}"
            )
        # A truthy string ("no") must not mean overwrite=True.
        check_flags(
            "UCPStorageWriter",
            overwrite=overwrite,
            sync_files=sync_files,
            placement_digests=placement_digests,
        )
        self.threads = threads
        self.path = path_arg(path, "UCPStorageWriter: path")
        self.storage_options = storage_options
        self.requests = requests
        self._storage: ModelDir | None = None
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.align = align
        self.save_id = ""
        self.progress = progress if progress is not None else ProgressConfig()
        self.rank_record: SlowestRecord | None = None
        self.slowest: SlowestRecord | None = None

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint's path or URL (what DCP's logging names the save by)."""
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save, optionally into another directory."""
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._storage = None
        self.save_id = ""

    @property
    def storage(self) -> ModelDir:
        """Where the checkpoint goes: a local directory or an object store (made when first
        used)."""
        if self._storage is None:
            self._storage = location_at(self.path, self.storage_options, self.requests)
        return self._storage

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember whether this rank commits the checkpoint, and its rank."""
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if rank is not None else current_rank()

    def storage_meta(self) -> StorageMeta | None:
        """Tell DCP where this checkpoint goes."""
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id or None)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Nothing to add per rank."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: check the target directory and name every rank's file."""
        if self.storage.exists(INDEX_FILE) and not self.overwrite:
            raise CheckpointExistsError(
                f"{self.storage.where} already holds a committed checkpoint ({INDEX_FILE}) and the "
                "writer was made with overwrite=False; refusing to replace it. Save into a new "
                "directory, or pass overwrite=True (the default: the old checkpoint stays loadable "
                "until the new one commits)"
            )
        self.storage.make()
        save_id = self.save_id = uuid.uuid4().hex[:8]
        return [
            dataclasses.replace(
                p, storage_data=_FileAssignment(data_file_name(r, save_id), len(plans), save_id)
            )
            for r, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's file: layout, data (hashed as written), header, fsync."""
        fut: Future[list[WriteResult]] = Future()
        # Every rank learns the save id the coordinator chose (DCP's writers
        # expose theirs as ``save_id``; the reader reports it back).
        self.save_id = plan.storage_data.save_id
        self.rank_record = self.slowest = None
        progress = Progress(f"save to {self.path}", self.rank, verb="written", config=self.progress)
        entries, values = self._entries(plan, planner)
        if not entries:
            fut.set_result([])
            return fut
        job: _FileAssignment = plan.storage_data
        shares: dict[str, int] | None = {} if self.placement_digests else None
        written = self.storage.write_data_file(
            job.file,
            entries,
            self._data(plan, planner, values, shares),
            DataFileSpec(
                self.rank,
                job.world_size,
                job.save_id,
                self.align,
                self.sync_files,
                self.threads,
                progress,
            ),
        )
        seconds = progress.finish()
        where, size = self.storage.path_of(job.file), written.size
        self.rank_record = self.slowest = timing = SlowestRecord(
            self.rank, where, seconds, size, seconds, size
        )
        results = self._results(
            plan, planner, job.file, size, written.entries, written.starts, timing=timing
        )
        if shares:
            results[0].storage_data.shares.update(shares)
        fut.set_result(results)
        return fut

    @staticmethod
    def _data(
        plan: SavePlan,
        planner: SavePlanner,
        values: dict[int, bytes],
        shares: dict[str, int] | None = None,
    ) -> Iterator[tuple[Any, bool]]:
        """Each item's bytes in plan order, resolved as they are taken: a value's encoding, or a
        tensor's values as a uint8 view (:func:`~ucp_dcp.dcp.save_planner.saved_form`).

        DCP's save is synchronous: the state is not changed until ``write_data``
        returns, so tensors are ``stable`` (the writer threads may write from
        their own memory, no copy). With ``shares``, each chunk's placement-digest
        share is added to its tensor's there (the element at its global position).
        """
        for i, item in enumerate(plan.items):
            if i in values:
                yield values[i], False
                continue
            t = saved_form(resolved_as(item, planner.resolve_data(item), torch.Tensor))
            if shares is not None:
                td = tensor_data(item)
                fqn = item.index.fqn
                share = box_share(t.reshape(td.chunk.sizes), td.chunk.offsets, td.size)
                shares[fqn] = (shares.get(fqn, 0) + share) & MASK64
            yield tensor_view(t), True
            del t

    def planned_results(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """What :meth:`write_data` would report for ``plan``, without writing anything.

        Checksums are placeholders. The scale simulator (``benchmarks/``)
        uses this to build the index of thousands of virtual ranks.
        """
        entries, _ = self._entries(plan, planner)
        if not entries:
            return []
        job: _FileAssignment = plan.storage_data
        _, starts, size = layout(entries, self.rank, job.world_size, job.save_id, self.align)
        return self._results(plan, planner, job.file, size, entries, starts)

    @staticmethod
    def _results(
        plan: SavePlan,
        planner: SavePlanner,
        name: str,
        size: int,
        entries: list[PlannedEntry],
        starts: list[int],
        *,
        timing: SlowestRecord | None = None,
    ) -> list[WriteResult]:
        assert isinstance(planner, UCPSavePlanner)
        explicit = []
        compact = 0
        for item, e, s in zip(plan.items, entries, starts):
            if item.type != WriteItemType.BYTE_IO and planner.is_compact(item.index.fqn):
                compact += 1
            else:
                explicit.append(WrittenEntry.of(e, s))
        record = _WriteRecord(name, size, explicit, compact, timing)
        return [WriteResult(MetadataIndex(name), size, record)]

    @staticmethod
    def _entries(
        plan: SavePlan, planner: SavePlanner
    ) -> tuple[list[PlannedEntry], dict[int, bytes]]:
        """This rank's entries in plan order, and the encoded bytes of its values by position."""
        if not isinstance(planner, UCPSavePlanner):
            raise InvalidArgumentTypeError(
                "UCPStorageWriter needs planner=UCPSavePlanner(): other planners pickle "
                "non-tensor values"
            )
        entries: list[PlannedEntry] = []
        values: dict[int, bytes] = {}
        for i, item in enumerate(plan.items):
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                encoded = resolved_as(item, planner.resolve_data(item), io.BytesIO)
                values[i] = data = encoded.getvalue()
                entries.append(value_entry(fqn, len(data)))
            else:
                td = tensor_data(item)
                entries.append(
                    chunk_entry(
                        fqn,
                        td.properties.dtype,
                        td.size,
                        td.chunk.offsets,
                        td.chunk.sizes,
                        planner.layout_of(fqn),
                    )
                )
        return entries, values

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: build and commit the index, then drop files of older saves."""
        files: list[FileRecord] = []
        written: list[list[WrittenEntry]] = []
        counts: dict[int, int] = {}
        timings = [r[0].storage_data.timing for r in results if r]
        self.slowest = slowest_of(timings)
        if len(timings) > 1:
            log_slowest(f"save to {self.path}", self.slowest, self.progress.threshold)
        for rank, res in enumerate(results):
            if not res:
                continue
            rec: _WriteRecord = res[0].storage_data
            files.append(FileRecord(rec.file, rank, rec.file_size))
            written.append(rec.entries)
            counts[rank] = rec.mesh_chunks
        summary = SaveSummary.of(metadata, len(results))
        compact = compact_records(summary.owners, summary.positions, files, counts)
        index = build_index(summary.world_size, files, written, summary.layouts, compact)
        if self.placement_digests:
            _record_digests(index, [r[0].storage_data.shares for r in results if r])
        index.paths = {
            k: p for k, p in summary.paths.items() if k in index.tensors or k in index.values
        }
        try:
            commit_index(self.storage, index)
        except StorageError:
            raise  # names the URL and the request already
        except OSError as e:
            raise write_error(
                e,
                f"could not commit checkpoint {self.storage.where} (writing {INDEX_FILE}): "
                f"{e.strerror or e}. The save is not committed and a previous checkpoint in this "
                f"directory, if any, is intact: {write_remedy(e)}, and save again; the next save "
                "that commits here removes this one's data files",
            ) from e

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Any local path or fsspec URL can receive a checkpoint."""
        return isinstance(checkpoint_id, (str, os.PathLike))


def _record_digests(index: Index, shares: list[dict[str, int]]) -> None:
    """Set every tensor's placement digest: the sum of the ranks' shares (each chunk is written
    by exactly one rank, so the shares tile the tensor; a tensor no rank wrote a byte of is
    empty and its digest is 0)."""
    for fqn, rec in index.tensors.items():
        rec.digest = digest_hex(combine(s.get(fqn, 0) for s in shares))
