"""Load overlap finding: the reads that fill a target box from the saved chunks of one tensor.

A target (this rank's shard of a DTensor, a plain tensor, a piece) is a box
of the global tensor; the saved chunks are boxes too. Every non-empty
intersection becomes one DCP read item. The saved chunks of a regular
layout form a grid, searched per dimension (:meth:`~ucp_dcp.core.sharding.Grid.overlapping`),
so the cost does not depend on the saved world size; an irregular chunk
list is scanned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from .._compat import create_chunk_list, dtensor_local, is_checkpointable
from ..core.sharding import Box, Grid, arith_box, intersect
from ..errors import CheckpointKeyError, UnsupportedValueError
from ..format import dtype_name
from ._plan_records import LoadSourceInfo

__all__ = ["check_target", "local_boxes", "saved_grid", "overlap_reads"]


def check_target(
    fqn: str, dest: torch.Tensor, smd: STORAGE_TYPES, shape: Sequence[int], allow_dtype_cast: bool
) -> TensorStorageMetadata:
    """``smd`` if saved tensor ``fqn`` can fill ``dest`` (logical shape ``shape``), else a
    ``CheckpointKeyError``."""
    if not isinstance(smd, TensorStorageMetadata):
        raise CheckpointKeyError(
            f"{fqn!r} is a non-tensor value in the checkpoint but a tensor in the state dict"
        )
    want = tuple(shape)
    if want != tuple(smd.size):
        raise CheckpointKeyError(
            # "Size mismatch" as DCP's DefaultLoadPlanner words it, for callers that match on it.
            f"Size mismatch for {fqn!r}: the checkpoint has shape {list(smd.size)}, "
            f"the state dict expects {list(want)}"
        )
    if dest.dtype != smd.properties.dtype and not allow_dtype_cast:
        raise CheckpointKeyError(
            f"dtype mismatch for {fqn!r}: the checkpoint has {dtype_name(smd.properties.dtype)}, "
            f"the state dict expects {dtype_name(dest.dtype)}, and the load was made with "
            "UCPLoadPlanner(allow_dtype_cast=False); leave it at its default (True) to cast on load"
        )
    return smd


def local_boxes(fqn: str, obj: torch.Tensor) -> list[Box]:
    """The boxes of the global tensor that ``obj`` (state-dict key ``fqn``) holds on this rank.

    A checkpointable tensor (a ``LocalShardsWrapper`` DTensor, a tensor
    subclass of DCP's protocol) lists its own chunks, which are checked to
    lie inside its shape; a DTensor whose mesh does not include this rank
    holds none.
    """
    if is_checkpointable(obj):
        inner = dtensor_local(obj) if isinstance(obj, DTensor) else obj
        if not hasattr(inner, "__create_chunk_list__"):
            raise UnsupportedValueError(
                f"{fqn!r}: its {type(inner).__name__} has __create_write_items__ but no "
                "__create_chunk_list__; "
                "a checkpointable tensor must implement both (and __get_tensor_shard__) to be "
                "loaded into"
            )
        shape = tuple(obj.shape)
        boxes = []
        for c in create_chunk_list(obj):
            b = Box(tuple(c.offsets), tuple(c.sizes))
            if not b.numel:
                continue  # an empty shard (this rank holds none of the tensor)
            if (
                len(b.offsets) != len(shape)
                or len(b.sizes) != len(shape)
                or any(o < 0 or o + n > d for o, n, d in zip(b.offsets, b.sizes, shape))
            ):
                raise UnsupportedValueError(
                    f"{fqn!r}: its {type(inner).__name__} lists a chunk at offsets "
                    f"{list(b.offsets)} of size "
                    f"{list(b.sizes)}, outside the tensor's shape {list(shape)}"
                )
            boxes.append(b)
        return boxes
    if isinstance(obj, DTensor):
        coord = obj.device_mesh.get_coordinate()
        if coord is None:
            return []  # a DTensor on a sub-mesh this rank is not part of
        box = arith_box(tuple(obj.shape), tuple(obj.device_mesh.shape), obj.placements, coord)
        if box is not None:
            return [box]
    return [Box(tuple(c.offsets), tuple(c.sizes)) for c in create_chunk_list(obj)]


def saved_grid(info: LoadSourceInfo, fqn: str, smd: TensorStorageMetadata) -> Grid | None:
    """The grid of the saved chunks of ``fqn``: from the reader when it supplies
    one, else built from DCP's chunk list (another reader); None if irregular."""
    if callable(info.chunk_grid):
        return info.chunk_grid(fqn)
    boxes = [Box(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks]
    return Grid.from_boxes(boxes, tuple(smd.size)) if all(b.numel for b in boxes) else None


def overlap_reads(
    fqn: str,
    targets: Sequence[Box],
    smd: TensorStorageMetadata,
    grid: Grid | None,
    dest: tuple[str, int] | None = None,
) -> list[ReadItem]:
    """Reads of every overlap of ``targets`` with the saved chunks of ``fqn``.

    ``dest`` is None for a state-dict tensor (read items name ``fqn``), or
    ``(state-dict key, piece number)`` for a piece. Raises
    ``CheckpointKeyError`` when the saved chunks leave part of a target
    uncovered.
    """
    items = []
    for target in targets:
        if not target.numel:
            continue
        dest_index = (
            MetadataIndex(fqn, target.offsets)
            if dest is None
            else MetadataIndex(dest[0], target.offsets, dest[1])
        )
        if grid is not None:  # binary search per dimension: independent of the saved world size
            found = [(int(k), grid.box(int(k))) for k in grid.overlapping(target)]
        else:  # an irregular chunk list: test every saved chunk
            found = [(k, Box(tuple(c.offsets), tuple(c.sizes))) for k, c in enumerate(smd.chunks)]
        covered = 0
        for idx, s in found:
            inter = intersect(target, s)
            if inter is None:
                continue
            covered += inter.numel
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=dest_index,
                    dest_offsets=torch.Size(o - t for o, t in zip(inter.offsets, target.offsets)),
                    storage_index=MetadataIndex(fqn, s.offsets, idx),
                    storage_offsets=torch.Size(o - so for o, so in zip(inter.offsets, s.offsets)),
                    lengths=torch.Size(inter.sizes),
                )
            )
        if covered != target.numel:
            raise CheckpointKeyError(
                f"{fqn!r}: the saved chunks cover {covered} of the {target.numel} elements this "
                "rank needs "
                f"(box at {list(target.offsets)} of size {list(target.sizes)}): the checkpoint is "
                "incomplete"
            )
    return items
