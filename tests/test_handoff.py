"""Single-process hand-off: load_state_dict, load_into_module, Checkpoint.verify."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any


import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from dist_utils import bit_equal, count_read_bytes, run_ranks
from layouts import build, full_reference, train_step
from ucp_dcp import (
    Checkpoint,
    CheckpointKeyError,
    UCPSavePlanner,
    UCPStorageWriter,
    load_into_module,
    load_state_dict,
)
from ucp_dcp.errors import InvalidArgumentTypeError, ShapeMismatchError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256))


@pytest.fixture()
def trained(tmp_path: Path) -> tuple[Path, nn.Module]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1, "ids": torch.arange(5)}, storage_writer=UCPStorageWriter(tmp_path / "ck"),
             planner=UCPSavePlanner())
    return tmp_path / "ck", model


def test_model_weights_read_only_their_bytes(trained: tuple[Path, nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the weights of a model+AdamW checkpoint reads <= 1.05x the weights' bytes (headers included)."""
    path, model = trained
    counted = count_read_bytes(monkeypatch)

    weights = load_state_dict(path, "model.")
    monkeypatch.undo()
    want = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    assert set(weights) == {f"model.{k}" for k in model.state_dict()}
    for k, v in model.state_dict().items():
        assert bit_equal(weights[f"model.{k}"], v)
    assert counted["bytes"] <= 1.05 * want, (counted["bytes"], want)


def test_selection_and_dtype(trained: tuple[Path, nn.Module]) -> None:
    """Keys by name, prefix or predicate; dtype casts floating tensors only; unmatched keys are named."""
    path, model = trained
    got = load_state_dict(path, ["step", "model.0.bias"], dtype=torch.bfloat16)
    assert set(got) == {"step", "model.0.bias"} and got["step"] == 1
    assert bit_equal(got["model.0.bias"], model.state_dict()["0.bias"].to(torch.bfloat16))
    ids = load_state_dict(path, lambda k: k in ("ids", "model.2.bias"), dtype=torch.bfloat16)
    assert ids["ids"].dtype == torch.int64 and torch.equal(ids["ids"], torch.arange(5))
    assert ids["model.2.bias"].dtype == torch.bfloat16
    with pytest.raises(CheckpointKeyError, match=r"no key matches \['model\.9'\]"):
        load_state_dict(path, ["model.0.weight", "model.9"])


def test_load_into_module_strict_and_cast(trained: tuple[Path, nn.Module]) -> None:
    """In place, with casts; strictness lists keys; shape mismatches name both shapes."""
    path, model = trained
    target = _model().to(torch.bfloat16)
    ptr = target[0].weight.data_ptr()
    assert load_into_module(target, path) == ([], [])
    assert target[0].weight.data_ptr() == ptr  # filled in place
    for (k, a), b in zip(model.state_dict().items(), target.state_dict().values()):
        assert bit_equal(a.to(torch.bfloat16), b), k
    bigger = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 256), nn.Linear(256, 2))
    with pytest.raises(CheckpointKeyError, match=r"missing keys \['3\.bias', '3\.weight'\]"):
        load_into_module(bigger, path)
    assert load_into_module(bigger, path, strict=False).missing_keys == ["3.bias", "3.weight"]
    wrong = nn.Sequential(nn.Linear(256, 500), nn.LayerNorm(500), nn.Linear(500, 256))
    with pytest.raises(CheckpointKeyError, match=r"size mismatch for 'model\.0\.weight': the checkpoint has shape \[512, 256\], the module expects \[500, 256\]"):
        load_into_module(wrong, path)


def test_verify_finds_a_flipped_byte(trained: tuple[Path, nn.Module]) -> None:
    """verify() is clean on a good checkpoint and names tensor and file after one flipped byte."""
    path, _ = trained
    with Checkpoint(path) as ck:
        assert ck.verify() == []
        (box, loc), = ck.chunks("model.2.weight")
        name = ck.index.files[loc.file].name
    with open(path / name, "r+b") as f:
        f.seek(loc.start + 1000)
        b = f.read(1)
        f.seek(loc.start + 1000)
        f.write(bytes([b[0] ^ 0x10]))
    with Checkpoint(path) as ck:
        problems = ck.verify()
    assert len(problems) == 1 and "tensor 'model.2.weight'" in problems[0] and name in problems[0], problems


def test_checkpoint_names_the_missing_name_and_the_wrong_shape(trained: tuple[Path, nn.Module]) -> None:
    """A tensor or value not in the checkpoint is named with the closest names, if any; read_into a
    tensor of another shape names both shapes."""
    path, _ = trained
    with Checkpoint(path) as ck:
        with pytest.raises(CheckpointKeyError, match=rf"^{re.escape(str(path))}: no tensor named 'model\.0\.weigth'; "
                                                     r"did you mean 'model\.0\.weight'"):
            ck.read_tensor("model.0.weigth")
        with pytest.raises(CheckpointKeyError, match=r": no value named 'stpe'; did you mean 'step'\?$"):
            ck.read_value("stpe")
        with pytest.raises(CheckpointKeyError, match=r": no rank-local value named 'zzz'$"):
            ck.read_rank_local("zzz")
        out = torch.zeros(5)
        with pytest.raises(ShapeMismatchError, match=r"^size mismatch for 'model\.0\.bias': the checkpoint has shape \[512\], "
                                                     r"the target has \[5\]$"):
            ck.read_into("model.0.bias", out)
        assert not out.any()


