"""This rank's place in the process group, and how lists of ranks read in error messages."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["rank_and_world", "describe_ranks"]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def describe_ranks(ranks: list[int]) -> str:
    """The first eight of ``ranks``, comma-separated, with ``...`` when there are more."""
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
