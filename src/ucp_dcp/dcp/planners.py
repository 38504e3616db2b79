"""DCP planners: what each rank saves, and what each rank reads back.

``UCPSavePlanner`` records every tensor's DTensor layout, encodes non-tensor
values as tagged JSON (never pickle), checks that values saved once for all
ranks really are the same on every rank, and spreads the writing of
replicated chunks across their replicas.

``UCPLoadPlanner`` turns the target state dict (any layout, any world size)
into reads of exactly the overlapping boxes of the saved chunks, with
strictness rules on keys, shapes and dtypes, and hands each rank its own
rank-local values.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import math
import warnings
from collections import defaultdict
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    STORAGE_TYPES,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_write_items
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .compact import LazyChunks, MeshGroup, TensorSpec
from ..format import Layout, dtype_name, rank_local_key, split_rank_local_key
from ..adapters.layout_rules import LAYOUT_KEY as LAYOUT_RECORD_KEY  # a load that does not ask for it is not warned about it
from ..core.pieces import Piece, TensorPieces
from ..byteio.rangeio import tensor_view
from ..core.sharding import Box, Grid, arith_box, intersect, placement_from_str, placement_to_str
from ..core.values import RankLocal, ReshardFn, decode_value, dtype_from_name, encode_value
from ..errors import CheckpointKeyError

__all__ = ["UCPSavePlanner", "UCPLoadPlanner", "CheckpointKeyError"]

logger = logging.getLogger(__name__)


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _digest(t: torch.Tensor) -> str:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return xxhash.xxh3_64_hexdigest(tensor_view(t.contiguous()))


def _describe(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


# ====================================================================== save


class UCPSavePlanner(DefaultSavePlanner):
    """Save planner for the universal format.

    Args:
        divergent_values: what to do when a non-tensor value or a plain
            (non-DTensor) tensor stored under one key differs between ranks.
            ``"error"`` (default) refuses the save, naming the key and ranks;
            ``"rank_local"`` saves each rank's own copy as if it had been
            wrapped in :class:`~ucp_dcp.RankLocal`. DCP itself would keep one
            rank's copy and hand it to everyone on load.
        check_replicated_tensors: hash plain tensors on every rank to detect
            divergence (costs one pass over them; DTensors are not hashed:
            their placements say what is replicated).
        compact_plans: plan regular DTensors per device mesh instead of per
            chunk (:mod:`ucp_dcp.dcp.compact`): the plans DCP gathers and
            scatters stay the same size whatever the world size. ``False``
            sends one write item per chunk, as DCP does.
    """

    def __init__(
        self,
        *,
        divergent_values: str = "error",
        check_replicated_tensors: bool = True,
        compact_plans: bool = True,
    ) -> None:
        if divergent_values not in ("error", "rank_local"):
            raise ValueError(f"divergent_values must be 'error' or 'rank_local', got {divergent_values!r}")
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.divergent_values = divergent_values
        self.check_replicated_tensors = check_replicated_tensors
        self.compact_plans = compact_plans
        self._compact: dict[str, list[int]] = {}
        self._groups: list[MeshGroup] = []
        self._encoded: dict[str, bytes] = {}
        self._layouts: dict[str, Layout | None] = {}
        self._pieces: dict[tuple[str, tuple[int, ...]], tuple[str, Piece]] = {}

    # ------------------------------------------------------------ local
    def set_up_planner(self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False) -> None:
        """Flatten the state dict (DCP's rules); remember this rank's identity."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.rank, self.world_size = _rank_and_world()
        self._encoded.clear()
        self._layouts.clear()
        self._pieces.clear()

    def layout_of(self, fqn: str) -> Layout | None:
        """The layout this rank saves tensor ``fqn`` with (None for non-tensors)."""
        return self._layouts.get(fqn)

    def encoded_value(self, key: str) -> bytes:
        """The encoded bytes of value ``key`` (a state-dict key or a rank-local key)."""
        rl = split_rank_local_key(key)
        return self._encoded[rl[1] if rl else key]

    def is_compact(self, fqn: str) -> bool:
        """Whether tensor ``fqn`` is planned through its mesh group (no per-chunk record)."""
        return fqn in self._compact

    def create_local_plan(self) -> SavePlan:
        """Write items for values, plain tensors and irregular chunks; mesh groups for the rest.

        Regular DTensors produce no write item here: the rank sends its
        mesh group's checksum (the mesh's first rank also sends the group's
        description) and derives its writes in :meth:`finish_plan`. See
        :mod:`ucp_dcp.dcp.compact`.
        """
        items: list[WriteItem] = []
        digests: dict[str, str] = {}
        layouts: dict[str, Any] = {}
        rank_local: list[str] = []
        meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...], list[int]]] = {}
        piece_fqns: set[str] = set()
        piece_digests: dict[tuple[str, tuple[int, ...]], str] = {}
        members: dict[tuple[tuple[int, ...], tuple[int, ...]], list[TensorSpec]] = defaultdict(list)
        self._compact = {}
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, RankLocal):
                self._encoded[fqn] = encode_value(obj.value, fqn)
                rank_local.append(fqn)
                items.append(WriteItem(MetadataIndex(rank_local_key(self.rank, fqn)), WriteItemType.BYTE_IO))
            elif isinstance(obj, DTensor):
                try:
                    layout = _layout_for(tuple(obj.device_mesh.shape), tuple(obj.placements))
                except ValueError as e:
                    raise ValueError(f"tensor {fqn!r}: {e}") from None
                self._layouts[fqn] = layout
                shape = tuple(obj.shape)
                if self.compact_plans and obj.numel() and _arithmetic_grid(layout, shape):
                    mesh = meshes.get(id(obj.device_mesh))
                    if mesh is None:
                        dm = obj.device_mesh
                        mesh = (tuple(dm.shape), tuple(dm.mesh.reshape(-1).tolist()), list(dm.get_coordinate() or ()))
                        meshes[id(obj.device_mesh)] = mesh
                    members[mesh[:2]].append(TensorSpec(fqn, dtype_name(obj.dtype), shape, layout))
                    self._compact[fqn] = mesh[2]
                    continue
                layouts[fqn] = layout.to_json()
                # Empty local shards (uneven FSDP splits) hold no bytes; keep
                # them only for an empty tensor, so that it is still recorded.
                items.extend(
                    i for i in _create_write_items(fqn, obj)
                    if i.tensor_data.chunk.sizes.numel() or not obj.numel()
                )
            elif isinstance(obj, TensorPieces):
                items.extend(self._piece_items(fqn, obj, piece_fqns, piece_digests))
            elif isinstance(obj, torch.Tensor):
                self._layouts[fqn] = Layout()
                layouts[fqn] = Layout().to_json()
                if self.check_replicated_tensors and self.world_size > 1:
                    digests[fqn] = _digest(obj)
                items.extend(_create_write_items(fqn, obj))
            else:
                data = encode_value(obj, fqn)
                self._encoded[fqn] = data
                digests[fqn] = xxhash.xxh3_64_hexdigest(data)
                items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
        self._groups = []
        groups = []
        for (mesh_shape, ranks), specs in members.items():
            group = _cached_group(MeshGroup(mesh_shape, ranks, tuple(sorted(specs, key=lambda t: t.fqn))))
            self._groups.append(group)
            describe = self.rank == group.first_rank
            groups.append((group.signature, group.first_rank, group.to_json() if describe else None))
        plan = SavePlan(
            items,
            planner_data={
                "rank": self.rank, "digests": digests, "layouts": layouts, "rank_local": rank_local, "groups": groups,
                "pieces": sorted(piece_fqns), "piece_digests": piece_digests,
            },
        )
        self.plan = plan
        return plan

    def _piece_items(
        self,
        key: str,
        obj: TensorPieces,
        piece_fqns: set[str],
        piece_digests: dict[tuple[str, tuple[int, ...]], str],
    ) -> list[WriteItem]:
        """One write item per piece, named by its logical tensor (the state-dict key is not stored)."""
        items = []
        for p in obj.pieces:
            piece_fqns.add(p.fqn)
            if not p.data.numel() and math.prod(p.shape):
                continue  # holds no bytes; an empty logical tensor is still recorded
            where = (p.fqn, p.offsets)
            other = self._pieces.get(where)
            if other is not None:
                raise ValueError(
                    f"logical tensor {p.fqn!r}: this rank (rank {self.rank}) gives the piece at offsets "
                    f"{list(p.offsets)} twice, under state-dict keys {other[0]!r} and {key!r}"
                )
            self._pieces[where] = (key, p)
            if obj.replicated and self.world_size > 1:
                piece_digests[where] = _digest(p.data)
            offsets, sizes = torch.Size(p.offsets), torch.Size(p.data.shape)
            items.append(
                WriteItem(
                    index=MetadataIndex(p.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=p.data.dtype),
                        size=torch.Size(p.shape),
                    ),
                )
            )
        return items

    # ------------------------------------------------------------ global
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Check cross-rank consistency, pick one writer per chunk, build metadata."""
        to_rank_local = self._divergent_keys(all_plans)
        _check_replicated_pieces(all_plans)
        groups = _check_groups(all_plans)
        self._value_writers: dict[str, int] = {}
        # chunk key -> ranks holding it, and one representative write item
        holders: dict[tuple[str, tuple[int, ...]], list[int]] = defaultdict(list)
        first: dict[tuple[str, tuple[int, ...]], WriteItem] = {}
        props: dict[str, tuple[TensorProperties, torch.Size, int]] = {}
        for r, plan in enumerate(all_plans):
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    continue
                td = item.tensor_data
                seen = props.get(fqn)
                if seen is None:
                    props[fqn] = (td.properties, td.size, r)
                elif (seen[0].dtype, seen[1]) != (td.properties.dtype, td.size):
                    raise ValueError(
                        f"tensor {fqn!r} is {dtype_name(seen[0].dtype)}{list(seen[1])} on rank {seen[2]} but "
                        f"{dtype_name(td.properties.dtype)}{list(td.size)} on rank {r}; one key must name one "
                        "tensor on every rank (pipeline stages: rename stage-local layers to global names)"
                    )
                key = (fqn, tuple(td.chunk.offsets))
                holders[key].append(r)
                seen_item = first.setdefault(key, item)
                if seen_item.tensor_data.chunk.sizes != td.chunk.sizes:
                    raise ValueError(
                        f"tensor {fqn!r}: rank {holders[key][0]} saves a box of size "
                        f"{list(seen_item.tensor_data.chunk.sizes)} at offsets {list(key[1])} but rank {r} one of size "
                        f"{list(td.chunk.sizes)}: pieces of one tensor held by several ranks must be the same box"
                    )
        # One writer per distinct chunk. The replica is chosen per tensor (the
        # same replica index for all its chunks) to keep the index compact,
        # and tensors are placed largest first on the least-loaded replica.
        load = [0] * len(all_plans)
        writer: dict[tuple[str, tuple[int, ...]], int] = {}
        by_tensor: dict[str, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
        for key in holders:
            by_tensor[key[0]].append(key)
        sizes = {
            fqn: sum((first[k].tensor_storage_size() or 0) for k in keys) for fqn, keys in by_tensor.items()
        }
        for fqn in sorted(by_tensor, key=lambda f: (-sizes[f], f)):
            keys = by_tensor[fqn]
            reps0 = sorted(holders[keys[0]])
            k = min(range(len(reps0)), key=lambda i: (load[reps0[i]], i))
            for key in keys:
                reps = sorted(holders[key])
                w = reps[k % len(reps)]
                writer[key] = w
                load[w] += first[key].tensor_storage_size() or 0
        new_plans = []
        for r, plan in enumerate(all_plans):
            items = []
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    fqn = item.index.fqn
                    if fqn in to_rank_local:
                        item = WriteItem(MetadataIndex(rank_local_key(r, fqn)), WriteItemType.BYTE_IO)
                    elif split_rank_local_key(fqn) is None and r != self._value_writer(fqn, all_plans):
                        continue
                    items.append(item)
                elif writer[(item.index.fqn, tuple(item.tensor_data.chunk.offsets))] == r:
                    items.append(item)
            new_plans.append(dataclasses.replace(plan, items=items, planner_data=None))
        _check_coverage(all_plans, by_tensor, first)
        md: dict[str, STORAGE_TYPES] = {}
        for fqn, (p, size, _) in props.items():
            md[fqn] = TensorStorageMetadata(
                p, size, [first[k].tensor_data.chunk for k in by_tensor[fqn]]
            )
        layouts: dict[str, Layout | None] = {}
        for plan in all_plans:
            for fqn, lj in plan.planner_data["layouts"].items():
                lay = Layout(tuple(lj["mesh"]), tuple(lj["placements"]))
                layouts[fqn] = lay if layouts.get(fqn, lay) == lay else None
        owners = _owners(groups, set(md))
        for fqn, (g, t) in owners.items():
            md[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype_from_name(t.dtype)),
                torch.Size(t.shape),
                LazyChunks(functools.partial(t.layout.chunks, t.shape)),
            )
            layouts[fqn] = t.layout
        # Tell each rank which of its groups' tensors another mesh writes.
        skip: dict[str, list[str]] = {}
        for g in groups:
            skip[g.signature] = sorted(t.fqn for t in g.tensors if owners[t.fqn][0] is not g)
        for r, plan in enumerate(all_plans):
            theirs = sorted({f for sig, _, _ in plan.planner_data.get("groups", ()) for f in skip[sig]})
            if theirs:
                new_plans[r] = dataclasses.replace(new_plans[r], planner_data={"skip": theirs})
        for plan in all_plans:
            for fqn in plan.planner_data["digests"]:
                if fqn not in props:
                    md[fqn] = BytesStorageMetadata()
            for fqn in plan.planner_data["rank_local"]:
                md[fqn] = BytesStorageMetadata()
        self.metadata = Metadata(
            state_dict_metadata=md,
            planner_data={
                "layouts": layouts,
                "world_size": len(all_plans),
                # In-process, for UCPStorageWriter.finish on the coordinator.
                "owners": {fqn: g for fqn, (g, _) in owners.items()},
                "positions": {p.planner_data["rank"]: r for r, p in enumerate(all_plans)},
            },
        )
        return new_plans, self.metadata

    def _value_writer(self, fqn: str, all_plans: list[SavePlan]) -> int:
        # Values are small: the lowest rank holding one writes it.
        w = self._value_writers.get(fqn)
        if w is None:
            w = min(r for r, p in enumerate(all_plans) if fqn in p.planner_data["digests"])
            self._value_writers[fqn] = w
        return w

    def _divergent_keys(self, all_plans: list[SavePlan]) -> set[str]:
        """Keys whose value differs across ranks; raises unless they may become rank-local."""
        per_key: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for r, plan in enumerate(all_plans):
            for fqn, d in plan.planner_data["digests"].items():
                per_key[fqn][d].append(r)
        divergent = {fqn: groups for fqn, groups in per_key.items() if len(groups) > 1}
        tensors = {fqn for plan in all_plans for fqn in plan.planner_data["layouts"]}
        bad_tensors = sorted(f for f in divergent if f in tensors)
        if bad_tensors or (divergent and self.divergent_values == "error"):
            fqn = (bad_tensors or sorted(divergent))[0]
            groups = sorted(divergent[fqn].values())
            what = "plain tensor" if fqn in tensors else "non-tensor value"
            raise ValueError(
                f"{what} {fqn!r} differs across ranks (ranks {_describe(groups[0])} hold one value, "
                f"ranks {_describe(groups[1])} another; {len(divergent)} key(s) differ in all). Saving one copy "
                "would hand every rank the same value on load. Wrap per-rank state in ucp_dcp.RankLocal(...)"
                + (", or pass UCPSavePlanner(divergent_values='rank_local')" if fqn not in tensors else
                   ", or make it a DTensor with the placements it really has")
            )
        return set(divergent)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """The coordinator's plan plus the chunks this rank writes for its mesh groups."""
        items = list(new_plan.items)
        skip = frozenset((new_plan.planner_data or {}).get("skip", ()))
        for g in self._groups:
            items.extend(self._group_items(g, skip))
        self.plan = dataclasses.replace(new_plan, items=items)
        return self.plan

    def _group_items(self, group: MeshGroup, skip: frozenset[str]) -> list[WriteItem]:
        """Write items of the chunks this rank writes for ``group``.

        Cached per (group, rank, coordinate): a training loop saving the
        same model again derives nothing twice (items name tensors by key;
        the data is looked up at write time).
        """
        coord = self._compact[group.tensors[0].fqn]
        key = (group.signature, self.rank, tuple(coord), skip)
        items = _GROUP_ITEMS.get(key)
        if items is None:
            items = []
            for t in group.tensors:
                if t.fqn not in skip and group.writes(t, coord):
                    box = arith_box(t.shape, group.mesh, _placements(t.layout), coord)
                    assert box is not None  # mesh groups hold arithmetic layouts only
                    if box.numel:
                        items.append(_shard_item(t, box))
            if len(_GROUP_ITEMS) >= 16:
                _GROUP_ITEMS.pop(next(iter(_GROUP_ITEMS)))
            _GROUP_ITEMS[key] = items
        return items

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The bytes of a value, or the local tensor of a chunk (detached)."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.encoded_value(write_item.index.fqn))
        if self._pieces:
            hit = self._pieces.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if hit is not None:
                return hit[1].data.detach()
        return super().resolve_data(write_item).detach()


