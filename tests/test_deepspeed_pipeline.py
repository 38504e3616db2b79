"""DeepSpeed pipeline-parallel (PipelineModule) checkpoints, loaded in place into other layouts.

The fixtures under ``tests/fixtures/deepspeed/pipe/`` were written by
DeepSpeed 0.19 (``generate_pipe.py`` there): a 6-layer PipelineModule on 2
stages with a tied embedding (layer 0, and the head at layer 5 through
``forward_fn``), a frozen parameter and a buffer, ZeRO-1 over 2 or 1
data-parallel ranks. ``reference.safetensors`` holds DeepSpeed's own full
fp32 params and Adam moments (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` on every stage) and each stage's module
state; ``reference.json`` the losses of the steps after the save.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, flatten, run_ranks
from ds_fixtures import generator
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from ucp_dcp import CheckpointFormatError, UCPLoadPlanner, UCPStorageReader, load_state_dict
from ucp_dcp.sources import DeepSpeedSource, DeepSpeedUniversalSource, open_source

PIPE = Path(__file__).parent / "fixtures" / "deepspeed" / "pipe"
ALL = sorted(p.name for p in PIPE.iterdir() if (p / "latest").is_file())
_TP = {v: json.loads((PIPE / v / "reference.json").read_text())["tp"] for v in ALL}
VARIANTS = [v for v in ALL if _TP[v] == 1]  # pipeline x data parallelism
# Trained on after loading (a bf16 run's next step depends on its bf16 module copies).
FP32 = [
    v for v in VARIANTS if not json.loads((PIPE / v / "reference.json").read_text()).get("bf16")
]
TP_VARIANTS = [v for v in ALL if _TP[v] > 1]  # tensor x (pipeline x) data parallelism
TP_FP32 = [
    v for v in TP_VARIANTS if not json.loads((PIPE / v / "reference.json").read_text())["bf16"]
]
# ds_to_universal's output of some of them (generate_pipe.py's UNIVERSAL_FROM).
UNIVERSAL = sorted(p.name for p in PIPE.iterdir() if (p / "latest_universal").is_file())


GEN = generator("generate_pipe.py")


def meta(variant: str) -> dict[str, Any]:
    return json.loads((PIPE / variant / "reference.json").read_text())


def expected(variant: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's own full tensors under the engine module's names, as get_state_dict keys."""
    ref = load_file(str(PIPE / variant / "reference.safetensors"))
    m = meta(variant)
    out: dict[str, torch.Tensor] = {}
    for k, t in ref.items():
        kind, name = k.split("/", 1)
        if kind == "fp32":
            out[f"model.{name}"] = t
        elif kind in ("exp_avg", "exp_avg_sq"):
            out[f"optim.state.{name}.{kind}"] = t
            out[f"optim.state.{name}.step"] = torch.tensor(float(m["optimizer_step"]))
    for k, t in ref.items():
        kind, name = k.split("/", 1)
        if kind == "module" and f"model.{name}" not in out:
            out[f"model.{name}"] = t  # the frozen param and the buffer: only in the layer files
    return out


