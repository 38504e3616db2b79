"""Where a process sits (rank, node) and the collectives the manager runs on its own process groups.

The manager owns two gloo groups: the foreground one (``save``'s checks,
``load``) runs in the training thread, the background one in the writer
thread. Sharing a group between threads would let their collectives
interleave differently on different ranks. Without an initialised process
group every collective is the one-rank identity.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointRestoreError, CheckpointSaveError
from .config import CheckpointConfig
from .tiers import CommitMarker, LocalTier, Tier

__all__ = ["NodeLayout", "Group", "GroupWorker", "describe"]

T = TypeVar("T")


@dataclass(frozen=True)
class NodeLayout:
    """This process's rank in the world and the node (ranks sharing one local directory) it is
    on."""

    rank: int
    world_size: int
    ranks_per_node: int

    @staticmethod
    def detect(
        rank: int,
        world_size: int,
        ranks_per_node: int | None,
        environ: Mapping[str, str] = os.environ,
    ) -> NodeLayout:
        """``ranks_per_node`` if given, else ``$LOCAL_WORLD_SIZE``, else one node; clamped to [1,
        world_size]."""
        rpn = ranks_per_node or int(environ.get("LOCAL_WORLD_SIZE", world_size))
        return NodeLayout(rank, world_size, max(1, min(rpn, world_size)))

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.ranks_per_node

    @property
    def node(self) -> int:
        """This process's node."""
        return self.node_of(self.rank)

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    @property
    def partner(self) -> int:
        """The node whose data files this node's local tier also keeps (peer replication): the
        previous node on the ring, ``(node - 1) mod num_nodes``; so node ``k``'s files live on
        node ``k`` and node ``k + 1``. The one place the ring's direction is decided."""
        return (self.node - 1) % self.num_nodes

    def held_files(self, marker: CommitMarker, *, peer: bool) -> list[str]:
        """The files of ``marker``'s step this node's local tier holds: the index, this node's
        ranks' data files and, with ``peer`` replication over several nodes, its
        :attr:`partner`'s."""
        nodes = {self.node} | ({self.partner} if peer and self.num_nodes > 1 else set())
        return [d.name for d in marker.files if d.rank < 0 or self.node_of(d.rank) in nodes]

    @property
    def is_leader(self) -> bool:
        """Whether this rank acts for its node in the node-local directory (the node's first
        rank)."""
        return self.rank % self.ranks_per_node == 0


class Group:
    """One process group of the manager's own (gloo), or none in a single process."""

    def __init__(self, layout: NodeLayout, distributed: bool) -> None:
        self.layout = layout
        self.pg: Any = dist.new_group(backend="gloo") if distributed else None

    def close(self) -> None:
        """Destroy the group: its threads and its sockets to every rank. A process that makes
        manager after manager (an elastic loop, a service, a notebook) keeps none of them; the
        manager's own work on it is over (its saves waited for). Local: no rank waits on another.
        """
        pg, self.pg = self.pg, None
        if pg is None or not dist.is_initialized():
            return  # the job already destroyed every group with its default one
        try:
            dist.destroy_process_group(pg)
        except (ValueError, RuntimeError):
            pass  # destroyed with an earlier default group, which a new one has replaced

    def gather(self, obj: T) -> list[T]:
        """``obj`` of every rank, in rank order."""
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def bcast(self, obj: T) -> T:
        """``obj`` of rank 0, on every rank."""
        if self.pg is None:
            return obj
        box = [obj if self.layout.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return cast(T, box[0])  # rank 0's obj, unpickled

    def agree(self, what: str, fn: Callable[[], T], *, step: int, restoring: bool = False) -> T:
        """Run ``fn`` on every rank; if it failed anywhere, raise on every rank (no rank is left
        waiting).

        The error is a :class:`CheckpointRestoreError` when ``restoring``, else
        a :class:`CheckpointSaveError`; it names ``what``, the step and each
        failed rank.
        """
        err: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            err = e
        errors = [
            m
            for m in self.gather(
                None if err is None else f"rank {self.layout.rank}: {describe(err)}"
            )
            if m
        ]
        if errors:
            if restoring:
                raise CheckpointRestoreError(f"step {step}: {what}: " + "; ".join(errors)) from err
            raise CheckpointSaveError(step, f"{what}: " + "; ".join(errors)) from err
        return result


@dataclass(frozen=True)
class GroupWorker:
    """What a part of the manager that runs collectives works with (the save pipeline, the
    restorer)."""

    config: CheckpointConfig
    layout: NodeLayout
    group: Group
    """The process group its collectives run on (every rank runs the same ones, in the same
    order)."""
    local: LocalTier | None
    """This node's local tier, if any."""
    persistent: Tier

    def acts_for(self, tier: Tier) -> bool:
        """Whether this rank does what one rank does for all that share ``tier`` (its clean-up,
        its retention): the node's leader for the local tier, rank 0 for the persistent one."""
        return self.layout.is_leader if tier is self.local else self.layout.rank == 0


def describe(e: BaseException) -> str:
    """One line for an error, including DCP's per-rank failures."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, err in sorted(e.failures.items()):
            inner = err[0] if isinstance(err, tuple) else err
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts) or str(e)
    return f"{type(e).__name__}: {e}"
