"""What a load plan's read items are, for :class:`~ucp_dcp.dcp.reader.UCPStorageReader`.

Small functions between DCP's records and this library's: the region of a
saved chunk a tensor read item reads, the bytes a planner expects for a
value, the saved chunk's offsets, the save that wrote a checkpoint, and the
pause of Python's garbage collector a load runs under.
"""

from __future__ import annotations

import contextlib
import gc
import io
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ..byteio.transfer import ChunkRegion
from ..core.sharding import Box
from ..core.values import decode_value
from ..errors import InvalidArgumentError
from ..format import TensorRecord
from ..format.names import save_id_of
from ..sources import Source
from .load_planner import UCPLoadPlanner

__all__ = [
    "chunk_offsets",
    "chunk_part",
    "collector_paused",
    "record_boxes",
    "save_id",
    "value_for",
]


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


def chunk_offsets(index: MetadataIndex) -> tuple[int, ...]:
    """The offsets of the chunk a tensor read item reads (DCP's planners set them on every one)."""
    if index.offset is None:
        raise InvalidArgumentError(
            f"tensor {index.fqn!r}: the load plan reads a chunk of it without its offsets "
            "(MetadataIndex.offset); a tensor read item must name the saved chunk it reads"
        )
    return tuple(index.offset)


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
