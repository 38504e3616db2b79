"""Non-tensor and per-rank values are never silently mixed across ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dist_utils import run_ranks
from ucp_dcp import RankLocal, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter

pytestmark = pytest.mark.multiproc


def _scenarios(rank: int, world: int, root: str) -> None:
    # 1. A value that differs per rank, unmarked: the save is refused, naming it.
    with pytest.raises(CheckpointException, match=r"non-tensor value 'loader\.pos' differs across ranks"):
        dcp.save({"loader": {"pos": 10 + rank}, "lr": 0.1}, storage_writer=UCPStorageWriter(f"{root}/refused"),
                 planner=UCPSavePlanner())
    assert not os.path.exists(f"{root}/refused/ucp_index.json")

    # 2. A plain tensor that differs per rank is refused too (DCP would keep one copy).
    with pytest.raises(CheckpointException, match=r"plain tensor 'rng' differs across ranks"):
        dcp.save({"rng": torch.full((4,), rank)}, storage_writer=UCPStorageWriter(f"{root}/refused2"),
                 planner=UCPSavePlanner())

    # 3. divergent_values="rank_local": each rank keeps its own copy.
    dcp.save({"loader": {"pos": 10 + rank}, "lr": 0.1}, storage_writer=UCPStorageWriter(f"{root}/auto"),
             planner=UCPSavePlanner(divergent_values="rank_local"))
    sd: dict[str, Any] = {"loader": {"pos": -1}, "lr": 0.0}
    dcp.load(sd, storage_reader=UCPStorageReader(f"{root}/auto"), planner=UCPLoadPlanner())
    assert sd == {"loader": {"pos": 10 + rank}, "lr": 0.1}

    # 4. Explicit RankLocal, same world size: each rank gets its own value.
    dcp.save({"rl": RankLocal({"pos": 100 + rank, "gen": torch.arange(3) + rank}), "x": torch.ones(5)},
             storage_writer=UCPStorageWriter(f"{root}/rl"), planner=UCPSavePlanner())
    target = RankLocal(None)
    dcp.load({"rl": target, "x": torch.zeros(5)}, storage_reader=UCPStorageReader(f"{root}/rl"),
             planner=UCPLoadPlanner())
    assert target.value["pos"] == 100 + rank and torch.equal(target.value["gen"], torch.arange(3) + rank)
    dist.barrier()


def test_rank_values(tmp_path: Any) -> None:
    """Divergent values are refused or kept per rank; RankLocal round-trips per rank."""
    run_ranks(2, _scenarios, str(tmp_path))
    # 5. A different world size (here: one process, no process group) without
    #    a hook is an error naming the key; with a hook the hook decides.
    with pytest.raises(CheckpointException, match=r"rank-local value 'rl' was saved by 2 rank\(s\) \(world size 2\)"):
        dcp.load({"rl": RankLocal(None), "x": torch.zeros(5)}, storage_reader=UCPStorageReader(tmp_path / "rl"),
                 planner=UCPLoadPlanner())
    seen: dict[str, Any] = {}

    def hook(key: str, by_rank: dict[int, Any], rank: int, world: int) -> Any:
        seen.update(key=key, ranks=sorted(by_rank), rank=rank, world=world)
        return max(v["pos"] for v in by_rank.values())

    target = RankLocal(None)
    dcp.load({"rl": target, "x": torch.zeros(5)}, storage_reader=UCPStorageReader(tmp_path / "rl"),
             planner=UCPLoadPlanner(rank_local_reshard=hook))
    assert target.value == 101
    assert seen == {"key": "rl", "ranks": [0, 1], "rank": 0, "world": 1}