# Plan caches (per process): mesh groups by signature, so their grids and
# replica choices are computed once, and derived write items per rank.
_GROUPS: dict[str, MeshGroup] = {}
_GROUP_ITEMS: dict[tuple[str, int, tuple[int, ...], frozenset[str]], list[WriteItem]] = {}


def _check_replicated_pieces(all_plans: list[SavePlan]) -> None:
    """Pieces declared replicated must hold the same bytes on every rank that has them."""
    per_key: dict[tuple[str, tuple[int, ...]], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for r, plan in enumerate(all_plans):
        for key, d in plan.planner_data.get("piece_digests", {}).items():
            per_key[key][d].append(r)
    bad = sorted(k for k, groups in per_key.items() if len(groups) > 1)
    if bad:
        groups = sorted(per_key[bad[0]].values())
        fqn, offs = bad[0]
        raise ValueError(
            f"replicated tensor {fqn!r} (box at offsets {list(offs)}) differs across ranks: ranks {_describe(groups[0])} "
            f"hold one value, ranks {_describe(groups[1])} another ({len(bad)} replicated piece(s) differ in all). "
            "A tensor declared replicated (Replicated layout rule, TensorPieces(replicated=True)) is saved once, so "
            "every rank that holds it must hold the same bytes: synchronise it, or declare how it is sharded"
        )


def _check_coverage(
    all_plans: list[SavePlan],
    by_tensor: dict[str, list[tuple[str, tuple[int, ...]]]],
    first: dict[tuple[str, tuple[int, ...]], WriteItem],
) -> None:
    """Every element of a tensor saved as pieces is held by exactly one distinct box.

    DTensor chunks tile their tensor by construction; pieces come from flat
    ranges and layout rules, which can leave gaps or overlap when they are
    described wrongly. Distinct boxes whose element counts add up to the
    tensor's and that never overlap tile it; overlaps are caught by the sum
    (an overlap that exactly cancels a gap is not, a rare double fault).
    """
    fqns = {f for plan in all_plans for f in plan.planner_data.get("pieces", ())}
    for fqn in sorted(fqns):
        keys = by_tensor.get(fqn, [])
        if not keys:
            continue  # only empty pieces
        size = first[keys[0]].tensor_data.size
        total = math.prod(size)
        covered = sum(math.prod(first[k].tensor_data.chunk.sizes) for k in keys)
        if covered != total:
            how = "leaving elements that no rank holds" if covered < total else "so some of them overlap"
            raise ValueError(
                f"tensor {fqn!r} of shape {list(size)}: the boxes saved by all ranks hold {covered} elements in "
                f"all, {how}; the tensor has {total}. Check the flat ranges (FlatParam offsets, each rank's start) "
                "or layout rules that describe it"
            )


@functools.lru_cache(maxsize=1024)
def _placements(layout: Layout) -> tuple[Placement, ...]:
    return tuple(placement_from_str(p) for p in layout.placements)


def _shard_item(spec: TensorSpec, box: Box) -> WriteItem:
    """DCP's write item for one DTensor shard (what ``_create_write_items``
    makes, without DTensor's per-call arithmetic)."""
    offsets, sizes = torch.Size(box.offsets), torch.Size(box.sizes)
    return WriteItem(
        index=MetadataIndex(spec.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype_from_name(spec.dtype)),
            size=torch.Size(spec.shape),
        ),
    )