def _model_and_optim(tp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model without a pipeline under the engine's names (``tp``: the tensor-parallel
    fixtures' layers, whole: their slices joined, the vocabulary padding cut) and its AdamW."""
    torch.manual_seed(0)
    model = GEN.build_plain_model(GEN.tp_layers() if tp else None)
    return model, _adamw(model)


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The generator's optimizer: its two groups and hyperparameters."""
    return torch.optim.AdamW(GEN.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("variant", VARIANTS)
def test_pipeline_checkpoint_loads_bit_exact_in_one_process(variant: str) -> None:
    """Weights (fp32 masters), moments, steps, the frozen param and the buffer equal DeepSpeed's;
    the keys are get_state_dict's of the same model without a pipeline; the tied embedding,
    held by both stages, is read once (from stage 0's partitions)."""
    src = open_source(PIPE / variant)
    assert isinstance(src, DeepSpeedSource) and src.stage == 1
    m = meta(variant)
    assert src.world_size == m["pp"] * m["dp"]
    # 5 layer files (the head at layer 5 has no state of its own), 2 model states, pp x dp optim.
    assert len(src.paths) == 5 + m["pp"] + m["pp"] * m["dp"]
    tied = src.index.tensors["model.tied_modules.embed.weight"]
    assert {src.paths[c.location.file].rsplit("_mp_rank_", 1)[1] for c in tied.chunks} == {
        "00_optim_states.pt"
    }
    got = load_state_dict(PIPE / variant)
    want = expected(variant)
    for k, v in want.items():
        assert bit_equal(got[k], v), k
    for g, grp in enumerate(m["param_groups"]):
        for hp, v in grp.items():
            assert got[f"optim.param_groups.{g}.{hp}"] == (
                tuple(v) if isinstance(v, list) else v
            ), (g, hp)
    model, optim = _model_and_optim()
    msd, osd = get_state_dict(model, optim)
    keys = set(flatten_state_dict({"model": msd, "optim": osd})[0])
    assert set(got) == keys, set(got) ^ keys
    assert sorted(got["optim.param_groups.0.params"]) == sorted(osd["param_groups"][0]["params"])


def _resume(
    model: torch.nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], variant: str
) -> None:
    """Step 3 and 4 after the load, without a pipeline: DeepSpeed's losses.

    Every micro-batch of every data-parallel rank is the same size, so the mean
    of their losses (what train_batch averaged gradients over) is the loss of
    their concatenation. DeepSpeed clips the global gradient norm (1.0 by
    default; under tensor parallelism it counts each slice once and a
    replicated parameter once), as ``clip_grad_norm_`` of the whole model does.
    """
    m = meta(variant)
    ref = load_file(str(PIPE / variant / "reference.safetensors"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def loss(step: int) -> torch.Tensor:
        t = torch.cat(
            [
                ref[f"batch/step{step}/dp{d}/micro{k}"]
                for d in range(m["dp"])
                for k in range(m["micro_batches"])
            ]
        )
        return GEN.loss_fn(model(t[:, :-1]), t[:, 1:])

    loss3 = loss(3)
    loss3.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), m["gradient_clipping"])
    optim.step()
    with torch.no_grad():
        loss4 = loss(4)
    assert math.isclose(loss3.item(), m["loss_step3"], rel_tol=1e-5), (
        variant,
        loss3.item(),
        m["loss_step3"],
    )
    assert math.isclose(loss4.item(), m["loss_step4"], rel_tol=1e-5), (
        variant,
        loss4.item(),
        m["loss_step4"],
    )


@pytest.mark.parametrize("variant", FP32)
def test_resumed_without_a_pipeline_training_matches_deepspeeds_next_steps(variant: str) -> None:
    model, optim = _model_and_optim()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(
        state,
        storage_reader=UCPStorageReader(PIPE / variant),
        planner=UCPLoadPlanner(),
        no_dist=True,
    )
    _resume(model, optim, state, variant)


def _load_into(
    model: torch.nn.Module, optim: torch.optim.Optimizer, path: Path | str, partial: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(model, optim)`` with every tensor set to 13, then loaded from ``path``:
    the state (for ``set_state_dict``) and its flattened view (keys as ``expected``'s)."""
    msd, osd = get_state_dict(model, optim)
    state: dict[str, Any] = {"model": msd, "optim": osd}
    for v in flatten(state).values():
        if isinstance(v, torch.Tensor):
            (v.to_local() if isinstance(v, DTensor) else v).fill_(13)
    dcp.load(
        state,
        storage_reader=UCPStorageReader(path),
        planner=UCPLoadPlanner(allow_partial_load=partial),
    )
    return state, flatten(state)


def _fsdp2(rank: int, world: int, variants: list[str]) -> None:
    from torch.distributed.fsdp import fully_shard

    for variant in variants:
        model, _ = _model_and_optim()
        fully_shard(model)
        optim = torch.optim.AdamW(GEN.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
        state, flat = _load_into(model, optim, PIPE / variant)
        for k, v in expected(variant).items():
            t = flat[k]
            full = t.full_tensor() if isinstance(t, DTensor) else t
            assert bit_equal(full, v), (variant, rank, k)
        _resume(model, optim, state, variant)


def _all_on_3(rank: int, world: int, root: str) -> None:
    from test_deepspeed_autotp import autotp_into_tp3

    _fsdp2(rank, world, FP32)
    autotp_into_tp3(rank, world)  # DeepSpeed AutoTP fixtures into TP=3
    for v in TP_VARIANTS:
        _tp_into_3(rank, world, v)
    for v in TP_FP32:
        _tp3_resume(rank, world, v, PIPE / v)
    for v in UNIVERSAL:
        src, path = _converted(v), _universal_dir(v, Path(root))
        if _TP[src] > 1:
            _tp_into_3(rank, world, v, expected_universal(v), path)
            if src in TP_FP32:
                _tp3_resume(rank, world, src, path, partial=True)
        else:
            _fsdp2_universal(rank, world, v, path)


@pytest.mark.multiproc
def test_every_fixture_loads_on_3_ranks(tmp_path: Path) -> None:
    """Pipeline x data-parallel fixtures into FSDP2 (bit-exact weights and moments, then
    DeepSpeed's next losses); tensor-parallel ones into a TP=3 layout (bit-exact to
    ds_to_universal's merged tensors; the fp32 ones also into a TP=3 model of DTensors that
    resumes to DeepSpeed's next losses); their Universal folders alike. One spawn for all: each
    costs seconds."""
    for v in UNIVERSAL:
        _universal_dir(v, tmp_path)
    run_ranks(3, _all_on_3, str(tmp_path))


# ---------------------------------------------------------------- refusals


def _copy(variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / variant
    shutil.copytree(PIPE / variant, dst)
    return dst


def test_tensor_parallel_without_partitioning_rules_is_refused_naming_them(tmp_path: Path) -> None:
    """Layer files of two tensor-parallel ranks and no universal_checkpoint_info: which dimension
    each parameter is split along is unknown."""
    d = _copy("pp2_dp1_zero1", tmp_path)
    tag = d / "step2"
    for f in tag.glob("layer_*-model_00-model_states.pt"):
        shutil.copy(f, f.with_name(f.name.replace("-model_00-", "-model_01-")))
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag / 'mp_rank_00_model_states.pt'}: tensor-parallel checkpoint without partitioning "
        "rules: universal_checkpoint_info is missing, so it is unknown which dimension each of "
        "1.fc1.bias, 1.fc1.weight, 1.fc2.bias, 1.fc2.weight, 2.fc1.bias, 2.fc1.weight ... (9 more) is "
        "split along (or whether it is replicated)"
    )


def test_damaged_pipeline_checkpoints_name_the_files(tmp_path: Path) -> None:
    d = _copy("pp2_dp2_zero1", tmp_path)
    tag = d / "step2"
    # A stage's optimizer file gone.
    (tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt").rename(tmp_path / "moved.pt")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag}: model-parallel rank 1 has optimizer files for data-parallel ranks [0]; expected "
        "0..1, as rank 0 (missing zero_pp_rank_1_mp_rank_01_optim_states.pt)"
    )
    (tmp_path / "moved.pt").rename(tag / "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    # The layer file holding the buffer gone.
    (tag / "layer_03-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag / 'mp_rank_01_model_states.pt'}: buffer '3.scale' of model-parallel rank 1 is in no "
        "layer file"
    )
    # A stage's model states gone.
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag}: model-parallel ranks (mp_rank_XX) [0, 1] with model states files for [0]; "
        "expected mp_rank_00..mp_rank_01 of each, a multiple of the 1 tensor-parallel ranks"
    )


def _fqn(key: str) -> str:
    """The parameter name in ``model.<fqn>`` / ``optim.state.<fqn>.<state>``."""
    return (
        key.split(".", 1)[1] if key.startswith("model.") else key.split(".", 2)[2].rsplit(".", 1)[0]
    )


@pytest.mark.filterwarnings("ignore:.*checkpoint key\\(s\\) not in the state dict")
def test_into_another_pipeline_split_each_stage_reads_its_layers() -> None:
    """Saved as 2 stages, loaded as 3 (layers 0-1, 2-3, 4-5; the tied embedding on the first and
    the last): each stage asks for its own names only and gets DeepSpeed's values."""
    want = expected("pp2_dp2_zero1")
    split = [("tied_modules.", "1."), ("2.", "3."), ("4.", "tied_modules.")]
    for prefixes in split:
        state = {k: torch.full_like(v, 13) for k, v in want.items() if _fqn(k).startswith(prefixes)}
        assert state
        reader = UCPStorageReader(PIPE / "pp2_dp2_zero1")
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
        for k, t in state.items():
            assert bit_equal(t, want[k]), (prefixes, k)


# ---------------------------------------------------------------- tensor parallelism


def expected_tp(variant: str) -> dict[str, torch.Tensor]:
    """ds_to_universal's merged tensors (slices joined, vocabulary padding stripped) as keys."""
    ref = load_file(str(PIPE / variant / "reference.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for k, t in ref.items():
        if k.startswith("universal/"):
            _, kind, name = k.split("/", 2)
            out[f"model.{name}" if kind == "fp32" else f"optim.state.{name}.{kind}"] = t
            if kind != "fp32":  # without a pipeline it also copies frozen params and buffers
                out[f"optim.state.{name}.step"] = torch.tensor(2.0)
    # Non-trainable entries are replicated: tensor-parallel rank 0's layer file.
    for name in ("3.frozen", "3.scale"):
        out[f"model.{name}"] = ref[f"module/{name}/tp0"]
    return out


@pytest.mark.parametrize("variant", TP_VARIANTS)
def test_tensor_parallel_slices_join_bit_exact_to_ds_to_universal(variant: str) -> None:
    """PP=2 x TP=2: column-parallel slices joined along 0, row-parallel along 1, replicated ones
    read from rank 0, the vocabulary-parallel tied embedding joined and its padding row cut,
    each by the checkpoint's universal_checkpoint_info; weights and moments equal
    ds_to_universal's, and each rank's slice equals what DeepSpeed's safe_get_full_* returned
    on that rank before the save (the bf16 run's fp32 masters included)."""
    src = open_source(PIPE / variant)
    assert isinstance(src, DeepSpeedSource)
    got = load_state_dict(PIPE / variant)
    want = expected_tp(variant)
    assert set(got) - {k for k in got if k.startswith("optim.param_groups.")} == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v), k
    for k, v in load_file(str(PIPE / variant / "reference.safetensors")).items():
        if k.startswith("slice/"):
            _, kind, rest = k.split("/", 2)
            name, t = rest.rsplit("/tp", 1)
            full = got[f"model.{name}" if kind == "fp32" else f"optim.state.{name}.{kind}"]
            if name.endswith((".gain", ".fc2.bias")) or name.startswith("3."):
                assert bit_equal(full, v), k  # replicated
                continue
            dim = 1 if name.endswith(".fc2.weight") else 0
            n = v.shape[dim]
            mine = full.narrow(dim, int(t) * n, min(n, full.shape[dim] - int(t) * n))
            assert bit_equal(mine, v.narrow(dim, 0, mine.shape[dim])), k  # the vocabulary cut
    # Replicated parameters are slice 0, checked against every tensor-parallel rank's
    # (ds_to_universal asserts they are equal): computed from the optimizer files of both
    # (zero_pp_rank_D_mp_rank_MM, the file of model-parallel rank MM).
    assert src.computed is not None
    replicas = {t.key: t for t in src.computed.tensors if t.op == "replica"}
    for k in ("model.1.gain", "model.4.fc2.bias"):
        mps = [
            {int(src.paths[loc.file].split("_mp_rank_")[1][:2]) % _TP[variant] for _, loc in op}
            for op in replicas[k].operands
        ]
        assert mps == [{t} for t in range(_TP[variant])], (k, mps)


@pytest.mark.parametrize("variant", TP_FP32)
def test_tensor_parallel_resumed_in_one_process_matches_deepspeeds_next_steps(variant: str) -> None:
    """TP=2 (x PP=2) x DP checkpoints into the whole model in one process: DeepSpeed's step-3
    and step-4 losses (its loss leaves the vocabulary padding row out, which the load cuts)."""
    model, optim = _model_and_optim(tp=True)
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(
        state,
        storage_reader=UCPStorageReader(PIPE / variant),
        planner=UCPLoadPlanner(),
        no_dist=True,
    )
    _resume(model, optim, state, variant)


def _tp3_partition(name: str, module: torch.nn.Module, mesh: Any) -> None:
    """TP=3 of the whole tensor-parallel model: ``fc1`` column-parallel (weight and bias split
    along 0), ``fc2`` row-parallel (weight along 1); :func:`distribute_module` replicates the
    rest (the vocabulary too: another layout than the checkpoint's)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if name.endswith((".fc1", ".fc2")):
        dim = 0 if name.endswith(".fc1") else 1
        for pname in ("weight", "bias") if dim == 0 else ("weight",):
            t = getattr(module, pname)
            module.register_parameter(
                pname, torch.nn.Parameter(distribute_tensor(t.data, mesh, [Shard(dim)]))
            )


def _tp3_resume(rank: int, world: int, variant: str, path: Path, partial: bool = False) -> None:
    """A tensor-parallel fixture (or its Universal folder at ``path``, which records no
    hyperparameters: ``partial`` keeps the optimizer's own) into a TP=3 model of DTensors
    (uneven slices: 14 and 10 over 3): bit-exact weights and moments, then DeepSpeed's next
    losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_module

    mesh = init_device_mesh("cpu", (world,))
    model, _ = _model_and_optim(tp=True)
    distribute_module(
        model,
        mesh,
        _tp3_partition,
        input_fn=lambda _m, args, mesh: tuple(
            DTensor.from_local(a, mesh, [Replicate()]) for a in args
        ),
        output_fn=lambda _m, out, _mesh: out.full_tensor(),
    )
    optim = _adamw(model)
    state, flat = _load_into(model, optim, path, partial)
    for k, v in expected_tp(variant).items():
        t = flat[k]
        assert bit_equal(t.full_tensor() if isinstance(t, DTensor) else t, v), (variant, rank, k)
    _resume(model, optim, state, variant)


def _tp_into_3(
    rank: int,
    world: int,
    variant: str,
    want: dict[str, torch.Tensor] | None = None,
    path: Path | None = None,
) -> None:
    """Into a TP=3 layout (column-parallel along 0, row-parallel along 1, the rest replicated)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    want = expected_tp(variant) if want is None else want
    state: dict[str, Any] = {}
    for k, v in want.items():
        name = _fqn(k)
        if v.ndim == 0 or name.startswith("3.") or name.endswith((".gain", ".fc2.bias")):
            placement: list[Any] = [Replicate()]
        else:
            placement = [Shard(1 if name.endswith(".fc2.weight") else 0)]
        state[k] = distribute_tensor(torch.full_like(v, 13), mesh, placement)
    reader = UCPStorageReader(PIPE / variant if path is None else path)
    dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
    for k, v in want.items():
        assert bit_equal(state[k].full_tensor(), v), (rank, k)


@pytest.mark.parametrize("variant", ["pp2_dp2_zero1", *TP_VARIANTS])
def test_from_an_object_store_url_as_from_the_local_directory(variant: str) -> None:
    """The layer files are read through the store view too (side by side with the others)."""
    import uuid

    import fsspec

    url = f"memory://ucp-ds-pipe-{uuid.uuid4().hex}/ck"
    fs, root = fsspec.core.url_to_fs(url)
    fs.put(str(PIPE / variant), root, recursive=True)
    src, local = open_source(url), open_source(PIPE / variant)
    assert isinstance(src, DeepSpeedSource) and src.store is not None
    assert [f.name for f in src.index.files] == [f.name for f in local.index.files]
    got, want = load_state_dict(url), load_state_dict(PIPE / variant)
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_layer_files_without_a_model_axis_load_alike(tmp_path: Path) -> None:
    """A PipeDataParallelTopology (no "model" axis) names layer files layer_XX-model_states.pt."""
    d = _copy("pp2_dp2_zero1", tmp_path)
    for f in (d / "step2").glob("layer_*-model_00-model_states.pt"):
        f.rename(f.with_name(f.name.replace("-model_00-", "-")))
    got, want = load_state_dict(d), load_state_dict(PIPE / "pp2_dp2_zero1")
    assert set(got) == set(want)
    assert all(bit_equal(got[k], v) for k, v in want.items() if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------- ds_to_universal's folders


def _converted(variant: str) -> str:
    """The fixture a Universal folder was converted from."""
    return variant.removesuffix("_universal")


def expected_universal(variant: str) -> dict[str, torch.Tensor]:
    """What a Universal folder gives: the trainable parameters' weights, moments and steps, the
    frozen parameter and the buffer (from the copied modules without a pipeline, from the
    layer files under one: :func:`_universal_dir`)."""
    src = _converted(variant)
    return expected_tp(src) if _TP[src] > 1 else expected(src)


def _universal_dir(variant: str, root: Path) -> Path:
    """Universal folder ``variant`` ready to load. A pipeline run's model states have ``module``
    None and ds_to_universal copies no layer files, so the folder is laid out under ``root`` as
    Megatron-DeepSpeed does: ``step2_universal`` (and ``latest_universal``) beside the tag
    folder it was converted from, ``step2``, whose layer files hold the frozen parameter and
    the buffer. Without a pipeline, the fixture itself."""
    if meta(_converted(variant))["pp"] == 1:
        return PIPE / variant
    dst = root / variant
    if not dst.exists():
        shutil.copytree(PIPE / variant, dst)
        shutil.copytree(PIPE / _converted(variant) / "step2", dst / "step2")
    return dst


@pytest.mark.parametrize("variant", UNIVERSAL)
def test_universal_folder_of_a_3d_run_loads_bit_exact(variant: str, tmp_path: Path) -> None:
    """One mp_rank_MM per stage x tensor-parallel rank (module None under a pipeline), cat_dim
    and vocab_tensor entries: the merged tensors (the vocabulary cut to 11 rows) equal
    DeepSpeed's references, the frozen parameter and the buffer too (under a pipeline from the
    layer files of the tag folder beside it); the param groups name the parameters as the
    source checkpoint's do."""
    d = _universal_dir(variant, tmp_path)
    src = open_source(d)
    assert isinstance(src, DeepSpeedUniversalSource)
    got = load_state_dict(d)
    want = expected_universal(variant)
    assert {k for k in got if not k.startswith("optim.param_groups.")} == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v), k
    assert tuple(got["model.tied_modules.embed.weight"].shape) == (11, 7)
    orig = load_state_dict(PIPE / _converted(variant))
    for g in (0, 1):
        key = f"optim.param_groups.{g}.params"
        assert got[key] == orig[key], g


def _fsdp2_universal(rank: int, world: int, variant: str, path: Path) -> None:
    """A pipeline run's Universal folder (at ``path``, beside the tag folder it was converted
    from) into FSDP2: bit-exact, the frozen parameter and the buffer from the layer files; then
    DeepSpeed's next losses. The folder records no hyperparameters: the optimizer's own stay."""
    from torch.distributed.fsdp import fully_shard

    model, _ = _model_and_optim()
    fully_shard(model)
    optim = _adamw(model)
    state, flat = _load_into(model, optim, path, partial=True)
    for k, v in expected(_converted(variant)).items():
        t = flat[k]
        full = t.full_tensor() if isinstance(t, DTensor) else t
        assert bit_equal(full, v), (variant, rank, k)
    _resume(model, optim, state, _converted(variant))


def _resave(f: Path, **entries: Any) -> None:
    """Rewrite Universal file ``f`` with ``entries`` changed (as DeepSpeed writes it: a dict)."""
    d = torch.load(f, weights_only=True)
    d.update(entries)
    torch.save(d, f)


def test_pipeline_universal_folder_without_layer_files_is_refused_naming_the_buffer(
    tmp_path: Path,
) -> None:
    """ds_to_universal's output of a pipeline run as it is: the model states name buffer
    3.scale, which only the layer files it does not copy hold. With them copied into the folder
    it loads whole (frozen parameter and buffer bit-exact); with the buffer's layer file gone it
    is refused, naming the folder of layer files."""
    for variant in ("pp2_dp2_zero1_universal", "pp2_tp2_dp2_zero1_universal"):
        folder = PIPE / variant / "step2_universal"
        with pytest.raises(CheckpointFormatError) as e:
            open_source(PIPE / variant)
        assert str(e.value) == (
            f"{folder}: a Universal folder of a pipeline run holds no layer files, so buffer "
            "'3.scale' is in no file (ds_to_universal does not copy the "
            "layer_XX-model_YY-model_states.pt files that hold frozen parameters and buffers): "
            "copy them from the checkpoint it was converted from into this folder, where "
            f"DeepSpeed's PipelineEngine reads them too, or keep that checkpoint's tag folder as "
            f"{PIPE / variant / 'step2'}"
        )
    d = _copy("pp2_dp2_zero1_universal", tmp_path)
    tag = d / "step2_universal"
    for f in (PIPE / "pp2_dp2_zero1" / "step2").glob("layer_*"):
        shutil.copy(f, tag / f.name)
    got, want = load_state_dict(d), expected("pp2_dp2_zero1")
    assert {k for k in got if not k.startswith("optim.param_groups.")} == set(want)
    assert all(bit_equal(got[k], v) for k, v in want.items())
    (tag / "layer_03-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag / 'mp_rank_01_model_states.pt'}: buffer '3.scale' of model-parallel rank 1 is in "
        f"no layer file of {tag}"
    )


def test_layer_files_of_another_run_beside_a_universal_folder_are_not_read(tmp_path: Path) -> None:
    """The tag folder beside step2_universal must be the one it was converted from: the model
    states ds_to_universal copied byte for byte tell (here PP=2 x DP=1's beside PP=2 x DP=2's)."""
    d = _copy("pp2_dp2_zero1_universal", tmp_path)
    shutil.copytree(PIPE / "pp2_dp1_zero1" / "step2", d / "step2")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2'}: not the checkpoint {d / 'step2_universal'} was converted from (its "
        "mp_rank_00_model_states.pt differs from the byte copy ds_to_universal made of it), so "
        "its layer files are not read"
    )


def test_universal_vocabulary_padding_is_stripped_where_the_entry_says_so(tmp_path: Path) -> None:
    """A vocab_tensor still holding its padding rows (12 of them) is read cut to the
    original_vocab_size of 11: the padding row is never read."""
    d = _universal_dir("pp2_tp2_dp2_zero1_universal", tmp_path)
    zero = d / "step2_universal" / "zero" / "tied_modules.embed.weight"
    want = load_state_dict(_universal_dir("pp2_tp2_dp2_zero1_universal", tmp_path / "orig"))
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        t = torch.load(zero / f"{kind}.pt", weights_only=True)["param"]
        _resave(zero / f"{kind}.pt", param=torch.cat([t, torch.full((1, 7), float("nan"))]))
    got = load_state_dict(d)
    assert set(got) == set(want)
    for k, v in want.items():
        assert bit_equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k


def test_damaged_universal_folders_name_the_file_and_what_is_missing(tmp_path: Path) -> None:
    d = _universal_dir("pp2_tp2_dp2_zero1_universal", tmp_path)
    tag = d / "step2_universal"
    zero = tag / "zero"
    # cat_dim disagreeing with universal_checkpoint_info (row-parallel: joined along 1).
    _resave(zero / "1.fc2.weight" / "fp32.pt", cat_dim=0)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{zero / '1.fc2.weight' / 'fp32.pt'}: cat_dim 0, but universal_checkpoint_info joins "
        "'1.fc2.weight' along dimension 1 (parameter_with_row_parallelism_patterns)"
    )
    _resave(zero / "1.fc2.weight" / "fp32.pt", cat_dim=1)
    # A merged tensor of the wrong shape (one slice only).
    t = torch.load(zero / "2.fc1.weight" / "exp_avg.pt", weights_only=True)["param"]
    _resave(zero / "2.fc1.weight" / "exp_avg.pt", param=t[:3].clone())
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{zero / '2.fc1.weight' / 'exp_avg.pt'}: a tensor of shape [3, 7], expected [6, 7]: "
        "param_shapes' [3, 7] of 2 tensor-parallel rank(s) joined as universal_checkpoint_info "
        "says"
    )
    _resave(zero / "2.fc1.weight" / "exp_avg.pt", param=t)
    # A parameter's weight gone.
    (zero / "4.gain" / "fp32.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{zero}: no 4.gain/fp32.pt for parameter '4.gain'"
    # A model-parallel rank's model states gone.
    (tag / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{tag}: model states of model-parallel ranks [0, 2, 3]; expected mp_rank_00..mp_rank_03 "
        "(missing mp_rank_01_model_states.pt)"
    )


def test_a_tag_folder_beside_a_universal_folder_lacking_a_model_states_file_is_not_read(
    tmp_path: Path,
) -> None:
    """The tag folder beside step2_universal without one of the model states files
    ds_to_universal copied from it: not the one it was converted from."""
    d = _copy("pp2_dp2_zero1_universal", tmp_path)
    shutil.copytree(PIPE / "pp2_dp2_zero1" / "step2", d / "step2")
    (d / "step2" / "mp_rank_01_model_states.pt").unlink()
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2'}: not the checkpoint {d / 'step2_universal'} was converted from (it has "
        "no mp_rank_01_model_states.pt), so its layer files are not read"
    )


