"""DeepSpeed checkpoints written by real DeepSpeed, loaded in place into other layouts.

The fixtures under ``tests/fixtures/deepspeed/`` were written by DeepSpeed
0.19 itself (``generate.py`` there, which needs deepspeed; the suite does
not): ZeRO-1/2/3, fp32 and bf16, 2 and 4 ranks, a tiny MLP with odd sizes,
two parameter groups, a frozen and a tied parameter and a buffer, two tiny
Llamas, and a ``ds_to_universal`` folder. Next to each,
``reference.safetensors`` holds DeepSpeed's own full tensors
(``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``,
``zero_to_fp32``) and ``reference.json`` the step count, hyperparameters
and the losses of the steps after the save.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, flatten, run_ranks
from ds_fixtures import generator, resave
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ucp_dcp import (
    Checkpoint,
    ReadOptions,
    CheckpointFormatError,
    FlatShard,
    UCPLoadPlanner,
    UCPStorageReader,
    load_state_dict,
)
from ucp_dcp.adapters.flat import flat_partition, pack_flat
from ucp_dcp.core.pieces import Piece, TensorPieces
from ucp_dcp.sources import DeepSpeedSource, DeepSpeedUniversalSource, SourceOptions, open_source
from ucp_dcp.tools.cli import main as cli_main

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
VARIANTS = sorted(p.name for p in FIXTURES.iterdir() if (p / "latest").is_file())
UNIVERSAL = "zero2_fp32_w2_universal"
UNIVERSAL3 = "zero3_fp32_w2_universal"
# Each universal folder was converted from this checkpoint; its references are those.
REFERENCE_OF = {UNIVERSAL: "zero2_fp32_w2", UNIVERSAL3: "zero3_fp32_w2"}
# Resumed and trained on (fp32 runs: a bf16 run's next step depends on its bf16 module copies).
RESUME = ("zero3_fp32_w4", "zero2_fp32_w2", "zero1_fp32_w4")


GEN = generator("generate.py")


def meta(variant: str) -> dict[str, Any]:
    with open(FIXTURES / REFERENCE_OF.get(variant, variant) / "reference.json") as f:
        return json.load(f)


def expected(variant: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full tensors under the names of ``get_state_dict(model, optim)``."""
    ref = load_file(str(FIXTURES / REFERENCE_OF.get(variant, variant) / "reference.safetensors"))
    m = meta(variant)
    model = GEN.build_model(m["model"])
    persistent = set(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for k, t in ref.items():
        kind, name = k.split("/", 1)
        if kind in ("fp32", "frozen") or (kind == "buffer" and name in persistent):
            out[f"model.{name}"] = t
        elif kind == "param" and f"model.{name}" not in out and m["zero_to_fp32"] == "ok":
            out[f"model.{name}"] = t  # zero_to_fp32's output: the fp32 master weights (tied names included)
        elif kind in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{kind}"] = t
    for tied, owner in m["tied"].items():
        out[f"model.{tied}"] = out[f"model.{owner}"]
    for name, trainable in m["requires_grad"].items():
        if trainable:
            out[f"optim.state.{name}.step"] = torch.tensor(float(m["optimizer_step"]))
    return out


def _model_and_optim(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GEN.build_model(kind)
    optim = torch.optim.AdamW(GEN.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return model, optim


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_fixture_loads_bit_exact_in_one_process(variant: str) -> None:
    """Weights, both moments, step and hyperparameters equal DeepSpeed's own; keys are get_state_dict's."""
    src = open_source(FIXTURES / variant)
    assert isinstance(src, DeepSpeedSource) and src.stage == meta(variant)["zero_stage"]
    got = load_state_dict(FIXTURES / variant)
    want = expected(variant)
    assert want and set(want) <= set(got)
    for k, v in want.items():
        # A bf16 run keeps frozen parameters in bf16 only (no fp32 master).
        assert bit_equal(got[k], v.to(got[k].dtype) if k == "model.frozen" else v), k
    m = meta(variant)
    for g, grp in enumerate(m["param_groups"]):
        for hp, v in grp.items():
            assert got[f"optim.param_groups.{g}.{hp}"] == (tuple(v) if isinstance(v, list) else v), (g, hp)
    # Exactly the keys of an FSDP2/plain training loop's get_state_dict(model, optim).
    model, optim = _model_and_optim(m["model"])
    msd, osd = get_state_dict(model, optim)
    keys = set(flatten_state_dict({"model": msd, "optim": osd})[0])
    assert set(got) == keys, set(got) ^ keys
    assert got["optim.param_groups.1.params"] == osd["param_groups"][1]["params"]


@pytest.mark.parametrize("universal", [UNIVERSAL, UNIVERSAL3])
def test_universal_folder_equals_the_checkpoint_it_came_from(universal: str) -> None:
    """ds_to_universal's output loads with the same bytes as the checkpoint it came from (no hyperparameters).

    From ZeRO-3 it holds flattened tensors, no ``step.pt`` and no frozen
    parameter files (the frozen one comes from the copied model states).
    """
    assert isinstance(open_source(FIXTURES / universal), DeepSpeedUniversalSource)
    uni = load_state_dict(FIXTURES / universal)
    orig = load_state_dict(FIXTURES / REFERENCE_OF[universal])
    zero3 = universal == UNIVERSAL3
    tensors = [k for k, v in orig.items() if isinstance(v, torch.Tensor) and not (zero3 and k.endswith(".step"))]
    assert set(k for k, v in uni.items() if isinstance(v, torch.Tensor)) == set(tensors)
    for k in tensors:
        assert bit_equal(uni[k], orig[k]), k
    if zero3:  # its param_shapes lists sub-groups, not the optimizer's groups
        assert not any(k.startswith("optim.param_groups.") for k in uni)
    else:
        assert uni["optim.param_groups.0.params"] == orig["optim.param_groups.0.params"]


@pytest.mark.parametrize("variant", RESUME)
def test_resumed_training_matches_deepspeeds_next_steps(variant: str) -> None:
    """In one process: load into a plain model + AdamW and train on (see :func:`_resume`)."""
    model, optim = _model_and_optim(meta(variant)["model"])
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=UCPStorageReader(FIXTURES / variant), planner=UCPLoadPlanner(), no_dist=True)
    _resume(model, optim, state, variant)


# ---------------------------------------------------------------- 3 ranks


def _needed_bytes(src: Any, flat: dict[str, Any]) -> int:
    """Bytes of the source this rank's targets hold: local elements times the stored item size."""
    n = 0
    for k, v in flat.items():
        if k in src.index.tensors and isinstance(v, torch.Tensor):
            local = v.to_local() if isinstance(v, DTensor) else v
            n += local.numel() * src.index.tensors[k].dtype.itemsize
    return n


def _fsdp2_on_3(rank: int, world: int, variants: list[str]) -> None:
    from torch.distributed.fsdp import fully_shard

    for variant in variants:
        m = meta(variant)
        model, _ = _model_and_optim(m["model"])
        fully_shard(model)
        optim = torch.optim.AdamW(GEN.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        msd, osd = get_state_dict(model, optim)
        state: dict[str, Any] = {"model": msd, "optim": osd}
        if variant == UNIVERSAL:  # no hyperparameters in a universal folder
            state["optim"] = {"state": osd["state"]}
        if variant == UNIVERSAL3:  # nor param_groups or step from ZeRO-3
            state["optim"] = {"state": {f: {k: v for k, v in st.items() if k != "step"}
                                        for f, st in osd["state"].items()}}
        for v in flatten(state).values():
            if isinstance(v, torch.Tensor):
                (v.to_local() if isinstance(v, DTensor) else v).fill_(13)
        # gap_bytes=0: count exactly the bytes asked for. (By default the
        # reader merges reads less than a page apart, which in files this
        # small means asking for more bytes of the same pages.)
        reader = UCPStorageReader(FIXTURES / variant, options=ReadOptions(gap_bytes=0))
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        flat = flatten(state)
        want = expected(variant)
        for k, v in want.items():
            if variant == UNIVERSAL3 and k.endswith(".step"):
                continue
            t = flat[k]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            assert bit_equal(full, v.to(full.dtype) if k == "model.frozen" else v), (variant, rank, k)
        if variant not in REFERENCE_OF:  # universal folders hold no hyperparameters
            for g, grp in enumerate(m["param_groups"]):
                got = {hp: state["optim"]["param_groups"][g][hp] for hp in grp}
                assert got == {hp: tuple(v) if isinstance(v, list) else v for hp, v in grp.items()}, (variant, g)
        needed = _needed_bytes(open_source(FIXTURES / variant), flat)
        assert needed <= reader.last_load.bytes_requested <= 1.05 * needed, (variant, rank, reader.last_load.bytes_requested, needed)
        if variant in RESUME:
            _resume(model, optim, state, variant)


def _resume(model: torch.nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], variant: str) -> None:
    """Train on from the loaded state: the losses equal DeepSpeed's after its save.

    DeepSpeed averaged gradients over its ranks' batches. Here every rank
    takes all of them, concatenated: FSDP2 averages identical gradients, so
    the step is the same.
    """
    m = meta(variant)
    ref = load_file(str(FIXTURES / variant / "reference.safetensors"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def tokens(step: int) -> torch.Tensor:
        return torch.cat([ref[f"batch/step{step}/rank{r}"] for r in range(m["world_size"])])

    loss3 = GEN.loss_of(model, m["model"], tokens(3))
    loss3.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), m["ds_config"].get("gradient_clipping", 1.0))
    optim.step()
    with torch.no_grad():
        loss4 = GEN.loss_of(model, m["model"], tokens(4))
    assert math.isclose(loss3.item(), m["loss_step3"], rel_tol=1e-5), (variant, loss3.item(), m["loss_step3"])
    assert math.isclose(loss4.item(), m["loss_step4"], rel_tol=1e-5), (variant, loss4.item(), m["loss_step4"])


@pytest.mark.multiproc
def test_every_fixture_loads_into_fsdp2_on_3_ranks_reading_only_what_each_needs_and_trains_on() -> None:
    """Weights, moments, steps and hyperparameters bit-exact; each rank asks for exactly its bytes."""
    run_ranks(3, _fsdp2_on_3, VARIANTS + [UNIVERSAL, UNIVERSAL3])


def _flat_on_3(rank: int, world: int, variant: str) -> None:
    """Into ZeRO-style flat shards at degree 3: each rank's slice of flat fp32 / exp_avg / exp_avg_sq buffers."""
    m = meta(variant)
    model, _ = _model_and_optim(m["model"])
    trainable = [(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad]
    params, total = pack_flat(trainable, align=4)
    start, stop = flat_partition(total, world, rank)
    bufs = {k: torch.full((stop - start,), 13.0) for k in ("param", "exp_avg", "exp_avg_sq")}
    step = torch.tensor(13.0)
    state = {
        "model": FlatShard(bufs["param"], params, start, prefix="model."),
        "exp_avg": FlatShard(bufs["exp_avg"], params, start, prefix="optim.state.", suffix=".exp_avg"),
        "exp_avg_sq": FlatShard(bufs["exp_avg_sq"], params, start, prefix="optim.state.", suffix=".exp_avg_sq"),
        "step": TensorPieces([Piece(f"optim.state.{p.fqn}.step", (), (), step) for p in params], replicated=True),
    }
    reader = UCPStorageReader(FIXTURES / variant)
    dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
    want = expected(variant)
    names = {"param": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}
    for key, fmt in names.items():
        ref = torch.zeros(max(total, stop))  # the last partition runs into the padding
        for p in params:
            ref[p.offset : p.offset + math.prod(p.shape)] = want[fmt.format(p.fqn)].reshape(-1)
        assert bit_equal(bufs[key], ref[start:stop]), (rank, key)
    assert step.item() == m["optimizer_step"]


def _flat_all(rank: int, world: int, variants: list[str]) -> None:
    for v in variants:
        _flat_on_3(rank, world, v)


@pytest.mark.multiproc
def test_zero_checkpoints_load_into_flat_shards_at_degree_3() -> None:
    """ZeRO-1/2/3 saved on 2 and 4 ranks into ZeRO-style flat buffers partitioned over 3."""
    run_ranks(3, _flat_all, [v for v in VARIANTS if not v.startswith("llama")])


# ---------------------------------------------------------------- hostile and unsupported


def _copy(variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / variant
    shutil.copytree(FIXTURES / variant, dst)
    return dst


def test_a_pickle_naming_any_other_class_is_refused_before_anything_runs(tmp_path: Path) -> None:
    d = _copy("zero2_fp32_w2", tmp_path)
    victim = d / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> Any:
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer_state_dict": {"x": Payload()}}, victim)
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(d)
    assert str(e.value) == f"{victim}: refusing to unpickle posix.system: it is not one of the classes this format stores"
    assert not marker.exists()
    # A class that is DeepSpeed's but not one its checkpoints hold: refused too.
    torch.save({"optimizer_state_dict": pickle.loads(pickle.dumps(torch.nn.Linear(1, 1)))}, victim)
    with pytest.raises(CheckpointFormatError, match=r"refusing to unpickle torch\.nn\.modules\.linear\.Linear"):
        open_source(d)


def test_unsupported_and_damaged_checkpoints_name_the_files(tmp_path: Path) -> None:
    d = _copy("zero2_fp32_w2", tmp_path)
    tag = d / "step2"
    # A tensor-parallel checkpoint (several model-parallel ranks) without rank 1's optimizer files.
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag}: model-parallel rank 1 has optimizer files for data-parallel ranks []; expected "
        "0..1, as rank 0 (missing zero_pp_rank_0_mp_rank_01_optim_states.pt, "
        "zero_pp_rank_1_mp_rank_01_optim_states.pt)"
    )
    (tag / "mp_rank_01_model_states.pt").unlink()
    # A missing rank.
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").rename(tag / "moved.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag}: saved by 2 data-parallel ranks (dp_world_size in mp_rank_00_model_states.pt) but holds optimizer "
        "files of 1: zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    (tag / "moved.pt").rename(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    # A truncated file.
    victim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CheckpointFormatError, match=str(victim)):
        load_state_dict(d)
    # latest naming a missing tag.
    (d / "latest").write_text("step9")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{d / 'latest'}: names tag 'step9', but {d / 'step9'} is not a directory"


