"""DeepSpeed AutoTP checkpoints, and tensor-parallel partitioning rules supplied by the user.

The fixtures under ``tests/fixtures/deepspeed/autotp/`` were written by
DeepSpeed 0.19.8 (``generate_autotp.py`` there): a tiny Hugging Face Llama
trained under ``"tensor_parallel": {"autotp_size": 2}`` with ZeRO-1 over 2 or
1 data-parallel ranks. AutoTP records its own ``universal_checkpoint_info``;
``reference.safetensors`` holds ``ds_to_universal``'s merged fp32 weights and
Adam moments (``universal/``), the engine's own gathered weights of the sliced
parameters (``consolidated/``) and the batches; ``reference.json`` the losses
of the steps after the save.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal
from ds_fixtures import generator
from safetensors.torch import load_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ucp_dcp.tools.checkpoint as checkpoint_mod
from ucp_dcp import (
    ReadOptions,
    CheckpointFormatError,
    Fused,
    LayoutSpec,
    Replicated,
    Shard,
    UCPLoadPlanner,
    UCPStorageReader,
    VocabPad,
    load_state_dict,
)
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.sources import DeepSpeedSource, SourceOptions, open_source

AUTOTP = Path(__file__).parent / "fixtures" / "deepspeed" / "autotp"
VARIANTS = sorted(p.name for p in AUTOTP.iterdir() if (p / "latest").is_file())


GEN = generator("generate_autotp.py")


def meta(variant: str) -> dict[str, Any]:
    import json

    return json.loads((AUTOTP / variant / "reference.json").read_text())


def expected(variant: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's merged tensors as get_state_dict keys (the tied lm_head: the embedding)."""
    ref = load_file(str(AUTOTP / variant / "reference.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for k, t in ref.items():
        if k.startswith("universal/"):
            _, kind, name = k.split("/", 2)
            if kind == "fp32":
                out[f"model.{name}"] = t
            else:
                out[f"optim.state.{name}.{kind}"] = t
                out[f"optim.state.{name}.step"] = torch.tensor(2.0)
    out["model.lm_head.weight"] = out["model.model.embed_tokens.weight"]
    return out


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    pytest.importorskip("transformers")
    model = GEN.build_model()
    optim = torch.optim.AdamW(GEN.PIPE.param_groups(model), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    return model, optim


@pytest.mark.parametrize("variant", VARIANTS)
def test_autotp_checkpoint_loads_bit_exact_in_one_process(variant: str) -> None:
    """Column-parallel slices joined along 0, o_proj/down_proj along 1, the vocabulary-parallel
    tied embedding along 0, the norms read from tensor-parallel rank 0, by AutoTP's own
    universal_checkpoint_info: weights and moments equal ds_to_universal's, and the sliced
    weights the engine's own gathered ones; the keys are get_state_dict's of the plain Llama."""
    src = open_source(AUTOTP / variant)
    m = meta(variant)
    assert isinstance(src, DeepSpeedSource) and src.world_size == m["tp"] * m["dp"]
    got = load_state_dict(AUTOTP / variant)
    for k, v in expected(variant).items():
        assert bit_equal(got[k], v), k
    ref = load_file(str(AUTOTP / variant / "reference.safetensors"))
    consolidated = {k.split("/", 1)[1]: t for k, t in ref.items() if k.startswith("consolidated/")}
    assert len(consolidated) == 15  # the embedding and 7 linear layers of each of 2 layers
    for name, t in consolidated.items():
        assert bit_equal(got[f"model.{name}"], t), name
    for g, grp in enumerate(m["param_groups"]):
        for hp, v in grp.items():
            want = tuple(v) if isinstance(v, list) else v
            assert got[f"optim.param_groups.{g}.{hp}"] == want, (g, hp)
    model, optim = _model_and_optim()
    msd, osd = get_state_dict(model, optim)
    keys = set(flatten_state_dict({"model": msd, "optim": osd})[0])
    assert set(got) == keys, set(got) ^ keys


def _resume(
    model: torch.nn.Module, optim: torch.optim.Optimizer, state: dict[str, Any], variant: str
) -> None:
    """DeepSpeed's step 3 in plain torch (the mean of the data-parallel ranks' losses, the
    global grad norm clipped to 1.0), then step 4's forward: DeepSpeed's losses."""
    m = meta(variant)
    ref = load_file(str(AUTOTP / variant / "reference.safetensors"))
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def loss(step: int) -> torch.Tensor:
        losses = [GEN.loss_of(model, ref[f"batch/step{step}/dp{d}"]) for d in range(m["dp"])]
        return torch.stack(losses).mean()

    loss3 = loss(3)
    loss3.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), m["gradient_clipping"])
    optim.step()
    with torch.no_grad():
        loss4 = loss(4)
    assert math.isclose(loss3.item(), m["loss_step3"], rel_tol=1e-5), (loss3, m["loss_step3"])
    assert math.isclose(loss4.item(), m["loss_step4"], rel_tol=1e-5), (loss4, m["loss_step4"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_resumed_without_tensor_parallelism_training_matches_deepspeeds_next_steps(
    variant: str,
) -> None:
    model, optim = _model_and_optim()
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(
        state,
        storage_reader=UCPStorageReader(AUTOTP / variant),
        planner=UCPLoadPlanner(),
        no_dist=True,
    )
    _resume(model, optim, state, variant)


def autotp_into_tp3(rank: int, world: int) -> None:
    """Each AutoTP fixture into a TP=3 layout (DTensors: column-parallel weights and the
    embedding split along 0, o_proj/down_proj along 1, the norms and steps replicated; 32 rows
    over 3 ranks are uneven shards), bit-exact. Run on 3 ranks by
    ``test_deepspeed_pipeline.test_every_fixture_loads_on_3_ranks``, whose spawn it shares."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as DShard

    mesh = init_device_mesh("cpu", (world,))
    for variant in VARIANTS:
        want = {k: v for k, v in expected(variant).items() if k != "model.lm_head.weight"}
        state: dict[str, Any] = {}
        for k, v in want.items():
            if v.ndim < 2:
                placement: Any = Replicate()
            else:
                placement = DShard(1 if (".o_proj." in k or ".down_proj." in k) else 0)
            state[k] = distribute_tensor(torch.full_like(v, 13), mesh, [placement])
        reader = UCPStorageReader(AUTOTP / variant)
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        for k, v in want.items():
            assert bit_equal(state[k].full_tensor(), v), (variant, rank, k)


# ---------------------------------------------------------------- rules supplied by the user

# AutoTP's layout of the Llama, as a user would write it (first match decides).
RULES = [
    Shard(r"\.(o_proj|down_proj)\.weight$", dim=1, axis="tp"),
    Shard(r"\.(q|k|v|gate|up)_proj\.weight$", dim=0, axis="tp"),
    VocabPad(r"embed_tokens\.weight$", size=64, axis="tp"),
    Replicated(r"norm\.weight$", axis="tp"),
]


def _resave_model_states(tag: Path, edit: Any) -> None:
    """Rewrite each mp_rank_XX_model_states.pt with ``edit(info)`` as its
    universal_checkpoint_info (None: the key removed)."""
    for f in sorted(tag.glob("mp_rank_*_model_states.pt")):
        d = torch.load(f, weights_only=True)
        info = edit(d.pop("universal_checkpoint_info"))
        if info is not None:
            d["universal_checkpoint_info"] = info
        torch.save(d, f)


def _stripped(tmp_path: Path, edit: Any = lambda info: None) -> Path:
    d = tmp_path / "autotp"
    shutil.copytree(AUTOTP / "autotp2_dp2_zero1", d)
    _resave_model_states(d / "step2", edit)
    return d


def _read_all(src: DeepSpeedSource, monkeypatch: pytest.MonkeyPatch) -> dict[str, torch.Tensor]:
    """Every tensor of ``src``, read through ``Checkpoint`` (its bytes, located by ``src``)."""
    monkeypatch.setattr(ReadOptions, "open_source", lambda *a, **k: src)
    with checkpoint_mod.Checkpoint(src.path) as ck:
        return {n: ck.read_tensor(n) for n in ck.tensor_names()}


def test_user_rules_load_a_checkpoint_without_universal_checkpoint_info(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stripped of its universal_checkpoint_info the checkpoint is refused, naming the
    parameters; with the rules given as a LayoutSpec, as rules, or as their JSON, it reads
    bit-exact to DeepSpeed's merged tensors."""
    d = _stripped(tmp_path)
    states = d / "step2" / "mp_rank_00_model_states.pt"
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{states}: tensor-parallel checkpoint without partitioning rules: "
        "universal_checkpoint_info is missing, so it is unknown which dimension each of "
        "model.embed_tokens.weight, model.layers.0.input_layernorm.weight, "
        "model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, "
        "model.layers.0.mlp.up_proj.weight, model.layers.0.post_attention_layernorm.weight ... (14 more) "
        "is split along (or whether it is replicated)"
    )
    want = expected("autotp2_dp2_zero1")
    for given in (
        LayoutSpec(RULES, axes={"tp": (0, 3)}),  # a spec of the new layout: its axes are unused
        RULES,
        [r.to_json() for r in RULES],
    ):
        got = _read_all(DeepSpeedSource.open(str(d), SourceOptions(tp_rules=given)), monkeypatch)
        assert set(got) == {k for k in want} | {
            k for k in got if k.startswith("optim.state.") and k.endswith(".step")
        }
        for k, v in want.items():
            assert bit_equal(got[k], v), k


def test_dcp_load_takes_the_rules_through_the_storage_reader(tmp_path: Path) -> None:
    """``UCPStorageReader(tp_rules=...)`` and ``load_state_dict(tp_rules=...)`` hand the rules to
    the DeepSpeed source: the stripped checkpoint loads every weight and moment bit-exact."""
    d = _stripped(tmp_path)
    want = expected("autotp2_dp2_zero1")
    sd = {k: torch.full_like(v, 13) for k, v in want.items()}
    reader = UCPStorageReader(str(d), options=ReadOptions(tp_rules=RULES))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    assert [k for k, v in want.items() if not bit_equal(sd[k], v)] == []
    # The hand-off reads it alike (Checkpoint passes the rules on).
    full = load_state_dict(d, options=ReadOptions(tp_rules=RULES))
    assert [k for k, v in want.items() if not bit_equal(full[k], v)] == []


def test_user_rules_override_wrong_patterns_of_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint whose patterns lost the row-parallel ones would join o_proj/down_proj
    along 0 (a (64, 16) o_proj); one Shard rule restores them, the checkpoint's other patterns
    still place the rest."""

    def no_rows(info: dict[str, Any]) -> dict[str, Any]:
        # Without its affine map too (as DeepSpeed wrote it before 0.18): the map decides first.
        info = {k: v for k, v in info.items() if k != "affine_map"}
        return {**info, "parameter_with_row_parallelism_patterns": []}

    # With the map, as ds_to_universal: the map places o_proj whatever the patterns say.
    d = _stripped(tmp_path / "map", lambda i: {**i, "parameter_with_row_parallelism_patterns": []})
    assert open_source(d).index.tensors["model.model.layers.0.self_attn.o_proj.weight"].shape == (
        32,
        32,
    )
    d = _stripped(tmp_path, no_rows)
    assert open_source(d).index.tensors["model.model.layers.0.self_attn.o_proj.weight"].shape == (
        64,
        16,
    )
    rules = [Shard(r"\.(o_proj|down_proj)\.weight$", dim=1)]
    got = _read_all(DeepSpeedSource.open(str(d), SourceOptions(tp_rules=rules)), monkeypatch)
    for k, v in expected("autotp2_dp2_zero1").items():
        assert bit_equal(got[k], v), k


def test_missing_and_wrong_user_rules_are_refused_naming_the_parameter(tmp_path: Path) -> None:
    d = _stripped(tmp_path)
    states = d / "step2" / "mp_rank_00_model_states.pt"
    # The norms have no rule.
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules=RULES[:3]))
    assert str(e.value) == (
        f"{states}: tensor-parallel checkpoint without partitioning rules: "
        "universal_checkpoint_info is missing and tp_rules match none of "
        "model.layers.0.input_layernorm.weight, model.layers.0.post_attention_layernorm.weight, "
        "model.layers.1.input_layernorm.weight, model.layers.1.post_attention_layernorm.weight, "
        "model.norm.weight, so it is unknown which dimension each of them is split along (or "
        "whether it is replicated)"
    )
    # A dimension the parameter does not have.
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules=[Shard(r"\.o_proj\.", dim=2), *RULES]))
    assert str(e.value) == (
        f"{states}: 'model.layers.0.self_attn.o_proj.weight' of shape (32, 16) cannot be joined "
        "along dimension 2 (tp_rules' Shard('\\\\.o_proj\\\\.', dim=2))"
    )
    # More vocabulary rows than the slices hold.
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules=[VocabPad(r"embed_tokens", size=65), *RULES]))
    assert str(e.value) == (
        f"{states}: 'model.embed_tokens.weight': tp_rules' VocabPad('embed_tokens', size=65) "
        "keeps 65 rows, but its 2 slices of 32 rows join to 64"
    )
    # A rule for no parameter (a typo), a fused layout, something that is not a rule.
    with pytest.raises(InvalidArgumentError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules=[*RULES, Replicated(r"layernorm\.bias")]))
    assert str(e.value) == (
        f"tp_rules: no parameter of {d / 'step2'} matches Replicated('layernorm\\\\.bias')"
    )
    # A fused layout whose parts do not fit the slices.
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(
            str(d), SourceOptions(tp_rules=[Fused(r"gate_proj", dim=0, parts={"a": 30, "b": 20}), *RULES])
        )
    assert str(e.value) == (
        f"{states}: 'model.layers.0.mlp.gate_proj.weight': tp_rules' Fused('gate_proj', "
        "parts={'a': 30, 'b': 20}) has parts of widths [30, 20] adding up to 50, but its 2 "
        "slices of 24 along dimension 0 join to 48"
    )
    with pytest.raises(InvalidArgumentError) as e:
        DeepSpeedSource.open(
            str(d), SourceOptions(tp_rules=[{"rule": "VocabPad", "pattern": "embed", "dim": 1, "size": 64}])
        )
    assert str(e.value) == (
        "tp_rules: VocabPad('embed', dim=1, size=64): vocabulary padding is cut along dimension "
        "0 only, to a positive size"
    )
    with pytest.raises(InvalidArgumentError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules="Shard"))
    assert str(e.value) == (
        "tp_rules: expected a LayoutSpec or a list of layout rules (Shard, VocabPad, "
        "Replicated, Averaged, Fused), got str"
    )


def test_parameters_autotp_could_not_describe_are_refused_unless_a_rule_places_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AutoTP lists the parameters it cannot describe in
    autotp_unsupported_parameter_patterns (pattern -> reason): refused by name, read once a
    user rule places them."""
    reason = "layer type LlamaRMSNorm has no tensor-parallel metadata"

    def unsupported(info: dict[str, Any]) -> dict[str, Any]:
        return {**info, "autotp_unsupported_parameter_patterns": {r"^model\.norm\.weight$": reason}}

    d = _stripped(tmp_path, unsupported)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: "
        "universal_checkpoint_info['autotp_unsupported_parameter_patterns'] says AutoTP cannot "
        f"describe the split of model.norm.weight ({reason}): give tp_rules for them"
    )
    src = DeepSpeedSource.open(str(d), SourceOptions(tp_rules=[Replicated(r"^model\.norm\.")]))
    got = _read_all(src, monkeypatch)
    for k, v in expected("autotp2_dp2_zero1").items():
        assert bit_equal(got[k], v), k


_EMBED = r"^model\.embed_tokens\.weight$"
_AMAP = "universal_checkpoint_info['affine_map']"


def _amap(edit: Any) -> Any:
    """An edit of universal_checkpoint_info applying ``edit`` to (a copy of) its affine map."""
    import copy

    def apply(info: dict[str, Any]) -> dict[str, Any]:
        info = copy.deepcopy(info)
        out = edit(info["affine_map"])
        return {**info, "affine_map": info["affine_map"] if out is None else out}

    return apply


def _piece(rank: int, **fields: Any) -> Any:
    """An affine-map edit setting ``fields`` of the embedding's one piece on ``rank``."""
    return _amap(lambda m: m["params"][_EMBED]["ranks"][rank]["pieces"][0].update(fields))


def _shard(m: dict[str, Any]) -> None:
    r0 = m["params"][_EMBED]["ranks"][0]
    r0["shard_shape"] = [31, 32]
    r0["pieces"][0]["shape"] = [31, 32]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_amap(lambda m: ["v1"]), f"{_AMAP} has keys ['v1']; expected version and params"),
        (
            _amap(lambda m: {**m, "dtype": "fp32"}),
            f"{_AMAP} has keys ['dtype', 'params', 'version']; expected version and params",
        ),
        (_amap(lambda m: {**m, "version": 2}), f"{_AMAP}: format version 2; this reader knows (1,)"),
        (
            _piece(0, stride=[32, 1]),
            f"{_AMAP}['^model\\\\.embed_tokens\\\\.weight$']: a piece has keys "
            "['dest', 'locations', 'shape', 'source', 'stride']",
        ),
        (
            _piece(1, scale=0.5),
            f"{_AMAP}['^model\\\\.embed_tokens\\\\.weight$']: a piece on rank 1 is scaled by 0.5: "
            "the merged tensor is no byte range of the slices (and DeepSpeed refuses its "
            "optimizer moments)",
        ),
        (
            _amap(lambda m: m["params"][_EMBED].pop("logical_shape") and None),
            f"{_AMAP}['^model\\\\.embed_tokens\\\\.weight$'] is not an affine map entry "
            "(KeyError('logical_shape'))",
        ),
        (
            _amap(lambda m: m["params"][_EMBED]["ranks"].pop(1) and None),
            f"{_AMAP} for 'model.embed_tokens.weight' has no tensor-parallel rank 1",
        ),
        (
            _amap(_shard),
            f"{_AMAP} gives tensor-parallel rank 0's slice of 'model.embed_tokens.weight' the "
            "shape [31, 32], but it holds [32, 32]",
        ),
        (
            _piece(0, dest=[32, [32, 1]]),
            f"{_AMAP}: a piece of 'model.embed_tokens.weight' on rank 0 lies outside its slice "
            "[32, 32] or the merged shape [64, 32]",
        ),
    ],
)
def test_a_malformed_affine_map_is_refused_naming_the_entry(
    tmp_path: Path, edit: Any, message: str
) -> None:
    """An affine map this reader cannot place in place (an unknown key or version, a scaled
    piece, a piece outside its tensors, a rank without an entry) is refused naming the model
    states file and the entry."""
    d = _stripped(tmp_path, edit)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: {message}"


