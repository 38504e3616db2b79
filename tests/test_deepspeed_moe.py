"""DeepSpeed MoE checkpoints (``deepspeed.moe.layer.MoE``, ZeRO-1/2), written by real DeepSpeed.

The fixtures under ``tests/fixtures/deepspeed/moe/`` were written by
DeepSpeed 0.19.8 on CPU ranks (``generate_moe.py`` there, which needs
deepspeed; the suite does not): 4 experts with expert-parallel size 2 on 4
ranks (ZeRO-1, ZeRO-2, and ZeRO-2 with ``use_data_before_expert_parallelism``)
and on 2 ranks, and two MoE layers (4 experts on EP 2, 8 on EP 4) on 4 ranks. Every expert's fp32 master weight, Adam moments and buffer is
compared bit for bit with DeepSpeed's own consolidated values under global
expert names; a plain-torch replay of the layer resumes to DeepSpeed's next
losses; the experts load stacked (``[E, ...]``, torchtitan style) and
sharded over 2 expert-parallel ranks by the ``Stacked`` rule (plain tensors
with ``no_dist``, and DTensors on 2 real gloo ranks), each rank reading only
its experts' bytes.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from ds_fixtures import generator, resave
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ucp_dcp import (
    ReadOptions,
    CheckpointFormatError,
    LayoutSpec,
    Replicated,
    Stacked,
    UCPLoadPlanner,
    UCPStorageReader,
    load_state_dict,
)
from ucp_dcp.sources import DeepSpeedSource, open_source

MOE = Path(__file__).parent / "fixtures" / "deepspeed" / "moe"
VARIANTS = sorted(p.name for p in MOE.iterdir() if (p / "latest").is_file())


GEN = generator("generate_moe.py")
EXPERT = GEN.PREFIX  # "moe.deepspeed_moe.experts.deepspeed_experts."


def meta(variant: str) -> dict[str, Any]:
    return json.loads((MOE / variant / "reference.json").read_text())


def expected(variant: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's consolidated tensors under the keys of ``get_state_dict`` (global expert names)."""
    out = {}
    for k, t in load_file(str(MOE / variant / "reference.safetensors")).items():
        kind, name = k.split("/", 1)
        if kind in ("fp32", "buffer"):
            out[f"model.{name}"] = t
        elif kind in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{kind}"] = t
            out[f"optim.state.{name}.step"] = torch.tensor(float(meta(variant)["optimizer_step"]))
    return out


