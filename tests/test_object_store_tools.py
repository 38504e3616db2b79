"""The tools on checkpoints in object storage: ``ucp-dcp`` commands, ``convert`` and ``export_hf`` given URLs.

Checkpoints are saved to ``memory://`` URLs (fsspec's in-memory store, one
unique root per test) and, once, to a real S3 server (moto on loopback, see
``s3_server.py``). fsspec's memory store lives in this process, so the
command line runs in-process through ``main([...])``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import s3_server
from cli_utils import one_error_line, run_cli
from ucp_dcp import RankLocal, UCPSavePlanner, UCPStorageWriter, load_state_dict
from ucp_dcp.errors import StorageError
from ucp_dcp.format import INDEX_FILE
from ucp_dcp.tools.cli import STORAGE_OPTIONS_ENV
from ucp_dcp.tools.checkpoint import Checkpoint
from ucp_dcp.tools.convert import convert

s3_bucket = s3_server.s3_bucket  # the session fixture, made visible to this module


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.w": torch.randn(300, 70, generator=g),
        "model.h": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "model.b": torch.arange(5),
        "step": 7,
        "optim.param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        "loader": RankLocal({"pos": 3}),
    }


@pytest.fixture(autouse=True)
def _no_env_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests set the environment variable themselves when they mean to."""
    monkeypatch.delenv(STORAGE_OPTIONS_ENV, raising=False)


@pytest.fixture
def root() -> Iterator[str]:
    """A fresh ``memory://`` root, removed afterwards (the memory store is shared by the whole process)."""
    url = f"memory://ucp-tools-{uuid.uuid4().hex[:12]}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


@pytest.fixture
def saved(root: str) -> str:
    url = f"{root}/ck"
    dcp.save(_state(), storage_writer=UCPStorageWriter(url), planner=UCPSavePlanner())
    return url


