"""Hugging Face export/import with the real client: FSDP2-trained Llama -> transformers and back.

A small Llama (``transformers``, random init from a local config, nothing
downloaded) is trained for a few steps with FSDP2 on 2 CPU ranks and saved
with its AdamW state. ``export_hf`` must give a directory that
``AutoModelForCausalLM.from_pretrained`` loads in a fresh process with the
trained weights exactly (fp32) or rounded to bf16, reading none of the
optimizer's bytes; ``import_hf`` must bring a ``save_pretrained`` directory
back into an FSDP2 model bit for bit.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dist_utils import bit_equal, count_read_bytes, run_ranks
from ucp_dcp import (
    Checkpoint,
    CheckpointFormatError,
    CheckpointKeyError,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    UCPWarning,
    load_into_module,
)
from ucp_dcp.tools import hf
from ucp_dcp.tools.hf import export_hf, import_hf, parse_size

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: models come from local configs
import transformers  # noqa: E402  (after HF_HUB_OFFLINE is set; the test extra installs it)

CONFIG = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    # Untied: lm_head and the embedding are separate trained tensors, so the
    # export must carry both (a tied config would let from_pretrained hide a
    # missing or stale lm_head by copying the embedding).
    tie_word_embeddings=False,
)


def _config() -> Any:
    return transformers.LlamaConfig(**CONFIG)


def _fsdp_llama(world: int, seed: int) -> Any:
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config())
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_weights(model: Any) -> dict[str, torch.Tensor]:
    """Full, unsharded weights (collective; complete on rank 0)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _train_and_save(rank: int, world: int, root: str) -> None:
    model = _fsdp_llama(world, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, CONFIG["vocab_size"], (4, 16), generator=g)[rank::world]
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, storage_writer=UCPStorageWriter(os.path.join(root, "ckpt")), planner=UCPSavePlanner())
    full = _full_weights(model)
    if rank == 0:  # test-only reference: the trained weights, gathered
        torch.save(full, os.path.join(root, "ref.pt"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A universal checkpoint of an FSDP2-trained Llama (model + AdamW), and its full weights."""
    root = tmp_path_factory.mktemp("hf")
    run_ranks(2, _train_and_save, str(root))
    return root


# A fresh interpreter loads each exported directory with from_pretrained and
# runs it next to a plain model holding the reference weights (fp32, and
# rounded through bf16), on the same input with one thread.
_CHECK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(1)
    cfg, ref_path, dirs, out = json.loads(sys.argv[1])
    ref = torch.load(ref_path)
    ids = torch.randint(0, cfg["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))
    result = {"ids": ids}

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits

    for rounding in (None, torch.bfloat16):
        plain = LlamaForCausalLM(LlamaConfig(**cfg))
        weights = ref if rounding is None else {k: v.to(rounding).float() for k, v in ref.items()}
        plain.load_state_dict(weights, strict=True)
        result[f"ref_{rounding}"] = logits(plain)
    for d in dirs:
        model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
        native = AutoModelForCausalLM.from_pretrained(d)
        result[d] = {
            "logits": logits(model),
            "info": {k: sorted(map(str, v)) for k, v in info.items()},
            "weights": {k: v.clone() for k, v in native.state_dict().items()},
            "class": type(model).__name__,
        }
    torch.save(result, out)
    """
)


def _from_pretrained_elsewhere(ref: Path, dirs: list[Path], out: Path) -> dict[str, Any]:
    arg = json.dumps([CONFIG, str(ref), [str(d) for d in dirs], str(out)])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, arg], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.mark.multiproc
