"""The ``ucp-dcp`` command line and the inspection/diff functions behind it.

Commands run in-process through ``main([...])``; a few run as real
subprocesses of the installed entry point and of ``python -m``, to check
the installed script, exit codes and that errors print one line, no traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from cli_utils import one_error_line, run_cli
from ucp_dcp import CheckpointFormatError, RankLocal, UCPSavePlanner, UCPStorageWriter
from ucp_dcp.errors import InvalidArgumentError
from ucp_dcp.tools.checkpoint import Checkpoint
from ucp_dcp.tools.cli import parse_size
from ucp_dcp.format import INDEX_FILE, ChunkRecord, Layout, Location, TensorRecord
from ucp_dcp.tools.inspection import compare_tensors, describe_sharding, diff_checkpoints, inspect_checkpoint
from ucp_dcp.byteio.progress import ProgressBar, format_bytes
from ucp_dcp.core.sharding import Box


def _state(**overrides: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    sd: dict[str, Any] = {
        "model.w": torch.randn(300, 70, generator=g),
        "model.b": torch.arange(5),
        "nan_t": torch.tensor([1.0, float("nan"), 3.0]),
        "step": 7,
        "optim.param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}],
        "loader": RankLocal({"pos": 3}),
    }
    sd.update(overrides)
    return {k: v for k, v in sd.items() if v is not None}


def _save(path: Path, sd: dict[str, Any]) -> Path:
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save(tmp_path_factory.mktemp("good") / "ckpt", _state())


@pytest.fixture
def copy(good: Path, tmp_path: Path) -> Path:
    """A private copy of the good checkpoint, free to damage."""
    return Path(shutil.copytree(good, tmp_path / "copy"))


def _flip_byte(ckpt: Path, loc: Location, at: int = 0) -> str:
    """Flip one byte inside ``loc``; return the data file's name."""
    name = json.loads((ckpt / INDEX_FILE).read_text())["files"][loc.file]["name"]
    with open(ckpt / name, "r+b") as f:
        f.seek(loc.start + at)
        b = f.read(1)
        f.seek(loc.start + at)
        f.write(bytes([b[0] ^ 0xFF]))
    return name


# ====================================================================== inspect


def test_inspect_prints_aligned_table_and_totals(capsys: pytest.CaptureFixture[str], good: Path) -> None:
    rc, out, err = run_cli(capsys, "inspect", good)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert any(line.split() == ["step", "7", "('step')"] for line in lines)
    assert any(line.split() == ["world", "size", "1"] for line in lines)
    header = next(line for line in lines if line.startswith("name "))
    row = next(line for line in lines if line.startswith("model.w "))
    assert row.split()[:4] == ["model.w", "float32", "[300,70]", "replicated"]
    for column in ("dtype", "shape", "sharding"):  # every column starts where its header does
        start = header.index(column)
        assert row[start] != " " and row[start - 1] == " ", column
    assert header.rstrip().endswith("size") and row.endswith(format_bytes(300 * 70 * 4))
    assert "totals: 3 tensors (" in out and "3 values, 1 rank-local value" in out


def test_inspect_json_is_machine_readable(capsys: pytest.CaptureFixture[str], good: Path) -> None:
    rc, out, _ = run_cli(capsys, "inspect", good, "--json")
    assert rc == 0
    info = json.loads(out)  # stdout holds nothing but the JSON document
    assert info["format_version"] == 1 and info["world_size"] == 1
    assert (info["step"], info["step_key"]) == (7, "step")
    assert info["files"]["count"] == 1 and info["files"]["bytes"] == sum(
        f.stat().st_size for f in good.glob("*.safetensors"))
    w = next(t for t in info["tensors"] if t["name"] == "model.w")
    assert w == {"name": "model.w", "dtype": "float32", "shape": [300, 70], "sharding": "replicated",
                 "bytes": 300 * 70 * 4}
    assert info["totals"] == {"tensors": 3, "tensor_bytes": 300 * 70 * 4 + 5 * 8 + 3 * 4, "values": 3,
                              "rank_local": 1}
    assert info["values"] == ["optim.param_groups.0.betas", "optim.param_groups.0.lr", "step"]
    assert info["rank_local"] == ["loader"]


def test_step_found_under_a_nested_key_only_without_top_level_step(tmp_path: Path) -> None:
    nested = _save(tmp_path / "a", {"x": torch.ones(2), "trainer.step": 11, "trainer.sched.step": 3})
    assert (inspect_checkpoint(nested)["step"], inspect_checkpoint(nested)["step_key"]) == (11, "trainer.step")
    tensor_step = _save(tmp_path / "b", {"x": torch.ones(2), "step": torch.tensor(5), "trainer.step": 11})
    assert inspect_checkpoint(tensor_step)["step"] == 5
    none = inspect_checkpoint(_save(tmp_path / "c", {"x": torch.ones(2)}))
    assert (none["step"], none["step_key"]) == (None, None)


