"""What one rank reads on load: the overlaps of its targets with the saved chunks, its rank-local
values, and which checkpoint keys it asked for.

A target (this rank's shard of a DTensor, a plain tensor, a piece) is a box
of the global tensor; the saved chunks are boxes too. Every non-empty
intersection becomes one DCP read item (:func:`overlap_reads`). The saved
chunks of a regular layout form a grid, searched per dimension
(:meth:`~ucp_dcp.core.sharding.Grid.overlapping`), so the cost does not
depend on the saved world size; an irregular chunk list is scanned.

A rank-local value is read from this rank's own copy when the world size is
unchanged; otherwise every saved copy is read and handed to a reshard
function (:func:`rank_local_reads`, :class:`RankLocalGather`).

Under pipeline or expert parallelism each rank loads only its part, so a
key one rank did not ask for is not news; a key that no rank asked for is.
Each rank sends one bit per checkpoint key (whatever the world size); the
coordinator ORs them (:func:`asked_keys`, :func:`keys_no_rank_asked`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
from torch.distributed.tensor import DTensor

from .._compat import create_chunk_list, dtensor_local, is_checkpointable
from ..core.pieces import TensorPieces
from ..core.sharding import Box, Grid, arith_box, intersect
from ..core.values import RankLocal, ReshardFn
from ..errors import CheckpointKeyError, UnsupportedValueError
from ..format import LAYOUT_KEY, dtype_name, rank_local_key, split_rank_local_key
from ._plan_records import LoadSourceInfo

__all__ = [
    "check_target",
    "local_boxes",
    "saved_grid",
    "overlap_reads",
    "bytes_item",
    "rank_local_reads",
    "RankLocalGather",
    "find_wrappers",
    "asked_keys",
    "keys_no_rank_asked",
    "key_list",
]


# ---------------------------------------------------------------------- tensors


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


# ---------------------------------------------------------------------- values


def bytes_item(dest_fqn: str, storage_fqn: str) -> ReadItem:
    """DCP's read item of a whole value stored under ``storage_fqn``, for state-dict key
    ``dest_fqn``."""
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(dest_fqn),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(storage_fqn),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )


class RankLocalGather:
    """The saved copies of one rank-local value, collected until all have been read."""

    def __init__(self, n: int, reshard: ReshardFn) -> None:
        self.n = n
        self.reshard = reshard
        self.got: dict[int, Any] = {}

    def add(self, storage_key: str, value: Any) -> bool:
        """Keep the copy read from ``storage_key``; True once every saved copy is in."""
        rl = split_rank_local_key(storage_key)
        self.got[rl[0] if rl else 0] = value
        return len(self.got) >= self.n

    def result(self, fqn: str, rank: int, world_size: int) -> Any:
        """This rank's value: the reshard function applied to every saved copy, by saving rank."""
        return self.reshard(fqn, dict(sorted(self.got.items())), rank, world_size)


def rank_local_reads(
    fqn: str,
    obj: Any,
    saved_ranks: list[int],
    saved_world: int | None,
    rank: int,
    world_size: int,
    default_reshard: ReshardFn | None,
) -> tuple[list[ReadItem], RankLocalGather | None]:
    """Reads of rank-local value ``fqn`` for this rank, and the gather that reshards them (if
    needed).

    Same world size and a saved copy of its own: that copy. Otherwise every
    saved copy, for ``obj``'s reshard function (a :class:`RankLocal`'s
    own) or ``default_reshard``; without either, a ``CheckpointKeyError``.
    """
    if saved_world == world_size and rank in saved_ranks:
        return [bytes_item(fqn, rank_local_key(rank, fqn))], None
    fn = obj.reshard if isinstance(obj, RankLocal) and obj.reshard else default_reshard
    if fn is None:
        raise CheckpointKeyError(
            f"rank-local value {fqn!r} was saved by {len(saved_ranks)} rank(s) (world size "
            f"{saved_world}) "
            f"but rank {rank} of world size {world_size} is loading it; another rank's value "
            "would be wrong here. Pass RankLocal(value, reshard=fn) or "
            "UCPLoadPlanner(rank_local_reshard=fn) to say how to map it"
        )
    return [bytes_item(fqn, rank_local_key(r, fqn)) for r in saved_ranks], RankLocalGather(
        len(saved_ranks), fn
    )


def find_wrappers(obj: Any) -> Iterator[tuple[Any, Any, RankLocal | TensorPieces]]:
    """``(container, key, wrapper)`` of every RankLocal and TensorPieces value in ``obj``.

    DCP's load set-up replaces every object it does not know with None.
    """
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for k, v in items:
        if isinstance(v, (RankLocal, TensorPieces)):
            yield obj, k, v
        else:
            yield from find_wrappers(v)


# ---------------------------------------------------------------------- keys


def _reported(key: str) -> bool:
    # The layout record is written by every LayoutSpec save; a load that does
    # not ask for it is not warned about it.
    return not key.startswith(LAYOUT_KEY)


def asked_keys(keys: Sequence[str], known: Collection[str]) -> tuple[bytes, list[str]]:
    """The bitmap over ``keys`` (sorted checkpoint keys) of those in ``known``, and the others worth
    reporting."""
    wanted = [k in known for k in keys]
    unexpected = [k for k, w in zip(keys, wanted) if not w and _reported(k)]
    # dtype: an empty list (an empty checkpoint) would otherwise be float64, which packbits refuses.
    return np.packbits(np.array(wanted, dtype=bool)).tobytes(), unexpected


def keys_no_rank_asked(keys: Sequence[str], masks: Sequence[bytes]) -> list[str]:
    """The keys (sorted checkpoint keys) whose bit is set in none of ``masks``, except the layout
    record."""
    if not keys:
        return []
    asked = np.bitwise_or.reduce([np.frombuffer(m, dtype=np.uint8) for m in masks])
    flags = np.unpackbits(asked, count=len(keys))
    return [k for k, f in zip(keys, flags) if not f and _reported(k)]


def key_list(keys: list[str], limit: int = 20) -> str:
    """``keys`` for an error message: the first ``limit``, quoted, in brackets."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