def _model_and_optim(m: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The plain model of fixture ``m`` (every expert of every MoE layer) and an AdamW with the
    checkpoint's optimizer groups."""
    model = GEN.build_model(layers=[tuple(layer) for layer in m["moe_layers"]])
    names = list(dict.fromkeys(g["name"] for g in m["param_groups"] if g.get("moe")))
    optim = torch.optim.AdamW(GEN.plain_param_groups(model, names), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return model, optim


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_expert_loads_bit_exact_in_one_process(variant: str) -> None:
    """Weights, moments and buffers of every expert (and the dense params) equal DeepSpeed's own;
    the keys are exactly a plain model's ``get_state_dict`` with DeepSpeed's optimizer groups
    (four; six with two MoE layers of different expert-parallel sizes)."""
    m = meta(variant)
    src = open_source(MOE / variant)
    assert isinstance(src, DeepSpeedSource) and src.stage == m["zero_stage"] and src.world_size == m["world_size"]
    got = load_state_dict(MOE / variant)
    want = expected(variant)
    # fc1/fc2 weight and bias and scale of every expert
    assert sum(GEN.INFIX in k and k.startswith("model.") for k in want) == sum(5 * n for _, n, _ in m["moe_layers"])
    for k, v in want.items():
        assert bit_equal(got[k], v), k
    for g, grp in enumerate(m["param_groups"]):
        for hp, v in grp.items():
            assert got[f"optim.param_groups.{g}.{hp}"] == (tuple(v) if isinstance(v, list) else v), (g, hp)
    assert got["optim.param_groups.2.params"] == [
        f"{EXPERT}{e}.{w}.weight" for e in range(4) for w in ("fc1", "fc2")
    ]
    # Each expert file is recorded as written by expert-data-parallel rank 0 of its expert's
    # expert-parallel rank (the layout's, as reference.json's ep_rank_of_rank says).
    writer = {f.name: f.rank for f in src.index.files}
    ep_ranks = m["ep_rank_of_rank"]
    for _, n, ep in m["moe_layers"][:1]:
        for gid in range(n):
            assert ep_ranks[writer[f"step2/layer_0_expert_{gid}_mp_rank_00_model_states.pt"]] == gid // (n // ep)
    model, optim = _model_and_optim(m)
    msd, osd = get_state_dict(model, optim)
    keys = set(flatten_state_dict({"model": msd, "optim": osd})[0])
    assert set(got) == keys, set(got) ^ keys
    assert [got[f"optim.param_groups.{g}.params"] for g in range(len(m["param_groups"]))] == [
        grp["params"] for grp in osd["param_groups"]
    ]


@pytest.mark.parametrize("variant", ["moe_zero2_ep2_w4_dbe", "moe_zero1_ep2_w4", "moe_zero2_ep2_w2", "moe2_zero2_w4"])
def test_resumed_training_matches_deepspeeds_next_steps(variant: str) -> None:
    """Loaded into the plain model (every expert in one process) and trained on: DeepSpeed's losses.

    DeepSpeed averages every gradient over the data-parallel ranks' batches (the
    experts' too: expert-parallel all-to-all, then a sum over the expert-data-parallel
    ranks of a gradient divided by the data-parallel degree) and clips the global norm
    to 1.0: the mean of the ranks' losses, backward, clip, step.
    """
    m = meta(variant)
    model, optim = _model_and_optim(m)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=UCPStorageReader(MOE / variant), planner=UCPLoadPlanner(), no_dist=True)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref = load_file(str(MOE / variant / "reference.safetensors"))
    W = m["world_size"]

    def loss(step: int) -> torch.Tensor:
        return sum(GEN.loss_of(model, ref[f"batch/step{step}/rank{r}"]) for r in range(W)) / W

    loss3 = loss(3)
    loss3.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), m["gradient_clipping"])
    optim.step()
    with torch.no_grad():
        loss4 = loss(4)
    assert math.isclose(loss3.item(), m["loss_step3"], rel_tol=1e-6), (loss3.item(), m["loss_step3"])
    assert math.isclose(loss4.item(), m["loss_step4"], rel_tol=1e-6), (loss4.item(), m["loss_step4"])


