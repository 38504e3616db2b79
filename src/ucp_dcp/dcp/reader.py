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

import contextlib
import functools
import gc
import io
import os
import uuid
from collections.abc import Iterator
from typing import Any

import torch
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

from ..byteio.blocksums import BlockVerifier, ChunkCheck
from ..byteio.integrity import ChunkVerifier
from ..byteio.rangeio import RangeReader, Segment
from ..byteio.transfer import (
    StagingBuffers,
    needs_staging,
    read_staged,
    segments_into,
    spanned,
    staging_plan,
)
from ..core.sharding import Box
from ..core.values import decode_value
from ..format import Location, TensorRecord
from ..format.names import save_id_of
from ..sources import Source, SourceOptions, open_source, read_value, source_types
from ..sources.distcp import DCP_VALUES_MODES
from ._directory import _Directory
from ._plan_records import LoadSourceInfo
from .compact import LazyChunks
from .planners import UCPLoadPlanner

__all__ = ["UCPStorageReader"]

_MiB = 1024 * 1024
# Read threads per rank. Measured on the development VM (2 cores, virtio disk, cold page cache
# evicted
# with benchmarks/harness/pagecache.py; RangeReader reading 64 MiB files, 3 runs each): with 4 ranks
# reading at once, 2 threads per rank pulled a median 1.6-2.1 GB/s in 1-16 MiB requests, 4 threads
# 1.2-1.5 GB/s, 8 threads 0.7-1.4 GB/s; one rank alone, 1-2 threads 2.7-2.9 GB/s in 1 MiB requests,
# 4
# threads 1.6-2.1. Each thread announces its requests a window ahead (POSIX_FADV_WILLNEED), so two
# keep
# the device's queue full; more only contend for the cores. Scattered one-page reads (one per 8 KiB)
# ran at 0.10-0.15 GB/s with 4 ranks whatever the thread count: bound by calls, not by requests in
# flight (core/spans.py reads such regions as spans).
_IO_THREADS = 2


