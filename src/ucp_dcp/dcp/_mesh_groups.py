"""Mesh-group planning (:mod:`ucp_dcp.dcp.compact`): agreement, ownership and each rank's own
writes.

Regular DTensors are planned per device mesh. The coordinator checks that
every rank of a mesh described the same group (:func:`check_groups`),
decides which mesh writes a tensor that several meshes hold
(:func:`assign_owners`) and tells ranks what another mesh writes
(:func:`group_replies`); each rank derives its own write items from its mesh
coordinate (:func:`group_items`). Groups and derived items are cached per
process, so a training loop that saves the same model again derives nothing
twice.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor.placement_types import Placement

from ..core.sharding import Box, arith_box, placement_from_str
from ..core.values import dtype_from_name
from ..format import Layout
from ._plan_records import SaveRankReport, SaveReply
from ._ranks import describe_ranks
from .compact import LazyChunks, MeshGroup, TensorSpec

__all__ = [
    "cached_group",
    "check_groups",
    "assign_owners",
    "owned_metadata",
    "group_replies",
    "group_items",
    "shard_item",
]

Owners = dict[str, tuple[MeshGroup, TensorSpec]]

# Plan caches (per process): mesh groups by signature, so their grids and
# replica choices are computed once, and derived write items per rank.
_GROUPS: dict[str, MeshGroup] = {}
_GROUP_ITEMS: dict[tuple[str, int, tuple[int, ...], frozenset[str]], list[WriteItem]] = {}


def cached_group(group: MeshGroup) -> MeshGroup:
    """The cached group with ``group``'s signature (``group`` itself the first time)."""
    cached = _GROUPS.get(group.signature)
    if cached is None:
        if len(_GROUPS) >= 64:
            _GROUPS.pop(next(iter(_GROUPS)))
        _GROUPS[group.signature] = cached = group
    return cached


def check_groups(reports: Sequence[SaveRankReport]) -> list[MeshGroup]:
    """The mesh groups of a save, checked: every rank of each mesh reported
    the same description as the mesh's first rank."""
    described: dict[tuple[int, str], MeshGroup] = {}
    members: dict[tuple[int, str], list[int]] = defaultdict(list)
    for report in reports:
        me = report.rank
        for g in report.groups:
            key = (g.first_rank, g.signature)
            if g.description is not None and key not in described:
                group = _GROUPS.get(g.signature) or cached_group(MeshGroup.from_json(g.description))
                if group.signature != g.signature:
                    raise ValueError(
                        f"rank {me}: its mesh group description does not match its own checksum"
                    )
                described[key] = group
            members[key].append(me)
    for (first, sig), ranks in members.items():
        group = described.get((first, sig))
        if group is None:
            raise ValueError(
                f"ranks {describe_ranks(sorted(ranks))} hold DTensors on a device mesh whose "
                "first rank is "
                f"{first}, but rank {first} does not hold the same ones: every rank of a mesh "
                "must save the same "
                "DTensors (names, dtypes, shapes, placements). Pass "
                "UCPSavePlanner(compact_plans=False) to plan "
                "per chunk, which names the tensors that differ"
            )
        if sorted(ranks) != sorted(group.ranks):
            missing = sorted(set(group.ranks) - set(ranks))
            raise ValueError(
                f"the device mesh of ranks {describe_ranks(sorted(group.ranks))} holds "
                f"{len(group.tensors)} "
                f"DTensor(s), but rank(s) {describe_ranks(missing)} of it did not report the same "
                "ones (or are "
                "not saving): every rank of a mesh must save the same DTensors, in the same "
                "process group"
            )
    return list(described.values())