def test_describe_sharding() -> None:
    mesh = TensorRecord(torch.float32, (8, 4), Layout((2, 2), ("SS(0,2)", "S(0)")), True, [0, 1, 2, 3])
    assert describe_sharding(mesh) == "mesh [2,2] SS(0,2),S(0)"
    plain = TensorRecord(torch.float32, (8, 4), Layout(), True, [0])
    assert describe_sharding(plain) == "replicated"
    loc = Location(0, 0, 64, "0" * 16)
    chunks = [ChunkRecord(Box((0, 0), (4, 4)), loc), ChunkRecord(Box((4, 0), (4, 4)), loc)]
    assert describe_sharding(TensorRecord(torch.float32, (8, 4), None, False, chunks=chunks)) == "explicit 2 chunks"


def test_inspect_bad_paths_fail_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, copy: Path) -> None:
    rc, out, err = run_cli(capsys, "inspect", tmp_path / "nope")
    assert rc == 2 and out == ""
    assert one_error_line(err) == f"ucp-dcp: error: {tmp_path / 'nope'}: not a checkpoint (the path does not exist)"
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, "inspect", tmp_path / "empty")
    assert rc == 2 and f"empty is not a checkpoint: found none of {INDEX_FILE} (ucp_dcp), " in one_error_line(err)
    assert "rebuild_index" not in one_error_line(err)
    index = copy / INDEX_FILE
    index.write_bytes(index.read_bytes()[:40])
    rc, _, err = run_cli(capsys, "inspect", copy, "--json")
    assert rc == 2 and "truncated or corrupt index" in one_error_line(err)


# ====================================================================== verify


def test_verify_good_checkpoint(capsys: pytest.CaptureFixture[str], good: Path) -> None:
    rc, out, err = run_cli(capsys, "verify", good)
    assert rc == 0 and err == "" and out.startswith(f"OK {good}: 3 tensors, 3 values, 1 rank-local value in 1 file")
    rc, out, _ = run_cli(capsys, "verify", good, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] is True and doc["problems"] == [] and doc["bytes_verified"] > 300 * 70 * 4


def test_verify_names_tensor_and_file_of_a_flipped_byte(capsys: pytest.CaptureFixture[str], copy: Path) -> None:
    with Checkpoint(copy) as ck:
        [(_, loc)] = ck.chunks("model.w")
    file = _flip_byte(copy, loc, at=1234)
    rc, out, err = run_cli(capsys, "verify", copy)
    assert rc == 1
    [problem] = out.splitlines()
    assert file in problem and "'model.w'" in problem and "checksum mismatch" in problem
    assert "verify found 1 problem" in one_error_line(err)
    rc, out, _ = run_cli(capsys, "verify", copy, "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and doc["problems"] == [problem]


def test_verify_names_a_damaged_value(capsys: pytest.CaptureFixture[str], copy: Path) -> None:
    with Checkpoint(copy) as ck:
        loc = ck.index.values["optim.param_groups.0.betas"]
    file = _flip_byte(copy, loc, at=3)
    rc, out, _ = run_cli(capsys, "verify", copy)
    assert rc == 1
    [problem] = out.splitlines()
    assert file in problem and "value 'optim.param_groups.0.betas'" in problem
    # inspect needs only the index; diff reads the value and reports the damage in one line
    assert run_cli(capsys, "inspect", copy)[0] == 0
    rc, _, err = run_cli(capsys, "diff", copy, copy)
    assert rc == 2 and "checksum mismatch" in one_error_line(err) and file in err


def test_verify_truncated_data_file(capsys: pytest.CaptureFixture[str], copy: Path) -> None:
    [data] = copy.glob("*.safetensors")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    rc, out, err = run_cli(capsys, "verify", copy)
    assert rc == 1 and out and all(data.name in line for line in out.splitlines())
    assert "truncated" in out
    one_error_line(err)


def test_verify_unreadable_index_or_missing_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path, copy: Path) -> None:
    (copy / INDEX_FILE).write_text('{"format": "ucp_dcp", "vers')
    rc, out, err = run_cli(capsys, "verify", copy)
    assert rc == 1 and INDEX_FILE in out and "truncated or corrupt index" in out
    one_error_line(err)
    # A path that is not there cannot be opened: status 2, as for every other command.
    for cmd in ("verify", "inspect"):
        rc, out, err = run_cli(capsys, cmd, tmp_path / "missing")
        assert rc == 2 and out == ""
        assert "missing" in one_error_line(err) and ("does not exist" in err or "no such directory" in err)


# ====================================================================== diff


