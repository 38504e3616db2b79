"""``UCPSavePlanner``: what each rank saves, as DCP's save-planner protocol.

The planner records every tensor's DTensor layout, encodes non-tensor values as tagged JSON (never
pickle), checks that values saved once for all ranks really are the same on every rank, and spreads
the writing of replicated chunks across their replicas. Its methods are thin: the local plan is
:func:`~ucp_dcp.dcp._save_local.create_local_save_plan`, the coordinator's step
:func:`~ucp_dcp.dcp._save_global.create_global_save_plan`, and the derived writes of mesh groups
:func:`~ucp_dcp.dcp._mesh_groups.group_items`.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..errors import InvalidArgumentError, InvalidArgumentTypeError
from ..format import Layout, split_rank_local_key
from ._mesh_groups import group_items
from ._plan_records import SaveReply, rank_and_world
from ._save_global import create_global_save_plan
from ._save_local import LocalSavePlan, create_local_save_plan

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
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        self.divergent_values = divergent_values
        self.check_replicated_tensors = check_replicated_tensors
        self.compact_plans = compact_plans
        self._local = LocalSavePlan(SavePlan([]))

    # ------------------------------------------------------------ local
    def set_up_planner(
        self, state_dict: dict[str, Any], storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        """Flatten the state dict (DCP's rules); remember this rank's identity."""
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
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