def test_export_loads_in_transformers(trained: Path, tmp_path: Path) -> None:
    """FSDP2 checkpoint -> export_hf -> from_pretrained in a fresh process: fp32 exact, bf16 rounded."""
    ref = torch.load(trained / "ref.pt")
    weight_bytes = sum(v.numel() * v.element_size() for v in ref.values())

    # fp32, sharded: several files, as from_pretrained expects them.
    fp32 = tmp_path / "fp32"
    files = export_hf(trained / "ckpt", fp32, max_shard_size="300KB", config=_config())
    index = json.loads((fp32 / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert files == [str(fp32 / s) for s in shards] + [str(fp32 / "model.safetensors.index.json"),
                                                       str(fp32 / "config.json")]
    assert set(index["weight_map"]) == set(ref)  # exactly the weights: no optimizer state, no prefix
    assert index["metadata"]["total_size"] == weight_bytes
    from safetensors import safe_open

    for s in shards:
        with safe_open(str(fp32 / s), framework="pt") as f:
            sizes = [f.get_slice(k).get_shape() for k in f.keys()]
            assert f.metadata() == {"format": "pt"}
        nbytes = sum(4 * torch.Size(sz).numel() for sz in sizes)
        assert nbytes <= 300_000 or len(sizes) == 1  # HF semantics: only a lone tensor may exceed the limit

    # bf16, one file: model.safetensors. Config written by transformers, passed as a directory.
    cfg_dir = tmp_path / "cfg"
    _config().save_pretrained(cfg_dir)
    bf16 = tmp_path / "bf16"
    export_hf(trained / "ckpt", bf16, dtype="bf16", config=cfg_dir)
    assert sorted(os.listdir(bf16)) == ["config.json", "model.safetensors", "model.safetensors.index.json"]

    got = _from_pretrained_elsewhere(trained / "ref.pt", [fp32, bf16], tmp_path / "check.pt")
    for d in (fp32, bf16):
        info = got[str(d)]["info"]
        assert got[str(d)]["class"] == "LlamaForCausalLM"
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # fp32: the trained weights exactly, hence the trained model's logits exactly.
    w32 = got[str(fp32)]["weights"]
    assert set(w32) == set(ref)
    for k, v in ref.items():
        assert bit_equal(w32[k], v), k
    assert torch.equal(got[str(fp32)]["logits"], got["ref_None"])
    # bf16: every weight is the trained one rounded to bf16 (loaded natively as bf16 or upcast).
    w16 = got[str(bf16)]["weights"]
    for k, v in ref.items():
        assert torch.equal(w16[k].float(), v.to(torch.bfloat16).float()), k
    assert torch.equal(got[str(bf16)]["logits"], got[f"ref_{torch.bfloat16}"])
    err = (got[str(bf16)]["logits"] - got["ref_None"]).abs().max().item()
    scale = got["ref_None"].abs().max().item()
    assert 0 < err < 0.05 * scale, (err, scale)  # within bf16 rounding of the weights, and not identical


@pytest.mark.multiproc
def test_export_reads_no_optimizer_bytes(trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """export_hf reads the weights' bytes and nothing of the optimizer state (<= 1.05x the weights)."""
    with Checkpoint(trained / "ckpt") as ck:
        size = {n: ck.tensor_record(n).dtype.itemsize * torch.Size(ck.tensor_record(n).shape).numel()
                for n in ck.tensor_names()}
    weights = sum(v for k, v in size.items() if k.startswith("model."))
    optim = sum(v for k, v in size.items() if k.startswith("optim."))
    assert optim >= 2 * weights  # AdamW moments: reading them would blow the bound below

    opened: list[Checkpoint] = []

    class Recording(Checkpoint):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            opened.append(self)

    counted = count_read_bytes(monkeypatch)

    monkeypatch.setattr(hf, "Checkpoint", Recording)
    export_hf(trained / "ckpt", tmp_path / "out", dtype=torch.bfloat16, max_shard_size=200_000)
    monkeypatch.undo()
    assert len(opened) == 1
    print(f"weights {weights} B, optimizer {optim} B, Checkpoint.bytes_read {opened[0].bytes_read} B, "
          f"all reads {counted['bytes']} B")
    assert weights <= opened[0].bytes_read <= 1.05 * weights, (opened[0].bytes_read, weights)
    # Everything read from storage, data-file headers included.
    assert counted["bytes"] <= 1.05 * weights, (counted["bytes"], weights)


def _load_into_fsdp(rank: int, world: int, ucp: str, hf_dir: str, out: str) -> None:
    model = _fsdp_llama(world, seed=123 + rank)  # different weights everywhere: the load must replace them
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=UCPStorageReader(ucp), planner=UCPLoadPlanner())
    set_model_state_dict(model, state["model"])
    full = _full_weights(model)
    if rank == 0:
        torch.save(full, out)


@pytest.mark.multiproc
def test_import_roundtrip_into_fsdp(tmp_path: Path) -> None:
    """save_pretrained (sharded) -> import_hf -> dcp.load into FSDP2 on 2 ranks: bit-exact."""
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(_config())
    src = tmp_path / "hf"
    model.save_pretrained(src, max_shard_size="300KB")
    assert (src / "model.safetensors.index.json").exists()  # the sharded form, written by transformers
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}

    seen: list[tuple[int, int]] = []
    import_hf(src, tmp_path / "ucp", on_progress=lambda done, total: seen.append((done, total)))
    total = sum(v.numel() * v.element_size() for v in expected.values())
    assert seen and seen[-1] == (total, total) and all(a <= b for (a, _), (b, _) in zip(seen, seen[1:]))
    with Checkpoint(tmp_path / "ucp") as ck:
        assert ck.tensor_names() == sorted(f"model.{k}" for k in expected)

    run_ranks(2, _load_into_fsdp, str(tmp_path / "ucp"), str(src), str(tmp_path / "loaded.pt"))
    loaded = torch.load(tmp_path / "loaded.pt")
    assert set(loaded) == set(expected)
    for k, v in expected.items():
        assert bit_equal(loaded[k], v), k


def test_export_tied_embeddings(tmp_path: Path) -> None:
    """A tied model (one process, no FSDP): both names are exported and from_pretrained ties them again."""
    cfg = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True, "num_hidden_layers": 1})
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    msd = get_model_state_dict(model)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(msd)
    dcp.save({"model": msd}, storage_writer=UCPStorageWriter(tmp_path / "ck"), planner=UCPSavePlanner())
    export_hf(tmp_path / "ck", tmp_path / "hf", config=cfg)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