@pytest.mark.parametrize(
    "degrees, message",
    [
        (
            (2, None),
            "<u>/mp_rank_01_model_states.pt: checkpoint_parallel_dimensions['tp_degree'] is None "
            "(<u>/mp_rank_00_model_states.pt: 2); a Universal folder of 2 model-parallel ranks "
            "needs it to tell stages from tensor-parallel ranks",
        ),
        (
            (3, 3),
            "<u>/mp_rank_00_model_states.pt: 2 model states files (mp_rank_XX) are not a multiple "
            "of tp_degree 3",
        ),
    ],
)
def test_a_universal_folder_whose_tp_degree_is_missing_or_wrong_is_refused(
    tmp_path: Path, degrees: tuple[Any, Any], message: str
) -> None:
    """Model states of a TP=2 Universal folder whose checkpoint_parallel_dimensions lose their
    tp_degree, or give one that does not divide the model-parallel ranks: which file is which
    rank is unknown, refused naming the file."""
    d = _copy("tp2_dp2_zero1_universal", tmp_path)
    u = d / "step2_universal"
    for mp, tp in enumerate(degrees):
        f = u / f"mp_rank_{mp:02d}_model_states.pt"
        dims = torch.load(f, weights_only=True)["checkpoint_parallel_dimensions"]
        _resave(f, checkpoint_parallel_dimensions={**dims, "tp_degree": tp})
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == message.replace("<u>", str(u))
