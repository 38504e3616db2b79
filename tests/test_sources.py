"""Every entry point on every source, bit-exact.

The sources are written by the real writers, with nothing of ucp_dcp:

* ``dcp``: plain ``dcp.save(checkpoint_id=...)`` on 4 ranks, a 2-D (dp, tp)
  mesh, uneven and empty shards, a transposed plain tensor, values;
* ``megatron``: the same, with every rank's local plan attached to the
  ``.metadata`` as Megatron-core's ``torch_dist`` strategy does
  (``all_local_plans``: DCP's ``SavePlan``/``WriteItem``/``TensorWriteData``);
* ``accelerate``: accelerate's FSDP layout, ``pytorch_model_fsdp_0/`` (keys
  ``model.*``) next to ``optimizer_0/`` (keys ``optimizer.*``), opened as
  the parent directory;
* ``hf``: a sharded ``save_pretrained`` directory of a tiny ``transformers``
  Llama (``model.safetensors.index.json`` + several files).

Each is loaded with ``dcp.load`` on 3 ranks into other layouts, and through
``Checkpoint``, ``load_state_dict``, ``load_into_module`` and the CLI
(``inspect``, ``verify``, ``diff``, ``export-hf``, ``convert``).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dist_utils import bit_equal, flatten, nest, run_ranks
from ucp_dcp import (
    Checkpoint,
    CheckpointFormatError,
    UCPLoadPlanner,
    UCPStorageReader,
    load_into_module,
    load_state_dict,
)
from ucp_dcp.errors import NotACheckpointError
from ucp_dcp.sources import CompositeSource, DCPSource, HFSource, NativeSource, formats_looked_for, open_source
from ucp_dcp.sources.distcp import read_dcp_metadata
from ucp_dcp.tools.cli import main as cli_main

SOURCES = ("dcp", "megatron", "accelerate", "hf")


# ---------------------------------------------------------------- the states


def full_state() -> dict[str, torch.Tensor]:
    """The full tensors of the DCP-written sources (same in every process)."""
    g = torch.Generator().manual_seed(11)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "model.embed.weight": r(37, 12),  # uneven over 2 and 3
        "model.proj.weight": r(10, 18),  # sharded on both mesh dims
        "model.tiny": r(1, 6),  # fewer rows than ranks: empty shards
        "model.bf": r(9, 8, dtype=torch.bfloat16),
        "model.wt": r(8, 6).t(),  # a plain tensor DCP stores transposed
        "optimizer.state.proj.weight.exp_avg": r(10, 18),
        "optimizer.state.embed.weight.exp_avg": r(37, 12),
    }


VALUES = {"optimizer.lr": 3e-4, "optimizer.betas": (0.9, 0.95), "step": 12}

# (dp, tp) mesh placements of the 4-rank source; None: a plain tensor on every rank.
SAVE = {
    "model.embed.weight": (Shard(0), Replicate()),
    "model.proj.weight": (Shard(0), Shard(1)),
    "model.tiny": (Shard(0), Replicate()),
    "model.bf": (Replicate(), Shard(0)),
    "model.wt": None,
    "optimizer.state.proj.weight.exp_avg": (Shard(1), Shard(0)),
    "optimizer.state.embed.weight.exp_avg": (Replicate(), Shard(1)),
}
# The 3-rank targets: other dims, so every read is a part of a saved chunk.
LOAD = {
    "model.embed.weight": Shard(1),
    "model.proj.weight": Shard(0),
    "model.tiny": Replicate(),
    "model.bf": Shard(1),
    "model.wt": Shard(0),
    "optimizer.state.proj.weight.exp_avg": Shard(1),
    "optimizer.state.embed.weight.exp_avg": Shard(0),
}


class MegatronStylePlanner(DefaultSavePlanner):
    """Attaches every rank's local plan to the metadata, as Megatron-core's torch_dist strategy does."""

    def create_global_plan(self, all_plans: Any) -> Any:
        global_plan, metadata = super().create_global_plan(all_plans)
        metadata.all_local_plans = all_plans  # DCP's own SavePlan / WriteItem / TensorWriteData records
        return global_plan, metadata


def _save_sources(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = full_state()
    flat: dict[str, Any] = {k: v if SAVE[k] is None else distribute_tensor(v, mesh, list(SAVE[k]))
                            for k, v in full.items()}
    flat.update(VALUES)
    dcp.save(nest(flat), checkpoint_id=os.path.join(root, "dcp"))
    dcp.save(nest(flat), storage_writer=FileSystemWriter(os.path.join(root, "megatron")),
             planner=MegatronStylePlanner())
    # accelerate: the model and the optimizer as two DCP checkpoints side by side.
    model = {k: v for k, v in flat.items() if k.startswith("model.")}
    optim = {k: v for k, v in flat.items() if not k.startswith("model.")}
    dcp.save(nest(model), checkpoint_id=os.path.join(root, "accelerate", "pytorch_model_fsdp_0"))
    dcp.save(nest(optim), checkpoint_id=os.path.join(root, "accelerate", "optimizer_0"))


def tiny_llama() -> Any:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    run_ranks(4, _save_sources, str(root))
    model = tiny_llama()
    model.save_pretrained(root / "hf", max_shard_size="20KB", safe_serialization=True)
    assert (root / "hf" / "model.safetensors.index.json").exists()
    return {name: root / name for name in SOURCES}


def expected(name: str) -> dict[str, torch.Tensor]:
    """Full tensors each source holds, by key."""
    if name == "hf":
        return {k: v.detach().clone() for k, v in tiny_llama().state_dict().items()}
    return full_state()


def expected_values(name: str) -> dict[str, Any]:
    return {} if name == "hf" else VALUES


# ---------------------------------------------------------------- detection and records


def test_open_source_detects_each_format(sources: dict[str, Path]) -> None:
    kinds = {"dcp": DCPSource, "megatron": DCPSource, "accelerate": CompositeSource, "hf": HFSource}
    for name, path in sources.items():
        src = open_source(path)
        try:
            assert type(src) is kinds[name], name
            assert set(src.index.tensors) == set(expected(name)), name
            assert set(src.index.values) == set(expected_values(name)), name
        finally:
            src.close()


def test_megatron_metadata_carries_local_plans(sources: dict[str, Path]) -> None:
    md = read_dcp_metadata(sources["megatron"])
    plans = md.all_local_plans  # type: ignore[attr-defined]
    assert len(plans) == 4 and all(type(p).__name__ == "SavePlan" for p in plans)
    assert {type(i).__name__ for p in plans for i in p.items} == {"WriteItem"}


def test_hostile_metadata_is_refused_before_anything_is_imported(tmp_path: Path, sources: dict[str, Path]) -> None:
    """A .metadata naming any class beyond DCP's metadata and plan records is refused, naming it."""

    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    md = read_dcp_metadata(sources["megatron"])
    md.all_local_plans = [Evil()]  # type: ignore[attr-defined]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(sources["megatron"]):
        if f.endswith(".distcp"):
            os.symlink(sources["megatron"] / f, bad / f)
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(md, f)
    for call in (lambda: open_source(bad), lambda: Checkpoint(bad), lambda: load_state_dict(bad)):
        with pytest.raises(CheckpointFormatError, match=r"refusing to unpickle posix\.system from \.metadata"):
            call()
    assert not (tmp_path / "pwned").exists()