def test_diff_identical_and_different(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path) -> None:
    rc, out, err = run_cli(capsys, "diff", good, good)
    assert rc == 0 and err == "" and out.startswith("identical: 3 tensors and 4 values compared")
    sd = _state()
    sd["model.w"] = sd["model.w"].clone()
    sd["model.w"][3, 4] += 0.5
    other = _save(tmp_path / "other", sd)
    rc, out, _ = run_cli(capsys, "diff", good, other)
    assert rc == 1
    assert "model.w: max abs diff 0.5, 1 of 21000 elements differ" in out and "1 difference" in out
    assert run_cli(capsys, "diff", good, other, "--atol", "0.6")[0] == 0
    assert run_cli(capsys, "diff", good, other, "--atol", "0.4")[0] == 1
    rc, out, _ = run_cli(capsys, "diff", good, other, "--json", "--atol", "0.6")
    doc = json.loads(out)
    assert rc == 0 and doc["identical"] is False and doc["within_atol"] is True
    assert [t["num_different"] for t in doc["tensors"] if t["name"] == "model.w"] == [1]


def test_diff_structure_values_and_nans(good: Path, tmp_path: Path) -> None:
    sd = _state(**{"model.b": torch.arange(6), "nan_t": torch.tensor([1.0, 2.0, float("nan")]),
                   "extra": torch.zeros(2), "step": 8, "optim.param_groups": None})
    sd["model.w"] = sd["model.w"].double()
    report = diff_checkpoints(good, _save(tmp_path / "b", sd))
    assert not report.identical and not report.within(1e9)
    assert report.only_in_a == ["optim.param_groups.0.betas", "optim.param_groups.0.lr"]
    assert report.only_in_b == ["extra"]
    assert [(m.name, m.a, m.b) for m in report.shape_mismatches] == [("model.b", "[5]", "[6]")]
    assert [(m.name, m.a, m.b) for m in report.dtype_mismatches] == [("model.w", "float32", "float64")]
    by_name = {t.name: t for t in report.tensors}
    assert by_name["model.w"].identical  # float32 -> float64 is exact
    nan = by_name["nan_t"]
    assert (nan.nan_mismatches, nan.num_different, nan.max_abs_diff) == (2, 2, 0.0)
    assert [(m.name, m.a, m.b) for m in report.value_mismatches] == [("step", "7", "8")]
    lines = report.differences()
    assert "nan_t: max abs diff 0, 2 of 3 elements differ, 2 NaN on one side only" in lines
    kinds = diff_checkpoints(good, _save(tmp_path / "c", _state(step=torch.tensor(7))))
    assert [(m.name, m.a, m.b) for m in kinds.kind_mismatches] == [("step", "value", "tensor")]


def test_compare_tensors_edge_cases() -> None:
    big = torch.tensor([2**62, 2**62], dtype=torch.int64)
    assert compare_tensors(big, big + torch.tensor([0, 1])).num_different == 1  # exact, not via float64
    inf = torch.tensor([float("inf"), -0.0, float("nan")])
    assert compare_tensors(inf, torch.tensor([float("inf"), 0.0, float("nan")])).identical
    assert compare_tensors(torch.empty(0, 3), torch.empty(0, 3)).identical
    c = compare_tensors(torch.tensor([1 + 1j]), torch.tensor([1 + 2j]))
    assert (c.num_different, c.max_abs_diff) == (1, 1.0)
    assert compare_tensors(torch.tensor([True, False]), torch.tensor([True, True])).max_abs_diff == 1.0


def test_diff_missing_side_and_bad_atol(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path) -> None:
    rc, out, err = run_cli(capsys, "diff", good, tmp_path / "gone")
    assert rc == 2 and out == "" and "gone: not a checkpoint" in one_error_line(err)
    rc, _, err = run_cli(capsys, "diff", good, good, "--atol", "-1")
    assert rc == 2 and "--atol" in one_error_line(err)


# ====================================================================== conversions


@pytest.mark.parametrize("argv, module", [
    (["export-hf", "src", "dst"], "ucp_dcp.tools.hf"),
    (["import-hf", "src", "dst", "--prefix", "model."], "ucp_dcp.tools.hf"),
    (["import-dcp", "src", "dst"], "ucp_dcp.tools.convert"),
    (["convert", "src", "dst"], "ucp_dcp.tools.convert"),
])
def test_conversion_without_its_module(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                       argv: list[str], module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail as if the file were absent
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and f"{argv[0]} is not available" in one_error_line(err) and module in err


def _fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **functions: Any) -> None:
    mod = types.ModuleType(name)
    for k, v in functions.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)