def _universal_param(d: Path, fqn: str) -> Path:
    """The ``zero/<fqn>/`` folder of a copied Universal fixture."""
    return d / "step2_universal" / "zero" / fqn


@pytest.mark.parametrize("universal", [UNIVERSAL, UNIVERSAL3])
@pytest.mark.parametrize("kind", ["exp_avg", "exp_avg_sq"])
def test_a_universal_folder_missing_one_moment_file_is_refused_naming_it(tmp_path: Path, universal: str, kind: str) -> None:
    """ds_to_universal writes exp_avg.pt and exp_avg_sq.pt together for every parameter of the
    optimizer: one of them gone (a partial copy) is lost state, not a tensor the checkpoint
    never had. Refused naming the folder and the file, by every entry point, instead of
    loading (and verifying) without optim.state.fc2.weight.<kind>."""
    d = _copy(universal, tmp_path)
    with Checkpoint(d) as ck:
        assert f"optim.state.fc2.weight.{kind}" in ck.tensor_names()
    folder = _universal_param(d, "fc2.weight")
    (folder / f"{kind}.pt").unlink()
    for entry in (open_source, load_state_dict, lambda p: Checkpoint(p).tensor_names()):
        with pytest.raises(CheckpointFormatError) as e:
            entry(d)
        msg = str(e.value)
        assert msg.startswith(f"{folder}: holds "), msg
        assert f"but no {kind}.pt for parameter 'fc2.weight'" in msg
    # The committed fixture is untouched.
    assert (_universal_param(FIXTURES / universal, "fc2.weight") / f"{kind}.pt").is_file()


