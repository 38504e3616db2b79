"""A small model with awkward sizes, built under any of the parallel layouts the tests use.

Sizes are chosen so that shards are uneven for 3 and 4 ranks, one parameter
has fewer rows than ranks (empty FSDP shards), and TP splits are uneven.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from dist_utils import bit_equal

D, FF, V = 20, 50, 37


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        return h + self.down(torch.relu(self.up(self.norm(h))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.tiny = nn.Parameter(torch.randn(2, 5))  # fewer rows than ranks
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h) + self.tiny.sum()


TP_PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
           "up": ColwiseParallel(), "o": RowwiseParallel(), "down": RowwiseParallel()}


def build(layout: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Model + AdamW under ``layout``: plain | dpN | tpN | dpAtpB | hsdpRxS."""
    torch.manual_seed(seed)
    model = Model()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if m := re.fullmatch(r"dp(\d+)tp(\d+)", layout):
        mesh = init_device_mesh("cpu", (int(m[1]), int(m[2])), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], TP_PLAN)
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif m := re.fullmatch(r"dp(\d+)", layout):
        mesh = init_device_mesh("cpu", (int(m[1]),))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif m := re.fullmatch(r"tp(\d+)", layout):
        mesh = init_device_mesh("cpu", (int(m[1]),))
        for b in model.blocks:
            parallelize_module(b, mesh, TP_PLAN)
    elif m := re.fullmatch(r"hsdp(\d+)x(\d+)", layout):
        mesh = init_device_mesh("cpu", (int(m[1]), int(m[2])), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout != "plain":
        raise ValueError(layout)
    if layout != "plain":
        assert mesh.size() == world, (layout, world)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    """One deterministic step (same data on every rank: only the state matters)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, V, (2, 6), generator=g)
    loss = model(tokens).float().pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()


def train_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The nested training state dict torchtitan-style loops save."""
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def full_reference(state: dict[str, Any]) -> dict[str, Any]:
    """Flattened state with every DTensor gathered to a full tensor (collective)."""
    flat, _ = flatten_state_dict(state)
    out = {}
    for k in sorted(flat):
        v = flat[k]
        out[k] = v.full_tensor() if isinstance(v, DTensor) else (v.clone() if isinstance(v, torch.Tensor) else v)
    return out


def columns_target(ref: dict[str, Any]) -> dict[str, Any]:
    """A load target from a full reference: every 2-D tensor ``Shard(1)`` over all ranks, other
    tensors replicated, all filled with 13; non-tensors as they are."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out: dict[str, Any] = {}
    for k, v in ref.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            out[k] = distribute_tensor(torch.full_like(v, 13), mesh, [Shard(1)])
        elif isinstance(v, torch.Tensor) and v.dim() >= 1:
            out[k] = distribute_tensor(torch.full_like(v, 13), mesh, [Replicate()])
        elif isinstance(v, torch.Tensor):
            out[k] = torch.full_like(v, 13)
        else:
            out[k] = v
    return out


def scramble(state: dict[str, Any]) -> None:
    """Overwrite every tensor in place so that a load must really write it."""
    flat, _ = flatten_state_dict(state)
    for v in flat.values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).fill_(13)


def check_against(state: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    """Assert ``state`` (this rank's shards) is bit-equal to the full tensors in ``ref``.

    DTensors are compared shard by shard against the matching slice of the
    reference; other tensors whole; plain values by value and type.
    """
    flat, _ = flatten_state_dict(state)
    assert set(flat) == set(ref), f"{what}: keys differ: {set(flat) ^ set(ref)}"
    for k, expected in ref.items():
        got = flat[k]
        if isinstance(got, DTensor):
            sizes, offsets = compute_local_shape_and_global_offset(got.shape, got.device_mesh, got.placements)
            want = expected[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert bit_equal(got.to_local(), want), f"{what}: local shard of {k} differs"
        elif isinstance(got, torch.Tensor):
            assert bit_equal(got, expected), f"{what}: {k} differs"
        else:
            assert got == expected and type(got) is type(expected), f"{what}: {k}: {got!r} != {expected!r}"
