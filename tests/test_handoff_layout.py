"""Hand-off under another model's names: ``load_state_dict(layout=)`` and ``export_hf(layout=)``.

A ``LayoutSpec`` says which logical tensors a one-process state dict holds: the checkpoint's
fused Megatron tensors come out as Hugging Face's separate ones (GQA-grouped QKV, SwiGLU's
gate/up), renamed and renumbered, optimizer moments alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal
from safetensors.torch import load_file

from ucp_dcp import (
    LayoutSpec,
    UCPSavePlanner,
    UCPStorageWriter,
    load_state_dict,
)
from ucp_dcp.adapters.rules import Fused, Reindex, Rename
from ucp_dcp.errors import InvalidArgumentError, LayoutRuleError
from ucp_dcp.tools.hf import export_hf

HEAD, Q, KV = 2, 4, 2  # head dim, query heads, KV heads: 2 groups of [2 q heads | k | v]


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "1.attention.qkv.weight": torch.randn((Q + 2 * KV) * HEAD, 6, generator=g),
        "1.mlp.gate_up.weight": torch.randn(2 * 5, 6, generator=g),
        "1.norm.weight": torch.randn(6, generator=g),
    }


SPEC = LayoutSpec(
    [
        Reindex(r"^(\d+)\.", offset=-1),
        Rename(r"^(\d+)\.attention\.", r"model.layers.\1.self_attn."),
        Rename(r"^(\d+)\.mlp\.", r"model.layers.\1.mlp."),
        Rename(r"^(\d+)\.norm\.", r"model.layers.\1.input_layernorm."),
        Fused(
            r"\.qkv\.",
            dim=0,
            parts={".q_proj.": Q * HEAD, ".k_proj.": KV * HEAD, ".v_proj.": KV * HEAD},
            groups=KV,
        ),
        Fused(r"\.gate_up\.", dim=0, parts={".gate_proj.": 5, ".up_proj.": 5}),
    ],
    strict=False,
)


def _hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The split written out by hand: QKV as 2 groups of [q (2 heads) | k | v], gate/up halves."""
    qkv = sd["1.attention.qkv.weight"].view(KV, (Q // KV + 2) * HEAD, 6)
    q, k, v = qkv.split([Q // KV * HEAD, HEAD, HEAD], dim=1)
    gate, up = sd["1.mlp.gate_up.weight"].chunk(2)
    return {
        "model.layers.0.self_attn.q_proj.weight": q.reshape(-1, 6),
        "model.layers.0.self_attn.k_proj.weight": k.reshape(-1, 6),
        "model.layers.0.self_attn.v_proj.weight": v.reshape(-1, 6),
        "model.layers.0.mlp.gate_proj.weight": gate,
        "model.layers.0.mlp.up_proj.weight": up,
        "model.layers.0.input_layernorm.weight": sd["1.norm.weight"],
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    dcp.save(
        {"model": _state()},
        storage_writer=UCPStorageWriter(d),
        planner=UCPSavePlanner(),
        no_dist=True,
    )
    return d


def test_load_state_dict_gives_the_layouts_logical_tensors(ckpt: Path) -> None:
    got = load_state_dict(
        ckpt, "model.", layout=LayoutSpec([Rename(r"^model\.", ""), *SPEC.rules], strict=False)
    )
    want = _hf(_state())
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v), k


def test_export_hf_writes_the_layouts_logical_tensors(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    with pytest.warns(UserWarning, match="config.json"):
        export_hf(ckpt, out, layout=SPEC, max_shard_size=400)  # several files: parts split too
    got: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    want = _hf(_state())
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v), k


def test_a_layout_rule_for_no_tensor_or_an_axis_wider_than_one_is_refused(
    ckpt: Path, tmp_path: Path
) -> None:
    typo = LayoutSpec([Fused(r"\.qvk\.", dim=0, parts={".q.": 8, ".k.": 2, ".v.": 2})])
    with pytest.raises(InvalidArgumentError, match=r"layout: no tensor of .* matches Fused"):
        export_hf(ckpt, tmp_path / "hf", layout=typo)
    wide = LayoutSpec(SPEC.rules, axes={"tp": (0, 2)}, strict=False)
    with pytest.raises(LayoutRuleError, match="every axis of size 1"):
        load_state_dict(ckpt, layout=wide)
