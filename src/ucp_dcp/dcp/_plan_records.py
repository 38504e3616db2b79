"""The records ucp_dcp's planners put in DCP's ``planner_data`` fields, one kind per field.

DCP carries an opaque ``planner_data`` on every ``SavePlan``, ``LoadPlan`` and ``Metadata``.
Each use here has its own frozen record, whose docstring says who hands it to whom. Those that
travel between ranks (:class:`SaveRankReport`, :class:`SaveReply`, :class:`LoadRankReport`) are
slotted: their pickles carry the field values only, not the field names, so what a rank sends
stays as small as a tuple (the README's "At scale" section). :class:`SaveSummary` and
:class:`LoadSourceInfo` never leave the process that made them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

from ..core.sharding import Grid
from ..errors import CheckpointKeyError, UnsupportedValueError
from ..format import Layout
from ._mesh_groups import MeshGroup

__all__ = [
    "PieceKey",
    "MeshGroupReport",
    "SaveRankReport",
    "SaveReply",
    "SaveSummary",
    "LoadRankReport",
    "LoadSourceInfo",
    "tensor_data",
]

PieceKey = tuple[str, tuple[int, ...]]
"""A saved box named by its logical tensor and global offsets: ``(fqn, offsets)``."""


def tensor_data(item: WriteItem) -> TensorWriteData:
    """The chunk, size and properties of a tensor write item.

    DCP sets ``tensor_data`` on every tensor item it creates, and the local
    save plan keeps no other (a checkpointable tensor's own items are checked
    there); raises :class:`~ucp_dcp.errors.UnsupportedValueError` for one without.
    """
    td = item.tensor_data
    if td is None:
        raise UnsupportedValueError(
            f"tensor {item.index.fqn!r}: its {item.type.name} write item carries no tensor data "
            "(chunk offsets and sizes); only tensor chunks can be saved"
        )
    return td


# ---------------------------------------------------------------------- save


@dataclass(frozen=True, slots=True)
class MeshGroupReport:
    """One rank's word on one of its mesh groups (:class:`~ucp_dcp.dcp._mesh_groups.MeshGroup`).

    Every rank of the mesh sends the group's checksum; only the mesh's
    first rank also sends the description (``MeshGroup.to_json()``).
    """

    signature: str
    first_rank: int
    description: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class SaveRankReport:
    """What a rank tells the coordinator with its local save plan.

    Attributes:
        rank: the rank's global rank.
        digests: xxh3 of every value and plain tensor it saves, by key (the coordinator finds values
            that differ across ranks).
        layouts: layout of every tensor planned per chunk (DTensors outside mesh groups, plain
            tensors).
        rank_local: keys of its :class:`~ucp_dcp.RankLocal` values.
        groups: one report per mesh group it holds.
        pieces: logical tensors it saves pieces of (sorted), to be checked for tiling.
        piece_digests: xxh3 of each box of a replicated piece set it holds.
    """

    rank: int
    digests: dict[str, str]
    layouts: dict[str, Layout]
    rank_local: tuple[str, ...]
    groups: tuple[MeshGroupReport, ...]
    pieces: tuple[str, ...]
    piece_digests: dict[PieceKey, str]


@dataclass(frozen=True, slots=True)
class SaveReply:
    """What the coordinator adds to a rank's plan: tensors of its mesh groups that another mesh
    writes.

    Sent only to ranks that have such tensors (a replica held by several
    meshes is written by one); other ranks get no reply.
    """

    skip: tuple[str, ...]


@dataclass(frozen=True)
class SaveSummary:
    """What the save planner leaves in the save's metadata for ``UCPStorageWriter.finish``
    (coordinator only).

    Attributes:
        world_size: ranks in the save.
        layouts: layout of every tensor (None where ranks disagree).
        owners: for every mesh-planned tensor, the mesh group that writes it.
        positions: global rank -> position in the save's process group.
        paths: the nesting path of every key whose path is not its dotted name split at the dots
            (list indices, keys with dots), so that a load into an empty state dict rebuilds the
            nesting.
    """

    world_size: int
    layouts: dict[str, Layout | None]
    owners: dict[str, MeshGroup]
    positions: dict[int, int]
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)

    @staticmethod
    def of(metadata: Metadata, world_size: int) -> SaveSummary:
        """The summary in ``metadata``; an empty one of ``world_size`` ranks if another planner made
        it."""
        data = metadata.planner_data
        if isinstance(data, SaveSummary):
            return data
        return SaveSummary(world_size, {}, {}, {})


# ---------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class LoadRankReport:
    """What a rank tells the coordinator with its (otherwise empty) local load plan.

    Attributes:
        rank: the rank's global rank.
        items: how many read items it keeps (DCP gets none of them).
        asked: bitmap over the sorted checkpoint keys (``numpy.packbits``): which ones its state
            dict asked for.
    """

    rank: int
    items: int
    asked: bytes


@dataclass(frozen=True)
class LoadSourceInfo:
    """What ``UCPStorageReader`` tells the load planner about the checkpoint, besides DCP's
    metadata.

    Attributes:
        world_size: ranks that saved the checkpoint (None if unknown).
        rank_local: for every rank-local value, the ranks that saved it.
        chunk_grid: ``fn(fqn)``, the grid of the saved chunks of a tensor
            (None where the chunks are irregular), so that overlaps are
            found without listing chunks. In process only: load metadata
            is never sent between ranks.
        keys: every tensor and value key of the checkpoint.
        paths: nesting paths recorded at save (see :class:`SaveSummary`).
    """

    world_size: int | None = None
    rank_local: dict[str, list[int]] = field(default_factory=dict)
    chunk_grid: Callable[[str], Grid | None] | None = None
    keys: frozenset[str] = frozenset()
    paths: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)

    @staticmethod
    def of(metadata: Metadata | None) -> LoadSourceInfo:
        """The info in ``metadata``; an empty one when another reader made it."""
        data = metadata.planner_data if metadata is not None else None
        return data if isinstance(data, LoadSourceInfo) else LoadSourceInfo()

    # DCP's own planners read a load's ``planner_data`` as the map from
    # flattened keys to their nesting paths (``_EmptyStateDictLoadPlanner``,
    # behind ``format_utils.dcp_to_torch_save``): answer as that map does.
    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key in self.keys

    def __getitem__(self, key: str) -> tuple[str | int, ...]:
        if key not in self.keys:
            raise CheckpointKeyError(f"{key!r} is not a key of the checkpoint")
        return self.paths.get(key) or tuple(key.split("."))

    def get(self, key: str, default: Any = None) -> Any:
        """The nesting path of checkpoint key ``key``, or ``default``."""
        return self[key] if key in self else default
