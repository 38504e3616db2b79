"""Megatron-DeepSpeed-shaped checkpoints written by the real DeepSpeed, read in place.

The fixtures (tests/fixtures/deepspeed/megatron_ds, ``generate_megatron_ds.py``) put every merge
rule of ``ds_to_universal`` in a checkpoint as Megatron-DeepSpeed writes it: GPT (averaged layer
norms, position embedding and row-parallel biases, a tied padded vocabulary; TP=2 x PP=2 x DP=2
bf16 and TP=2 x DP=2 fp32), Llama (averaged RMSNorms, SwiGLU under
``parameter_with_2_sub_params_cat_dim_0``, GQA QKV under ``parameter_with_sub_params``; TP=2 x
PP=2 and TP=2 x DP=2) and current Megatron-DeepSpeed's Llama (grouped QKV, replicated norms,
SwiGLU). Each loads bit-exactly equal to ``ds_to_universal``'s merged tensors (fp32 masters and
both Adam moments), and so does its Universal folder; the merged model resumes to the losses
of ``ds_to_universal``'s tensors (DeepSpeed's own where nothing is averaged).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from ds_fixtures import generator
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ucp_dcp import LayoutSpec, load_state_dict, ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.adapters.rules import Fused, Rename
from ucp_dcp.sources import DeepSpeedSource, DeepSpeedUniversalSource, open_source
from ucp_dcp.tools.hf import export_hf

MDS = Path(__file__).parent / "fixtures" / "deepspeed" / "megatron_ds"
GEN = generator("generate_megatron_ds.py")
VARIANTS = [v.name for v in GEN.VARIANTS]
KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _meta(variant: str) -> dict[str, Any]:
    return json.loads((MDS / variant / "reference.json").read_text())


def _universal(variant: str) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> parameter -> ds_to_universal's merged tensor (recorded by the generator)."""
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for k, v in load_file(str(MDS / variant / "reference.safetensors")).items():
        if k.startswith("universal/"):
            _, kind, name = k.split("/", 2)
            out[kind][name] = v
    return out


def _key(kind: str, name: str) -> str:
    return f"model.{name}" if kind == "fp32" else f"optim.state.{name}.{kind}"