def _local_boxes(obj: torch.Tensor) -> list[Box]:
    """The boxes of the global tensor that ``obj`` holds on this rank."""
    if isinstance(obj, DTensor):
        coord = obj.device_mesh.get_coordinate()
        if coord is not None:
            box = arith_box(tuple(obj.shape), tuple(obj.device_mesh.shape), obj.placements, coord)
            if box is not None:
                return [box]
    return [Box(tuple(c.offsets), tuple(c.sizes)) for c in _create_chunk_list(obj)]


def _cached_group(group: MeshGroup) -> MeshGroup:
    cached = _GROUPS.get(group.signature)
    if cached is None:
        if len(_GROUPS) >= 64:
            _GROUPS.pop(next(iter(_GROUPS)))
        _GROUPS[group.signature] = cached = group
    return cached


@functools.lru_cache(maxsize=4096)
def _layout_for(mesh_shape: tuple[int, ...], placements: tuple[Placement, ...]) -> Layout:
    # Every parameter of a model shares a handful of layouts: name them once.
    return Layout(mesh_shape, tuple(placement_to_str(p) for p in placements))


@functools.lru_cache(maxsize=4096)
def _arithmetic_grid(layout: Layout, shape: tuple[int, ...]) -> bool:
    """Whether the layout's chunks (and their holders) follow by arithmetic."""
    try:
        return layout.grid(shape).mesh_lin is not None
    except ValueError:  # not box-shaped: planned per chunk
        return False


