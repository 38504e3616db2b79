"""The chunks planned per chunk in a save: who holds each one, and which rank writes it.

The coordinator collects every rank's tensor write items into one
:class:`ChunkTable` (refusing a key that names different tensors on
different ranks, or boxes of different sizes at one offset), then picks one
writer per distinct chunk among the ranks holding it
(:func:`assign_writers`), spreading replicated chunks over their replicas.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ..format import dtype_name
from ._plan_records import PieceKey

__all__ = ["ChunkTable", "collect_chunks", "assign_writers"]


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
                p, size, [self.first[k].tensor_data.chunk for k in self.by_tensor[fqn]]
            )
            for fqn, (p, size, _) in self.props.items()
        }


def collect_chunks(plans: Sequence[SavePlan]) -> ChunkTable:
    """The chunk table of ``plans`` (one per rank, in rank order).

    Raises ``ValueError`` when one key is a different dtype or shape on two
    ranks, or two ranks save boxes of different sizes at the same offsets.
    """
    table = ChunkTable()
    for r, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            fqn = item.index.fqn
            td = item.tensor_data
            seen = table.props.get(fqn)
            if seen is None:
                table.props[fqn] = (td.properties, td.size, r)
            elif (seen[0].dtype, seen[1]) != (td.properties.dtype, td.size):
                raise ValueError(
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
            if seen_item.tensor_data.chunk.sizes != td.chunk.sizes:
                raise ValueError(
                    f"tensor {fqn!r}: rank {table.holders[key][0]} saves a box of size "
                    f"{list(seen_item.tensor_data.chunk.sizes)} at offsets {list(key[1])} but "
                    f"rank {r} one of "
                    f"size {list(td.chunk.sizes)}: pieces of one tensor held by several ranks "
                    "must be the same box"
                )
    return table


def assign_writers(table: ChunkTable, world_size: int) -> dict[PieceKey, int]:
    """One writer per distinct chunk, among the ranks holding it.

    The replica is chosen per tensor (the same replica index for all its
    chunks) to keep the index compact, and tensors are placed largest first
    on the least-loaded replica.
    """
    load = [0] * world_size
    writer: dict[PieceKey, int] = {}
    first = table.first
    sizes = {
        fqn: sum((first[k].tensor_storage_size() or 0) for k in keys)
        for fqn, keys in table.by_tensor.items()
    }
    for fqn in sorted(table.by_tensor, key=lambda f: (-sizes[f], f)):
        keys = table.by_tensor[fqn]
        reps0 = sorted(table.holders[keys[0]])
        k = min(range(len(reps0)), key=lambda i: (load[reps0[i]], i))
        for key in keys:
            reps = sorted(table.holders[key])
            w = reps[k % len(reps)]
            writer[key] = w
            load[w] += first[key].tensor_storage_size() or 0
    return writer