def test_export_hf_passes_parsed_options(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                         good: Path) -> None:
    calls: list[tuple[Any, ...]] = []
    _fake_module(monkeypatch, "ucp_dcp.tools.hf", export_hf=lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.chdir(good.parent)
    rc, out, _ = run_cli(capsys, "export-hf", good.name, "D", "--dtype", "bf16", "--max-shard-size", "2GB", "--prefix",
                      "model.", "--rename", r"^layers\.(\d+)=h.\1", "--rename", "a=b=c", "--config", "cfg.json", "-q")
    assert rc == 0 and f"exported {good.name} to D" in out
    [(args, kw)] = calls
    assert args == (good.name, "D") and callable(kw.pop("on_progress"))
    assert kw == {"dtype": torch.bfloat16, "max_shard_size": 2 * 10**9, "prefix": "model.",
                  "rename": [(r"^layers\.(\d+)", r"h.\1"), ("a", "b=c")], "config": "cfg.json"}


@pytest.mark.parametrize("bad, expected", [
    (["--rename", "no-equals-sign"], "PATTERN=REPL"),
    (["--rename", "(unclosed=x"], "invalid rename pattern"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["--max-shard-size", "0GB"], "at least 1 byte"),
    (["--max-shard-size", "lots"], "invalid size 'lots'"),
])
def test_export_hf_bad_arguments(capsys: pytest.CaptureFixture[str], bad: list[str], expected: str) -> None:
    rc, _, err = run_cli(capsys, "export-hf", "S", "D", *bad)
    line = one_error_line(err)
    assert rc == 2 and expected in line and "see 'ucp-dcp export-hf --help'" in line


def test_conversion_errors_become_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    from ucp_dcp import CheckpointFormatError

    def fail(*a: Any, **kw: Any) -> None:
        raise CheckpointFormatError(f"{a[0]}: not a DCP checkpoint\n(no .metadata)")

    _fake_module(monkeypatch, "ucp_dcp.tools.convert", convert=fail)
    (tmp_path / "x").mkdir()
    rc, _, err = run_cli(capsys, "import-dcp", tmp_path / "x", tmp_path / "y")
    assert rc == 2 and one_error_line(err).endswith("x: not a DCP checkpoint; (no .metadata)")
    _fake_module(monkeypatch, "ucp_dcp.tools.hf")  # the module exists but lacks the function
    rc, _, err = run_cli(capsys, "import-hf", tmp_path / "x", "b")
    assert rc == 2 and "has no function import_hf()" in one_error_line(err)


@pytest.mark.parametrize("argv", [["export-hf"], ["import-hf"], ["import-dcp"]])
def test_real_conversions_reject_a_missing_source(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                  argv: list[str]) -> None:
    """Whether or not the conversion modules are installed, a bad source is one line and status 2."""
    rc, _, err = run_cli(capsys, *argv, tmp_path / "no-such-source", tmp_path / "out")
    assert rc == 2
    one_error_line(err)


def test_hf_round_trip_through_the_cli(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path) -> None:
    """With the real ucp_dcp.tools.hf: export, import back, and diff finds the weights unchanged."""
    hf, back = tmp_path / "hf", tmp_path / "back"
    rc, out, err = run_cli(capsys, "export-hf", good, hf, "--max-shard-size", "50KB", "--dtype", "fp32")
    assert rc == 0 and out.strip().endswith(": 3 files")  # two shards and the index
    # Without --config the weights cannot be from_pretrained'ed alone: one warning line says what to pass.
    assert err.startswith("ucp-dcp: warning: ") and "config.json" in err and "--config" in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(capsys, "import-hf", hf, back)
    assert rc == 0 and err == ""  # torch's single-process notice is not shown
    report = diff_checkpoints(good, back)
    assert sorted(t.name for t in report.tensors if t.identical) == ["model.b", "model.w"]
    assert report.only_in_b == [] and "model.w" not in report.only_in_a


def test_warnings_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                               good: Path, tmp_path: Path) -> None:
    import warnings

    _fake_module(monkeypatch, "ucp_dcp.tools.convert",
                 convert=lambda *a, **kw: warnings.warn("2 keys skipped:\n a, b", UserWarning, stacklevel=1))
    rc, out, err = run_cli(capsys, "import-dcp", good, tmp_path / "b")
    assert rc == 0 and err == "ucp-dcp: warning: 2 keys skipped:; a, b\n"


def test_unexpected_errors_and_debug(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                     good: Path) -> None:
    def boom(*a: Any, **kw: Any) -> None:
        raise RuntimeError("kaput")

    _fake_module(monkeypatch, "ucp_dcp.tools.convert", convert=boom)
    rc, _, err = run_cli(capsys, "import-dcp", good, "b")
    assert rc == 2 and "unexpected RuntimeError: kaput (rerun with --debug" in one_error_line(err)
    rc, _, err = run_cli(capsys, "--debug", "import-dcp", good, "b")
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("ucp-dcp: error: ")