def _as_universal(got: dict[str, Any], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: {n: got[_key(kind, n)] for n in names} for kind in KINDS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_in_place_equals_ds_to_universal_bit_for_bit(variant: str) -> None:
    """Every parameter (fp32 master, exp_avg, exp_avg_sq) of the in-place load equals
    ds_to_universal's merge, whatever its rule; the averaged ones are computed, the rest read."""
    want = _universal(variant)
    src = open_source(MDS / variant)
    assert isinstance(src, DeepSpeedSource)
    averaged = _meta(variant)["averaged_params"]
    got = load_state_dict(MDS / variant)
    assert set(want["fp32"]) == {
        k[len("model.") :] for k in got if k.startswith("model.") and k[6:] in want["fp32"]
    }
    for kind in KINDS:
        for name, v in want[kind].items():
            assert bit_equal(got[_key(kind, name)], v), (variant, kind, name)
    # Averaged parameters are the slices' mean, replicated ones slice 0 checked against the
    # others: both computed from every slice.
    assert src.computed is not None
    ops = {t.key: t.op for t in src.computed.tensors}
    assert {k for k, op in ops.items() if op == "mean" and k.startswith("model.")} == {
        f"model.{n}" for n in averaged
    }
    rules = _meta(variant)["param_rules"]
    replicated = {n for n, r in rules.items() if r.startswith("replicated")}
    assert {k for k, op in ops.items() if op == "replica" and k.startswith("model.")} == {
        f"model.{n}" for n in replicated
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_its_universal_folder_loads_the_same(variant: str) -> None:
    """ds_to_universal's folder (SubparamShape records and all) loads to the same tensors."""
    src = open_source(MDS / f"{variant}_universal")
    assert isinstance(src, DeepSpeedUniversalSource)
    got = load_state_dict(MDS / f"{variant}_universal")
    for kind, tensors in _universal(variant).items():
        for name, v in tensors.items():
            assert bit_equal(got[_key(kind, name)], v), (variant, kind, name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_merged_model_resumes_to_the_losses_of_ds_to_universals_tensors(variant: str) -> None:
    """Loaded in place into the merged model, training goes on to the losses the generator
    measured from ds_to_universal's tensors; without averaged parameters, DeepSpeed's own."""
    meta = _meta(variant)
    want = _universal(variant)
    got = load_state_dict(MDS / variant)
    # One thread, as the generator's ranks under torchrun (OMP_NUM_THREADS=1): the same sums in
    # the same order, so the losses are equal, not close.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = GEN.merged_resume_losses(
            variant,
            _as_universal(got, sorted(want["fp32"])),
            load_file(str(MDS / variant / "reference.safetensors")),
            meta["dp"],
            meta["optimizer_step"],
            meta["gradient_clipping"],
        )
    finally:
        torch.set_num_threads(threads)
    resumed = meta["merged_resume"]
    assert losses == (resumed["loss_step3"], resumed["loss_step4"])
    if not meta["averaged_params"]:
        assert losses == (meta["loss_step3"], meta["loss_step4"])


def _into_new_layouts(rank: int, world: int, variant: str, read_once: Any) -> None:
    """Every tensor of ``variant`` as a DTensor on ``world`` ranks, sharded along 0 (FSDP's
    layout; the fused QKV and SwiGLU re-cut into ``world`` pieces, another TP degree than
    saved) or, for row-parallel weights, along 1: bit-exact to ds_to_universal's merge."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    want = load_state_dict(MDS / variant)
    rows = GEN.INFOS[GEN.family_of(variant)]["parameter_with_row_parallelism_patterns"]
    state = {}
    for k, v in want.items():
        if not isinstance(v, torch.Tensor):
            continue
        import re

        name = k.removeprefix("model.").removeprefix("optim.state.").rsplit(".", 1)[0]
        row = any(re.match(p, k.removeprefix("model.")) or re.match(p, name) for p in rows)
        placement = [Replicate()] if v.ndim == 0 else [Shard(1 if row else 0)]
        state[k] = distribute_tensor(torch.full_like(v, 13), mesh, placement)
    reader = UCPStorageReader(MDS / variant, options=ReadOptions(read_once=read_once))
    dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
    for k, t in state.items():
        assert bit_equal(t.full_tensor(), want[k]), (rank, variant, k)


@pytest.mark.parametrize(
    ("variant", "world", "read_once"),
    [("llama_tp2_dp2", 4, False), ("gpt_tp2_pp2_dp2_bf16", 3, True), ("llama_tp2_pp2", 3, True)],
)
def test_into_fsdp_and_another_tensor_parallel_degree(
    variant: str, world: int, read_once: bool
) -> None:
    run_ranks(world, _into_new_layouts, variant, read_once)


def test_a_rank_reads_only_the_sub_parameter_pieces_it_needs() -> None:
    """Rank 1 of 4 wants rows [6, 12) of a merged QKV [q_0; q_1; k_0; k_1; v_0; v_1] (16 + 4 +
    4 rows of 8): they lie in q_0's and q_1's pieces of the two slices; the chunks it reads
    hold exactly those rows, and nothing of k or v."""
    src = open_source(MDS / "llama_tp2_dp2")
    name = "model.1.self_attention.query_key_value.weight"
    rec = src.index.tensors[name]
    assert tuple(rec.shape) == (24, 8)
    wanted = set(range(6, 12))
    read = 0
    for c in src.chunks(name):
        lo, n = c.box.offsets[0], c.box.sizes[0]
        if wanted & set(range(lo, lo + n)):
            read += len(wanted & set(range(lo, lo + n))) * c.box.sizes[1]
            assert lo + n <= 16, c.box  # only q rows
    assert read == 6 * 8


LLAMAS = [v for v in VARIANTS if v.startswith("llama")]


def _hf_layout(variant: str, *, strip: bool) -> LayoutSpec:
    """The generator's Hugging Face names for ``variant`` as a LayoutSpec: its renames, then its
    Fused splits of QKV (after one another, or per KV group) and SwiGLU (``strip``: the
    checkpoint's ``model.`` prefix first)."""
    renames, fused = GEN.hf_split_rules(GEN.family_of(variant))
    rules: list[Any] = [Rename(r"^model\.", "")] if strip else []
    rules += [Rename(p, r) for p, r in renames] + [Fused(**f) for f in fused]
    return LayoutSpec(rules, strict=False)


@pytest.mark.parametrize("variant", LLAMAS)
def test_as_hugging_face_tensors_through_load_state_dict(variant: str) -> None:
    """The in-place load under Hugging Face's names, q/k/v and gate/up split: the generator's
    split of ds_to_universal's merged tensors, bit for bit."""
    got = load_state_dict(MDS / variant, "model.", layout=_hf_layout(variant, strip=True))
    want = GEN.hf_state_dict(_universal(variant)["fp32"], GEN.family_of(variant))
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v), (variant, k)


@pytest.mark.parametrize("variant", LLAMAS)
def test_export_hf_gives_transformers_the_reference_logits(variant: str, tmp_path: Path) -> None:
    """export_hf straight from the DeepSpeed directory, then transformers' LlamaForCausalLM
    from_pretrained: its logits on step 4's batch equal those of DeepSpeed's merged weights in
    the same model (the generator's reference), bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    family = GEN.family_of(variant)
    out = tmp_path / "hf"
    export_hf(
        MDS / variant,
        out,
        layout=_hf_layout(variant, strip=False),
        config=LlamaConfig(**GEN.hf_config(family)),
    )
    ref = load_file(str(MDS / variant / "reference.safetensors"))
    model = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tokens = GEN.global_batch(ref, 4, _meta(variant)["dp"])[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the generator computed the reference
    try:
        with torch.no_grad():
            logits = model(tokens).logits
    finally:
        torch.set_num_threads(threads)
    assert bit_equal(logits, ref["hf/logits_step4"])