def test_experts_load_stacked_and_sharded_over_two_expert_parallel_ranks() -> None:
    """torchtitan-style ``moe.experts.fc1.weight`` of shape ``[4, 5, 7]`` (weights and both moments),
    split over EP 2 as plain tensors: each rank gets experts ``2r, 2r + 1`` bit-exact and reads
    exactly their bytes and the dense params'."""
    variant = "moe_zero2_ep2_w4"
    want = expected(variant)
    names = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    for rank in range(2):
        sd: dict[str, torch.Tensor] = {}
        for n in names:
            per = want[f"model.{EXPERT}0.{n}"].shape
            for key in (f"model.moe.experts.{n}", f"optim.state.moe.experts.{n}.exp_avg", f"optim.state.moe.experts.{n}.exp_avg_sq"):
                sd[key] = torch.full((2, *per), 13.0)
        sd["model.moe.deepspeed_moe.gate.wg.weight"] = torch.full((4, 7), 13.0)
        spec = LayoutSpec(
            [
                Stacked(r"\.moe\.experts\.(fc[12]\.(?:weight|bias))", repl=r".moe.deepspeed_moe.experts.deepspeed_experts.{}.\1", experts=4, axis="ep"),
                Replicated(r"gate"),
            ],
            axes={"ep": (rank, 2)},
        )
        reader = UCPStorageReader(MOE / variant, options=ReadOptions(gap_bytes=0))  # no neighbouring bytes merged in
        dcp.load(spec.apply(sd), storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
        for key, t in sd.items():
            if "gate" in key:
                assert bit_equal(t, want[key]), key
                continue
            kind, n = key.split(".moe.experts.")
            n, _, moment = n.partition(".exp_avg")
            mine = [want[f"{kind}.{EXPERT}{e}.{n}" + (f".exp_avg{moment}" if key.endswith(("exp_avg", "exp_avg_sq")) else "")] for e in (2 * rank, 2 * rank + 1)]
            assert bit_equal(t, torch.stack(mine)), (rank, key)
        assert reader.last_load.bytes_requested == sum(t.numel() * 4 for t in sd.values()), (rank, reader.last_load.bytes_requested)


def test_a_moe_checkpoint_in_an_object_store_loads_as_the_local_one() -> None:
    """At a ``memory://`` URL: the same files (expert files included, each opened with one request
    at this size) and bit-identical tensors."""
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://ucp-ds-moe-{uuid.uuid4().hex}/ck"
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(MOE / "moe_zero2_ep2_w4"), root, recursive=True)
    src, local = open_source(url), open_source(MOE / "moe_zero2_ep2_w4")
    assert [f.name for f in src.index.files] == [f.name for f in local.index.files]
    assert sum("_expert_" in f.name for f in src.index.files) == 4
    got, want = load_state_dict(url), load_state_dict(MOE / "moe_zero2_ep2_w4")
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def _stacked_dtensors_on_2(rank: int, world: int, variant: str) -> None:
    """Experts stacked as DTensors ``Shard(0)`` over a 2-rank expert-parallel mesh (``Stacked``
    without ``axis``: the DTensor says which experts a rank holds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    want = expected(variant)
    sd = {}
    for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        for kind, suffix in (("model", ""), ("optim.state", ".exp_avg"), ("optim.state", ".exp_avg_sq")):
            full = torch.stack([want[f"{kind}.{EXPERT}{e}.{n}{suffix}"] for e in range(4)])
            sd[f"{kind}.moe.experts.{n}{suffix}"] = (full, distribute_tensor(torch.full_like(full, float("nan")), mesh, [Shard(0)]))
    spec = LayoutSpec([Stacked(r"\.moe\.experts\.(fc[12]\.(?:weight|bias))", repl=r".moe.deepspeed_moe.experts.deepspeed_experts.{}.\1", experts=4)])
    reader = UCPStorageReader(MOE / variant, options=ReadOptions(gap_bytes=0))
    dcp.load(spec.apply({k: d for k, (_, d) in sd.items()}), storage_reader=reader, planner=UCPLoadPlanner())
    for key, (full, d) in sd.items():
        assert bit_equal(d.to_local(), full[2 * rank : 2 * rank + 2]), (rank, key)
    assert reader.last_load.bytes_requested == sum(d.to_local().numel() * 4 for _, d in sd.values())


@pytest.mark.multiproc
def test_experts_load_into_stacked_dtensors_on_two_ranks() -> None:
    """DeepSpeed's EP 2 x DP 2 (strided layout) into a torchtitan-style EP 2 model on 2 real ranks."""
    run_ranks(2, _stacked_dtensors_on_2, "moe_zero2_ep2_w4_dbe")


# ---------------------------------------------------------------- refusals


def _copy(tmp_path: Path, variant: str = "moe_zero2_ep2_w4") -> Path:
    dst = tmp_path / variant
    shutil.copytree(MOE / variant, dst)
    return dst / "step2"


def test_missing_or_damaged_expert_files_are_refused_naming_the_file(tmp_path: Path) -> None:
    tag = _copy(tmp_path)
    models = tag / "mp_rank_00_model_states.pt"
    # A missing expert file.
    (tag / "layer_0_expert_2_mp_rank_00_model_states.pt").rename(tmp_path / "moved.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: no layer_0_expert_2_mp_rank_00_model_states.pt (MoE layer 0 has 4 experts by num_experts in {models})"
    )
    # Another expert's file under its name.
    shutil.copy(tag / "layer_0_expert_3_mp_rank_00_model_states.pt", tag / "layer_0_expert_2_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag / 'layer_0_expert_2_mp_rank_00_model_states.pt'}: entry '{EXPERT}3.scale' is not a parameter "
        "or buffer of expert 2 (<module>.deepspeed_moe.experts.deepspeed_experts.2.<name>)"
    )
    # A truncated one.
    victim = tag / "layer_0_expert_2_mp_rank_00_model_states.pt"
    (tmp_path / "moved.pt").rename(victim)
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        open_source(tag.parent)
    # No expert files at all, though the optimizer groups hold experts.
    for f in tag.glob("layer_0_expert_*"):
        f.unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: optimizer groups [2, 3] hold experts (marked moe), but there is no "
        "layer_<L>_expert_<G>_mp_rank_00_model_states.pt file"
    )