def test_tied_model_loads_strictly_from_save_pretrained(tmp_path: Path) -> None:
    """save_pretrained writes a tied weight once; strict load_into_module fills both names, from the
    Hugging Face folder and from import_hf's checkpoint, and a tie whose twin is absent stays missing."""
    cfg = transformers.LlamaConfig(**{**CONFIG, "tie_word_embeddings": True, "num_hidden_layers": 1})
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path / "hf")
    with Checkpoint(tmp_path / "hf") as ck:
        assert "lm_head.weight" not in ck.tensor_names()  # one copy on disk, as transformers writes it
    import_hf(tmp_path / "hf", tmp_path / "ucp")
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for path, prefix in ((tmp_path / "hf", ""), (tmp_path / "ucp", "model.")):
        target = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for p in target.parameters():
                p.zero_()
        assert load_into_module(target, path, prefix=prefix) == ([], [])
        assert target.lm_head.weight is target.model.embed_tokens.weight
        got = target.state_dict()
        for k, v in expected.items():
            assert bit_equal(got[k], v), (path, k)
    # Untied, the head is a tensor of its own: the checkpoint does not hold it.
    untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False}))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    with pytest.raises(CheckpointKeyError, match=r"missing keys \['lm_head\.weight'\]"):
        load_into_module(untied, tmp_path / "hf", prefix="")
    assert load_into_module(untied, tmp_path / "hf", prefix="", strict=False).missing_keys == ["lm_head.weight"]