def assign_owners(groups: list[MeshGroup], taken: set[str]) -> Owners:
    """Which group writes each mesh-planned tensor (``taken``: keys planned per chunk elsewhere).

    A tensor held by several meshes with the same description is a replica
    (a TP-replicated parameter kept on each TP rank's data-parallel
    submesh): one mesh writes it, chosen largest tensors first on the least
    loaded mesh. Different descriptions under one key are an error.
    """
    holders: dict[str, list[tuple[MeshGroup, TensorSpec]]] = defaultdict(list)
    for g in sorted(groups, key=lambda g: g.first_rank):
        for t in g.tensors:
            holders[t.fqn].append((g, t))
    load: dict[int, int] = defaultdict(int)
    owners: Owners = {}
    for fqn in sorted(holders, key=lambda f: (-holders[f][0][1].nbytes, f)):
        cands = holders[fqn]
        spec = cands[0][1]
        same = (spec.dtype, spec.shape, spec.layout)
        other = next(((g, t) for g, t in cands if (t.dtype, t.shape, t.layout) != same), None)
        if fqn in taken or other is not None:
            where = (
                f"as {spec.dtype}{list(spec.shape)} on ranks "
                f"{describe_ranks(sorted(cands[0][0].ranks))} and as "
                f"{other[1].dtype}{list(other[1].shape)} on ranks "
                f"{describe_ranks(sorted(other[0].ranks))}"
                if other
                else "as a DTensor on some ranks and a plain or irregular tensor on others"
            )
            raise ValueError(
                f"tensor {fqn!r} is saved {where}; one key must name one tensor on every rank "
                "(pipeline stages: rename stage-local layers to global names)"
            )
        g, t = min(cands, key=lambda c: (load[c[0].first_rank], c[0].first_rank))
        load[g.first_rank] += t.nbytes
        owners[fqn] = (g, t)
    return owners


def owned_metadata(owners: Owners) -> dict[str, TensorStorageMetadata]:
    """DCP's metadata of the mesh-planned tensors; their chunk lists are built only if read."""
    return {
        fqn: TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(t.dtype)),
            torch.Size(t.shape),
            LazyChunks(functools.partial(t.layout.chunks, t.shape)),
        )
        for fqn, (_, t) in owners.items()
    }


def group_replies(
    groups: list[MeshGroup], owners: Owners, reports: Sequence[SaveRankReport]
) -> list[SaveReply | None]:
    """Per rank: the tensors of its mesh groups that another mesh writes (None when there are
    none)."""
    skip = {
        g.signature: sorted(t.fqn for t in g.tensors if owners[t.fqn][0] is not g) for g in groups
    }
    replies: list[SaveReply | None] = []
    for report in reports:
        theirs = sorted({f for g in report.groups for f in skip[g.signature]})
        replies.append(SaveReply(tuple(theirs)) if theirs else None)
    return replies


def group_items(
    group: MeshGroup, rank: int, coord: Sequence[int], skip: frozenset[str]
) -> list[WriteItem]:
    """Write items of the chunks the rank at mesh coordinate ``coord`` writes for ``group``.

    Cached per (group, rank, coordinate, skip): a training loop saving the
    same model again derives nothing twice (items name tensors by key; the
    data is looked up at write time).
    """
    key = (group.signature, rank, tuple(coord), skip)
    items = _GROUP_ITEMS.get(key)
    if items is None:
        items = []
        for t in group.tensors:
            if t.fqn not in skip and group.writes(t, coord):
                box = arith_box(t.shape, group.mesh, _placements(t.layout), coord)
                assert box is not None  # mesh groups hold arithmetic layouts only
                if box.numel:
                    items.append(shard_item(t.fqn, box, dtype_from_name(t.dtype), t.shape))
        if len(_GROUP_ITEMS) >= 16:
            _GROUP_ITEMS.pop(next(iter(_GROUP_ITEMS)))
        _GROUP_ITEMS[key] = items
    return items


@functools.lru_cache(maxsize=1024)
def _placements(layout: Layout) -> tuple[Placement, ...]:
    return tuple(placement_from_str(p) for p in layout.placements)


def shard_item(fqn: str, box: Box, dtype: torch.dtype, shape: Sequence[int]) -> WriteItem:
    """DCP's write item for box ``box`` of tensor ``fqn`` (what ``_create_write_items``
    makes for a DTensor shard, without DTensor's per-call arithmetic)."""
    offsets, sizes = torch.Size(box.offsets), torch.Size(box.sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )
