"""Megatron-style tensors for the layout-rule tests: fused, padded, stage-local, expert-local.

A reference model is a dict of *full, unfused* tensors under global names
(``layers.2.attn.q.weight``). :func:`local_state` cuts it, by explicit
Megatron arithmetic written independently of :mod:`ucp_dcp.adapters.layout_spec`,
into what one rank of a TP x PP layout holds: fused GQA QKV (per KV group:
that group's query heads, then its key head, then its value head), fused
SwiGLU ``gate_up`` (this rank's gate rows, then its up rows), row-parallel
``o``/``down`` (columns split), embedding and output head padded to a
multiple of ``4 * tp`` rows, TP-replicated norms, stage-local layer numbers.
:func:`block_spec` describes that layout with rules; a test saves the local
tensors under one layout and checks a load under another bit for bit
against :func:`local_state` of the same reference.

Sizes (:data:`CFG`): 24 query heads, 12 KV heads (GQA, 2 queries per KV
head), head dim 1, hidden 8, ffn 12, vocabulary 37 (prime: padded at every
TP size > 1, and at TP 1 by the multiple-of-4 rule). Every TP size that
divides the 12 KV heads and the ffn works: 1, 2, 3, 4, 6 and 12; the tests
use 1, 2, 3 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ucp_dcp import Fused, LayoutSpec, Reindex, Rename, Replicated, Shard, VocabPad
from ucp_dcp.adapters.rules import Rule


@dataclass(frozen=True)
class BlockConfig:
    """Sizes of the Megatron-style model."""

    vocab: int = 37
    hidden: int = 8
    heads: int = 24
    kv_heads: int = 12
    head_dim: int = 1
    ffn: int = 12
    layers: int = 4
    pad_multiple: int = 4  # vocabulary padded to a multiple of pad_multiple * tp (Megatron: 128 * tp)


CFG = BlockConfig()


def reference(cfg: BlockConfig = CFG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full, unfused tensors under global names (float32, seeded)."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv = cfg.hidden, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    ref = {"embed.weight": r(cfg.vocab, h)}
    for i in range(cfg.layers):
        p = f"layers.{i}."
        ref[p + "input_norm.weight"] = r(h)
        ref[p + "attn.q.weight"], ref[p + "attn.k.weight"], ref[p + "attn.v.weight"] = r(q, h), r(kv, h), r(kv, h)
        ref[p + "attn.q.bias"], ref[p + "attn.k.bias"], ref[p + "attn.v.bias"] = r(q), r(kv), r(kv)
        ref[p + "attn.o.weight"] = r(h, q)
        ref[p + "post_norm.weight"] = r(h)
        ref[p + "mlp.gate.weight"], ref[p + "mlp.up.weight"] = r(cfg.ffn, h), r(cfg.ffn, h)
        ref[p + "mlp.down.weight"] = r(h, cfg.ffn)
    ref["final_norm.weight"] = r(h)
    ref["head.weight"] = r(cfg.vocab, h)
    return ref


def stage_layers(num_layers: int, pp: int, stage: int) -> list[int]:
    """Global layer indices of pipeline stage ``stage`` of ``pp`` (first stages get the extra layers)."""
    per, extra = divmod(num_layers, pp)
    start = stage * per + min(stage, extra)
    return list(range(start, start + per + (stage < extra)))


def padded_vocab(cfg: BlockConfig, tp: int) -> int:
    """Rows of the padded embedding at TP size ``tp``."""
    m = cfg.pad_multiple * tp
    return -(-cfg.vocab // m) * m


def _rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[start : start + n]


def local_state(
    ref: dict[str, torch.Tensor], tp_rank: int, tp: int, stage: int = 0, pp: int = 1,
    cfg: BlockConfig = CFG, pad_value: float = 0.0,
) -> dict[str, torch.Tensor]:
    """What rank (tp_rank, stage) holds, under stage-local names, built from ``ref``.

    Padding rows of the embedding/head hold ``pad_value``.
    """
    hd, qpg = cfg.head_dim, cfg.heads // cfg.kv_heads
    assert cfg.kv_heads % tp == 0 and cfg.ffn % tp == 0, f"TP {tp} does not divide the heads/ffn"
    groups = cfg.kv_heads // tp
    out: dict[str, torch.Tensor] = {}

    def padded(t: torch.Tensor) -> torch.Tensor:
        rows = padded_vocab(cfg, tp) // tp
        full = torch.full((padded_vocab(cfg, tp), t.shape[1]), pad_value, dtype=t.dtype)
        full[: t.shape[0]] = t
        return full[tp_rank * rows : (tp_rank + 1) * rows].clone()

    if stage == 0:
        out["embed.weight"] = padded(ref["embed.weight"])
    for local, i in enumerate(stage_layers(cfg.layers, pp, stage)):
        src, dst = f"layers.{i}.", f"layers.{local}."
        for what in ("weight", "bias"):
            q, k, v = (ref[f"{src}attn.{n}.{what}"] for n in "qkv")
            blocks = []
            for g in range(tp_rank * groups, (tp_rank + 1) * groups):
                blocks += [_rows(q, g * qpg * hd, qpg * hd), _rows(k, g * hd, hd), _rows(v, g * hd, hd)]
            out[f"{dst}attn.qkv.{what}"] = torch.cat(blocks).clone()
        cols = cfg.heads * hd // tp
        out[dst + "attn.o.weight"] = ref[src + "attn.o.weight"][:, tp_rank * cols : (tp_rank + 1) * cols].clone()
        f = cfg.ffn // tp
        out[dst + "mlp.gate_up.weight"] = torch.cat(
            [_rows(ref[src + "mlp.gate.weight"], tp_rank * f, f), _rows(ref[src + "mlp.up.weight"], tp_rank * f, f)]
        )
        out[dst + "mlp.down.weight"] = ref[src + "mlp.down.weight"][:, tp_rank * f : (tp_rank + 1) * f].clone()
        for n in ("input_norm.weight", "post_norm.weight"):
            out[dst + n] = ref[src + n].clone()
    if stage == pp - 1:
        out["final_norm.weight"] = ref["final_norm.weight"].clone()
        out["head.weight"] = padded(ref["head.weight"])
    return out


def block_rules(cfg: BlockConfig = CFG, *, layer_offset: int = 0, wrapped: bool = False) -> list[Rule]:
    """The rules for one rank of the Megatron-style layout (first stage/last stage rules are optional)."""
    hd = cfg.head_dim
    rules: list[Rule] = []
    if wrapped:
        rules += [Rename(r"_orig_mod\."), Rename(r"_fsdp_wrapped_module\.")]
    rules += [
        Reindex(r"layers\.(\d+)\.", offset=layer_offset),
        # Megatron GQA QKV: per KV group [q heads of the group | k head | v head]; groups split over TP.
        Fused(r"\.qkv\.", dim=0, parts={".q.": cfg.heads * hd, ".k.": cfg.kv_heads * hd, ".v.": cfg.kv_heads * hd},
              groups=cfg.kv_heads, axis="tp"),
        # SwiGLU fc1: this TP rank's gate rows, then its up rows.
        Fused(r"\.gate_up\.", dim=0, parts={".gate.": cfg.ffn, ".up.": cfg.ffn}, axis="tp"),
        Shard(r"\.(o|down)\.weight", dim=1, axis="tp"),
        VocabPad(r"(^|\.)(embed|head)\.weight", dim=0, size=cfg.vocab, axis="tp", optional=True),
        Replicated(r"norm", axis="tp"),
    ]
    return rules


def block_spec(tp_rank: int, tp: int, stage: int = 0, pp: int = 1, cfg: BlockConfig = CFG, **kw: Any) -> LayoutSpec:
    """The layout spec of rank (tp_rank, stage) of a TP x PP layout."""
    first = stage_layers(cfg.layers, pp, stage)[0]
    return LayoutSpec(block_rules(cfg, layer_offset=first, **kw), axes={"tp": (tp_rank, tp)})


def rank_coords(rank: int, tp: int) -> tuple[int, int]:
    """(tp_rank, stage) of global rank ``rank`` (TP innermost)."""
    return rank % tp, rank // tp


def train_state(local: dict[str, torch.Tensor], moments: dict[str, torch.Tensor], step: int = 5) -> dict[str, Any]:
    """A model + optimizer-like state dict: ``model`` and ``optim.state.<name>.exp_avg``."""
    return {
        "model": dict(local),
        "optim": {"state": {k: {"exp_avg": v, "step": step} for k, v in moments.items()}},
        "step": step,
    }


def scrambled(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of the same shapes full of a value no load may leave behind."""
    return {k: torch.full_like(v, float("nan")) for k, v in local.items()}


# ---------------------------------------------------------------- experts

EXPERTS, EXPERT_HIDDEN, EXPERT_FFN = 4, 6, 5


def expert_reference(seed: int = 0) -> dict[str, torch.Tensor]:
    """A router and 4 experts (w1: [ffn, hidden], w2: [hidden, ffn]) under global expert indices."""
    g = torch.Generator().manual_seed(seed)
    ref = {"moe.router.weight": torch.randn(EXPERTS, EXPERT_HIDDEN, generator=g)}
    for e in range(EXPERTS):
        ref[f"moe.experts.{e}.w1.weight"] = torch.randn(EXPERT_FFN, EXPERT_HIDDEN, generator=g)
        ref[f"moe.experts.{e}.w2.weight"] = torch.randn(EXPERT_HIDDEN, EXPERT_FFN, generator=g)
    return ref


def expert_local(ref: dict[str, torch.Tensor], ep_rank: int, ep: int) -> dict[str, torch.Tensor]:
    """EP rank ``ep_rank``'s tensors: the router, and its experts under local indices 0, 1, ..."""
    per = EXPERTS // ep
    out = {"moe.router.weight": ref["moe.router.weight"].clone()}
    for local in range(per):
        e = ep_rank * per + local
        for w in ("w1", "w2"):
            out[f"moe.experts.{local}.{w}.weight"] = ref[f"moe.experts.{e}.{w}.weight"].clone()
    return out


def expert_spec(ep_rank: int, ep: int) -> LayoutSpec:
    """Local expert index -> global under EP; router and whole experts are replicated pieces."""
    return LayoutSpec(
        [
            Reindex(r"experts\.(\d+)\.", axis="ep", per_rank=EXPERTS // ep),
            # Replicated also describes a whole tensor one rank holds (an expert): it would be
            # held by every data-parallel replica, and is checked equal across them.
            Replicated(r"router|experts\.", axis="ep"),
        ],
        axes={"ep": (ep_rank, ep)},
    )