def test_a_universal_parameter_without_the_state_of_the_rest_of_its_group_is_refused(tmp_path: Path) -> None:
    """ds_to_universal takes each parameter's exp_avg/exp_avg_sq/step from its optimizer group's
    flat state: a parameter whose files are all gone, or whose step.pt alone is, while the other
    parameters of its group (param_shapes[0]) have them, is refused naming what is missing. A
    group with no state at all (what DeepSpeed 0.19 writes for a group that never stepped:
    fp32.pt only) still loads, without optim.state for it."""
    d = _copy(UNIVERSAL, tmp_path)
    folder = _universal_param(d, "fc2.weight")
    (folder / "step.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value).startswith(f"{folder}: no step.pt (ds_to_universal writes an optimizer group's state ")
    assert "3 of the 4 parameters of param_shapes[0] have exp_avg.pt, exp_avg_sq.pt, step.pt" in str(e.value)
    for kind in ("exp_avg", "exp_avg_sq"):
        (folder / f"{kind}.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(d)
    assert str(e.value).startswith(f"{folder}: no exp_avg.pt, exp_avg_sq.pt, step.pt (")
    # step.pt left alone without the moments: refused as a partial folder.
    shutil.copy(_universal_param(d, "fc1.weight") / "step.pt", folder / "step.pt")
    with pytest.raises(CheckpointFormatError, match=f"^{folder}: holds step.pt but no exp_avg.pt and no exp_avg_sq.pt "):
        open_source(d)
    # The whole group 1 without optimizer state: as ds_to_universal writes a group that has none.
    shutil.rmtree(d)
    d = _copy(UNIVERSAL, tmp_path)
    for fqn in ("fc1.bias", "fc2.bias", "proj.bias"):
        for kind in ("exp_avg", "exp_avg_sq", "step"):
            (_universal_param(d, fqn) / f"{kind}.pt").unlink()
    sd = load_state_dict(d)
    assert not [k for k in sd if k.startswith("optim.state.") and k.endswith(".bias.exp_avg")]
    assert "optim.state.fc2.weight.exp_avg" in sd and "model.fc2.bias" in sd


def test_a_zero3_universal_parameter_without_moments_is_refused(tmp_path: Path) -> None:
    """From ZeRO-3, ds_to_universal writes exp_avg.pt and exp_avg_sq.pt for every parameter
    (and step.pt for none): a folder with fp32.pt alone is refused naming both files."""
    d = _copy(UNIVERSAL3, tmp_path)
    folder = _universal_param(d, "fc2.weight")
    for kind in ("exp_avg", "exp_avg_sq"):
        (folder / f"{kind}.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(d)
    assert str(e.value).startswith(
        f"{folder}: no exp_avg.pt, exp_avg_sq.pt (ds_to_universal writes exp_avg.pt and exp_avg_sq.pt for every "
        "parameter of a ZeRO-3 checkpoint"
    )


@pytest.mark.parametrize("kind", ["exp_avg_sq", "step"])
def test_a_tensor_parallel_universal_folder_missing_a_state_file_is_refused(tmp_path: Path, kind: str) -> None:
    """The same rules for the folder of a tensor-parallel run (one mp_rank_MM per rank)."""
    name = "tp2_dp2_zero1_universal"
    d = tmp_path / name
    shutil.copytree(FIXTURES / "pipe" / name, d)
    assert "optim.state.2.fc1.weight.exp_avg_sq" in load_state_dict(d)
    folder = _universal_param(d, "2.fc1.weight")
    (folder / f"{kind}.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value).startswith(f"{folder}: "), str(e.value)
    assert f"no {kind}.pt" in str(e.value)
    if kind == "step":
        assert "param_shapes[0] of mp_rank_00_model_states.pt" in str(e.value)


# ---------------------------------------------------------------- CLI


def test_cli_inspect_verify_convert_export_on_a_deepspeed_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = FIXTURES / "zero3_fp32_w2"
    assert cli_main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "deepspeed" in out and "optim.state.fc1.weight.exp_avg" in out
    assert cli_main(["verify", str(src)]) == 0
    assert "records no checksums" in capsys.readouterr().out
    dst = tmp_path / "native"
    assert cli_main(["convert", str(src), str(dst)]) == 0
    a, b = load_state_dict(src), load_state_dict(dst)
    assert set(a) == set(b)
    for k, v in a.items():
        assert bit_equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k], k
    assert cli_main(["diff", str(src), str(dst)]) == 0
    # The fp32 master weights as a Hugging Face directory (names without "model.").
    out = tmp_path / "hf"
    assert cli_main(["export-hf", str(src), str(out), "-q", "--prefix", "model."]) == 0
    exported = load_state_dict(out)
    want = {k[len("model."):]: v for k, v in a.items() if k.startswith("model.")}
    assert set(exported) == set(want)
    for k, v in want.items():
        assert bit_equal(exported[k], v), k


# ---------------------------------------------------------------- damaged entries


def _edited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edits: dict[str, Any], variant: str = "zero2_fp32_w2"
) -> Path:
    """A copy of ``variant`` whose ``step2/<file>`` holds ``edit(its object)`` (in place where
    ``edit`` returns None), for each ``file: edit`` of ``edits``."""
    d = _copy(variant, tmp_path)
    for file, edit in edits.items():
        resave(d / "step2" / file, edit, monkeypatch)
    return d


_M = "mp_rank_00_model_states.pt"
_O = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def _osd(edit: Any) -> Any:
    """An edit of an optimizer file's optimizer_state_dict (in place)."""

    def apply(o: dict[str, Any]) -> None:
        edit(o["optimizer_state_dict"])

    return apply


def _inner(edit: Any) -> Any:
    """An edit of an optimizer file's inner optimizer state dict."""
    return _osd(lambda s: edit(s["base_optimizer_state"]))


@pytest.mark.parametrize(
    "file, edit, message",
    [
        (_M, lambda sd: [1], "holds a list, not DeepSpeed's model states dict"),
        (_M, lambda sd: sd.pop("param_shapes") and None, "no 'param_shapes' entry"),
        (_M, lambda sd: sd.update(param_shapes={}), "'param_shapes' is a dict, expected list"),
        (
            _M,
            lambda sd: sd["param_shapes"].__setitem__(0, ["embed.weight"]),
            "param_shapes[0] is a list, expected a dict",
        ),
        (
            _M,
            lambda sd: sd["param_shapes"][0].update({"fc1.weight": "13x7"}),
            "param_shapes[0]['fc1.weight']: '13x7' is not a shape",
        ),
        (
            _M,
            lambda sd: sd.update(module={"embed.weight": 1}),
            "'module': expected a dict of name -> tensor",
        ),
        (
            _M,
            lambda sd: sd.update(shared_params={"lm_head.weight": 1}),
            "'shared_params' is not a dict of name -> name",
        ),
        (
            _M,
            lambda sd: sd.update(buffer_names="running_mean"),
            "'buffer_names' is not a list of names",
        ),
        (_M, lambda sd: sd.update(dp_world_size=0), "dp_world_size 0 is not a positive integer"),
        (
            _M,
            lambda sd: sd.update(checkpoint_parallel_dimensions={"tp_degree": 0}),
            "checkpoint_parallel_dimensions['tp_degree'] 0 is not a positive integer",
        ),
        (
            _M,
            lambda sd: sd["param_shapes"][0].update({"embed.weight": (110, 7)}),
            "group 0: 973 parameter elements do not fit in partitions of 280",
        ),
        (
            _M,
            lambda sd: sd["param_shapes"].append({}),
            "param_shapes has 3 groups, the optimizer files 2",
        ),
        (
            _M,
            lambda sd: sd["frozen_param_fragments"].clear(),
            "no frozen_param_fragments entry for 'frozen'",
        ),
        (
            _M,
            lambda sd: sd.update(module=None),
            "'module' is None (a pipeline-parallel engine's model states) but <tag> holds no "
            "layer_XX-model_YY-model_states.pt files",
        ),
        (
            _O,
            _inner(lambda i: i["state"][0].update(step=2)),
            "optimizer state 'step' of flat buffer 0 is a int, not a tensor",
        ),
        (
            _O,
            _inner(lambda i: i["state"][0].update(betas_used=(0.9, 0.95))),
            "optimizer state 'betas_used' of flat buffer 0 is a tuple, not a tensor",
        ),
        (
            _O,
            _inner(lambda i: i.update(param_groups=[{**i["param_groups"][0], "params": [0, 1]}])),
            "1 inner optimizer groups for 2 parameter groups",
        ),
        (_O, lambda o: o.pop("optimizer_state_dict") and None, "no 'optimizer_state_dict' entry"),
        (_O, _osd(lambda s: s.update(zero_stage=5)), "optimizer_state_dict: zero_stage 5 is not 1, 2 or 3"),
        (
            _O,
            _osd(lambda s: s.update(group_paddings=[0])),
            "optimizer_state_dict: group_paddings [0] does not give one count per group",
        ),
        (
            _O,
            _osd(lambda s: s.update(param_alignment_paddings=[[0, 4], [0]])),
            "optimizer_state_dict: per-parameter alignment padding (param_alignment_paddings "
            "[[0, 4], [0]]) is not supported",
        ),
        (
            _O,
            _osd(lambda s: s["single_partition_of_fp32_groups"].__setitem__(
                0, s["single_partition_of_fp32_groups"][0].reshape(1, -1)
            )),
            "optimizer_state_dict: the fp32 buffers are not all 1-D tensors",
        ),
        (
            _O,
            _inner(lambda i: i["state"].update({7: {}})),
            "optimizer_state_dict: inner optimizer state key 7 is not a flat buffer number",
        ),
        (
            _O,
            _inner(lambda i: i["param_groups"][0].pop("params") and None),
            "optimizer_state_dict: inner optimizer param_groups[0] has no list of 'params'",
        ),
        (
            _O,
            _inner(lambda i: i["param_groups"][1].update(params=[0])),
            "optimizer_state_dict: inner optimizer groups cover flat buffers [0, 0], expected 0..1",
        ),
        (
            _O,
            _inner(lambda i: i["state"][0].update(exp_avg=i["state"][0]["exp_avg"][:5])),
            "optimizer state of flat buffer 0: exp_avg is not a 1-D tensor of at least 140 "
            "elements",
        ),
    ],
)
def test_a_damaged_deepspeed_entry_is_refused_naming_the_file_and_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, edit: Any, message: str
) -> None:
    """Each entry of a real ZeRO-2 checkpoint's model states and optimizer files, replaced by
    something DeepSpeed never writes there, is refused naming the file and the entry."""
    d = _edited(tmp_path, monkeypatch, {file: edit})
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{d / 'step2' / file}: {message.replace('<tag>', str(d / 'step2'))}"



def test_a_moment_one_rank_lacks_is_refused_naming_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's flat buffer 0 has exp_avg, rank 1's not: refused naming rank 1's file, the
    buffer and the moment, not read as zeros or from rank 0."""
    file = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    d = _edited(tmp_path, monkeypatch, {file: _inner(lambda i: i["state"][0].pop("exp_avg"))})
    with pytest.raises(CheckpointFormatError) as e:
        load_state_dict(d)
    assert str(e.value) == f"{d / 'step2' / file}: flat buffer 0 has no 'exp_avg' state"


def _stage(n: int) -> Any:
    return _osd(lambda s: s.update(zero_stage=n))


_Z3 = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
_O3 = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
_P = "zero_pp_rank_{}_mp_rank_0{}_optim_states.pt"


@pytest.mark.parametrize(
    "variant, edits, message",
    [
        (
            "zero2_fp32_w2",
            {_O: _stage(3), _O3.format(1): _stage(3)},
            "<tag>: ZeRO stage 3 optimizer files with one model states file(s)",
        ),
        (
            "zero2_fp32_w2",
            {_O3.format(1): _stage(1)},
            "<tag>/zero_pp_rank_1_mp_rank_00_optim_states.pt: ZeRO stage 1 with 2 flat buffers; "
            "<tag>/zero_pp_rank_0_mp_rank_00_optim_states.pt has stage 2 with 2",
        ),
        (
            "zero2_fp32_w2",
            {_O: _osd(lambda s: s.update(group_paddings=[10, 0]))},
            "<tag>/zero_pp_rank_0_mp_rank_00_optim_states.pt: fp32 weight 'fc1.weight' needs "
            "elements [77, 147) of a buffer of 140",
        ),
        (
            "zero2_fp32_w2",
            {
                _O3.format(1): _osd(
                    lambda s: s["single_partition_of_fp32_groups"].__setitem__(
                        0, s["single_partition_of_fp32_groups"][0].double()
                    )
                )
            },
            "<tag>/zero_pp_rank_1_mp_rank_00_optim_states.pt: fp32 weight 'fc1.weight' is stored "
            "as both torch.float32 and torch.float64",
        ),
        (
            "zero3_fp32_w2",
            {_O3.format(1): _osd(lambda s: s["fp32_flat_groups"].__setitem__(0, s["fp32_flat_groups"][0][:-1]))},
            "<tag>/zero_pp_rank_1_mp_rank_00_optim_states.pt: fp32_flat_groups of [84, 57, 15] "
            "elements; rank 0 has [85, 57, 15]",
        ),
        (
            "zero3_fp32_w2",
            {_Z3.format(0): lambda sd: sd["param_shapes"][0].update({"fc1.weight": (130, 7)})},
            "<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt: parameter slices of 566 elements per "
            "rank do not fit in buffers of 157",
        ),
        (
            "zero3_fp32_w2",
            {_Z3.format(0): lambda sd: sd["module"].update(extra=torch.zeros(1))},
            "<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt: module entry 'extra' is neither in "
            "param_shapes, frozen_param_shapes, shared_params nor buffer_names; under ZeRO-3 its "
            "module copy is a placeholder",
        ),
        (
            "pipe/tp2_dp2_zero1",
            {_P.format(dp, mp): _stage(3) for dp in (0, 1) for mp in (0, 1)},
            "<tag>/mp_rank_00_model_states.pt: ZeRO-3 optimizer files in a pipeline- or "
            "tensor-parallel checkpoint",
        ),
        (
            "pipe/tp2_dp2_zero1",
            {"mp_rank_01_model_states.pt": lambda sd: sd["param_shapes"][0].update({"1.fc1.weight": (6, 7)})},
            "<tag>/mp_rank_01_model_states.pt: '1.fc1.weight' is a (6, 7) slice; model-parallel rank "
            "0 holds a (7, 7) one (uneven tensor-parallel slices are not supported by its rule, "
            "column-parallel)",
        ),
    ],
)
def test_deepspeed_files_that_disagree_are_refused_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str, edits: dict[str, Any], message: str
) -> None:
    """Optimizer and model states files of one real checkpoint edited to disagree with each
    other (ZeRO stage, buffer sizes, groups, slice shapes, module entries) are refused naming
    the file (``<tag>``: the tag folder) and what it disagrees with."""
    d = _edited(tmp_path, monkeypatch, edits, variant)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == message.replace("<tag>", str(d / "step2"))


def test_optimizer_groups_that_differ_between_model_parallel_ranks_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor-parallel rank 1's optimizer groups with another learning rate than rank 0's: the
    merged state would have no one value; refused naming both files and the groups."""
    d = _edited(
        tmp_path,
        monkeypatch,
        {_P.format(0, 1): _inner(lambda i: i["param_groups"][0].update(lr=0.5))},
        "pipe/tp2_dp2_zero1",
    )
    tag = d / "step2"
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    msg = str(e.value)
    assert msg.startswith(
        f"{tag / _P.format(0, 1)}: model-parallel rank 1's optimizer groups [{{'weight_decay': 0.1, "
        "'lr': 0.5, "
    )
    assert "differ from rank 0's [{'weight_decay': 0.1, 'lr': 0.01, " in msg
    assert msg.endswith(f"({tag / _P.format(0, 0)})")


def test_a_layer_file_two_tied_modules_could_be_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline run whose stages name a second tied module with the embedding's entry
    (tied_modules.head.weight, a buffer here): layer 0's file could be either; refused naming
    it and both, not read as the first."""
    d = _edited(
        tmp_path,
        monkeypatch,
        {"mp_rank_00_model_states.pt": lambda sd: sd["buffer_names"].append("tied_modules.head.weight")},
        "pipe/pp2_dp2_zero1",
    )
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2' / 'layer_00-model_00-model_states.pt'}: layer 0's entries ['weight'] match "
        "tied modules embed, head alike; cannot tell which one this layer is"
    )


@pytest.mark.parametrize(
    "variant, damage, message",
    [
        (
            "zero2_fp32_w2",
            lambda d: (d / "latest").write_bytes(b"\xffstep2"),
            "<d>/latest: cannot read the tag ('utf-8' codec can't decode byte 0xff in position 0: "
            "invalid start byte)",
        ),
        (
            "zero2_fp32_w2",
            lambda d: (d / "latest").write_text("../step2"),
            "<d>/latest: '../step2' is not a tag folder name",
        ),
        (
            "zero2_fp32_w2",
            lambda d: shutil.copy(
                d / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                d / "step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
            ),
            "<d>/step2: holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files",
        ),
        (
            "zero2_fp32_w2",
            lambda d: (d / "step2" / "mp_rank_00_model_states.pt").unlink(),
            "<d>/step2: no mp_rank_00_model_states.pt (or zero_pp_rank_*_model_states.pt)",
        ),
        (
            "pipe/pp2_tp2_dp2_zero1",
            lambda d: (d / "step2" / "layer_03-model_01-model_states.pt").unlink(),
            "<d>/step2: no layer_03-model_01-model_states.pt, though other tensor-parallel ranks "
            "of layer 3 have one",
        ),
        (
            "pipe/pp2_dp2_zero1",
            lambda d: shutil.copy(
                d / "step2" / "mp_rank_00_model_states.pt",
                d / "step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
            ),
            "<d>/step2: ZeRO-3 model files (zero_pp_rank_0_mp_rank_00_model_states.pt) of a "
            "pipeline- or tensor-parallel checkpoint are not supported",
        ),
        (
            "zero3_fp32_w2_universal",
            lambda d: shutil.copy(
                d / "step2_universal" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                d / "step2_universal" / "zero_pp_rank_0_mp_rank_01_model_states.pt",
            ),
            "<d>/step2_universal: zero_pp_rank_0_mp_rank_01_model_states.pt: tensor- or "
            "pipeline-parallel Universal folders are not supported",
        ),
    ],
    ids=["latest_bytes", "latest_path", "bf16_mixed", "no_model_states", "layer_file", "zero3_pipeline", "universal_tp"],
)
def test_a_deepspeed_folder_with_wrong_files_is_refused_naming_them(
    tmp_path: Path, variant: str, damage: Any, message: str
) -> None:
    """A real checkpoint whose ``latest`` is not a tag name, or whose tag folder mixes, lacks
    or adds files DeepSpeed writes together, is refused naming the folder and the file."""
    d = _copy(variant, tmp_path)
    damage(d)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == message.replace("<d>", str(d))


def test_opening_a_folder_without_deepspeed_files_as_deepspeed_is_refused(tmp_path: Path) -> None:
    """DeepSpeedSource.open and DeepSpeedUniversalSource on folders detection would not offer
    them: named, with what is missing."""
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(str(tmp_path), SourceOptions())
    assert str(e.value) == (
        f"{tmp_path}: not a DeepSpeed ZeRO checkpoint: no "
        "*zero_pp_rank_*_mp_rank_*_optim_states.pt files (notes.txt)"
    )
    gone = tmp_path / "gone"
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedUniversalSource(str(gone))
    assert str(e.value) == (
        f"{gone}: a DeepSpeed Universal folder without model states (expected "
        "mp_rank_00_model_states.pt or zero_pp_rank_<R>_mp_rank_00_model_states.pt)"
    )


def _zero_file(edit: Any, fqn: str = "fc1.weight") -> Any:
    """A damage to zero/<fqn>/fp32.pt of a copied Universal folder: saved as ``edit(its
    dict)``."""

    def damage(d: Path) -> Path:
        f = _universal_param(d, fqn) / "fp32.pt"
        torch.save(edit(torch.load(f, weights_only=True)), f)
        return f

    return damage


@pytest.mark.parametrize(
    "damage, message",
    [
        (_zero_file(lambda sd: {"x": 1}), "<f>: holds no tensor (expected a dict with 'param', or a tensor)"),
        (
            _zero_file(lambda sd: {**sd, "optimizer": 1}),
            "<f>: holds key(s) 'optimizer' this reader does not know (it knows param, cat_dim, "
            "param_n_sub_params, sub_param_shape, vocab_tensor); an unread key could change what "
            "the tensor is",
        ),
        (
            _zero_file(lambda sd: {**sd, "param": torch.zeros(3)}),
            "<f>: a tensor of shape [3], expected [13, 7] from param_shapes",
        ),
    ],
    ids=["no_tensor", "unknown_key", "shape"],
)
def test_a_damaged_universal_file_is_refused_naming_it(tmp_path: Path, damage: Any, message: str) -> None:
    """A zero/<fqn>/fp32.pt that holds no tensor, a key ds_to_universal does not write, or a
    tensor of another shape than param_shapes gives: refused naming the file."""
    d = _copy(UNIVERSAL, tmp_path)
    f = damage(d)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == message.replace("<f>", str(f))


def test_a_universal_parameter_without_fp32_is_refused(tmp_path: Path) -> None:
    d = _copy(UNIVERSAL, tmp_path)
    (_universal_param(d, "fc1.weight") / "fp32.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    zero = d / "step2_universal" / "zero"
    assert str(e.value) == f"{zero}: no fc1.weight/fp32.pt for parameter 'fc1.weight'"


def test_check_files_names_a_deepspeed_file_gone_or_resized_since_open(tmp_path: Path) -> None:
    """check_files (verify) of a DeepSpeed checkpoint: one line per file deleted or grown since
    it was opened."""
    d = _copy("zero2_fp32_w2", tmp_path)
    src = open_source(d)
    assert src.check_files() == []
    gone = d / "step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    grown = d / "step2" / "mp_rank_00_model_states.pt"
    size = grown.stat().st_size
    gone.unlink()
    with open(grown, "ab") as f:
        f.write(b"\0" * 3)
    assert sorted(src.check_files()) == sorted(
        [f"{gone}: No such file or directory", f"{grown}: {size + 3} bytes on disk, {size} when opened"]
    )


def test_tensor_parallel_slices_of_two_dtypes_are_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor-parallel rank 1's fp32 partitions saved as float64, rank 0's as float32: the
    merged tensor has no one dtype. Refused naming rank 1's file and rank; the message once
    named only the key, leaving which of the files to look at unsaid."""
    d = _edited(
        tmp_path,
        monkeypatch,
        {
            _P.format(dp, 1): _osd(
                lambda s: s.update(
                    single_partition_of_fp32_groups=[t.double() for t in s["single_partition_of_fp32_groups"]]
                )
            )
            for dp in (0, 1)
        },
        "pipe/tp2_dp2_zero1",
    )
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2' / _P.format(0, 1)}: tensor-parallel rank 1's slice of "
        "model.tied_modules.embed.weight is torch.float64, merged shape (11, 7); other ranks' "
        "slices are torch.float32, merged shape (11, 7)"
    )