def _owners(groups: list[MeshGroup], taken: set[str]) -> dict[str, tuple[MeshGroup, TensorSpec]]:
    """Which group writes each mesh-planned tensor.

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
    owners: dict[str, tuple[MeshGroup, TensorSpec]] = {}
    for fqn in sorted(holders, key=lambda f: (-holders[f][0][1].nbytes, f)):
        cands = holders[fqn]
        spec = cands[0][1]
        if fqn in taken or any((t.dtype, t.shape, t.layout) != (spec.dtype, spec.shape, spec.layout) for _, t in cands):
            other = next(((g, t) for g, t in cands if (t.dtype, t.shape, t.layout) != (spec.dtype, spec.shape, spec.layout)), None)
            where = (
                f"as {spec.dtype}{list(spec.shape)} on ranks {_describe(sorted(cands[0][0].ranks))} and as "
                f"{other[1].dtype}{list(other[1].shape)} on ranks {_describe(sorted(other[0].ranks))}"
                if other else "as a DTensor on some ranks and a plain or irregular tensor on others"
            )
            raise ValueError(
                f"tensor {fqn!r} is saved {where}; one key must name one tensor on every rank "
                "(pipeline stages: rename stage-local layers to global names)"
            )
        g, t = min(cands, key=lambda c: (load[c[0].first_rank], c[0].first_rank))
        load[g.first_rank] += t.nbytes
        owners[fqn] = (g, t)
    return owners


def _check_groups(all_plans: list[SavePlan]) -> list[MeshGroup]:
    """The mesh groups of a save, checked: every rank of each mesh reported
    the same description as the mesh's first rank."""
    described: dict[tuple[int, str], MeshGroup] = {}
    members: dict[tuple[int, str], list[int]] = defaultdict(list)
    for plan in all_plans:
        me = plan.planner_data["rank"]
        for sig, first, desc in plan.planner_data.get("groups", ()):
            key = (first, sig)
            if desc is not None and key not in described:
                group = _GROUPS.get(sig) or _cached_group(MeshGroup.from_json(desc))
                if group.signature != sig:
                    raise ValueError(f"rank {me}: its mesh group description does not match its own checksum")
                described[key] = group
            members[key].append(me)
    for (first, sig), ranks in members.items():
        group = described.get((first, sig))
        if group is None:
            raise ValueError(
                f"ranks {_describe(sorted(ranks))} hold DTensors on a device mesh whose first rank is {first}, "
                f"but rank {first} does not hold the same ones: every rank of a mesh must save the same DTensors "
                "(names, dtypes, shapes, placements). Pass UCPSavePlanner(compact_plans=False) to plan per "
                "chunk, which names the tensors that differ"
            )
        if sorted(ranks) != sorted(group.ranks):
            missing = sorted(set(group.ranks) - set(ranks))
            raise ValueError(
                f"the device mesh of ranks {_describe(sorted(group.ranks))} holds {len(group.tensors)} DTensor(s), "
                f"but rank(s) {_describe(missing)} of it did not report the same ones (or are not saving): every "
                "rank of a mesh must save the same DTensors, in the same process group"
            )
    return list(described.values())