def _write_raw_safetensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file with entries in the given order: unaligned offsets allowed."""
    codes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL",
             torch.float16: "F16", torch.uint8: "U8"}
    header: dict[str, Any] = {}
    pos = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {"dtype": codes[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def test_import_keeps_dtypes_and_odd_offsets(tmp_path: Path) -> None:
    """bf16/fp16/int64/bool, empty and unaligned tensors come back exactly, in one process."""
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: what follows is unaligned
        ("b.f32", torch.randn(7, 3, generator=g)),
        ("c.i64", torch.randint(-(2**40), 2**40, (5,), generator=g)),
        ("d.bool", torch.rand(9, generator=g) > 0.5),
        ("e.f16", torch.randn(2, 2, generator=g).half()),
        ("f.empty", torch.empty(0, 4)),
        ("g.scalar", torch.tensor(3.5)),
    ]
    src = tmp_path / "src"
    src.mkdir()
    _write_raw_safetensors(src / "weights.safetensors", tensors)
    import_hf(src / "weights.safetensors", tmp_path / "ucp", prefix="net.")
    state = {"net": {k: torch.full_like(v, 0) for k, v in tensors}}
    dcp.load(state, storage_reader=UCPStorageReader(tmp_path / "ucp"), planner=UCPLoadPlanner())
    for k, v in tensors:
        assert bit_equal(state["net"][k], v), k


def test_shard_size_parsing() -> None:
    """max_shard_size: ints and HF-style strings (1GB = 10**9), binary units, clear errors."""
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("2GiB") == 2**31
    assert parse_size(1234) == 1234 and parse_size("1.5kb") == 1500 and parse_size(" 10 ") == 10
    for bad in ("5XB", "", "GB", "-1", 0, -5, 1.5, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)


# ---------------------------------------------------------------- bad input


@pytest.fixture()
def small_ckpt(tmp_path: Path) -> Path:
    """A one-process checkpoint of {'model': ..., 'optim': ...} (no process group)."""
    lin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(3, 8)).sum().backward()  # BatchNorm: an int64 buffer (num_batches_tracked)
    opt.step()
    state = {"model": get_model_state_dict(lin), "optim": get_optimizer_state_dict(lin, opt), "step": 1}
    dcp.save(state, storage_writer=UCPStorageWriter(tmp_path / "ck"), planner=UCPSavePlanner())
    return tmp_path / "ck"


def _leftovers(parent: Path) -> list[str]:
    return [n for n in os.listdir(parent) if ".tmp-" in n]


def test_export_rename_and_names(small_ckpt: Path, tmp_path: Path) -> None:
    """rename rules apply in order after the prefix is stripped; int tensors are not cast."""
    out = tmp_path / "out"
    export_hf(small_ckpt, out, rename=[(r"^(\d+)\.", r"layers.\1."), (r"^layers\.2\.", "head.")], dtype="fp16")
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == [
        "head.bias", "head.weight", "layers.0.bias", "layers.0.weight", "layers.1.bias",
        "layers.1.num_batches_tracked", "layers.1.running_mean", "layers.1.running_var", "layers.1.weight",
    ]
    # Floating tensors are cast; the integer buffer keeps its dtype and value.
    assert all(v.dtype == torch.float16 for k, v in got.items() if "num_batches" not in k)
    assert got["layers.1.num_batches_tracked"].dtype == torch.int64
    with Checkpoint(small_ckpt) as ck:
        assert bit_equal(got["head.weight"], ck.read_tensor("model.2.weight").half())
        assert bit_equal(got["layers.1.num_batches_tracked"], ck.read_tensor("model.1.num_batches_tracked"))
    # Any prefix: here the Adam moments, with dots renamed.
    export_hf(small_ckpt, tmp_path / "moments", prefix="optim.state.", rename=[(r"\.", "/")])
    moments = load_file(str(tmp_path / "moments" / "model.safetensors"))
    assert "0/weight/exp_avg" in moments and "2/bias/exp_avg_sq" in moments


def test_export_says_which_values_it_leaves_out(tmp_path: Path) -> None:
    """Non-tensor values under the prefix cannot go into safetensors: the export writes the
    tensors and one library warning names the values left out."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"model": {"w": w, "meta": "v1", "n": 7}, "step": 3}
    dcp.save(state, storage_writer=UCPStorageWriter(tmp_path / "ck"), planner=UCPSavePlanner())
    with pytest.warns(UCPWarning, match=r"2 non-tensor value\(s\) under 'model\.' are not exported "
                                        r"\(safetensors holds tensors only\): 'model\.meta', 'model\.n'$"):
        export_hf(tmp_path / "ck", tmp_path / "out")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert list(got) == ["w"] and bit_equal(got["w"], w)