@pytest.mark.parametrize(
    "at",
    [
        "row 0",  # not [offset, strides]
        [0.5, [32, 1]],  # an offset not an integer
        [0, [1, 32]],  # column-major: a strided piece
    ],
)
def test_an_affine_piece_that_is_no_box_is_refused(tmp_path: Path, at: Any) -> None:
    """A piece whose source is not a row-major box of the merged tensor is not read in place."""
    d = _stripped(tmp_path, _piece(0, source=at))
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: {_AMAP}['^model\\\\.embed_tokens\\\\."
        "weight$']: a piece on rank 0 is not a box of the slice and of the merged tensor "
        "(strided pieces are not read in place): "
        f"{ {'shape': [32, 32], 'source': at, 'dest': [0, [32, 1]], 'locations': [0]}!r}"
    )


@pytest.mark.parametrize(
    "rule, message",
    [
        (42, "42 is not a layout rule (Shard, VocabPad, Replicated, Averaged, Fused) or its JSON"),
        (
            {"rule": "Mirror", "pattern": "x"},
            "Mirror('x') is not a tensor-parallel partitioning rule: expected one of Shard, "
            "VocabPad, Replicated, Averaged, Fused",
        ),
        (
            {"rule": "Shard", "pattern": "proj("},
            "Shard('proj('): missing ), unterminated subpattern at position 4",
        ),
        (
            {"rule": "Shard", "pattern": "proj", "dim": "1"},
            "Shard('proj', dim='1'): dim and size must be integers",
        ),
        (
            {"rule": "Fused", "pattern": "proj", "parts": [8]},
            "Fused('proj', parts=[8]): parts must be [name, width] pairs",
        ),
        (
            {"rule": "Fused", "pattern": "proj", "parts": [["a", 0]]},
            "Fused('proj', parts=[['a', 0]]): parts need positive widths",
        ),
        (
            {"rule": "Fused", "pattern": "proj", "parts": [["a", 8]], "groups": -1},
            "Fused('proj', parts=[['a', 8]], groups=-1): groups must be a positive integer",
        ),
    ],
)
def test_a_malformed_user_rule_is_refused_naming_it(rule: Any, message: str) -> None:
    """A rule given as JSON that is not one this reader places is refused before anything is
    read, written as the rule."""
    with pytest.raises(InvalidArgumentError) as e:
        DeepSpeedSource.open(str(AUTOTP / "autotp2_dp2_zero1"), SourceOptions(tp_rules=[rule]))
    assert str(e.value) == f"tp_rules: {message}"


def test_fused_parts_that_do_not_split_over_the_ranks_are_refused(tmp_path: Path) -> None:
    d = _stripped(tmp_path)
    rules = [Fused(r"gate_proj", dim=0, parts={"a": 25, "b": 23}), *RULES]
    with pytest.raises(CheckpointFormatError) as e:
        DeepSpeedSource.open(str(d), SourceOptions(tp_rules=rules))
    assert str(e.value) == (
        f"{d / 'step2' / 'mp_rank_00_model_states.pt'}: 'model.layers.0.mlp.gate_proj.weight': "
        "tp_rules' Fused('gate_proj', parts={'a': 25, 'b': 23}) has parts of widths [25, 23], "
        "which do not split evenly over 2 tensor-parallel ranks"
    )