def _assert_same_tensors(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


# ====================================================================== inspect / verify


def test_inspect_url_lists_every_tensor(capsys: pytest.CaptureFixture[str], saved: str) -> None:
    rc, out, err = run_cli(capsys, "inspect", saved)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", saved]
    assert next(x for x in lines if x.startswith("model.w ")).split()[:4] == [
        "model.w", "float32", "[300,70]", "replicated"]
    assert next(x for x in lines if x.startswith("model.h ")).split()[:3] == ["model.h", "bfloat16", "[33,17]"]
    assert "totals: 3 tensors (" in out and "3 values, 1 rank-local value" in out

    rc, out, _ = run_cli(capsys, "inspect", saved, "--json")
    info = json.loads(out)
    assert rc == 0 and info["path"] == saved and info["step"] == 7
    assert [t["name"] for t in info["tensors"]] == ["model.b", "model.h", "model.w"]
    fs = fsspec.filesystem("memory")
    data = [p for p in fs.ls(saved, detail=False) if p.endswith(".safetensors")]
    assert info["files"] == {"count": 1, "bytes": fs.size(data[0])}


def test_verify_url_passes_then_finds_one_flipped_byte(capsys: pytest.CaptureFixture[str], saved: str) -> None:
    rc, out, err = run_cli(capsys, "verify", saved)
    assert rc == 0 and err == "" and out.startswith(f"OK {saved}: 3 tensors, 3 values, 1 rank-local value")

    # Flip one byte inside model.w's data and rewrite the whole object, as a bad upload would.
    with Checkpoint(saved) as ck:
        [(_, loc)] = ck.chunks("model.w")
        obj = ck.source.paths[loc.file]
    fs, path = fsspec.core.url_to_fs(obj)
    raw = bytearray(fs.cat_file(path))
    raw[loc.start + 1000] ^= 0x01
    fs.pipe_file(path, bytes(raw))

    rc, out, err = run_cli(capsys, "verify", saved)
    assert rc == 1
    assert "model.w" in out and obj in out and "mismatch" in out
    assert all("model.h" not in line and "model.b" not in line for line in out.splitlines())
    assert saved in one_error_line(err) and "verify found" in err
    rc, out, _ = run_cli(capsys, "verify", saved, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and any("model.w" in p for p in doc["problems"])


def test_url_with_no_checkpoint_is_one_error_line(capsys: pytest.CaptureFixture[str], root: str,
                                                  tmp_path: Path) -> None:
    missing = f"{root}/nothing-here"
    for argv in (["inspect", missing], ["verify", missing], ["diff", missing, missing],
                 ["export-hf", missing, tmp_path / "hf"], ["convert", missing, tmp_path / "out"]):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == "", argv
        line = one_error_line(err)
        assert line == f"ucp-dcp: error: {missing}: not a checkpoint (nothing is stored at this URL)", argv
    assert not (tmp_path / "hf").exists() and not (tmp_path / "out").exists()


def test_objects_but_no_index_is_a_verify_failure(capsys: pytest.CaptureFixture[str], saved: str) -> None:
    # A save that never committed leaves data objects and no index: something is there, but not a checkpoint.
    fsspec.filesystem("memory").rm_file(f"{saved}/{INDEX_FILE}")
    rc, out, err = run_cli(capsys, "verify", saved)
    assert rc == 1 and INDEX_FILE in out and saved in out
    one_error_line(err)
    rc, out, err = run_cli(capsys, "inspect", saved)
    assert rc == 2 and INDEX_FILE in one_error_line(err) and saved in err


# ====================================================================== --storage-options


def test_storage_options_must_be_a_json_object(capsys: pytest.CaptureFixture[str], saved: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for bad, expected in (("{bad", "not valid JSON"), ("[1, 2]", "expected a JSON object")):
        for argv in (["--storage-options", bad, "inspect", saved], ["inspect", saved, "--storage-options", bad]):
            rc, out, err = run_cli(capsys, *argv)
            assert rc == 2 and out == ""
            line = one_error_line(err)
            assert line.startswith("ucp-dcp: error: --storage-options: ") and expected in line
    # The environment variable is read only when the option is absent.
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, "not json")
    rc, _, err = run_cli(capsys, "inspect", saved)
    assert rc == 2 and f"${STORAGE_OPTIONS_ENV}: not valid JSON" in one_error_line(err)
    rc, out, err = run_cli(capsys, "--storage-options", "{}", "inspect", saved)
    assert rc == 0 and err == "" and "model.w" in out


# ====================================================================== convert / diff / export-hf


def test_convert_url_to_local_dir_is_bit_identical(capsys: pytest.CaptureFixture[str], saved: str,
                                                   tmp_path: Path) -> None:
    out_dir = tmp_path / "local"
    rc, out, err = run_cli(capsys, "convert", saved, out_dir)
    assert rc == 0 and err == "" and f"converted {saved} into" in out
    assert (out_dir / INDEX_FILE).is_file()
    a, b = load_state_dict(saved), load_state_dict(out_dir)
    _assert_same_tensors(a, b)
    assert b["model.h"].dtype == torch.bfloat16 and b["step"] == 7
    rc, out, _ = run_cli(capsys, "diff", saved, out_dir)
    assert rc == 0 and out.startswith("identical: 3 tensors and 4 values compared")
    rc, out, _ = run_cli(capsys, "verify", out_dir)
    assert rc == 0


def test_convert_refuses_a_url_destination(capsys: pytest.CaptureFixture[str], saved: str, root: str) -> None:
    dst = f"{root}/converted"
    with pytest.raises(StorageError, match="writes a local directory"):
        convert(saved, dst)
    rc, out, err = run_cli(capsys, "convert", saved, dst)
    assert rc == 2 and out == "" and dst in one_error_line(err) and "local directory" in err
    assert not fsspec.filesystem("memory").exists(dst)


def test_export_hf_from_url(capsys: pytest.CaptureFixture[str], saved: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    rc, out, err = run_cli(capsys, "export-hf", saved, tmp_path / "hf", "-q")
    assert rc == 0 and f"exported {saved} to" in out
    assert "config.json" in err  # the one warning: weights only
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    want = load_state_dict(saved, keys="model.")
    assert got.keys() == {"w", "h", "b"}
    for k, v in got.items():
        assert torch.equal(v, want[f"model.{k}"]), k


# ====================================================================== a real S3 server


def test_inspect_and_verify_on_s3_with_storage_options(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       s3_bucket: tuple[str, dict[str, Any]]) -> None:
    bucket, options = s3_bucket
    url = f"{bucket}/{uuid.uuid4().hex[:10]}/ck"
    dcp.save(_state(), storage_writer=UCPStorageWriter(url, storage_options=options), planner=UCPSavePlanner())
    opts = json.dumps(options)

    rc, out, err = run_cli(capsys, "--storage-options", opts, "inspect", url)
    assert rc == 0 and err == ""
    assert out.splitlines()[0].split() == ["checkpoint", url]
    assert all(any(line.startswith(f"{n} ") for line in out.splitlines()) for n in ("model.w", "model.h", "model.b"))

    rc, out, err = run_cli(capsys, "verify", url, "--storage-options", opts)
    assert rc == 0 and err == "" and out.startswith(f"OK {url}: 3 tensors")

    # The same options from the environment; a missing prefix in the bucket is the one-line error.
    monkeypatch.setenv(STORAGE_OPTIONS_ENV, opts)
    rc, out, _ = run_cli(capsys, "verify", url, "--json")
    assert rc == 0 and json.loads(out)["ok"] is True
    missing = f"{bucket}/{uuid.uuid4().hex[:10]}/none"
    rc, out, err = run_cli(capsys, "verify", missing)
    assert rc == 2 and out == "" and one_error_line(err) == (
        f"ucp-dcp: error: {missing}: not a checkpoint (nothing is stored at this URL)")