# ====================================================================== load


class UCPLoadPlanner(DefaultLoadPlanner):
    """Load planner for the universal format: any saved layout into any target.

    Args:
        allow_partial_load: keys of the state dict that the checkpoint lacks
            are skipped instead of failing the load.
        allow_dtype_cast: a tensor saved in another dtype is cast on load
            instead of failing.
        rank_local_reshard: ``fn(key, saved_by_rank, rank, world_size)`` that
            produces a rank-local value when the world size changed (a
            :class:`~ucp_dcp.RankLocal` in the state dict may carry its own).

    After a load, ``unexpected_keys`` lists checkpoint keys this rank's state
    dict did not ask for. The coordinator warns about the keys that no rank
    asked for (under pipeline or expert parallelism each rank loads only
    its part).
    """

    def __init__(
        self,
        *,
        allow_partial_load: bool = False,
        allow_dtype_cast: bool = False,
        rank_local_reshard: ReshardFn | None = None,
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        self.allow_dtype_cast = allow_dtype_cast
        self.rank_local_reshard = rank_local_reshard
        self.unexpected_keys: list[str] = []
        self.missing_keys: list[str] = []

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        """Flatten the target state dict (DCP's rules), keeping RankLocal wrappers."""
        # DCP's set-up replaces every object it does not know (RankLocal among
        # them) with None, in the caller's dict; put the wrappers back.
        wrappers = list(_find_wrappers(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if wrappers:
            for container, key, w in wrappers:
                container[key] = w
            self.state_dict, self.mappings = flatten_state_dict(_flatten_sharded_tensors(state_dict))
        self.rank, self.world_size = _rank_and_world()
        self._pending: dict[str, tuple[int, dict[int, Any], ReshardFn]] = {}
        self._piece_sets: dict[str, TensorPieces] = {
            k: v for k, v in self.state_dict.items() if isinstance(v, TensorPieces)
        }

    def create_local_plan(self) -> LoadPlan:
        """Read items for every overlap of a target box with a saved chunk."""
        md = self.metadata
        assert md is not None, "set_up_planner was not called with checkpoint metadata"
        pdata = md.planner_data or {}
        rank_local: dict[str, list[int]] = pdata.get("rank_local", {})
        saved_world = pdata.get("world_size")
        items: list[ReadItem] = []
        missing: list[str] = []
        for fqn, obj in self.state_dict.items():
            if fqn in rank_local:
                items.extend(self._rank_local_items(fqn, obj, rank_local[fqn], saved_world))
                continue
            if isinstance(obj, TensorPieces):  # its key is not stored; its pieces name their tensors
                items.extend(self._piece_items(fqn, obj, missing))
                continue
            smd = md.state_dict_metadata.get(fqn)
            if smd is None:
                missing.append(fqn)
                continue
            if isinstance(obj, torch.Tensor):
                items.extend(self._tensor_items(fqn, obj, smd))
            else:
                if not isinstance(smd, BytesStorageMetadata):
                    raise CheckpointKeyError(
                        f"{fqn!r} is a tensor of shape {list(smd.size)} in the checkpoint but a "
                        f"{type(obj).__name__} in the state dict"
                    )
                items.append(_bytes_item(fqn, fqn))
        self.missing_keys = sorted(missing)
        if missing and not self.allow_partial_load:
            raise CheckpointKeyError(
                f"{len(missing)} key(s) of the state dict are missing from the checkpoint: "
                f"{_key_list(self.missing_keys)}. Pass UCPLoadPlanner(allow_partial_load=True) to load the rest"
            )
        known = set(self.state_dict)
        known.update(p.fqn for v in self._piece_sets.values() for p in v.pieces)
        keys = sorted(md.state_dict_metadata)
        wanted = [k in known for k in keys]
        self.unexpected_keys = [k for k, w in zip(keys, wanted) if not w and not k.startswith(LAYOUT_RECORD_KEY)]
        # Which checkpoint keys this rank asks for, as a bitmap over the
        # sorted keys (a bit per key, whatever the world size): the
        # coordinator warns only about keys no rank asked for.
        asked = np.packbits(wanted).tobytes()
        # DCP gathers every rank's load plan on the coordinator only to hand
        # it back unchanged (its global load plan is the identity): at 16384
        # ranks that is gigabytes through one process. Keep the items here
        # and send an empty plan; finish_plan puts them back.
        self._items = items
        self.plan = LoadPlan([], planner_data={"rank": self.rank, "items": len(items), "asked": asked})
        return self.plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's identity plan; warns about checkpoint keys that no rank's state dict asked for."""
        md = self.metadata
        masks = [(p.planner_data or {}).get("asked") for p in global_plan]
        if md is not None and masks and all(m is not None for m in masks):
            keys = sorted(md.state_dict_metadata)
            asked = np.bitwise_or.reduce([np.frombuffer(m, dtype=np.uint8) for m in masks])
            flags = np.unpackbits(asked, count=len(keys))
            not_loaded = [k for k, f in zip(keys, flags) if not f and not k.startswith(LAYOUT_RECORD_KEY)]
            if not_loaded:
                warnings.warn(
                    f"{len(not_loaded)} checkpoint key(s) not in the state dict were not loaded: "
                    f"{_key_list(not_loaded)}",
                    stacklevel=2,
                )
        return super().create_global_plan(global_plan)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        """This rank's read items (kept local since create_local_plan)."""
        items = getattr(self, "_items", None)
        if items is not None and not new_plan.items:
            new_plan = dataclasses.replace(new_plan, items=items)
        self._items = None
        self.plan = new_plan
        return new_plan

    def _piece_items(self, key: str, obj: TensorPieces, missing: list[str]) -> list[ReadItem]:
        """Reads into each piece's view; padding set to the fill value first."""
        with torch.no_grad():
            for t in obj.fill:
                t.fill_(obj.fill_value)
        items = []
        md = self.metadata
        assert md is not None
        for i, p in enumerate(obj.pieces):
            smd = md.state_dict_metadata.get(p.fqn)
            if smd is None:
                missing.append(p.fqn)
                continue
            items.extend(self._tensor_items(p.fqn, p.data, smd, shape=p.shape, boxes=[p.box], dest=(key, i)))
        return items

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination of a read: a piece's view, or DCP's lookup for everything else."""
        pieces = self._piece_sets.get(read_item.dest_index.fqn) if self._piece_sets else None
        if pieces is not None and read_item.dest_index.index is not None:
            view = pieces.pieces[read_item.dest_index.index].data
            return self.transform_tensor(read_item, view)
        return super().resolve_tensor(read_item)

    def _tensor_items(
        self,
        fqn: str,
        obj: torch.Tensor,
        smd: STORAGE_TYPES,
        *,
        shape: tuple[int, ...] | None = None,
        boxes: list[Box] | None = None,
        dest: tuple[str, int] | None = None,
    ) -> list[ReadItem]:
        """Reads of every overlap of the target boxes with saved chunks of ``fqn``.

        ``obj`` is the destination (its dtype is checked). For a piece,
        ``shape`` is the logical tensor's, ``boxes`` the piece's box and
        ``dest`` (state-dict key, piece number) where :meth:`resolve_tensor`
        finds its view.
        """
        if not isinstance(smd, TensorStorageMetadata):
            raise CheckpointKeyError(f"{fqn!r} is a non-tensor value in the checkpoint but a tensor in the state dict")
        want = tuple(obj.shape) if shape is None else tuple(shape)
        if want != tuple(smd.size):
            raise CheckpointKeyError(
                f"size mismatch for {fqn!r}: the checkpoint has shape {list(smd.size)}, "
                f"the state dict expects {list(want)}"
            )
        if obj.dtype != smd.properties.dtype and not self.allow_dtype_cast:
            raise CheckpointKeyError(
                f"dtype mismatch for {fqn!r}: the checkpoint has {dtype_name(smd.properties.dtype)}, "
                f"the state dict expects {dtype_name(obj.dtype)}. Pass UCPLoadPlanner(allow_dtype_cast=True) "
                "to cast on load"
            )
        grid = self._saved_grid(fqn, smd)
        items = []
        for target in _local_boxes(obj) if boxes is None else boxes:
            if not target.numel:
                continue
            dest_index = (
                MetadataIndex(fqn, target.offsets) if dest is None else MetadataIndex(dest[0], target.offsets, dest[1])
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
                    f"{fqn!r}: the saved chunks cover {covered} of the {target.numel} elements this rank needs "
                    f"(box at {list(target.offsets)} of size {list(target.sizes)}): the checkpoint is incomplete"
                )
        return items

    def _saved_grid(self, fqn: str, smd: TensorStorageMetadata) -> Grid | None:
        """The grid of the saved chunks: from the index when UCPStorageReader
        supplied it, else built from DCP's chunk list (another reader)."""
        source = (self.metadata.planner_data or {}).get("chunk_grid") if self.metadata else None
        if callable(source):
            return source(fqn)
        boxes = [Box(tuple(c.offsets), tuple(c.sizes)) for c in smd.chunks]
        return Grid.from_boxes(boxes, tuple(smd.size)) if all(b.numel for b in boxes) else None

    def _rank_local_items(self, fqn: str, obj: Any, saved_ranks: list[int], saved_world: int | None) -> list[ReadItem]:
        if saved_world == self.world_size and self.rank in saved_ranks:
            return [_bytes_item(fqn, rank_local_key(self.rank, fqn))]
        fn = obj.reshard if isinstance(obj, RankLocal) and obj.reshard else self.rank_local_reshard
        if fn is None:
            raise CheckpointKeyError(
                f"rank-local value {fqn!r} was saved by {len(saved_ranks)} rank(s) (world size {saved_world}) "
                f"but rank {self.rank} of world size {self.world_size} is loading it; another rank's value "
                "would be wrong here. Pass RankLocal(value, reshard=fn) or "
                "UCPLoadPlanner(rank_local_reshard=fn) to say how to map it"
            )
        self._pending[fqn] = (len(saved_ranks), {}, fn)
        return [_bytes_item(fqn, rank_local_key(r, fqn)) for r in saved_ranks]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a JSON value and put it in place (rank-local values too)."""
        fqn = read_item.dest_index.fqn
        decoded = decode_value(value.getvalue(), fqn)
        pending = self._pending.get(fqn)
        if pending is not None:
            n, got, fn = pending
            rl = split_rank_local_key(read_item.storage_index.fqn)
            got[rl[0] if rl else 0] = decoded
            if len(got) < n:
                return
            del self._pending[fqn]
            decoded = fn(fqn, dict(sorted(got.items())), self.rank, self.world_size)
        target = self.state_dict.get(fqn)
        if isinstance(target, RankLocal):
            target.value = decoded  # the wrapper object is shared with the caller's dict
            return
        self.state_dict[fqn] = decoded
        if self.flatten_state_dict:
            _set_in_place(self.original_state_dict, self.mappings[fqn], decoded)


def _set_in_place(root: Any, path: tuple[Any, ...], value: Any) -> None:
    """Put ``value`` at ``path`` of the caller's nested state dict.

    DCP's flattened paths hold ``str(key)`` for dict keys; where the caller's
    dict has a non-str key with that spelling (``{0: ...}`` in optimizer-style
    state), use the caller's key rather than adding a new str one.
    """
    cur = root
    for i, p in enumerate(path):
        key = p
        if isinstance(cur, dict) and p not in cur:
            key = next((k for k in cur if str(k) == str(p)), p)
        if i == len(path) - 1:
            cur[key] = value
            return
        try:
            cur = cur[key]
        except (KeyError, IndexError, TypeError):
            set_element(root, path, value)  # a missing container: DCP's own rules create it
            return


def _find_wrappers(obj: Any) -> Iterator[tuple[Any, Any, RankLocal | TensorPieces]]:
    """RankLocal and TensorPieces values, which DCP's set-up would replace with None."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        if isinstance(v, (RankLocal, TensorPieces)):
            yield obj, k, v
        else:
            yield from _find_wrappers(v)


def _bytes_item(dest_fqn: str, storage_fqn: str) -> ReadItem:
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(dest_fqn),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(storage_fqn),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )


def _key_list(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{', ...' if len(keys) > limit else ''}]"
