"""``UCPLoadPlanner``: what each rank reads back, as DCP's load-planner protocol; its local step.

The planner turns the target state dict (any layout, any world size) into reads of exactly the
overlapping boxes of the saved chunks (:func:`overlap_reads`), with strictness rules on keys,
shapes and dtypes, and hands each rank its own rank-local values (:func:`rank_local_reads`).
Its read items stay on the rank: DCP's global load plan only sees a
:class:`~ucp_dcp.dcp._plan_records.LoadRankReport`. Why the cost does not depend on the saved
world size: docs/scale.md, "Load planning by arithmetic".
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.tensor import DTensor

from .._compat import (
    create_chunk_list,
    dtensor_local,
    flatten_sharded_tensors,
    flatten_state_dict,
    is_checkpointable,
)
from ..byteio.requests import rank_and_world
from ..core.pieces import TensorPieces
from ..core.sharding import Box, Grid, arith_box, intersect
from ..core.values import RankLocal, ReshardFn, decode_value, set_in_place
from ..errors import (
    CheckpointKeyError,
    InvalidArgumentTypeError,
    UCPWarning,
    UnsupportedValueError,
)
from ..format import LAYOUT_KEY, dtype_name, rank_local_key, split_rank_local_key
from ..format.schema import check_flags
from ._plan_records import LoadRankReport, LoadSourceInfo

__all__ = ["UCPLoadPlanner"]


class UCPLoadPlanner(DefaultLoadPlanner):
    """Load planner for the universal format: any saved layout into any target.

    Args:
        allow_partial_load: keys of the state dict that the checkpoint lacks
            are skipped instead of failing the load.
        allow_dtype_cast: a tensor saved in another dtype is cast on load,
            as DCP does, and one warning lists the keys cast (``cast_keys``
            after the load); ``False`` makes any dtype mismatch an error.
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
        allow_dtype_cast: bool = True,
        rank_local_reshard: ReshardFn | None = None,
    ) -> None:
        # allow_partial_load="no" must not load a checkpoint that lacks keys without a word.
        check_flags(
            "UCPLoadPlanner",
            allow_partial_load=allow_partial_load,
            allow_dtype_cast=allow_dtype_cast,
        )
        if rank_local_reshard is not None and not callable(rank_local_reshard):
            raise InvalidArgumentTypeError(
                "UCPLoadPlanner(rank_local_reshard=...) takes a function or None, got "
                f"{type(rank_local_reshard).__name__}"
            )
        super().__init__(
            flatten_state_dict=True,
            flatten_sharded_tensors=True,
            allow_partial_load=allow_partial_load,
        )
        self.allow_dtype_cast = allow_dtype_cast
        self.rank_local_reshard = rank_local_reshard
        self.unexpected_keys: list[str] = []
        self.missing_keys: list[str] = []
        self.cast_keys: dict[str, tuple[torch.dtype, torch.dtype]] = {}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Flatten the target state dict (DCP's rules), keeping RankLocal wrappers."""
        # DCP's set-up replaces every object it does not know (RankLocal among
        # them) with None, in the caller's dict; put the wrappers back.
        wrappers = list(find_wrappers(state_dict))
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if wrappers:
            for container, key, w in wrappers:
                container[key] = w
            self.state_dict, self.mappings = flatten_state_dict(flatten_sharded_tensors(state_dict))
        self.rank, self.world_size = rank_and_world()
        self._pending: dict[str, RankLocalGather] = {}
        self._piece_sets: dict[str, TensorPieces] = {
            k: v for k, v in self.state_dict.items() if isinstance(v, TensorPieces)
        }

    def create_local_plan(self) -> LoadPlan:
        """Read items for every overlap of a target box with a saved chunk."""
        md = self.metadata
        assert md is not None, "set_up_planner was not called with checkpoint metadata"
        info = LoadSourceInfo.of(md)
        items: list[ReadItem] = []
        missing: list[str] = []
        self.cast_keys = {}
        for fqn, obj in self.state_dict.items():
            if fqn in info.rank_local:
                reads, gather = rank_local_reads(
                    fqn,
                    obj,
                    info.rank_local[fqn],
                    info.world_size,
                    self.rank,
                    self.world_size,
                    self.rank_local_reshard,
                )
                if gather is not None:
                    self._pending[fqn] = gather
                items.extend(reads)
                continue
            if isinstance(
                obj, TensorPieces
            ):  # its key is not stored; its pieces name their tensors
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
                items.append(bytes_item(fqn, fqn))
        self.missing_keys = sorted(missing)
        if self.cast_keys:
            casts = [
                f"{k} ({dtype_name(a)} -> {dtype_name(b)})"
                for k, (a, b) in sorted(self.cast_keys.items())
            ]
            hint = "UCPLoadPlanner(allow_dtype_cast=False)"
            warnings.warn(
                UCPWarning(
                    f"{len(casts)} tensor(s) are cast from the checkpoint's dtype on load: "
                    f"{key_list(casts)}. Pass {hint} to make a dtype mismatch an error"
                ).with_option("allow_dtype_cast", False, hint),
                stacklevel=2,
            )
        if missing and not self.allow_partial_load:
            # Opens with DCP's own words ("Missing key in checkpoint"), for callers that match on
            # them.
            raise CheckpointKeyError(
                f"Missing key in checkpoint state_dict: {len(missing)} key(s) of the state dict "
                "are missing "
                f"from the checkpoint: {key_list(self.missing_keys)}. Pass "
                "UCPLoadPlanner(allow_partial_load=True) to load the rest"
            )
        known = set(self.state_dict)
        known.update(p.fqn for v in self._piece_sets.values() for p in v.pieces)
        asked, self.unexpected_keys = asked_keys(sorted(md.state_dict_metadata), known)
        # DCP gathers every rank's load plan on the coordinator only to hand
        # it back unchanged (its global load plan is the identity): at 16384
        # ranks that is gigabytes through one process. Keep the items here
        # and send an empty plan; finish_plan puts them back.
        self._items: list[ReadItem] | None = items
        self.plan = LoadPlan([], planner_data=LoadRankReport(self.rank, len(items), asked))
        return self.plan

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """DCP's identity plan; warns about checkpoint keys that no rank's state dict asked for."""
        md = self.metadata
        reports = [p.planner_data for p in global_plan]
        if md is not None and reports and all(isinstance(r, LoadRankReport) for r in reports):
            not_loaded = keys_no_rank_asked(
                sorted(md.state_dict_metadata), [r.asked for r in reports]
            )
            if not_loaded:
                warnings.warn(
                    UCPWarning(
                        f"{len(not_loaded)} checkpoint key(s) not in the state dict were not "
                        f"loaded: {key_list(not_loaded)}"
                    ),
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
            items.extend(
                self._tensor_items(p.fqn, p.data, smd, shape=p.shape, boxes=[p.box], dest=(key, i))
            )
        return items

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
        tmd = check_target(
            fqn, obj, smd, obj.shape if shape is None else shape, self.allow_dtype_cast
        )
        if obj.dtype != tmd.properties.dtype:
            self.cast_keys[fqn] = (tmd.properties.dtype, obj.dtype)
        grid = saved_grid(LoadSourceInfo.of(self.metadata), fqn, tmd)
        return overlap_reads(
            fqn, local_boxes(fqn, obj) if boxes is None else boxes, tmd, grid, dest
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination of a read: a piece's view, or DCP's lookup for everything else."""
        pieces = self._piece_sets.get(read_item.dest_index.fqn) if self._piece_sets else None
        if pieces is not None and read_item.dest_index.index is not None:
            view = pieces.pieces[read_item.dest_index.index].data
            return self.transform_tensor(read_item, view)
        return super().resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode a JSON value and put it in place (rank-local values too)."""
        fqn = read_item.dest_index.fqn
        decoded = decode_value(value.getvalue(), fqn)
        gather = self._pending.get(fqn)
        if gather is not None:
            if not gather.add(read_item.storage_index.fqn, decoded):
                return
            del self._pending[fqn]
            decoded = gather.result(fqn, self.rank, self.world_size)
        target = self.state_dict.get(fqn)
        if isinstance(target, RankLocal):
            target.value = decoded  # the wrapper object is shared with the caller's dict
            return
        self.state_dict[fqn] = decoded
        if self.flatten_state_dict:
            set_in_place(self.original_state_dict, self.mappings[fqn], decoded)


# ------------------------------------------------------------ what one rank reads


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
        inner = dtensor_local(obj)
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
            b = _box_of(c)
            if not b.numel:
                continue  # an empty shard (this rank holds none of the tensor)
            if not b.fits(shape):
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
    return [_box_of(c) for c in create_chunk_list(obj)]


def _box_of(c: ChunkStorageMetadata) -> Box:
    """The box of DCP's chunk record ``c``."""
    return Box(tuple(c.offsets), tuple(c.sizes))


def saved_grid(info: LoadSourceInfo, fqn: str, smd: TensorStorageMetadata) -> Grid | None:
    """The grid of the saved chunks of ``fqn``: from the reader when it supplies
    one, else built from DCP's chunk list (another reader); None if irregular."""
    if callable(info.chunk_grid):
        return info.chunk_grid(fqn)
    return Grid.from_boxes([_box_of(c) for c in smd.chunks], tuple(smd.size))


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
            found = [(k, _box_of(c)) for k, c in enumerate(smd.chunks)]
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