# ====================================================================== messages in the CLI's words


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint in DCP's default format with a pickled value ('step')."""
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    dcp.save({"model.w": torch.ones(4, 4), "step": 3}, checkpoint_id=path)
    return path


def test_messages_name_the_commands_flags(capsys: pytest.CaptureFixture[str], good: Path, dcp_dir: Path,
                                          tmp_path: Path) -> None:
    rc, _, err = run_cli(capsys, "diff", dcp_dir, good)
    assert rc == 2 and one_error_line(err) == (
        f"ucp-dcp: error: {dcp_dir}: value 'step' is stored by DCP as a pickle (torch.save), and "
        "UCPStorageReader does not unpickle checkpoint data by default. Pass --dcp-values weights_only to "
        "load it with torch.load(weights_only=True), torch's restricted unpickler, or convert the checkpoint "
        "once with `ucp-dcp convert SRC DST`")
    assert run_cli(capsys, "diff", dcp_dir, dcp_dir, "--dcp-values", "weights_only")[0] == 0
    rc, out, _ = run_cli(capsys, "inspect", dcp_dir)  # inspect's warning too
    assert rc == 0 and out.splitlines()[-1] == (
        f"warning: cannot read the step counter 'step': {dcp_dir}: value 'step' is stored by DCP as a pickle "
        "(torch.save), and UCPStorageReader does not unpickle checkpoint data by default. Pass --dcp-values "
        "weights_only to load it with torch.load(weights_only=True), torch's restricted unpickler, or convert "
        "the checkpoint once with `ucp-dcp convert SRC DST`")
    for cmd in ("convert", "import-dcp"):
        rc, _, err = run_cli(capsys, cmd, dcp_dir, good)
        assert rc == 2 and one_error_line(err) == (
            f"ucp-dcp: error: {good} already holds a committed ucp_dcp checkpoint ({INDEX_FILE}); refusing to "
            "replace it. Convert into a new directory, or pass --overwrite")
    rc, _, err = run_cli(capsys, "export-hf", good, tmp_path / "hf", "--prefix", "x.")
    assert rc == 2 and one_error_line(err) == (
        f"ucp-dcp: error: {good}: no tensor name starts with prefix 'x.'; the checkpoint's tensors start with "
        "'model.', 'nan_t.'. Pass the prefix the model was saved under, e.g. --prefix model. (a model saved "
        "as {'model': model_state_dict} has 'model.')")


def test_export_hf_config_warning_names_the_flag(capsys: pytest.CaptureFixture[str], good: Path,
                                                 tmp_path: Path) -> None:
    pytest.importorskip("ucp_dcp.tools.hf")
    rc, _, err = run_cli(capsys, "export-hf", good, tmp_path / "hf")
    assert rc == 0 and err == (
        f"ucp-dcp: warning: {tmp_path / 'hf'}: wrote the weights only; transformers' from_pretrained also "
        "needs a config.json there: pass --config PATH, a config.json or a Hugging Face model directory\n")


def test_export_hf_bad_source_fails_without_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(capsys, "export-hf", tmp_path / "empty", tmp_path / "hf")
    assert rc == 2 and "warning" not in err
    assert one_error_line(err).startswith(f"ucp-dcp: error: {tmp_path / 'empty'} is not a checkpoint")


_COMMANDS_READING = [["inspect"], ["verify"], ["diff", "{good}"], ["export-hf", "{out}"], ["convert", "{out}"],
                     ["import-dcp", "{out}"]]


@pytest.mark.parametrize("argv", _COMMANDS_READING + [["import-hf", "{out}"]])
def test_a_missing_path_is_one_wording_and_status_2(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path,
                                                    argv: list[str]) -> None:
    missing = tmp_path / "missing"
    rest = [a.format(good=good, out=tmp_path / "out") for a in argv[1:]]
    rc, out, err = run_cli(capsys, argv[0], missing, *rest)
    assert rc == 2 and out == ""
    assert one_error_line(err) == f"ucp-dcp: error: {missing}: not a checkpoint (the path does not exist)"


