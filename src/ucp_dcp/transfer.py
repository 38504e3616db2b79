"""Moving a box of a saved chunk into a destination tensor.

Two ways, chosen by the destination: a CPU tensor of the saved dtype is
filled in place (its storage is the read buffer); anything else (a dtype
cast, a device tensor) goes through a bounded staging buffer in the saved
dtype, slab by slab. Both the distributed reader and the single-process
:class:`~ucp_dcp.checkpoint.Checkpoint` use these.
"""

from __future__ import annotations

from typing import Iterator

import torch
import xxhash

from .format import CheckpointFormatError, Location
from .rangeio import RangeReader, Segment, storage_view
from .sharding import Box, runs, slabs

__all__ = ["needs_staging", "segments_into", "read_staged", "read_checked"]


def needs_staging(dest: torch.Tensor, src_dtype: torch.dtype) -> bool:
    """Whether ``dest`` cannot be filled in place from bytes of ``src_dtype``."""
    return dest.device.type != "cpu" or dest.dtype != src_dtype


def segments_into(
    location: Location,
    chunk_sizes: tuple[int, ...],
    region: Box,
    dest: torch.Tensor,
    view: memoryview | None = None,
) -> Iterator[Segment]:
    """Segments that read ``region`` of a saved chunk into CPU tensor ``dest``.

    ``dest`` has the region's shape and the saved dtype; ``view`` is
    :func:`storage_view` of it (pass it when making many calls on one tensor).
    """
    view = storage_view(dest) if view is None else view
    es = dest.element_size()
    grid = runs(chunk_sizes, region, dest.stride(), dest.storage_offset())
    n = grid.count * es
    file = location.file
    for src, dst in zip((grid.src * es + location.start).tolist(), (grid.dst * es).tolist()):
        yield Segment(file, src, view[dst : dst + n])


def read_staged(
    reader: RangeReader,
    location: Location,
    chunk_sizes: tuple[int, ...],
    region: Box,
    src_dtype: torch.dtype,
    dest: torch.Tensor,
    max_buffer_bytes: int,
) -> None:
    """Read ``region`` of a saved chunk into ``dest`` (any dtype, any device).

    Slab by slab through one staging buffer of at most ``max_buffer_bytes``
    (pinned when ``dest`` is on CUDA), so memory stays bounded whatever the
    tensor size.
    """
    pin = dest.device.type == "cuda"
    budget = min(max_buffer_bytes, max(region.numel * src_dtype.itemsize, 1))
    staging = torch.empty(budget, dtype=torch.uint8, pin_memory=pin)
    view = storage_view(staging)
    for offs, sizes in slabs(region.sizes, src_dtype.itemsize, budget):
        n = torch.Size(sizes).numel()
        buf = staging[: n * src_dtype.itemsize].view(src_dtype).view(sizes)
        sub = Box(tuple(b + o for b, o in zip(region.offsets, offs)), sizes)
        reader.read(list(segments_into(location, chunk_sizes, sub, buf, view)))
        target = dest
        for d, (o, s) in enumerate(zip(offs, sizes)):
            target = target.narrow(d, o, s)
        # Blocking: the next slab reuses the staging buffer.
        target.copy_(buf)


def read_checked(reader: RangeReader, location: Location, path: str, what: str) -> bytes:
    """The bytes at ``location`` (in file ``path``), checked against its checksum.

    A location with no checksum (an imported DCP checkpoint) is not checked.
    ``what`` names the entry in the error.
    """
    buf = bytearray(location.nbytes)
    reader.read([Segment(location.file, location.start, memoryview(buf))])
    if location.xxh3 and xxhash.xxh3_64_hexdigest(buf) != location.xxh3:
        raise CheckpointFormatError(f"{path}: checksum mismatch for {what}: the file is corrupt")
    return bytes(buf)
