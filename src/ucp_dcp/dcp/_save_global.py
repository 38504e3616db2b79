"""The coordinator's step of a save: check every rank's report, pick the writers, build the
metadata.

:func:`create_global_save_plan` is what ``UCPSavePlanner.create_global_plan`` does, as one
function of the gathered local plans (as DCP's ``create_default_global_save_plan`` is for its
planner). The functions after it are its steps, in the order it runs them: the checks that what
is saved once is the same everywhere and whole, the chunk table and its writers, the owners of
tensors several meshes hold, the value writers.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Container, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..errors import InconsistentSaveError, listed
from ..format import Layout, dtype_name, rank_local_key, split_rank_local_key
from ._mesh_groups import (
    MeshGroup,
    Owners,
    TensorSpec,
    balance,
    described_group,
    owned_metadata,
)
from ._plan_records import PieceKey, SaveRankReport, SaveReply, SaveSummary, tensor_data

__all__ = [
    "create_global_save_plan",
    "merged_layouts",
    "divergent_keys",
    "check_replicated_pieces",
    "check_tiling",
    "check_groups",
    "ChunkTable",
    "collect_chunks",
    "assign_writers",
    "assign_owners",
    "group_replies",
    "value_writers",
    "plan_value_item",
    "value_metadata",
]

K = TypeVar("K", bound=Hashable)


def create_global_save_plan(
    all_plans: list[SavePlan], *, allow_rank_local: bool
) -> tuple[list[SavePlan], Metadata]:
    """Every rank's plan (only the items it writes) and the save's metadata.

    ``all_plans`` are the local plans in process-group order, each carrying
    a :class:`SaveRankReport`. The returned plans carry a
    :class:`~ucp_dcp.dcp._plan_records.SaveReply` where a rank's mesh groups
    hold tensors another mesh writes; the metadata carries a
    :class:`SaveSummary` for ``UCPStorageWriter.finish``.
    """
    reports: list[SaveRankReport] = [p.planner_data for p in all_plans]
    to_rank_local = divergent_keys(reports, allow_rank_local)
    check_replicated_pieces(reports)
    groups = check_groups(reports)
    table = collect_chunks(all_plans)
    writer = assign_writers(table, len(all_plans))
    values = value_writers(reports)
    new_plans = [
        _rank_plan(r, plan, writer, values, to_rank_local) for r, plan in enumerate(all_plans)
    ]
    check_tiling(reports, table)
    md: dict[str, STORAGE_TYPES] = dict(table.metadata())
    layouts = merged_layouts(reports)
    owners = assign_owners(groups, set(md))
    md.update(owned_metadata(owners))
    layouts.update((fqn, t.layout) for fqn, (_, t) in owners.items())
    for r, reply in enumerate(group_replies(groups, owners, reports)):
        if reply is not None:
            new_plans[r] = dataclasses.replace(new_plans[r], planner_data=reply)
    md.update(value_metadata(reports, table.props))
    summary = SaveSummary(
        world_size=len(all_plans),
        layouts=layouts,
        owners={fqn: g for fqn, (g, _) in owners.items()},
        positions={report.rank: r for r, report in enumerate(reports)},
    )
    return new_plans, Metadata(state_dict_metadata=md, planner_data=summary)


def merged_layouts(reports: Sequence[SaveRankReport]) -> dict[str, Layout | None]:
    """The layout of every per-chunk-planned tensor; None where ranks report different ones."""
    layouts: dict[str, Layout | None] = {}
    for report in reports:
        for fqn, lay in report.layouts.items():
            layouts[fqn] = lay if layouts.get(fqn, lay) == lay else None
    return layouts


def _rank_plan(
    r: int,
    plan: SavePlan,
    writer: dict[PieceKey, int],
    values: dict[str, int],
    to_rank_local: set[str],
) -> SavePlan:
    """Rank ``r``'s share of its own local plan: the chunks and values it was chosen to write."""
    items = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            kept = plan_value_item(item, r, to_rank_local, values)
            if kept is not None:
                items.append(kept)
        elif writer[(item.index.fqn, tuple(tensor_data(item).chunk.offsets))] == r:
            items.append(item)
    return dataclasses.replace(plan, items=items, planner_data=None)


# ---------------------------------------------------------------------- checks


