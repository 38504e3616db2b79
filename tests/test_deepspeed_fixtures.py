"""The committed DeepSpeed fixtures hold what docs/deepspeed-format.md says they hold.

No deepspeed import: the pickles are read with ``torch.load(weights_only=True)``
and stand-ins for the three DeepSpeed classes they name, and every full fp32
param and Adam moment is rebuilt from the shards by the documented layout
rules and compared bit-exactly with DeepSpeed's own full tensors
(``reference.safetensors``, written by tests/fixtures/deepspeed/generate.py).
"""

from __future__ import annotations

import json
import math
import pickletools
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from ds_fixtures import STANDINS, generator
from safetensors.torch import load_file

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
VARIANTS = sorted(p.parent.name for p in FIXTURES.glob("*/reference.json"))

# docs/deepspeed-format.md, "GLOBAL opcodes": the whole set, over all files.
DOCUMENTED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "FloatStorage"),
    ("torch", "BFloat16Storage"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape"),
}


def _load(path: Path):
    with torch.serialization.safe_globals(STANDINS):
        return torch.load(path, weights_only=True, map_location="cpu")


def _rank(path: Path) -> int:
    return int(path.name.split("zero_pp_rank_")[1].split("_")[0])


def _by_rank(ckpt: Path, pattern: str) -> list[Path]:
    paths = sorted(ckpt.glob(pattern), key=_rank)
    assert [_rank(p) for p in paths] == list(range(len(paths))), paths
    return paths


def _all_pt() -> list[Path]:
    return sorted(FIXTURES.rglob("*.pt"))


def test_fixtures_present():
    assert {"zero1_fp32_w2", "zero2_fp32_w2", "zero3_fp32_w2", "zero1_bf16_w2", "zero2_bf16_w2",
            "zero3_bf16_w2"} <= set(VARIANTS)
    assert (FIXTURES / "zero2_fp32_w2_universal" / "step2_universal" / "zero").is_dir()


def test_pickles_name_exactly_the_documented_globals():
    seen: set[tuple[str, str]] = set()
    for path in _all_pt():
        with zipfile.ZipFile(path) as z:
            (pkl,) = [n for n in z.namelist() if n.endswith("/data.pkl")]
            for op, arg, _ in pickletools.genops(z.read(pkl)):
                assert op.name != "STACK_GLOBAL", path
                if op.name == "GLOBAL":
                    mod, _, name = arg.partition(" ")
                    seen.add((mod, name))
    assert seen == DOCUMENTED_GLOBALS


def test_storages_are_stored_uncompressed_and_64_byte_aligned():
    for path in _all_pt():
        raw = path.read_bytes()
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                assert info.compress_type == zipfile.ZIP_STORED, (path, info.filename)
                if "/data/" in info.filename:
                    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
                    assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, (path, info.filename)