def test_moe_checkpoints_this_does_not_read_are_refused(tmp_path: Path) -> None:
    tag = _copy(tmp_path, "moe_zero2_ep2_w2")
    # DeepSpeed writes expp_rank_* optimizer files only without ZeRO.
    expp = tag / "expp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", expp)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: expp_rank_0_mp_rank_00_optim_states.pt holds the optimizer state of a MoE model trained "
        "without ZeRO; only ZeRO-1/2 MoE checkpoints (expert state in zero_pp_rank_* files) are read"
    )
    expp.unlink()
    # An expert file of another model-parallel rank.
    shutil.copy(tag / "layer_0_expert_0_mp_rank_00_model_states.pt", tag / "layer_0_expert_0_mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: layer_0_expert_0_mp_rank_01_model_states.pt: MoE checkpoints with tensor or pipeline "
        "parallelism (mp_rank other than 00) are not supported"
    )


_M = "mp_rank_00_model_states.pt"
_O = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
_X = EXPERT  # the experts' name prefix of MoE layer 0 (module "moe")


def _inner(edit: Any) -> Any:
    """An edit of an optimizer file's inner optimizer state dict (in place)."""

    def apply(o: dict[str, Any]) -> None:
        edit(o["optimizer_state_dict"]["base_optimizer_state"])

    return apply


def _renamed(g: int, old: str, new: str) -> Any:
    """An edit of the model states renaming ``old`` to ``new`` in param_shapes[g] (in place,
    keeping the order)."""

    def apply(sd: dict[str, Any]) -> None:
        shapes = sd["param_shapes"][g]
        items = [(new if k == old else k, v) for k, v in shapes.items()]
        shapes.clear()
        shapes.update(items)

    return apply


def _partition_count(g: int, n: int) -> Any:
    def apply(o: dict[str, Any]) -> None:
        o["optimizer_state_dict"]["partition_count"][g] = n

    return apply


@pytest.mark.parametrize(
    "variant, edits, message",
    [
        (
            "moe_zero2_ep2_w4",
            {_M: lambda sd: sd.update(num_experts="4")},
            "<tag>/mp_rank_00_model_states.pt: num_experts '4' is not a list of expert counts",
        ),
        (
            "moe_zero2_ep2_w4",
            {_M: lambda sd: sd.update(num_experts=[])},
            "<tag>: expert files of MoE layers [0], but num_experts in "
            "<tag>/mp_rank_00_model_states.pt lists 0 MoE layer(s): []",
        ),
        (
            "moe_zero2_ep2_w4",
            {_O: _partition_count(2, 3)},
            f"<tag>/{_O}: optimizer group 2 is marked moe, but its partition_count 3 does not "
            "divide the 4 data-parallel ranks",
        ),
        (
            "moe_zero2_ep2_w4",
            {_O: _inner(lambda i: i["param_groups"][2].update(name="ep_size_4"))},
            f"<tag>/{_O}: optimizer group 2 is named 'ep_size_4' but is partitioned over 2 of 4 "
            "ranks (expert-parallel size 2)",
        ),
        (
            "moe_zero2_ep2_w4",
            {_M: _renamed(2, f"{_X}0.fc1.weight", "dense.weight")},
            "<tag>/mp_rank_00_model_states.pt: optimizer group 2 is marked moe, but "
            "'dense.weight' is not an expert parameter of a MoE layer with expert files (['moe'])",
        ),
        (
            "moe_zero2_ep2_w4",
            {_M: _renamed(1, "head.bias", f"{_X}0.scale")},
            f"<tag>/mp_rank_00_model_states.pt: expert parameter '{_X}0.scale' is in optimizer "
            "group 1, which is not marked moe",
        ),
        (
            "moe_zero2_ep2_w4",
            {_M: _renamed(2, f"{_X}1.fc1.weight", f"{_X}2.fc1.weight")},
            f"<tag>: '{_X}2.fc1.weight' in param_shapes is local expert 2, but MoE layer 0 has 4 "
            "experts over 2 expert-parallel ranks (2 each)",
        ),
        (
            "moe_zero2_ep2_w4",
            {
                "layer_0_expert_0_mp_rank_00_model_states.pt": lambda sd: sd.update(
                    {f"{_X}0.fc1.weight": torch.zeros(5, 6)}
                )
            },
            f"<tag>/layer_0_expert_0_mp_rank_00_model_states.pt: expected '{_X}0.fc1.weight' of "
            "shape (5, 7) (param_shapes of the model states, local expert name renumbered), "
            "found a (5, 6) entry",
        ),
        (
            "moe_zero2_ep2_w4",
            {"layer_0_expert_1_mp_rank_00_model_states.pt": lambda sd: (sd.pop(f"{_X}1.fc2.bias"), None)[1]},
            f"<tag>/layer_0_expert_1_mp_rank_00_model_states.pt: expected '{_X}1.fc2.bias' of "
            "shape (7,) (param_shapes of the model states, local expert name renumbered), "
            "found no such entry",
        ),
        (
            "moe2_zero2_w4",
            {
                _O: lambda o: (
                    _partition_count(3, 2)(o),
                    _inner(lambda i: i["param_groups"][3].update(name="ep_size_2"))(o),
                )[-1]
            },
            "<tag>/mp_rank_00_model_states.pt: the experts of MoE layer 1 are in moe optimizer "
            "groups of expert-parallel sizes 2 and 4",
        ),
    ],
)
def test_moe_files_that_disagree_are_refused_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, edits: dict[str, Any], message: str
) -> None:
    """Model states, optimizer and expert files of a real MoE checkpoint edited to disagree
    (num_experts, partition counts, group names, an expert in the wrong group, an expert file's
    entry) are refused naming the file (``<tag>``: the tag folder) and what it disagrees
    with."""
    tag = _copy(tmp_path, variant)
    for file, edit in edits.items():
        resave(tag / file, edit, monkeypatch)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == message.replace("<tag>", str(tag))