def test_export_bad_input(small_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-empty dst, missing src, non-checkpoint src, unmatched prefix, name clashes: clear errors, no output."""
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"busy is not empty"):
        export_hf(small_ckpt, busy)
    assert os.listdir(busy) == ["keep.txt"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_hf(small_ckpt, tmp_path / "afile")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        export_hf(tmp_path / "nowhere", tmp_path / "o1")
    with pytest.raises(CheckpointFormatError, match="ucp_index.json"):
        export_hf(busy, tmp_path / "o2")
    with pytest.raises(CheckpointKeyError, match=r"prefix 'module\.'.*'model\.', 'optim\.'"):
        export_hf(small_ckpt, tmp_path / "o3", prefix="module.")
    with pytest.raises(ValueError, match=r"both map to 'bias'"):
        export_hf(small_ckpt, tmp_path / "o4", rename=[(r".*\.", "")])
    with pytest.raises(ValueError, match="not a valid regular expression"):
        export_hf(small_ckpt, tmp_path / "o5", rename=[("(", "")])
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        export_hf(small_ckpt, tmp_path / "o6", dtype="int8")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_hf(small_ckpt, tmp_path / "o7", config=busy)
    # A failure half way leaves neither dst nor a temporary directory behind.
    calls = {"n": 0}
    real = Checkpoint.read_tensor

    def failing(self: Checkpoint, name: str, **kw: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk on fire")
        return real(self, name, **kw)

    monkeypatch.setattr(Checkpoint, "read_tensor", failing)
    with pytest.raises(OSError, match="disk on fire"):
        export_hf(small_ckpt, tmp_path / "o8", max_shard_size=100)
    monkeypatch.undo()
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 9))
    assert _leftovers(tmp_path) == []
    # An empty existing directory is fine.
    (tmp_path / "empty").mkdir()
    export_hf(small_ckpt, tmp_path / "empty")
    assert (tmp_path / "empty" / "model.safetensors").exists()


def test_export_refusals_name_the_argument(small_ckpt: Path, tmp_path: Path) -> None:
    """A dtype safetensors cannot store, malformed rename pairs and replacements, names
    safetensors cannot hold, a checkpoint without tensors, configs that are no JSON object:
    each refused by the library's error naming the tensor, rule or file, with no output."""
    from ucp_dcp.errors import InvalidArgumentError, InvalidArgumentTypeError, PathNotFoundError

    out = tmp_path / "out"
    refusals: list[tuple[Any, type[Exception], str]] = [
        (dict(dtype=torch.int32), InvalidArgumentError,
         r"^dtype must be a floating dtype that safetensors stores, got torch\.int32$"),
        (dict(rename=[("a",)]), InvalidArgumentError,
         r"^rename\[0\] must be a \(regex pattern, replacement\) pair of strings, got \('a',\)$"),
        (dict(rename=[("(weight)", r"\2")]), InvalidArgumentError,
         r"^rename\[0\]: '\\\\2' is not a valid replacement for '\(weight\)' \(invalid group reference 2"),
        (dict(rename=[("^nothing$", "x"), ("^0\\.bias$", r"\g<name>")]), InvalidArgumentError,
         r"^rename\[1\]: '\\\\g<name>' is not a valid replacement for '\^0\\\\.bias\$' \(unknown group name 'name'\)$"),
        (dict(rename=[("^0\\.weight$", "")]), InvalidArgumentError,
         r"^tensor 'model\.0\.weight' gets an empty name after stripping 'model\.' and renaming$"),
        (dict(rename=[("^0\\.weight$", "__metadata__")]), InvalidArgumentError,
         r"^tensor 'model\.0\.weight' would be named '__metadata__', which safetensors reserves$"),
        (dict(prefix=None), InvalidArgumentTypeError, r"^prefix must be a string, got None$"),
        (dict(config=tmp_path / "none.json"), PathNotFoundError, r"none\.json: no such file or directory$"),
        (dict(config=5), InvalidArgumentTypeError, r"^config must be a path .*, got int$"),
    ]
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "list.json").write_text("[1, 2]")
    refusals += [
        (dict(config=tmp_path / "bad.json"), InvalidArgumentError, r"bad\.json is not valid JSON \(Expecting"),
        (dict(config=tmp_path / "list.json"), InvalidArgumentError, r"list\.json is not a JSON object$"),
    ]
    for kw, cls, says in refusals:
        with pytest.raises(cls, match=says):
            export_hf(small_ckpt, out, **kw)
        assert not out.exists() and _leftovers(tmp_path) == [], kw
    # A complex tensor has no safetensors dtype; a checkpoint of values only has no tensor at all.
    state = {"model": {"c": torch.ones(2, dtype=torch.complex64)}, "step": 1}
    dcp.save(state, storage_writer=UCPStorageWriter(tmp_path / "cplx"), planner=UCPSavePlanner())
    with pytest.raises(InvalidArgumentError, match=r"^tensor 'model\.c' has dtype complex64, which safetensors cannot store$"):
        export_hf(tmp_path / "cplx", out)
    dcp.save({"step": 1}, storage_writer=UCPStorageWriter(tmp_path / "bare"), planner=UCPSavePlanner())
    with pytest.raises(CheckpointKeyError, match=r"bare: no tensor name starts with prefix 'model\.'; the checkpoint's "
                                                 r"tensors start with nothing \(it holds no tensors\)$"):
        export_hf(tmp_path / "bare", out)
    with pytest.raises(InvalidArgumentTypeError, match=r"^prefix must be a string, got 5$"):
        import_hf(tmp_path, out, prefix=5)
    assert not out.exists()