def _record_boxes(record: TensorRecord) -> list[Box]:
    return [c.box for c in record.chunk_list()]


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        io_threads: int = _IO_THREADS,
        max_buffer_bytes: int = 64 * _MiB,
        gap_bytes: int | None = None,
        max_request_bytes: int = 16 * _MiB,
        dcp_values: str | None = None,
        prefix: str = "",
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if dcp_values not in DCP_VALUES_MODES:
            raise ValueError(f"dcp_values must be one of {DCP_VALUES_MODES}, got {dcp_values!r}")
        self.path = os.fspath(path)
        self.options = SourceOptions(dcp_values=dcp_values, prefix=prefix)
        self.source: Source | None = None
        self.io_threads = io_threads
        self.max_buffer_bytes = max(max_buffer_bytes, _MiB)
        self.gap_bytes = gap_bytes  # None: the storage's default (Source.open_reader)
        self.storage_options = storage_options
        self.max_request_bytes = max_request_bytes
        self.bytes_requested = 0
        self.read_calls = 0
        self.verify = verify
        self.verified_bytes = 0
        self.verify_seconds = 0.0
        self.load_id = uuid.uuid4().hex

    @property
    def index(self) -> Any:
        """The open source's records (None before :meth:`read_metadata`)."""
        return self.source.index if self.source is not None else None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new load, optionally from another checkpoint."""
        self._set_path(checkpoint_id)
        self.source = None
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Open the source and describe it as DCP's metadata (nothing is unpickled but DCP's own
        records)."""
        self.source = source = open_source(
            self.path, self.options, storage_options=self.storage_options
        )
        index = source.index
        md: dict[str, Any] = {}
        for fqn, t in index.tensors.items():
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=t.dtype),
                torch.Size(t.shape),
                LazyChunks(functools.partial(_record_boxes, t)),
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
                checkpoint_id=self.path, save_id=_save_id(index), load_id=self.load_id
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

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to coordinate: every rank reads its own byte ranges."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` into the tensors ``planner`` resolves."""
        # A strided load makes tens of thousands of short-lived read segments,
        # and each burst of allocations sets off Python's cyclic garbage
        # collector, which walks every live object: a third to a half of the
        # CPU time of such a load on 2 cores, falling on loads at random.
        # Nothing a load allocates forms reference cycles, so the collector
        # waits until it is done.
        with _collector_paused():
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        src = self.source
        assert src is not None
        value_items = [ri for ri in plan.items if ri.type == LoadItemType.BYTE_IO]
        tensor_items = [
            (
                ri,
                src.chunk_index(
                    ri.storage_index.fqn, tuple(ri.storage_index.offset), ri.storage_index.index
                ),
            )
            for ri in plan.items
            if ri.type != LoadItemType.BYTE_IO
        ]
        # Everything this load reads, before any byte is read: a source
        # refuses here what it will not read, and may locate chunks ahead.
        src.prepare(
            [(ri.storage_index.fqn, idx) for ri, idx in tensor_items],
            [ri.storage_index.fqn for ri in value_items],
            self.io_threads,
        )
        reader = src.open_reader(
            threads=self.io_threads,
            gap_bytes=self.gap_bytes,
            max_request_bytes=self.max_request_bytes,
        )
        ranks = [src.file_rank(i) for i in range(len(src.paths))]
        # Blocks where the source records block checksums; whole chunks where it records only those.
        blocks = BlockVerifier(src.paths, ranks) if self.verify else None
        chunks = (
            ChunkVerifier(reader, src.paths, ranks, block=self.max_request_bytes)
            if self.verify
            else None
        )
        try:
            segments: list[Segment] = []
            pending: list[tuple[ReadItem, torch.Tensor]] = []
            staged: list[
                tuple[ReadItem, torch.Tensor, Location, Box, torch.dtype, ChunkCheck | None]
            ] = []

            def flush() -> None:
                self._flush(reader, segments, pending, planner, chunks, blocks)

            for ri, idx in tensor_items:
                fqn = ri.storage_index.fqn
                src_dtype = src.index.tensors[fqn].dtype
                location = src.locate(fqn, idx)
                chunk = src.box(fqn, idx)
                dest = planner.resolve_tensor(ri)
                sums = src.block_sums(fqn, idx, location) if blocks is not None else None
                check = (
                    ChunkCheck(blocks, sums, fqn, chunk.offsets)
                    if blocks is not None and sums is not None
                    else None
                )
                region = Box(tuple(ri.storage_offsets), tuple(ri.lengths))
                # Through staging: casts, devices, other dimension orders, and regions of many short
                # runs
                # (narrow column slices, or a destination laid out in another order) that cost less
                # read
                # as their covering spans (core.spans), scattered by one strided copy.
                if needs_staging(dest, src_dtype, location) or spanned(
                    reader, location, chunk.sizes, region, src_dtype.itemsize, dest
                ):
                    staged.append((ri, dest, location, chunk, src_dtype, check))
                    continue
                if check is not None:
                    for part in check.verifier.plan(location, check, chunk.sizes, region, dest):
                        segments.extend(part)
                        if check.verifier.scratch_bytes >= check.verifier.scratch_limit:
                            flush()  # bound the scratch memory (this item is committed later)
                else:
                    if chunks is not None:
                        # The destination holds exactly the chunk's bytes after
                        # the read: hash it there. Otherwise read the chunk again.
                        whole = (
                            region == Box((0,) * len(chunk.sizes), chunk.sizes)
                            and dest.is_contiguous()
                        )
                        chunks.add(location, fqn, chunk.offsets, dest if whole else None)
                    segments.extend(segments_into(location, chunk.sizes, region, dest))
                pending.append((ri, dest))
                if len(segments) >= 16384:  # bound the bookkeeping memory, not just the data
                    flush()
            flush()
            # One staging buffer for all staged items (pinned, double-buffered
            # for CUDA targets); close() waits for the last device copies.
            # How each staged item is read (as spans or slab by slab), decided once, and the staging
            # it takes.
            plans = [
                staging_plan(
                    reader,
                    loc,
                    ch.sizes,
                    Box(tuple(ri.storage_offsets), tuple(ri.lengths)),
                    sd,
                    dest,
                    ck.sums.block if ck is not None else 0,
                )
                for ri, dest, loc, ch, sd, ck in staged
            ]
            largest = max((nbytes for _, nbytes in plans), default=0)
            # Staging and the block verifier's scratch together stay within max_buffer_bytes (the
            # default
            # 64 MiB: 48 MiB of staging, 16 MiB of scratch); a bound too small to share is staging's
            # alone.
            bound = self.max_buffer_bytes
            if blocks is not None and bound >= 2 * blocks.scratch_limit:
                bound -= blocks.scratch_limit
            with StagingBuffers(bound, largest_bytes=largest) as staging:
                for (ri, dest, location, chunk, src_dtype, check), (span, _) in zip(staged, plans):
                    region = Box(tuple(ri.storage_offsets), tuple(ri.lengths))
                    # With block checksums, every slab is checked in the staging buffer.
                    read_staged(
                        reader,
                        location,
                        chunk.sizes,
                        region,
                        src_dtype,
                        dest,
                        buffers=staging,
                        check=check,
                        span=span,
                    )
                    # A CUDA dest may still be receiving (on its current stream,
                    # which orders any device work commit_tensor does after the copies).
                    planner.commit_tensor(ri, dest)
                    if (
                        check is None and chunks is not None
                    ):  # a cast or device copy: the chunk is read again
                        chunks.add(location, ri.storage_index.fqn, chunk.offsets)
                        chunks.check()  # right after the read: its pages are likely still cached
            for ri in value_items:
                planner.load_bytes(
                    ri, self._value_for(planner, read_value(src, reader, ri.storage_index.fqn), ri)
                )
        finally:
            reader.close()
            if blocks is not None:
                blocks.close()
            self.bytes_requested += reader.stats.bytes
            self.read_calls += reader.stats.calls
            for v in (chunks, blocks):
                if v is not None:
                    self.verified_bytes += v.bytes
                    self.verify_seconds += v.seconds
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _value_for(planner: LoadPlanner, tagged: bytes, ri: ReadItem) -> io.BytesIO:
        """What ``planner.load_bytes`` expects: the tagged JSON for UCPLoadPlanner; for any other
        planner
        (DCP's own, which calls ``torch.load`` on it) the decoded value re-saved with
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

    @staticmethod
    def _flush(
        reader: RangeReader,
        segments: list[Segment],
        pending: list[tuple[ReadItem, torch.Tensor]],
        planner: LoadPlanner,
        chunks: ChunkVerifier | None = None,
        blocks: BlockVerifier | None = None,
    ) -> None:
        reader.read(segments)
        # Before commit: planners may move the data on.
        if blocks is not None:
            blocks.check()  # also copies the edges of reads from scratch into place
        if chunks is not None:
            chunks.check()
        for ri, dest in pending:
            planner.commit_tensor(ri, dest)
        segments.clear()
        pending.clear()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a path some source format recognises."""
        path = os.fspath(checkpoint_id)
        return any(c.detect(path) for c in source_types())


def _save_id(index: Any) -> str | None:
    """The save that wrote a native checkpoint's data files (None for other formats, or a mix)."""
    ids = {save_id_of(f.name) for f in getattr(index, "files", ())}
    return ids.pop() if len(ids) == 1 else None


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector (process-wide) for the ``with`` block, if it was
    running."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