@pytest.mark.parametrize("argv", _COMMANDS_READING)
def test_not_a_checkpoint_is_one_wording_and_status_2(capsys: pytest.CaptureFixture[str], good: Path,
                                                      tmp_path: Path, argv: list[str]) -> None:
    """An empty directory or a plain file: the library's one "not a checkpoint" line, status 2 (verify too)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    rest = [a.format(good=good, out=tmp_path / "out") for a in argv[1:]]
    lines = []
    for bad in (tmp_path / "empty", tmp_path / "afile"):
        rc, out, err = run_cli(capsys, argv[0], bad, *rest)
        assert rc == 2 and out == "", err
        line = one_error_line(err)
        assert line.startswith(f"ucp-dcp: error: {bad} is not a checkpoint") and "rebuild_index" not in line
        assert INDEX_FILE in line and ".metadata" in line  # the formats looked for
        lines.append(line)
    from ucp_dcp.sources import open_source

    for bad, line in zip((tmp_path / "empty", tmp_path / "afile"), lines):  # the library's own message
        with pytest.raises(CheckpointFormatError) as e:
            open_source(bad)
        assert line == f"ucp-dcp: error: {e.value}"


def test_convert_into_a_file(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    rc, _, err = run_cli(capsys, "convert", good, tmp_path / "afile")
    assert rc == 2 and one_error_line(err) == (
        f"ucp-dcp: error: {tmp_path / 'afile'}: is a file; convert writes a checkpoint directory: name a new "
        "directory")


@pytest.mark.parametrize("argv, refused", [
    (["verify", "{good}", "--no-verify"], "--no-verify"),
    (["import-hf", "{good}", "{out}", "--dcp-values", "weights_only"], "--dcp-values"),
    (["import-hf", "{good}", "{out}", "--no-verify"], "--no-verify"),
    (["import-hf", "{good}", "{out}", "--storage-options", "{{}}"], "--storage-options"),
    # given before the command name, as the options every reading command takes may be
    (["--no-verify", "verify", "{good}"], "--no-verify"),
    (["--dcp-values", "weights_only", "import-hf", "{good}", "{out}"], "--dcp-values"),
])
def test_options_a_command_does_not_use_are_refused(capsys: pytest.CaptureFixture[str], good: Path, tmp_path: Path,
                                                    argv: list[str], refused: str) -> None:
    args = [a.format(good=good, out=tmp_path / "out") for a in argv]
    rc, out, err = run_cli(capsys, *args)
    assert rc == 2 and out == "" and not (tmp_path / "out").exists()
    command = next(a for a in argv if a in ("verify", "import-hf"))
    assert one_error_line(err) == (
        f"ucp-dcp: error: {command} does not take the option {refused} (see 'ucp-dcp {command} --help')")


def test_help_says_how_dcp_values_are_loaded(capsys: pytest.CaptureFixture[str]) -> None:
    """convert loads them with weights_only by default; the readers refuse them unless asked.
    docs/handoff.md says the same."""
    for cmd in ("convert", "import-dcp"):
        rc, out, _ = run_cli(capsys, cmd, "--help")
        flat = " ".join(out.split())
        assert rc == 0 and "--dcp-values {weights_only} how the pickled values of a DCP checkpoint are " \
            "loaded: with torch.load(weights_only=True), the one choice and convert's default" in flat
    assert ("The pickled values of a DCP checkpoint are loaded with torch.load(weights_only=True) "
            "(--dcp-values weights_only, the default here).") in " ".join(run_cli(capsys, "convert", "--help")[1].split())
    for cmd in ("inspect", "verify", "diff", "export-hf"):
        rc, out, _ = run_cli(capsys, cmd, "--help")
        assert rc == 0 and "--dcp-values {weights_only}" in out and "(refused by default)" in " ".join(out.split())
    handoff = " ".join((Path(__file__).parents[1] / "docs" / "handoff.md").read_text().split())
    assert "they are refused by default. `convert` loads them that way by default" in handoff


class NoCredentialsError(Exception):
    """Named as botocore's: the client found no credentials."""


