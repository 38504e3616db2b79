"""The coordinator's step of a save: check every rank's report, pick the writers, build the
metadata.

:func:`create_global_save_plan` is what ``UCPSavePlanner.create_global_plan``
does, as one function of the gathered local plans (as DCP's
``create_default_global_save_plan`` is for its planner).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ..format import Layout
from ._mesh_groups import assign_owners, check_groups, group_replies, owned_metadata
from ._plan_records import PieceKey, SaveRankReport, SaveSummary
from ._rank_values import plan_value_item, value_metadata, value_writers
from ._save_checks import check_replicated_pieces, check_tiling, divergent_keys
from ._save_chunks import assign_writers, collect_chunks

__all__ = ["create_global_save_plan", "merged_layouts"]


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
        elif writer[(item.index.fqn, tuple(item.tensor_data.chunk.offsets))] == r:
            items.append(item)
    return dataclasses.replace(plan, items=items, planner_data=None)
