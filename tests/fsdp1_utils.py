"""FSDP1 (FullyShardedDataParallel) versions of the small test model in layouts.py."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from layouts import Block, Model
from ucp_dcp.core.pieces import TensorPieces


def build_fsdp1(
    use_orig_params: bool, seed: int = 0, strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD, **fsdp_kw: Any
) -> tuple[FSDP, torch.optim.Optimizer]:
    """layouts.Model under FSDP1 (one unit per Block plus the root) with AdamW as layouts.build."""
    torch.manual_seed(seed)
    model = FSDP(
        Model(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        sharding_strategy=strategy,
        device_id=torch.device("cpu"),
        **fsdp_kw,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optim


def fsdp1_full_reference(model: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Flattened full (gathered) state via DCP's get_state_dict (collective), keys as for FSDP2."""
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    flat, _ = flatten_state_dict({"model": msd, "optim": osd})
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in sorted(flat.items())}


def piece_sets(sd: dict[str, Any]) -> list[TensorPieces]:
    """Every TensorPieces value in a nested state dict."""
    flat, _ = flatten_state_dict(sd)
    return [v for v in flat.values() if isinstance(v, TensorPieces)]


def scramble_pieces(sd: dict[str, Any]) -> None:
    """Overwrite every piece, padding and plain tensor in place so that a load must really write it."""
    flat, _ = flatten_state_dict(sd)
    for v in flat.values():
        if isinstance(v, TensorPieces):
            for p in v.pieces:
                p.data.fill_(13)
            for f in v.fill:
                f.fill_(13)
        elif isinstance(v, torch.Tensor):
            v.fill_(13)
