"""Model, parallelism plan and data for ``train_demo.py``.

Kept apart from the driver so that the part a reader would copy into their own
training script (model + TP plan + world-size-independent data) is small and
self-contained: plain ``torch.nn`` and ``torch.distributed``, nothing from
``ucp_dcp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4  # divisible by every TP degree used (2)
    n_layers: int = 2
    seq_len: int = 32
    max_stride: int = 7  # data: strides 1..max_stride, see sample_sequence()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        # Separate q/k/v projections rather than one fused qkv: ColwiseParallel
        # splits the output dim into contiguous blocks, which for a fused weight
        # would hand one rank all of q and another all of v.
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not n_heads: under tensor parallelism this rank holds only
        # n_heads / tp of the heads, and the local activations say how many.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """Pre-LayerNorm decoder-only transformer with learned positions."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def apply_tensor_parallel(model: TinyLM, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP inside each block: column-parallel in, row-parallel out.

    Activations between blocks stay replicated, so embeddings, LayerNorms and
    the LM head are left as ordinary (TP-replicated) parameters; the only
    communication is one all-reduce after ``wo`` and one after ``fc2``.
    """
    plan: dict[str, Any] = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)


def sample_sequence(index: int, cfg: ModelConfig, seed: int = 1234) -> torch.Tensor:
    """Global sample ``index`` of the synthetic corpus: ``seq_len + 1`` tokens.

    Each sequence is an arithmetic progression mod ``vocab`` with a random
    start and a random stride in 1..max_stride. The first target is a guess,
    but from the second on the stride can be read off the context, so a model
    that learns to attend to the previous tokens drives the loss well below
    the uniform ln(vocab) ~ 4.16. The sample depends only on ``index`` (its
    own generator), never on which rank or how many ranks read it.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    start = int(torch.randint(cfg.vocab, (1,), generator=g))
    stride = int(torch.randint(1, cfg.max_stride + 1, (1,), generator=g))
    return (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab


class ShardedLoader:
    """This data-parallel rank's cursor into the global sample stream.

    Step ``s`` uses global samples ``[s*G, (s+1)*G)`` (``G`` = global batch);
    DP rank ``r`` of ``dp`` reads the ``r``-th contiguous ``G/dp`` of them. So
    the global batch of a step is the same for every dp size, and the state is
    genuinely per rank: the ranks' cursors differ.
    """

    def __init__(self, cfg: ModelConfig, global_batch: int, dp_rank: int, dp_size: int) -> None:
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp size {dp_size}")
        self.cfg, self.global_batch = cfg, global_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch = global_batch // dp_size
        self.next_sample = dp_rank * self.local_batch

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = range(self.next_sample, self.next_sample + self.local_batch)
        seqs = torch.stack([sample_sequence(i, self.cfg) for i in idx])
        self.next_sample += self.global_batch
        return seqs[:, :-1], seqs[:, 1:]

    def state_dict(self) -> dict[str, int]:
        # The layout travels with the cursor, so a state saved under another
        # dp layout can be mapped onto this one (load_state_dict).
        return {"next_sample": self.next_sample, "dp_rank": self.dp_rank, "dp_size": self.dp_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # Any one rank's saved cursor pins the global position: undo that
        # rank's offset within the global batch, then apply ours.
        saved_local_batch = self.global_batch // state["dp_size"]
        global_pos = state["next_sample"] - state["dp_rank"] * saved_local_batch
        self.next_sample = global_pos + self.dp_rank * self.local_batch
