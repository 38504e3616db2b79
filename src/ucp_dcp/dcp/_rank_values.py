"""Non-tensor values across ranks: saved once when shared, once per rank when rank-local.

Save: a value every rank holds alike is written by the lowest rank holding
it (:func:`value_writers`); a :class:`~ucp_dcp.RankLocal` value, or a value
found to differ when the planner may make it rank-local, is written by every
rank under its own key (:func:`plan_value_item`).

Load: a rank-local value is read from this rank's own copy when the world
size is unchanged; otherwise every saved copy is read and handed to a
reshard function (:func:`rank_local_reads`, :class:`RankLocalGather`).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem, WriteItemType

from ..core.pieces import TensorPieces
from ..core.values import RankLocal, ReshardFn
from ..errors import CheckpointKeyError
from ..format import rank_local_key, split_rank_local_key
from ._plan_records import SaveRankReport

__all__ = [
    "value_writers",
    "plan_value_item",
    "value_metadata",
    "bytes_item",
    "rank_local_reads",
    "RankLocalGather",
    "find_wrappers",
]


# ---------------------------------------------------------------------- save


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


# ---------------------------------------------------------------------- load


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