def test_accelerate_keys_that_repeat_across_subfolders_are_an_error(tmp_path: Path, sources: dict[str, Path]) -> None:
    root = tmp_path / "twice"
    root.mkdir()
    os.symlink(sources["dcp"], root / "a")
    os.symlink(sources["megatron"], root / "b")
    with pytest.raises(CheckpointFormatError, match=r"is in both a/ and b/"):
        open_source(root)


def test_not_a_checkpoint_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tmp_path)
    assert str(e.value) == (
        f"{tmp_path} is not a checkpoint: found none of ucp_index.json (ucp_dcp), .metadata (DCP), "
        "latest / *zero_pp_rank_*_optim_states.pt (DeepSpeed), latest_universal / zero/ (DeepSpeed "
        "Universal), model.safetensors / model.safetensors.index.json / one .safetensors file "
        "(Hugging Face), subfolders that are checkpoints (accelerate); it holds notes.txt"
    )
    assert isinstance(e.value, NotACheckpointError) and e.value.path == str(tmp_path)
    assert e.value.formats == tuple(formats_looked_for())



def test_not_a_checkpoint_error_pickles_with_its_path_and_formats(tmp_path: Path) -> None:
    """DCP pickles a rank's failure to gather it: the message, path and formats survive."""
    import pickle

    with pytest.raises(NotACheckpointError) as e:
        open_source(tmp_path)
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is NotACheckpointError and str(back) == str(e.value)
    assert (back.path, back.formats) == (str(tmp_path), tuple(formats_looked_for()))