def _save_fsdp(rank: int, world: int, path: str) -> None:
    model, optim = build("dp2")
    train_step(model, optim, 0)
    msd, osd = get_state_dict(model, optim)
    ref = full_reference({"model": msd})
    dcp.save({"model": msd, "optim": osd}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    if rank == 0:
        torch.save(ref, os.path.join(os.path.dirname(path), "ref.pt"))
    dist.barrier()
    # The sharded model itself is not a load_into_module target: its first DTensor is named.
    first = next(iter(model.state_dict()))
    with pytest.raises(InvalidArgumentTypeError, match=rf"^'{re.escape(first)}' is a DTensor: use dcp\.load with "
                                                         r"UCPStorageReader/UCPLoadPlanner for sharded modules$"):
        load_into_module(model, path, prefix="model.")


@pytest.mark.multiproc
def test_fsdp_checkpoint_to_one_process(tmp_path: Path) -> None:
    """An FSDP2 checkpoint from 2 ranks loads as full tensors into one process, bit-exact."""
    run_ranks(2, _save_fsdp, str(tmp_path / "ck"))
    ref = torch.load(tmp_path / "ref.pt")
    got = load_state_dict(tmp_path / "ck", "model")
    assert set(got) == set(ref)
    for k in ref:
        assert bit_equal(got[k], ref[k]), k


# ------------------------------------------------------------ arguments of the wrong kind
def _misuses(path: str) -> dict[str, Any]:
    """Each call with one argument of the wrong kind, and the words its error must hold."""
    from ucp_dcp import convert
    from ucp_dcp.tools.hf import export_hf, import_hf

    ck = Checkpoint(path)
    w = torch.zeros(4, 6)
    return {
        "Checkpoint(None)": (lambda: Checkpoint(None), "Checkpoint: path must be a path or URL"),
        "Checkpoint(options=1)": (lambda: Checkpoint(path, options=1), "options must be a ReadOptions"),
        "read_tensor(123)": (lambda: ck.read_tensor(123), "a tensor name must be a string"),
        "read_tensor(dtype='x')": (lambda: ck.read_tensor("w", dtype="x"), "dtype must be a torch.dtype"),
        "read_tensor(device='bogus')": (lambda: ck.read_tensor("w", device="bogus"), "cannot place tensors on 'bogus'"),
        "read_into(list)": (lambda: ck.read_into("w", [0.0]), "out must be a torch.Tensor"),
        "read_into(expanded)": (lambda: ck.read_into("w", w[:1].expand(4, 6)), "expanded or overlapping view"),
        "load_state_dict(keys=123)": (lambda: load_state_dict(path, 123), "keys must be None, a name"),
        "load_state_dict(keys=[None])": (lambda: load_state_dict(path, [None]), "keys must be None, a name"),
        "load_into_module(None)": (lambda: load_into_module(None, path), "module must be a torch.nn.Module"),
        "load_into_module(prefix=None)": (
            lambda: load_into_module(nn.Linear(6, 4), path, prefix=None),
            "prefix must be a string",
        ),
        "convert(dst=None)": (lambda: convert(path, None), "convert: dst must be a path or URL"),
        "export_hf(rename=5)": (lambda: export_hf(path, f"{path}-hf", rename=5), "rename must be"),
        "export_hf(layout=5)": (lambda: export_hf(path, f"{path}-hf", layout=5), "layout must be a LayoutSpec"),
        "export_hf(config=object)": (
            lambda: export_hf(path, f"{path}-hf", config={"a": object()}),
            "config is not a JSON document",
        ),
        "export_hf(dst under a file)": (
            lambda: export_hf(path, os.path.join(path, "ucp_index.json", "hf"), prefix=""),
            "cannot make a directory there",
        ),
        "import_hf(dst=s3://)": (
            lambda: import_hf(f"{path}-hf-src", "s3://bucket/run/init"),
            "import_hf writes a local directory, not object storage",
        ),
    }


def test_arguments_of_the_wrong_kind_are_named(tmp_path: Path) -> None:
    """Every single-process entry point refuses an argument of the wrong kind with the library's
    error naming it, not Python's TypeError or AttributeError from deep inside."""
    from ucp_dcp import UCPError

    path = str(tmp_path / "ck")
    w = torch.arange(24.0).reshape(4, 6)
    dcp.save({"w": w}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    for what, (call, says) in _misuses(path).items():
        with pytest.raises(UCPError, match=re.escape(says)):
            call()
        assert not os.path.exists("None") and not os.path.exists("s3:"), what  # made nothing
        assert not os.path.exists(f"{path}-hf"), what
    # A dtype's name is taken as export_hf takes it.
    assert load_state_dict(path, "w", dtype="bf16")["w"].dtype == torch.bfloat16
    with Checkpoint(path) as ck:
        assert bit_equal(ck.read_tensor("w", dtype="fp64"), w.double())
