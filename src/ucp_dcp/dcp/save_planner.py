"""``UCPSavePlanner``: what each rank saves, as DCP's save-planner protocol, and its local step.

The planner records every tensor's DTensor layout, encodes non-tensor values as tagged JSON (never
pickle), checks that values saved once for all ranks really are the same on every rank, and spreads
the writing of replicated chunks across their replicas. Its methods are thin: the local plan is
:func:`create_local_save_plan` (below; what it makes of each kind of entry: docs/resharding.md,
"Tensor kinds"), the coordinator's step
:func:`~ucp_dcp.dcp._save_global.create_global_save_plan`, and the derived writes of mesh groups
:func:`~ucp_dcp.dcp._mesh_groups.group_items`.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from .._compat import ShardedTensor, create_write_items, dtensor_local, is_checkpointable
from ..byteio.rangeio import tensor_view
from ..byteio.requests import rank_and_world
from ..core.pieces import Piece, TensorPieces
from ..core.sharding import Box, placement_to_str
from ..core.values import RankLocal, encode_value
from ..errors import (
    InconsistentSaveError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    LayoutError,
    UnsupportedValueError,
    listed,
)
from ..format import Layout, dtype_name, rank_local_key, split_rank_local_key
from ..format.names import RANK_LOCAL_PREFIX
from ..format.schema import check_flags
from ._mesh_groups import MeshGroup, TensorSpec, cached_group, group_items, shard_item
from ._plan_records import (
    MeshGroupReport,
    PieceKey,
    SaveRankReport,
    SaveReply,
    tensor_data,
)
from ._save_global import create_global_save_plan

__all__ = ["UCPSavePlanner"]


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
            chunk (:mod:`ucp_dcp.dcp._mesh_groups`): the plans DCP gathers and
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
            raise InvalidArgumentError(
                f"divergent_values must be 'error' or 'rank_local', got {divergent_values!r}"
            )
        check_flags(
            "UCPSavePlanner",
            check_replicated_tensors=check_replicated_tensors,
            compact_plans=compact_plans,
        )
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.divergent_values = divergent_values
        self.check_replicated_tensors = check_replicated_tensors
        self.compact_plans = compact_plans
        self._local = LocalSavePlan(SavePlan([]))

    # ------------------------------------------------------------ local
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        """Flatten the state dict (DCP's rules); remember this rank's identity. Keys that collide
        once flattened, or that begin with the format's reserved rank-local prefix, are refused."""
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except ValueError as e:
            if "duplicated flatten key" not in str(e):
                raise
            raise UnsupportedValueError(
                f"two state-dict entries flatten to one key ({e}): nested {{'a': {{'b': ...}}}} "
                "and a key 'a.b' at the top, say; rename one"
            ) from None
        reserved = [k for k in self.state_dict if k.startswith(RANK_LOCAL_PREFIX)]
        if reserved:
            raise UnsupportedValueError(
                f"state-dict key(s) {listed(reserved, 5)} begin with {RANK_LOCAL_PREFIX!r}, the "
                "prefix the format names rank-local values by; rename them"
            )
        self.rank, self.world_size = rank_and_world()
        self._local = LocalSavePlan(SavePlan([]))

    def layout_of(self, fqn: str) -> Layout | None:
        """The layout this rank saves tensor ``fqn`` with (None for non-tensors)."""
        return self._local.layouts.get(fqn)

    def encoded_value(self, key: str) -> bytes:
        """The encoded bytes of value ``key`` (a state-dict key or a rank-local key)."""
        rl = split_rank_local_key(key)
        return self._local.encoded[rl[1] if rl else key]

    def is_compact(self, fqn: str) -> bool:
        """Whether tensor ``fqn`` is planned through its mesh group (no per-chunk record)."""
        return fqn in self._local.coords

    def create_local_plan(self) -> SavePlan:
        """Write items for values, plain tensors and irregular chunks; mesh groups for the rest.

        Regular DTensors produce no write item here: the rank sends its
        mesh group's checksum (the mesh's first rank also sends the group's
        description) and derives its writes in :meth:`finish_plan`. See
        :mod:`ucp_dcp.dcp._mesh_groups`.
        """
        self._local = create_local_save_plan(
            self.state_dict,
            self.rank,
            self.world_size,
            compact_plans=self.compact_plans,
            check_replicated_tensors=self.check_replicated_tensors,
        )
        self.plan = self._local.plan
        return self.plan

    # ------------------------------------------------------------ global
    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """Check cross-rank consistency, pick one writer per chunk, build metadata."""
        new_plans, self.metadata = create_global_save_plan(
            all_plans, allow_rank_local=self.divergent_values == "rank_local"
        )
        # The coordinator's nesting paths that a dotted key does not say by
        # itself (list indices, keys with dots), for loads into an empty dict.
        paths = {k: tuple(p) for k, p in self.mappings.items() if tuple(p) != tuple(k.split("."))}
        if paths:
            self.metadata.planner_data = dataclasses.replace(
                self.metadata.planner_data, paths=paths
            )
        return new_plans, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        """The coordinator's plan plus the chunks this rank writes for its mesh groups."""
        items = list(new_plan.items)
        reply = new_plan.planner_data
        skip = frozenset(reply.skip if isinstance(reply, SaveReply) else ())
        for g in self._local.groups:
            items.extend(group_items(g, self.rank, self._local.coords[g.tensors[0].fqn], skip))
        self.plan = dataclasses.replace(new_plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The bytes of a value, or the local tensor of a chunk (detached)."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.encoded_value(write_item.index.fqn))
        pieces = self._local.pieces
        if pieces:
            hit = pieces.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
            if hit is not None:
                return hit[1].data.detach()
        return resolved_as(write_item, super().resolve_data(write_item), torch.Tensor).detach()


_T = TypeVar("_T")


def resolved_as(item: WriteItem, data: object, kind: type[_T]) -> _T:
    """``data``, what a save planner's ``resolve_data`` gave for ``item``, as a ``kind``.

    DCP types it as a tensor or a buffer: a tensor item resolves to a tensor,
    a value to an ``io.BytesIO``.

    Raises :class:`~ucp_dcp.errors.InvalidArgumentTypeError` for anything else.
    """
    if not isinstance(data, kind):
        raise InvalidArgumentTypeError(
            f"{item.index.fqn!r}: the save planner resolved its {item.type.name} write item to a "
            f"{type(data).__name__}, not a {kind.__name__}"
        )
    return data


# ------------------------------------------------------------ what one rank saves

_PLAIN = Layout()  # one object for every plain tensor: pickled once per plan


@dataclass
class LocalSavePlan:
    """A rank's local save plan, and what its planner keeps to finish and resolve it.

    Attributes:
        plan: the items and the :class:`SaveRankReport` sent to the coordinator.
        groups: this rank's mesh groups (their writes are derived in ``finish_plan``).
        coords: mesh-planned tensor -> this rank's coordinate on its mesh.
        encoded: encoded bytes of every value, by state-dict key.
        layouts: layout of every tensor this rank saves (None: pieces).
        pieces: ``(fqn, offsets)`` -> (state-dict key, piece) of every piece it saves.
    """

    plan: SavePlan
    groups: list[MeshGroup] = field(default_factory=list)
    coords: dict[str, list[int]] = field(default_factory=dict)
    encoded: dict[str, bytes] = field(default_factory=dict)
    layouts: dict[str, Layout | None] = field(default_factory=dict)
    pieces: dict[PieceKey, tuple[str, Piece]] = field(default_factory=dict)


def saved_form(t: torch.Tensor) -> torch.Tensor:
    """``t`` as it is saved: its values in contiguous CPU memory (copied where they are not; a
    conjugate or negative view's memory holds other values than it reads as)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


def tensor_digest(t: torch.Tensor) -> str:
    """xxh3-64 of the bytes tensor ``t`` is saved as (:func:`saved_form`)."""
    return xxhash.xxh3_64_hexdigest(tensor_view(saved_form(t)))


def create_local_save_plan(
    state_dict: dict[str, Any],
    rank: int,
    world_size: int,
    *,
    compact_plans: bool = True,
    check_replicated_tensors: bool = True,
) -> LocalSavePlan:
    """Write items for values, plain tensors and irregular chunks; mesh groups for the rest.

    ``state_dict`` is flattened (DCP's keys). Regular DTensors produce no
    write item here when ``compact_plans``: the rank sends its mesh group's
    checksum (the mesh's first rank also sends the group's description).
    """
    out = LocalSavePlan(SavePlan([]))
    items: list[WriteItem] = []
    digests: dict[str, str] = {}
    layouts: dict[str, Layout] = {}
    rank_local: list[str] = []
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...], list[int]]] = {}
    piece_fqns: set[str] = set()
    piece_digests: dict[PieceKey, str] = {}
    members: dict[tuple[tuple[int, ...], tuple[int, ...]], list[TensorSpec]] = defaultdict(list)
    for fqn, obj in state_dict.items():
        if isinstance(obj, RankLocal):
            out.encoded[fqn] = encode_value(obj.value, fqn)
            rank_local.append(fqn)
            items.append(WriteItem(MetadataIndex(rank_local_key(rank, fqn)), WriteItemType.BYTE_IO))
        elif is_checkpointable(obj):
            # LocalShardsWrapper DTensors (torchrec) and tensor subclasses of
            # DCP's checkpointable protocol say their own chunks: their
            # placements, if any, do not describe them. Listed explicitly, as
            # a ShardedTensor's are.
            if isinstance(obj, DTensor):
                _dtensor_layout(fqn, obj)  # refuses Partial placements, naming the key
            out.layouts[fqn] = None
            items.extend(_checkpointable_items(fqn, obj))
        elif isinstance(obj, DTensor):
            layout = _dtensor_layout(fqn, obj)
            if obj.device_mesh.get_coordinate() is None:
                # This rank is not in the tensor's mesh (a DTensor on a
                # sub-mesh): it holds none of it, and the mesh's ranks save it.
                continue
            out.layouts[fqn] = layout
            shape = tuple(obj.shape)
            if compact_plans and obj.numel() and _arithmetic_grid(layout, shape):
                mesh = meshes.get(id(obj.device_mesh))
                if mesh is None:
                    dm = obj.device_mesh
                    mesh = (
                        tuple(dm.shape),
                        tuple(dm.mesh.reshape(-1).tolist()),
                        list(dm.get_coordinate() or ()),
                    )
                    meshes[id(obj.device_mesh)] = mesh
                members[mesh[:2]].append(TensorSpec(fqn, dtype_name(obj.dtype), shape, layout))
                out.coords[fqn] = mesh[2]
                continue
            layouts[fqn] = layout
            items.extend(_write_items(fqn, obj))
        elif isinstance(obj, TensorPieces):
            items.extend(
                _piece_items(
                    fqn,
                    obj,
                    rank,
                    world_size,
                    out.pieces,
                    piece_fqns,
                    piece_digests,
                    check_replicated_tensors,
                )
            )
        elif isinstance(obj, ShardedTensor):
            # FSDP1 SHARDED_STATE_DICT, torchrec: each rank holds shards at
            # global offsets, as an irregular DTensor does. No layout is known,
            # so the index lists its chunks explicitly.
            out.layouts[fqn] = None
            items.extend(_write_items(fqn, obj))
        elif isinstance(obj, torch.Tensor):
            out.layouts[fqn] = layouts[fqn] = _PLAIN
            if check_replicated_tensors and world_size > 1:
                digests[fqn] = tensor_digest(obj)
            items.extend(create_write_items(fqn, obj))
        else:
            data = encode_value(obj, fqn)
            out.encoded[fqn] = data
            digests[fqn] = xxhash.xxh3_64_hexdigest(data)
            items.append(WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO))
    reports = []
    for (mesh_shape, ranks), specs in members.items():
        group = cached_group(
            MeshGroup(mesh_shape, ranks, tuple(sorted(specs, key=lambda t: t.fqn)))
        )
        out.groups.append(group)
        describe = rank == group.first_rank
        reports.append(
            MeshGroupReport(
                group.signature, group.first_rank, group.to_json() if describe else None
            )
        )
    report = SaveRankReport(
        rank=rank,
        digests=digests,
        layouts=layouts,
        rank_local=tuple(rank_local),
        groups=tuple(reports),
        pieces=tuple(sorted(piece_fqns)),
        piece_digests=piece_digests,
    )
    out.plan = SavePlan(items, planner_data=report)
    return out


def _write_items(fqn: str, obj: DTensor | ShardedTensor) -> list[WriteItem]:
    """DCP's write items of ``obj``'s local shards but the empty ones (uneven FSDP splits hold
    no bytes), kept only for an empty tensor, so that it is still recorded."""
    return [
        i
        for i in create_write_items(fqn, obj)
        if tensor_data(i).chunk.sizes.numel() or not obj.numel()
    ]


def _dtensor_layout(fqn: str, obj: DTensor) -> Layout:
    """The layout of DTensor ``fqn``; a ``LayoutError`` naming it when its placements have none
    (Partial)."""
    try:
        return _layout_for(tuple(obj.device_mesh.shape), tuple(obj.placements))
    except ValueError as e:
        raise LayoutError(f"tensor {fqn!r}: {e}") from None


def _checkpointable_items(fqn: str, obj: torch.Tensor) -> list[WriteItem]:
    """The write items ``obj`` plans for itself (``__create_write_items__``), checked.

    Every item must be a tensor chunk inside the tensor's global shape; the
    empty shard of a rank that holds none is dropped.
    """
    kind = type(dtensor_local(obj)).__name__
    if not hasattr(obj, "__create_write_items__"):
        raise UnsupportedValueError(
            f"tensor {fqn!r}: its {kind} has __create_chunk_list__ but no __create_write_items__; "
            "a checkpointable tensor must implement both (and __get_tensor_shard__) to be saved"
        )
    shape = tuple(obj.shape)
    out = []
    for item in create_write_items(fqn, obj):
        td = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or td is None:
            raise UnsupportedValueError(
                f"tensor {fqn!r}: its {kind} plans a non-tensor write item ({item.type.name}); "
                "only tensor "
                "chunks can be saved from a checkpointable tensor"
            )
        offsets, sizes = tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        if math.prod(sizes) == 0 and math.prod(shape) != 0:
            # an empty shard (a rank that holds none) has no bytes; an empty tensor is still
            # recorded
            continue
        if tuple(td.size) != shape or not Box(offsets, sizes).fits(shape):
            raise UnsupportedValueError(
                f"tensor {fqn!r}: its {kind} plans a chunk at offsets {list(offsets)} of size "
                f"{list(sizes)} "
                f"in a tensor of size {list(td.size)}, but the tensor's shape is {list(shape)}: "
                "the chunk must "
                "lie inside it"
            )
        out.append(item)
    return out


def _piece_items(
    key: str,
    obj: TensorPieces,
    rank: int,
    world_size: int,
    seen: dict[PieceKey, tuple[str, Piece]],
    piece_fqns: set[str],
    piece_digests: dict[PieceKey, str],
    check: bool = True,
) -> list[WriteItem]:
    """One write item per piece, named by its logical tensor (the state-dict key is not stored).

    Each piece's digest goes to the coordinator when several ranks save (``check``, as for plain
    tensors; always for replicated pieces): a box that two ranks save is written once, so they
    must hold the same bytes (data-parallel replicas of a flat partition do; a pipeline stage
    that forgot its ``Reindex`` does not, and one stage's layer would be lost)."""
    items = []
    for p in obj.pieces:
        piece_fqns.add(p.fqn)
        if not p.data.numel() and math.prod(p.shape) != 0:
            continue  # holds no bytes; an empty logical tensor is still recorded
        where = (p.fqn, p.offsets)
        other = seen.get(where)
        if other is not None:
            raise InconsistentSaveError(
                f"logical tensor {p.fqn!r}: this rank (rank {rank}) gives the piece at offsets "
                f"{list(p.offsets)} twice, under state-dict keys {other[0]!r} and {key!r}"
            )
        seen[where] = (key, p)
        if world_size > 1 and (obj.replicated or check):
            piece_digests[where] = tensor_digest(p.data)
        items.append(shard_item(p.fqn, p.box, p.data.dtype, p.shape))
    return items


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