# ---------------------------------------------------------------- single-process entry points


@pytest.mark.parametrize("name", SOURCES)
def test_load_state_dict_and_checkpoint_bit_exact(sources: dict[str, Path], name: str) -> None:
    got = load_state_dict(sources[name], dcp_values="weights_only")
    want = expected(name)
    assert set(got) == set(want) | set(expected_values(name))
    for k, v in want.items():
        assert bit_equal(got[k], v), k
    for k, v in expected_values(name).items():
        assert got[k] == v and type(got[k]) is type(v), k
    with Checkpoint(sources[name], dcp_values="weights_only") as ck:
        key = sorted(want)[0]
        assert bit_equal(ck.read_tensor(key), want[key])
        assert ck.verify() == []


def test_load_state_dict_reads_only_the_selected_tensors(sources: dict[str, Path]) -> None:
    got = load_state_dict(sources["hf"], "model.layers.1.", prefix="")
    assert got and all(k.startswith("model.layers.1.") for k in got)
    got = load_state_dict(sources["hf"], "model.model.norm.weight", prefix="model.")
    assert list(got) == ["model.model.norm.weight"]


def test_load_into_module_from_dcp_and_hf(sources: dict[str, Path]) -> None:
    target = tiny_llama()
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    load_into_module(target, sources["hf"], prefix="")
    for k, v in expected("hf").items():
        assert bit_equal(target.state_dict()[k], v), k

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(37, 12)
            self.proj = torch.nn.Linear(18, 10, bias=False)

    for name in ("dcp", "megatron", "accelerate"):
        m = Small()
        res = load_into_module(m, sources[name], prefix="model.", strict=False)
        assert bit_equal(m.embed.weight, full_state()["model.embed.weight"]), name
        assert bit_equal(m.proj.weight, full_state()["model.proj.weight"]), name
        assert res.missing_keys == [] and "tiny" in res.unexpected_keys


# ---------------------------------------------------------------- the CLI


