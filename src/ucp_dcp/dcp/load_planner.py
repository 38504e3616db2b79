"""``UCPLoadPlanner``: what each rank reads back, as DCP's load-planner protocol.

The planner turns the target state dict (any layout, any world size) into reads of exactly the
overlapping boxes of the saved chunks, with strictness rules on keys, shapes and dtypes, and hands
each rank its own rank-local values (both in :mod:`~ucp_dcp.dcp._load_plan`). Its read items stay on
the rank: DCP's global load plan only sees a :class:`~ucp_dcp.dcp._plan_records.LoadRankReport`.
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import STORAGE_TYPES, BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from .._compat import flatten_sharded_tensors, flatten_state_dict
from ..core.pieces import TensorPieces
from ..core.sharding import Box
from ..core.values import RankLocal, ReshardFn, decode_value, set_in_place
from ..errors import CheckpointKeyError
from ..format import dtype_name
from ._load_plan import (
    RankLocalGather,
    asked_keys,
    bytes_item,
    check_target,
    find_wrappers,
    key_list,
    keys_no_rank_asked,
    local_boxes,
    overlap_reads,
    rank_local_reads,
    saved_grid,
)
from ._plan_records import LoadRankReport, LoadSourceInfo, rank_and_world

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
            warnings.warn(
                f"{len(casts)} tensor(s) are cast from the checkpoint's dtype on load: "
                f"{key_list(casts)}. "
                "Pass UCPLoadPlanner(allow_dtype_cast=False) to make a dtype mismatch an error",
                UserWarning,
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
                    f"{len(not_loaded)} checkpoint key(s) not in the state dict were not loaded: "
                    f"{key_list(not_loaded)}",
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
