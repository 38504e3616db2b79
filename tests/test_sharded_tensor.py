"""ShardedTensor state (FSDP1's SHARDED_STATE_DICT, torchrec-style sharding) saves and reshards.

Row-wise on 2 ranks, loaded column-wise on 3, into plain tensors, and back
into a ShardedTensor from plain tensors, bit-exact, as PyTorch's own DCP
tests do with its default planners.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

from dist_utils import bit_equal, run_ranks
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter, load_state_dict

SHAPE = (10, 7)  # uneven over 2 and 3 ranks


def _full() -> torch.Tensor:
    return torch.randn(*SHAPE, generator=torch.Generator().manual_seed(5))


def _spec(world: int, dim: int) -> ChunkShardingSpec:
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in range(world)])


def _sharded(world: int, dim: int, fill: torch.Tensor | None) -> Any:
    st = sharded_tensor.zeros(_spec(world, dim), *SHAPE)
    for shard in st.local_shards():
        md = shard.metadata
        box = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
        shard.tensor.copy_(fill[box] if fill is not None else torch.full(md.shard_sizes, 13.0))
    return st


def _check(st: Any) -> None:
    full = _full()
    for shard in st.local_shards():
        md = shard.metadata
        box = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
        assert bit_equal(shard.tensor, full[box]), md


def _save_rowwise(rank: int, world: int, path: str) -> None:
    sd = {"emb": _sharded(world, 0, _full()), "plain": _full() * 2, "step": 3}
    dcp.save(sd, storage_writer=UCPStorageWriter(path, placement_digests=True), planner=UCPSavePlanner())


def _load_colwise(rank: int, world: int, path: str, back: str) -> None:
    sd: dict[str, Any] = {"emb": _sharded(world, 1, None), "plain": torch.zeros(SHAPE), "step": 0}
    reader = UCPStorageReader(path, options=ReadOptions(verify_placement=True))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    _check(sd["emb"])
    # the shards' placement proven from their own metadata: one copy of emb, plain on each rank
    assert reader.last_load.placement is not None
    assert reader.last_load.placement.checked == ("emb", "plain")
    assert reader.last_load.placement.copies == {"emb": 1, "plain": world}
    assert bit_equal(sd["plain"], _full() * 2) and sd["step"] == 3
    # The ShardedTensor into a plain tensor, and a plain tensor into a ShardedTensor.
    swap: dict[str, Any] = {"emb": torch.zeros(SHAPE), "plain": _sharded(world, 0, None)}
    dcp.load(swap, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner(allow_partial_load=True))
    assert bit_equal(swap["emb"], _full())
    for shard in swap["plain"].local_shards():
        md = shard.metadata
        box = tuple(slice(o, o + s) for o, s in zip(md.shard_offsets, md.shard_sizes))
        assert bit_equal(shard.tensor, (_full() * 2)[box])
    # A ShardedTensor saved again from its column-wise layout.
    dcp.save({"emb": sd["emb"]}, storage_writer=UCPStorageWriter(back), planner=UCPSavePlanner())
    dist.barrier()


@pytest.mark.multiproc
def test_sharded_tensor_rowwise_2_to_colwise_3(tmp_path: Path) -> None:
    src, back = str(tmp_path / "rowwise"), str(tmp_path / "colwise")
    run_ranks(2, _save_rowwise, src)
    run_ranks(3, _load_colwise, src, back)
    assert bit_equal(load_state_dict(src)["emb"], _full())
    assert bit_equal(load_state_dict(back)["emb"], _full())