def _holders_by_digest(per_rank: Iterable[dict[K, str]]) -> dict[K, dict[str, list[int]]]:
    """key -> digest -> ranks that hold that digest (ranks in order)."""
    per_key: dict[K, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, digests in enumerate(per_rank):
        for key, d in digests.items():
            per_key[key][d].append(r)
    return per_key


def divergent_keys(reports: Sequence[SaveRankReport], allow_rank_local: bool) -> set[str]:
    """Keys whose value differs across ranks.

    Raises :class:`~ucp_dcp.errors.InconsistentSaveError` for a plain tensor
    that differs, and for a value that differs unless ``allow_rank_local``
    (the caller then saves each rank's copy as a rank-local value).
    """
    per_key = _holders_by_digest(r.digests for r in reports)
    divergent = {fqn: groups for fqn, groups in per_key.items() if len(groups) > 1}
    tensors = {fqn for r in reports for fqn in r.layouts}
    bad_tensors = sorted(f for f in divergent if f in tensors)
    if bad_tensors or (divergent and not allow_rank_local):
        fqn = (bad_tensors or sorted(divergent))[0]
        groups = sorted(divergent[fqn].values())
        what = "plain tensor" if fqn in tensors else "non-tensor value"
        raise InconsistentSaveError(
            f"{what} {fqn!r} differs across ranks (ranks {listed(groups[0])} hold one "
            "value, "
            f"ranks {listed(groups[1])} another; {len(divergent)} key(s) differ in all). "
            "Saving one copy "
            "would hand every rank the same value on load. Wrap per-rank state in "
            "ucp_dcp.RankLocal(...)"
            + (
                ", or pass UCPSavePlanner(divergent_values='rank_local')"
                if fqn not in tensors
                else ", or make it a DTensor with the placements it really has"
            )
        )
    return set(divergent)


def check_replicated_pieces(reports: Sequence[SaveRankReport]) -> None:
    """A piece (a box of a logical tensor) that several ranks save must hold the same bytes on
    each: it is written once."""
    per_key = _holders_by_digest(r.piece_digests for r in reports)
    bad = sorted(k for k, groups in per_key.items() if len(groups) > 1)
    if bad:
        groups = sorted(per_key[bad[0]].values())
        fqn, offs = bad[0]
        raise InconsistentSaveError(
            f"replicated tensor {fqn!r} (box at offsets {list(offs)}) differs across ranks: ranks "
            f"{listed(groups[0])} hold one value, ranks {listed(groups[1])} "
            f"another ({len(bad)} piece(s) differ in all). A box that several ranks save (a "
            "replicated tensor: a Replicated layout rule, TensorPieces(replicated=True); replicas "
            "of a flat partition) is written once, so every rank that holds it must hold the same "
            "bytes: synchronise it, or give each rank's piece its own place (pipeline stages: a "
            "Reindex rule)"
        )


def check_tiling(reports: Sequence[SaveRankReport], table: ChunkTable) -> None:
    """Every element of a tensor saved as pieces is held by exactly one distinct box.

    DTensor chunks tile their tensor by construction; pieces come from flat
    ranges and layout rules, which can leave gaps or overlap when they are
    described wrongly. Distinct boxes whose element counts add up to the
    tensor's and that never overlap tile it; overlaps are caught by the sum
    (an overlap that exactly cancels a gap is not, a rare double fault).
    """
    fqns = {f for r in reports for f in r.pieces}
    for fqn in sorted(fqns):
        keys = table.by_tensor.get(fqn, [])
        if not keys:
            continue  # only empty pieces
        size = tensor_data(table.first[keys[0]]).size
        total = math.prod(size)
        covered = sum(math.prod(tensor_data(table.first[k]).chunk.sizes) for k in keys)
        if covered != total:
            how = (
                "leaving elements that no rank holds"
                if covered < total
                else "so some of them overlap"
            )
            raise InconsistentSaveError(
                f"tensor {fqn!r} of shape {list(size)}: the boxes saved by all ranks hold "
                f"{covered} elements in "
                f"all, {how}; the tensor has {total}. Check the flat ranges (FlatParam offsets, "
                "each rank's start) "
                "or layout rules that describe it"
            )


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
                made = described_group(g.signature, g.description)
                if made.signature != g.signature:
                    raise InconsistentSaveError(
                        f"rank {me}: its mesh group description does not match its own checksum"
                    )
                described[key] = made
            members[key].append(me)
    for (first, sig), ranks in members.items():
        group = described.get((first, sig))
        if group is None:
            raise InconsistentSaveError(
                f"ranks {listed(sorted(ranks))} hold DTensors on a device mesh whose "
                "first rank is "
                f"{first}, but rank {first} does not hold the same ones: every rank of a mesh "
                "must save the same "
                "DTensors (names, dtypes, shapes, placements). Pass "
                "UCPSavePlanner(compact_plans=False) to plan "
                "per chunk, which names the tensors that differ"
            )
        if sorted(ranks) != sorted(group.ranks):
            missing = sorted(set(group.ranks) - set(ranks))
            raise InconsistentSaveError(
                f"the device mesh of ranks {listed(sorted(group.ranks))} holds "
                f"{len(group.tensors)} "
                f"DTensor(s), but rank(s) {listed(missing)} of it did not report the same "
                "ones (or are "
                "not saving): every rank of a mesh must save the same DTensors, in the same "
                "process group"
            )
    return list(described.values())


# ---------------------------------------------------------------------- writers


@dataclass
class ChunkTable:
    """Every distinct chunk of a save's per-chunk-planned tensors.

    Attributes:
        holders: chunk ``(fqn, offsets)`` -> ranks holding it, in rank order.
        first: chunk -> the first write item seen for it.
        props: tensor -> (properties, global size, first rank that saves it).
        by_tensor: tensor -> its chunks, in the order first seen.
    """

    holders: dict[PieceKey, list[int]] = field(default_factory=lambda: defaultdict(list))
    first: dict[PieceKey, WriteItem] = field(default_factory=dict)
    props: dict[str, tuple[TensorProperties, torch.Size, int]] = field(default_factory=dict)
    by_tensor: dict[str, list[PieceKey]] = field(default_factory=lambda: defaultdict(list))

    def metadata(self) -> dict[str, TensorStorageMetadata]:
        """DCP's metadata of every tensor in the table, with its chunk list."""
        return {
            fqn: TensorStorageMetadata(
                p, size, [tensor_data(self.first[k]).chunk for k in self.by_tensor[fqn]]
            )
            for fqn, (p, size, _) in self.props.items()
        }


def collect_chunks(plans: Sequence[SavePlan]) -> ChunkTable:
    """The chunk table of ``plans`` (one per rank, in rank order).

    Raises :class:`~ucp_dcp.errors.InconsistentSaveError` when one key is a
    different dtype or shape on two ranks, or two ranks save boxes of
    different sizes at the same offsets.
    """
    table = ChunkTable()
    for r, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            fqn = item.index.fqn
            td = tensor_data(item)
            seen = table.props.get(fqn)
            if seen is None:
                table.props[fqn] = (td.properties, td.size, r)
            elif (seen[0].dtype, seen[1]) != (td.properties.dtype, td.size):
                raise InconsistentSaveError(
                    f"tensor {fqn!r} is {dtype_name(seen[0].dtype)}{list(seen[1])} on rank "
                    f"{seen[2]} but "
                    f"{dtype_name(td.properties.dtype)}{list(td.size)} on rank {r}; one key must "
                    "name one "
                    "tensor on every rank (pipeline stages: rename stage-local layers to global "
                    "names)"
                )
            key = (fqn, tuple(td.chunk.offsets))
            if key not in table.first:
                table.by_tensor[fqn].append(key)
            table.holders[key].append(r)
            seen_item = table.first.setdefault(key, item)
            if tensor_data(seen_item).chunk.sizes != td.chunk.sizes:
                raise InconsistentSaveError(
                    f"tensor {fqn!r}: rank {table.holders[key][0]} saves a box of size "
                    f"{list(tensor_data(seen_item).chunk.sizes)} at offsets {list(key[1])} but "
                    f"rank {r} one of "
                    f"size {list(td.chunk.sizes)}: pieces of one tensor held by several ranks "
                    "must be the same box"
                )
    return table


# Replicated tensors up to this size (all their chunks) are written by their lowest holder, like
# shared values, not spread for balance: their bytes do not matter, but each data file they are
# spread over is one more header every rank that loads them opens and parses (AdamW's ``step``
# counters, one plain scalar per parameter: spread, they sent every rank of an FSDP2 restart
# through every rank's file, N headers a rank). A holder takes at most SMALL_BYTES_PER_RANK of
# them, then the next one does, so that a state of many small tensors (a DDP model's biases and
# norms) still spreads its writes, over as few files as that allows.
SMALL_TENSOR_BYTES = 64 << 10
SMALL_BYTES_PER_RANK = 16 << 20


def assign_writers(table: ChunkTable, world_size: int) -> dict[PieceKey, int]:
    """One writer per distinct chunk, among the ranks holding it.

    The replica is chosen per tensor (the same replica index for all its
    chunks) to keep the index compact, by :func:`~ucp_dcp.dcp._mesh_groups.balance`
    over the ranks holding its first chunk; tensors of at most :data:`SMALL_TENSOR_BYTES`
    on the lowest rank holding them that has written less than
    :data:`SMALL_BYTES_PER_RANK` of such tensors.
    """
    load: dict[int, int] = defaultdict(int)
    small = [0] * world_size  # bytes of small tensors each rank writes
    writer: dict[PieceKey, int] = {}
    first = table.first
    sizes = {
        fqn: sum((first[k].tensor_storage_size() or 0) for k in keys)
        for fqn, keys in table.by_tensor.items()
    }
    replicas = {fqn: sorted(table.holders[keys[0]]) for fqn, keys in table.by_tensor.items()}
    for fqn, k in balance(sizes, replicas, load):
        reps0 = replicas[fqn]
        if sizes[fqn] <= SMALL_TENSOR_BYTES:
            room = (i for i, r in enumerate(reps0) if small[r] + sizes[fqn] <= SMALL_BYTES_PER_RANK)
            k = next(room, k)
            small[reps0[k]] += sizes[fqn]
        for key in table.by_tensor[fqn]:
            reps = sorted(table.holders[key])
            w = reps[k % len(reps)]
            writer[key] = w
            load[w] += first[key].tensor_storage_size() or 0
    return writer


def assign_owners(groups: list[MeshGroup], taken: set[str]) -> Owners:
    """Which group writes each mesh-planned tensor (``taken``: keys planned per chunk elsewhere).

    A tensor held by several meshes with the same description is a replica
    (a TP-replicated parameter kept on each TP rank's data-parallel
    submesh): one mesh writes it, chosen by :func:`~ucp_dcp.dcp._mesh_groups.balance`
    over the meshes. Different descriptions under one key are an error.
    """
    holders: dict[str, list[tuple[MeshGroup, TensorSpec]]] = defaultdict(list)
    for g in sorted(groups, key=lambda g: g.first_rank):
        for t in g.tensors:
            holders[t.fqn].append((g, t))
    load: dict[int, int] = defaultdict(int)
    owners: Owners = {}
    sizes = {fqn: cands[0][1].nbytes for fqn, cands in holders.items()}
    meshes = {fqn: [g.first_rank for g, _ in cands] for fqn, cands in holders.items()}
    for fqn, k in balance(sizes, meshes, load):
        cands = holders[fqn]
        spec = cands[0][1]
        same = (spec.dtype, spec.shape, spec.layout)
        other = next(((g, t) for g, t in cands if (t.dtype, t.shape, t.layout) != same), None)
        if fqn in taken or other is not None:
            where = (
                f"as {spec.dtype}{list(spec.shape)} on ranks "
                f"{listed(sorted(cands[0][0].ranks))} and as "
                f"{other[1].dtype}{list(other[1].shape)} on ranks "
                f"{listed(sorted(other[0].ranks))}"
                if other
                else "as a DTensor on some ranks and a plain or irregular tensor on others"
            )
            raise InconsistentSaveError(
                f"tensor {fqn!r} is saved {where}; one key must name one tensor on every rank "
                "(pipeline stages: rename stage-local layers to global names)"
            )
        g, t = cands[k]
        load[g.first_rank] += t.nbytes
        owners[fqn] = (g, t)
    return owners


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


# ---------------------------------------------------------------------- values


def value_writers(reports: Sequence[SaveRankReport]) -> dict[str, int]:
    """Which rank writes each shared value: the lowest one holding it (values are small)."""
    writers: dict[str, int] = {}
    for r, report in enumerate(reports):
        for fqn in report.digests:
            writers.setdefault(fqn, r)
    return writers


def plan_value_item(
    item: WriteItem, r: int, to_rank_local: set[str], writers: dict[str, int]
) -> WriteItem | None:
    """The value write item rank ``r`` keeps in the global plan, or None if another rank writes
    it."""
    fqn = item.index.fqn
    if fqn in to_rank_local:
        return WriteItem(MetadataIndex(rank_local_key(r, fqn)), WriteItemType.BYTE_IO)
    if split_rank_local_key(fqn) is None and r != writers[fqn]:
        return None
    return item


def value_metadata(
    reports: Sequence[SaveRankReport], tensors: Container[str]
) -> dict[str, BytesStorageMetadata]:
    """DCP's metadata of every value and rank-local value (``tensors``: keys that are tensors)."""
    md: dict[str, BytesStorageMetadata] = {}
    for report in reports:
        for fqn in report.digests:
            if fqn not in tensors:
                md[fqn] = BytesStorageMetadata()
        for fqn in report.rank_local:
            md[fqn] = BytesStorageMetadata()
    return md