def test_export_config_as_a_dict_or_a_file_takes_the_cast_dtype(small_ckpt: Path, tmp_path: Path) -> None:
    """A config given as a dict or as a config.json path is written as it is, except that its
    dtype keys name the dtype the export casts to."""
    doc = {"model_type": "x", "torch_dtype": "float32", "dtype": "float32", "n": 3}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    for config in (doc, tmp_path / "config.json"):
        out = tmp_path / f"out-{type(config).__name__}"
        export_hf(small_ckpt, out, dtype="bf16", config=config)
        assert json.loads((out / "config.json").read_text()) == {**doc, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    assert doc["torch_dtype"] == "float32"  # the caller's dict is not changed


def test_import_bad_input(small_ckpt: Path, tmp_path: Path) -> None:
    """Missing or non-HF src, broken files and indexes, non-empty dst: errors name the file or key."""
    good = tmp_path / "good"
    export_hf(small_ckpt, good, max_shard_size=100)  # several shards + index
    with pytest.raises(FileNotFoundError, match="nowhere"):
        import_hf(tmp_path / "nowhere", tmp_path / "o1")
    with pytest.raises(CheckpointFormatError, match=r"is a ucp_dcp checkpoint, not a Hugging Face model"):
        import_hf(small_ckpt, tmp_path / "o2")
    with pytest.raises(CheckpointFormatError, match=r"not a Hugging Face safetensors model directory"):
        import_hf(tmp_path, tmp_path / "o2")
    with pytest.raises(FileExistsError, match="not empty"):
        import_hf(good, small_ckpt)

    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((good / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    for name in set(index["weight_map"].values()):
        (broken / name).write_bytes((good / name).read_bytes())
    (broken / shard).write_bytes((good / shard).read_bytes()[:-3])  # truncated
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=rf"{shard}: truncated: entries need"):
        import_hf(broken, tmp_path / "o3")
    (broken / shard).unlink()
    with pytest.raises(CheckpointFormatError, match=rf"lists {shard}, which is missing"):
        import_hf(broken, tmp_path / "o4")
    (broken / shard).write_bytes((good / shard).read_bytes())
    index["weight_map"]["extra.weight"] = shard
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match=r"'extra\.weight' in model-00001"):
        import_hf(broken, tmp_path / "o5")
    index["weight_map"]["extra.weight"] = "../escape.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFormatError, match="not a plain file name"):
        import_hf(broken, tmp_path / "o6")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7)) and _leftovers(tmp_path) == []


@pytest.mark.multiproc
def test_cli_export_hf(trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m ucp_dcp export-hf CKPT OUT --dtype bf16`` gives the same files as export_hf."""
    out = tmp_path / "cli"
    proc = subprocess.run([sys.executable, "-m", "ucp_dcp", "export-hf", str(trained / "ckpt"), str(out),
                           "--dtype", "bf16", "--max-shard-size", "300KB", "-q"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    export_hf(trained / "ckpt", tmp_path / "api", dtype=torch.bfloat16, max_shard_size=300_000)
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "api"))
    for name in os.listdir(out):
        assert (out / name).read_bytes() == (tmp_path / "api" / name).read_bytes(), name
    from ucp_dcp.tools.cli import main

    assert main(["export-hf", str(trained / "ckpt"), str(out), "-q"]) == 2  # refuses: not empty
    assert "is not empty" in capsys.readouterr().err