@pytest.mark.parametrize("name", SOURCES)
def test_cli_inspect_verify_diff_convert_export(sources: dict[str, Path], tmp_path: Path, name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = str(sources[name])
    assert cli_main(["inspect", path, "--json", "--dcp-values", "weights_only"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == {"hf": "hf", "accelerate": "subfolders"}.get(name, "dcp")
    assert info["checksums"] is False
    assert {t["name"] for t in info["tensors"]} == set(expected(name))
    if name != "hf":
        assert info["step"] == 12

    assert cli_main(["verify", path, "-q"]) == 0
    assert "records no checksums" in capsys.readouterr().out

    converted = tmp_path / "converted"
    assert cli_main(["convert", path, str(converted), "-q"]) == 0
    capsys.readouterr()
    with Checkpoint(converted) as ck:
        assert ck.format == "ucp_dcp" and ck.has_checksums and ck.verify() == []
    got = load_state_dict(converted)
    for k, v in expected(name).items():
        assert bit_equal(got[k], v), k
    for k, v in expected_values(name).items():
        assert got[k] == v, k

    assert cli_main(["diff", path, str(converted), "-q", "--dcp-values", "weights_only"]) == 0
    assert "identical" in capsys.readouterr().out

    prefix = "" if name == "hf" else "model."
    out = tmp_path / "exported"
    assert cli_main(["export-hf", path, str(out), "-q", "--prefix", prefix]) == 0
    err = capsys.readouterr().err
    assert ("needs a config.json" in err) == (name != "hf")
    exported = load_state_dict(out)
    # A Hugging Face source carries its config.json over, so from_pretrained can load the export.
    assert (out / "config.json").exists() == (name == "hf")
    want = {k[len(prefix):]: v for k, v in expected(name).items() if k.startswith(prefix)}
    assert set(exported) == set(want)
    for k, v in want.items():
        assert bit_equal(exported[k], v), k


def test_import_aliases_still_work(sources: dict[str, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["import-dcp", str(sources["dcp"]), str(tmp_path / "a"), "-q"]) == 0
    assert cli_main(["import-hf", str(sources["hf"]), str(tmp_path / "b"), "-q"]) == 0
    capsys.readouterr()
    assert NativeSource.detect(str(tmp_path / "a")) and NativeSource.detect(str(tmp_path / "b"))
    got = load_state_dict(tmp_path / "b", "model.lm_head.weight")
    assert bit_equal(got["model.lm_head.weight"], expected("hf")["lm_head.weight"])


# ---------------------------------------------------------------- dcp.load on 3 ranks


def _load_all_3(rank: int, world: int, paths: dict[str, str]) -> None:
    mesh = init_device_mesh("cpu", (world,))
    for name in ("dcp", "megatron", "accelerate"):
        full = full_state()
        flat: dict[str, Any] = {k: distribute_tensor(torch.full(v.shape, 7, dtype=v.dtype), mesh, [LOAD[k]])
                                for k, v in full.items()}
        flat.update({k: None for k in VALUES})
        sd = nest(flat)
        reader = UCPStorageReader(paths[name], dcp_values="weights_only")
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        got = flatten(sd)
        for k, v in full.items():
            assert isinstance(got[k], DTensor) and bit_equal(got[k].full_tensor(), v), (name, k)
        for k, v in VALUES.items():
            assert got[k] == v, (name, k)
    # The Hugging Face model into FSDP-style row shards, names as get_state_dict gives them.
    want = expected("hf")
    flat = {f"model.{k}": distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in want.items()}
    dcp.load(nest(flat), storage_reader=UCPStorageReader(paths["hf"], prefix="model."), planner=UCPLoadPlanner())
    for k, v in want.items():
        assert bit_equal(flat[f"model.{k}"].full_tensor(), v), k


@pytest.mark.multiproc
def test_dcp_load_every_source_on_3_ranks(sources: dict[str, Path]) -> None:
    run_ranks(3, _load_all_3, {k: str(v) for k, v in sources.items()})


# ---------------------------------------------------------------- Hugging Face directories


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.randn(5, generator=g).bfloat16()}


def test_one_safetensors_file_or_index_of_any_name_is_the_model(tmp_path: Path) -> None:
    """A directory holding one ``*.safetensors`` file not named model.safetensors (an adapter),
    or one ``*.safetensors.index.json`` of another name, is that model: read bit-exact."""
    from safetensors.torch import save_file

    want = _hf_tensors()
    one = tmp_path / "one"
    one.mkdir()
    save_file(want, str(one / "adapter_model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": want["a.weight"]}, str(sharded / "w-1.safetensors"))
    save_file({"b.bias": want["b.bias"]}, str(sharded / "w-2.safetensors"))
    weight_map = {"a.weight": "w-1.safetensors", "b.bias": "w-2.safetensors"}
    (sharded / "weights.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for d in (one, sharded):
        assert isinstance(open_source(d), HFSource)
        got = load_state_dict(d)
        assert set(got) == set(want) and all(bit_equal(got[k], v) for k, v in want.items()), d


def _hf_dir(tmp_path: Path, files: dict[str, dict[str, torch.Tensor]], weight_map: Any) -> Path:
    """A model directory of safetensors ``files`` and a model.safetensors.index.json whose
    weight_map is ``weight_map``."""
    from safetensors.torch import save_file

    d = tmp_path / "hf"
    d.mkdir()
    for name, tensors in files.items():
        save_file(tensors, str(d / name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


@pytest.mark.parametrize(
    "files, weight_map, message",
    [
        ({}, ["a.weight"], '<index>: no "weight_map" object of tensor name -> file name'),
        ({}, {"a.weight": 1}, '<index>: no "weight_map" object of tensor name -> file name'),
        ({}, {}, "<index>: the weight_map is empty"),
        (
            {"w-1.safetensors": {"a": torch.ones(2), "b": torch.ones(1)}, "w-2.safetensors": {"a": torch.ones(2)}},
            {"a": "w-2.safetensors", "b": "w-1.safetensors"},
            "<dir>: tensor 'a' is in both w-2.safetensors and w-1.safetensors",
        ),
        (
            {"w-1.safetensors": {"a": torch.ones(2), "b": torch.ones(1)}, "w-2.safetensors": {"c": torch.ones(1)}},
            {"b": "w-1.safetensors", "a": "w-2.safetensors", "c": "w-2.safetensors"},
            "<dir>: the index puts 'a' in w-2.safetensors, but it is in w-1.safetensors",
        ),
    ],
)
def test_a_bad_hf_index_is_refused_naming_it(
    tmp_path: Path, files: dict[str, dict[str, torch.Tensor]], weight_map: Any, message: str
) -> None:
    """An index whose weight_map is not a map of names to files, is empty, or disagrees with
    the files (a tensor in two of them, or in another than the index says) is refused naming
    the index or the directory and the tensor."""
    d = _hf_dir(tmp_path, files, weight_map)
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    index = d / "model.safetensors.index.json"
    assert str(e.value) == message.replace("<index>", str(index)).replace("<dir>", str(d))


def test_an_hf_file_without_tensors_or_with_a_dtype_torch_lacks_is_refused(tmp_path: Path) -> None:
    """A model.safetensors holding no tensor, and one whose tensor has a dtype code torch has
    no dtype for (complex 64-bit here): refused naming the file (and the tensor)."""
    from safetensors.torch import save_file

    d = tmp_path / "empty"
    d.mkdir()
    save_file({}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == f"{d}: holds no tensors"
    d = tmp_path / "odd"
    d.mkdir()
    header = json.dumps({"z": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(CheckpointFormatError) as e:
        open_source(d)
    assert str(e.value) == (
        f"{d / 'model.safetensors'}: tensor 'z' has dtype 'C64', which torch cannot hold"
    )


def test_hf_check_files_reports_a_file_changed_damaged_or_gone_since_open(tmp_path: Path) -> None:
    """check_files (verify) names each file whose size changed, whose header no longer parses
    or that is gone, instead of raising on the first."""
    from safetensors.torch import save_file

    want = _hf_tensors()
    d = _hf_dir(
        tmp_path,
        {f"w-{i}.safetensors": {k: v} for i, (k, v) in enumerate(want.items())},
        {k: f"w-{i}.safetensors" for i, k in enumerate(want)},
    )
    src = open_source(d)
    assert src.check_files() == []
    grown = d / "w-0.safetensors"
    size = grown.stat().st_size
    with open(grown, "ab") as f:
        f.write(b"\0" * 8)
    (d / "w-1.safetensors").unlink()
    problems = src.check_files()
    assert problems[0] == f"{grown}: {size + 8} bytes on disk, {size} when opened"
    assert problems[1:] == [f"data file {d / 'w-1.safetensors'} is missing"]
    save_file({"b.bias": want["b.bias"]}, str(d / "w-1.safetensors"))
    grown.write_bytes(b"\xff" * 8)
    assert src.check_files()[0].startswith(f"{grown}: ")


def test_hfsource_refuses_a_prefix_that_is_not_a_string(tmp_path: Path) -> None:
    """HFSource built directly (SourceOptions checks its own fields' types): the prefix
    prepended to every name must be a string."""
    from safetensors.torch import save_file

    from ucp_dcp.byteio.location import view_of
    from ucp_dcp.errors import InvalidArgumentTypeError

    save_file(_hf_tensors(), str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidArgumentTypeError) as e:
        HFSource(view_of(tmp_path), prefix=1)  # type: ignore[arg-type]
    assert str(e.value) == f"HFSource({str(tmp_path)!r}): prefix must be a string, got 1"


def test_subfolders_holding_an_unaddressable_item_convert_and_name_missing_keys(tmp_path: Path) -> None:
    """accelerate's layout (DCP checkpoints in subfolders), one item of which has overlapping
    strides: convert reads it whole through its own subfolder's files, with two subfolders
    and with one; a key no subfolder holds is refused naming it."""
    from ucp_dcp.tools.convert import convert

    ov = torch.arange(4.0).as_strided((2, 2), (1, 1))  # DCP keeps the strides: no byte range
    w = torch.arange(6.0).reshape(2, 3)
    for root, parts in (("two", {"model": {"w": w}, "optim": {"ov": ov}}), ("one", {"optim": {"ov": ov}})):
        for sub, state in parts.items():
            dcp.save(state, checkpoint_id=str(tmp_path / root / sub))
        assert isinstance(open_source(tmp_path / root), CompositeSource)
        convert(tmp_path / root, tmp_path / f"{root}_ucp")
        got = load_state_dict(tmp_path / f"{root}_ucp")
        want = {k: v for state in parts.values() for k, v in state.items()}
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items()), root
    with pytest.raises(CheckpointFormatError) as e:
        open_source(tmp_path / "two").value_location("nope")
    assert str(e.value) == f"{tmp_path / 'two'}: no saved tensor or value 'nope'"