def test_expert_files_that_do_not_fit_num_experts_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expert file beyond num_experts, one of DeepSpeed's older naming, an expert count
    that expert parallelism does not divide, and one module's experts in two layers' files."""
    tag = _copy(tmp_path)
    models = tag / _M
    extra = tag / "layer_0_expert_4_mp_rank_00_model_states.pt"
    shutil.copy(tag / "layer_0_expert_3_mp_rank_00_model_states.pt", extra)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: layer_0_expert_4_mp_rank_00_model_states.pt is beyond the [4] experts per MoE "
        f"layer of num_experts in {models}"
    )
    extra.rename(tag / "expert_4_mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: expert_4_mp_rank_00_model_states.pt is an expert file of DeepSpeed's older "
        "naming (no MoE layer id); only layer_<L>_expert_<G>_mp_rank_00_model_states.pt files "
        "are read"
    )
    (tag / "expert_4_mp_rank_00_model_states.pt").unlink()
    (tag / "layer_0_expert_3_mp_rank_00_model_states.pt").unlink()
    resave(models, lambda sd: sd.update(num_experts=[3]), monkeypatch)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: MoE layer 0 has 3 experts, not a multiple of its expert-parallel size 2"
    )
    tag = _copy(tmp_path, "moe2_zero2_w4")
    shutil.copy(
        tag / "layer_0_expert_0_mp_rank_00_model_states.pt",
        tag / "layer_1_expert_0_mp_rank_00_model_states.pt",
    )
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag / 'layer_1_expert_0_mp_rank_00_model_states.pt'}: MoE module 'moe' is in the "
        "files of MoE layers 0 and 1"
    )


def test_experts_load_without_num_experts_counted_from_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Model states that record no num_experts (older DeepSpeed): the expert files say how
    many; every tensor loads as with it."""
    tag = _copy(tmp_path)
    resave(tag / _M, lambda sd: sd.pop("num_experts") and None, monkeypatch)
    got, want = load_state_dict(tag.parent), load_state_dict(MOE / "moe_zero2_ep2_w4")
    assert set(got) == set(want)
    assert [k for k, v in want.items() if isinstance(v, torch.Tensor) and not bit_equal(got[k], v)] == []


def test_a_zero3_or_pipeline_moe_checkpoint_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Optimizer files of ZeRO stage 3, or a pipeline layer file next to the expert files:
    layouts of MoE this reader does not place, refused naming the tag folder."""
    tag = _copy(tmp_path / "z3")
    for r in range(4):
        resave(
            tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            lambda o: o["optimizer_state_dict"].update(zero_stage=3),
            monkeypatch,
        )
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == (
        f"{tag}: a ZeRO-3 MoE checkpoint is not supported (DeepSpeed's native MoE trains under "
        "ZeRO-1/2)"
    )
    tag = _copy(tmp_path / "pp")
    shutil.copy(tag / "layer_0_expert_0_mp_rank_00_model_states.pt", tag / "layer_01-model_00-model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tag.parent)
    assert str(e.value) == f"{tag}: a MoE checkpoint with tensor or pipeline parallelism is not supported"