def _rebuild_zero12(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full tensors by the ZeRO-1/2 flat-group rules of the doc."""
    model = _load(ckpt / "mp_rank_00_model_states.pt")
    opts = [_load(p)["optimizer_state_dict"] for p in _by_rank(ckpt, "*zero_pp_rank_*_optim_states.pt")]
    world = len(opts)
    out = {}
    for g, shapes in enumerate(model["param_shapes"]):
        total = sum(math.prod(s) for s in shapes.values())
        padded = math.ceil(total / (2 * world)) * 2 * world
        part = padded // world
        pads = [o["group_paddings"][g] for o in opts]
        assert pads == [0] * (world - 1) + [padded - total]
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if key == "fp32":
                pieces = [o["single_partition_of_fp32_groups"][g] for o in opts]
                # The ZeRO optimizer narrows the last rank's fp32 partition; BF16_Optimizer does not.
                narrowed = "zero_stage" in opts[0]
                assert [p.numel() for p in pieces] == [part] * (world - 1) + [part - pads[-1] if narrowed else part]
            else:
                pieces = [o["base_optimizer_state"]["state"][g][key] for o in opts]
                assert [p.numel() for p in pieces] == [part] * world
            flat = torch.cat(pieces)
            off = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                out[f"{key}/{name}"] = flat[off: off + n].view(shape)
                off += n
    return out


def _rebuild_zero3(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full tensors by the ZeRO-3 per-param ceil(numel/W) rules of the doc."""
    models = [_load(p) for p in _by_rank(ckpt, "zero_pp_rank_*_model_states.pt")]
    opts = [_load(p)["optimizer_state_dict"] for p in _by_rank(ckpt, "*zero_pp_rank_*_optim_states.pt")]
    world = len(opts)
    assert all(o["partition_count"] == world for o in opts)
    out = {}
    for sg, shapes in enumerate(models[0]["param_shapes"]):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            pieces = [o["fp32_flat_groups"][sg] if key == "fp32" else o["optimizer_state_dict"]["state"][sg][key]
                      for o in opts]
            off = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                c = math.ceil(n / world)
                out[f"{key}/{name}"] = torch.cat([p[off: off + c] for p in pieces])[:n].view(shape)
                off += c
            assert all(p.numel() == off for p in pieces)
    for name, shape in models[0]["frozen_param_shapes"].items():
        n = math.prod(shape)
        out[f"frozen_fragments/{name}"] = torch.cat(
            [m["frozen_param_fragments"][name] for m in models])[:n].view(shape)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_documented_layout_rebuilds_deepspeeds_full_tensors(variant):
    meta = json.loads((FIXTURES / variant / "reference.json").read_text())
    ref = load_file(FIXTURES / variant / "reference.safetensors")
    ckpt = FIXTURES / variant / meta["tag"]
    full = _rebuild_zero3(ckpt) if meta["zero_stage"] == 3 else _rebuild_zero12(ckpt)
    trainable = [n for n, rg in meta["requires_grad"].items() if rg]
    compared = 0
    for name in trainable:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if f"{key}/{name}" in ref:
                assert torch.equal(full[f"{key}/{name}"], ref[f"{key}/{name}"]), (variant, key, name)
                compared += 1
        if f"param/{name}" in ref:  # zero_to_fp32's output
            assert torch.equal(full[f"fp32/{name}"], ref[f"param/{name}"]), (variant, name)
            compared += 1
    assert compared >= len(trainable)
    if meta["zero_stage"] == 3 and meta["model"] == "mlp":
        assert torch.equal(full["frozen_fragments/frozen"].float(), ref["frozen/frozen"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_step_groups_and_model_states_metadata(variant):
    meta = json.loads((FIXTURES / variant / "reference.json").read_text())
    ckpt = FIXTURES / variant / meta["tag"]
    assert (FIXTURES / variant / "latest").read_bytes() == meta["tag"].encode()
    opt = _load(next(ckpt.glob("*zero_pp_rank_0_*optim_states.pt")))
    inner = opt["optimizer_state_dict"]
    base = inner["optimizer_state_dict"] if meta["zero_stage"] == 3 else inner["base_optimizer_state"]
    assert {float(s["step"]) for s in base["state"].values()} == {float(meta["optimizer_step"])}
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
              for g in base["param_groups"]]
    assert groups == meta["param_groups"]
    assert opt["ds_version"] == meta["deepspeed_version"]
    model_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if meta["zero_stage"] == 3 else "mp_rank_00_model_states.pt"
    model = _load(ckpt / model_file)
    alias, owner = next(iter(meta["tied"].items()))
    assert model["shared_params"] == {alias: owner}  # rank 0 has it at every stage
    assert model["dp_world_size"] == meta["world_size"] and model["global_steps"] == meta["optimizer_step"]


def test_universal_folder_matches_its_source_references():
    ref = load_file(FIXTURES / "zero2_fp32_w2" / "reference.safetensors")
    zero = FIXTURES / "zero2_fp32_w2_universal" / "step2_universal" / "zero"
    names = sorted(k.split("/", 1)[1] for k in ref if k.startswith("fp32/"))
    for name in names:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            item = _load(zero / name / f"{key}.pt")
            assert item["cat_dim"] == 0 and torch.equal(item["param"], ref[f"{key}/{name}"]), (name, key)
        assert float(_load(zero / name / "step.pt")) == 2.0
    assert torch.equal(_load(zero / "scale" / "fp32.pt")["param"], ref["buffer/scale"])
    assert torch.equal(_load(zero / "head.weight" / "fp32.pt")["param"], ref["param/head.weight"])


def _mean_loss(gen, model, kind, ref, step, world):
    return sum(gen.loss_of(model, kind, ref[f"batch/step{step}/rank{r}"]) for r in range(world)) / world


# Losses are recomputed by the same fp32 torch ops DeepSpeed ran, but the mean
# over ranks is summed in another order than gloo's all_reduce (1 ulp apart on
# zero2_fp32_w4), and another CPU may pick kernels that differ in the last bits.
_LOSS_TOL = dict(rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if "_fp32_" in v and not v.startswith("llama")])
def test_references_resume_training_in_plain_torch(variant):
    """Full params + moments + step from the references, the recipe of reference.json: DeepSpeed's step 3 and 4 losses."""
    gen = generator("generate.py")
    meta = json.loads((FIXTURES / variant / "reference.json").read_text())
    ref = load_file(FIXTURES / variant / "reference.safetensors")
    model = gen.build_model("mlp")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ref[f"fp32/{name}"] if p.requires_grad else ref[f"frozen/{name}"])
        for name, b in model.named_buffers():
            b.copy_(ref[f"buffer/{name}"])
    groups = gen.param_groups(model)
    for g, hp in zip(groups, meta["param_groups"]):
        g.update({k: tuple(v) if k == "betas" else v for k, v in hp.items()})
    opt = torch.optim.AdamW(groups)
    names = {id(p): n for n, p in model.named_parameters()}
    for g in opt.param_groups:
        for p in g["params"]:
            n = names[id(p)]
            opt.state[p] = {"step": torch.tensor(float(meta["optimizer_step"])),
                            "exp_avg": ref[f"exp_avg/{n}"].clone(), "exp_avg_sq": ref[f"exp_avg_sq/{n}"].clone()}
    world = meta["world_size"]
    loss3 = _mean_loss(gen, model, "mlp", ref, 3, world)
    assert loss3.item() == pytest.approx(meta["loss_step3"], **_LOSS_TOL)
    loss3.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], meta["gradient_clipping"])
    opt.step()
    with torch.no_grad():
        loss4 = _mean_loss(gen, model, "mlp", ref, 4, world)
    assert loss4.item() == pytest.approx(meta["loss_step4"], **_LOSS_TOL)


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.startswith("llama")])
def test_llama_references_reproduce_step3_loss(variant):
    pytest.importorskip("transformers")
    gen = generator("generate.py")
    meta = json.loads((FIXTURES / variant / "reference.json").read_text())
    ref = load_file(FIXTURES / variant / "reference.safetensors")
    model = gen.build_model("llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(ref[f"param/{name}"])
        assert torch.equal(model.lm_head.weight, ref["param/lm_head.weight"])  # tied
        loss3 = _mean_loss(gen, model, "llama", ref, 3, meta["world_size"])
    assert loss3.item() == pytest.approx(meta["loss_step3"], **_LOSS_TOL)