def test_object_store_without_credentials(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """No retries (a retry finds no credentials either), and the CLI says how to give them."""
    import ucp_dcp.sources as sources
    from ucp_dcp.byteio.objstore import ObjectStore
    from ucp_dcp.errors import StorageError

    store = ObjectStore("memory://bucket/ckpt")
    calls = []

    def no_credentials() -> None:
        calls.append(1)
        raise NoCredentialsError("Unable to locate credentials")

    with pytest.raises(StorageError) as e:
        store.call("checking for the object", "", no_credentials)
    assert len(calls) == 1
    monkeypatch.setattr(sources, "checkpoint_exists", lambda *a, **kw: (_ for _ in ()).throw(e.value))
    rc, _, err = run_cli(capsys, "inspect", "s3://bucket/ckpt")
    assert rc == 2 and one_error_line(err) == (
        "ucp-dcp: error: memory://bucket/ckpt: checking for the object failed: NoCredentialsError: Unable to "
        "locate credentials; give the store's credentials with --storage-options JSON (e.g. '{\"key\": "
        "\"...\", \"secret\": \"...\"}' for s3://) or the environment variable UCP_DCP_STORAGE_OPTIONS")


# ====================================================================== parser, progress


def test_help_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("inspect", "verify", "diff", "export-hf", "import-hf", "import-dcp"):
        rc, out, _ = run_cli(capsys, cmd, "--help")
        assert rc == 0 and f"usage: ucp-dcp {cmd}" in out and "exit status" in out
    rc, _, err = run_cli(capsys)
    assert rc == 2 and "COMMAND" in one_error_line(err)
    rc, _, err = run_cli(capsys, "frobnicate")
    assert rc == 2 and "invalid choice: 'frobnicate'" in one_error_line(err)


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6 and parse_size("1.5KB") == 1500 and parse_size("4096") == 4096


def test_progress_bar() -> None:
    stream = io.StringIO()
    bar = ProgressBar("verifying", stream=stream, enabled=True, min_interval=0)
    bar(5, 10)
    frames = stream.getvalue().split("\r")
    assert frames[-1].startswith("verifying:  50%|#####     | 5.00/10.0 [00:00<00:00, ")  # tqdm: rate, ETA
    assert frames[-1].endswith("B/s]")
    bar(10, 10)
    last = stream.getvalue().split("\r")[-1]
    assert last.startswith("verifying: 100%|##########| 10.0/10.0 [") and last.endswith("B/s]\n")
    bar.close()  # the finished bar already ended its line
    assert stream.getvalue().count("\n") == 1
    quiet = io.StringIO()
    ProgressBar(stream=quiet)(1, 2)  # a StringIO is not a terminal: nothing drawn
    assert quiet.getvalue() == ""
    throttled = io.StringIO()
    slow = ProgressBar(stream=throttled, enabled=True, min_interval=3600)
    slow(1, 4), slow(2, 4), slow(3, 4)
    assert throttled.getvalue().count("\r") == 1


def test_progress_bar_follows_a_growing_total_and_a_closed_stream_is_no_terminal() -> None:
    stream = io.StringIO()
    with ProgressBar("loading", stream=stream, enabled=True, min_interval=0) as bar:
        bar(5, 10)
        bar(6, 20)  # more work was found: the bar's total follows
        assert stream.getvalue().split("\r")[-1].startswith("loading:  30%|###       | 6.00/20.0 [")
    assert stream.getvalue().endswith("\n")  # leaving the block ended the line
    closed = io.StringIO()
    closed.close()
    assert not ProgressBar(stream=closed).enabled


def test_progress_bar_last_frame_leaves_no_stale_characters() -> None:
    """A shorter frame after a longer one is padded over (the hand-written bar left "807 MBB")."""
    stream = io.StringIO()
    bar = ProgressBar("converting", stream=stream, enabled=True, min_interval=0)
    bar(999_999, 10**6)
    bar(10**6, 10**6)
    frames = stream.getvalue().rstrip("\n").split("\r")[1:]
    for before, after in zip(frames, frames[1:]):
        assert len(after) >= len(before.rstrip()), (before, after)
    assert frames[-1].rstrip().endswith("B/s]")


def test_progress_flag_draws_on_stderr(capsys: pytest.CaptureFixture[str], good: Path) -> None:
    rc, out, err = run_cli(capsys, "verify", good, "--progress")
    assert rc == 0 and out.startswith("OK") and "verifying: 100%|" in err and "100%" in err
    assert run_cli(capsys, "--progress", "-q", "verify", good)[2] == ""


# ====================================================================== subprocesses


def _script() -> Path:
    script = Path(sys.executable).parent / "ucp-dcp"
    if not script.exists():
        pytest.skip("the ucp-dcp entry point is not installed (pip install -e .)")
    return script


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def test_installed_entry_point(copy: Path, tmp_path: Path) -> None:
    with Checkpoint(copy) as ck:
        [(_, loc)] = ck.chunks("model.w")
    file = _flip_byte(copy, loc)
    p = subprocess.run([_script(), "verify", copy], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 1, p.stderr
    assert file in p.stdout and "'model.w'" in p.stdout
    one_error_line(p.stderr)
    p = subprocess.run([_script(), "inspect", tmp_path / "nope"], capture_output=True, text=True, env=_env(),
                       timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "not a checkpoint" in one_error_line(p.stderr)


def test_python_dash_m(good: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "ucp_dcp.tools.cli", "inspect", "--json", good], capture_output=True,
                       text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["step"] == 7
    p = subprocess.run([sys.executable, "-m", "ucp_dcp", "diff", good, good], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("identical"), p.stderr


def test_an_unfinished_save_is_a_verify_failure(capsys: pytest.CaptureFixture[str], copy: Path) -> None:
    """Data files and no index (a save that did not finish): a damaged checkpoint, status 1, with the fix."""
    (copy / INDEX_FILE).unlink()
    rc, out, err = run_cli(capsys, "verify", copy)
    assert rc == 1 and out == (
        f"{copy}: not a ucp_dcp checkpoint: {INDEX_FILE} is missing. A save that did not finish leaves no index; "
        "load an earlier checkpoint or rebuild the index from complete data files with "
        "ucp_dcp.rebuild_index(path, write=True)\n")
    assert one_error_line(err) == f"ucp-dcp: error: {copy}: verify found 1 problem"


def test_os_errors_are_words_after_the_path(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                            good: Path) -> None:
    def denied(*a: Any, **kw: Any) -> None:
        raise PermissionError(13, "Permission denied", "/out/x")

    _fake_module(monkeypatch, "ucp_dcp.tools.convert", convert=denied)
    rc, _, err = run_cli(capsys, "convert", good, "out")
    assert rc == 2 and one_error_line(err) == "ucp-dcp: error: /out/x: permission denied"


# ====================================================================== stdout gone, Ctrl-C, conversions


class _Stdout(io.TextIOBase):
    """A stdout whose every write raises ``exc`` (the reader left, Ctrl-C); ``fd``: its file
    descriptor, None for one without (as under pytest)."""

    def __init__(self, exc: type[BaseException], fd: int | None = None) -> None:
        self.exc, self.fd = exc, fd

    def write(self, s: str) -> int:
        raise self.exc()

    def fileno(self) -> int:
        if self.fd is None:
            raise io.UnsupportedOperation("fileno")
        return self.fd


def test_stdout_closed_or_interrupted(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                      good: Path, tmp_path: Path) -> None:
    """`ucp-dcp inspect PATH | head`: when the reader leaves, the status is 2 with nothing said
    and stdout is pointed at /dev/null (when it has a descriptor); Ctrl-C is 'interrupted', 130."""
    monkeypatch.setattr(sys, "stdout", _Stdout(BrokenPipeError))
    rc, _, err = run_cli(capsys, "inspect", good)
    assert rc == 2 and err == ""
    with open(tmp_path / "out.txt", "w") as f:
        monkeypatch.setattr(sys, "stdout", _Stdout(BrokenPipeError, f.fileno()))
        rc, _, err = run_cli(capsys, "inspect", good)
        assert rc == 2 and err == "" and os.path.samefile(f"/proc/self/fd/{f.fileno()}", os.devnull)
    monkeypatch.setattr(sys, "stdout", _Stdout(KeyboardInterrupt))
    rc, _, err = run_cli(capsys, "inspect", good)
    assert rc == 130 and one_error_line(err) == "ucp-dcp: error: interrupted"


def test_diff_tolerance_that_is_not_a_number(capsys: pytest.CaptureFixture[str], good: Path) -> None:
    rc, out, err = run_cli(capsys, "diff", good, good, "--atol", "tiny")
    line = one_error_line(err)
    assert rc == 2 and out == "" and "argument --atol: invalid tolerance 'tiny'; write a number such as 1e-6" in line


def test_convert_prefix_names_a_hugging_face_models_tensors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    w = torch.arange(6.0).reshape(2, 3)
    (tmp_path / "hf").mkdir()
    save_file({"layer.weight": w}, str(tmp_path / "hf" / "model.safetensors"))
    rc, _, _ = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "out", "--prefix", "net.", "-q")
    assert rc == 0
    with Checkpoint(tmp_path / "out") as ck:
        assert ck.tensor_names() == ["net.layer.weight"] and torch.equal(ck.read_tensor("net.layer.weight"), w)


def test_diff_of_numpy_nan_and_tensor_values_and_of_infinities(tmp_path: Path) -> None:
    """Values compare by type and content: numpy scalars and arrays (NaN equal to NaN), NaN
    floats, tuples holding tensors; 1 and 1.0 differ. An infinite difference is "inf" in JSON.
    A numpy step counts as the step; a step that is no number is none."""
    import numpy as np

    def values(kind: Any, step: Any, x: float) -> dict[str, Any]:
        return {"x": torch.tensor([0.0, x]), "v.np": np.float32(1.5), "v.arr": np.array([np.nan, 1.0]),
                "v.nan": float("nan"), "v.tup": (torch.ones(2), 3), "v.kind": kind, "step": step}

    a = _save(tmp_path / "a", values(1, np.int64(9), 0.0))
    b = _save(tmp_path / "b", values(1.0, "nine", float("inf")))
    assert (inspect_checkpoint(a)["step"], inspect_checkpoint(b)["step"]) == (9, None)
    report = diff_checkpoints(a, b)
    assert [(m.name, m.a, m.b) for m in report.value_mismatches] == [("step", "np.int64(9)", "'nine'"),
                                                                     ("v.kind", "1", "1.0")]
    (x,) = report.to_json()["tensors"]
    assert x == {"name": "x", "numel": 2, "max_abs_diff": "inf", "num_different": 1, "nan_mismatches": 0}
    with pytest.raises(InvalidArgumentError, match=r"^x: cannot compare shapes \[2\] and \[3\]$"):
        compare_tensors(torch.zeros(2), torch.zeros(3), "x")
