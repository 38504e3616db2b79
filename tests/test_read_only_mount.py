"""Checkpoints on a read-only mount, as shared training runs are handed to fine-tuning jobs.

The test bind-mounts a directory of fresh checkpoints, and the committed framework fixtures,
read-only in a private mount namespace (``unshare -m``, as root; skipped where that is not
allowed), and runs this file as a script there. Every read path (``Checkpoint``, ``dcp.load``,
``load_state_dict``, ``inspect``, the CLI's ``verify``, ``convert`` and ``export_hf`` out of it,
the manager's restore) must work bit-exactly; every write into it must fail with the library's
own error naming the path; and the files must be byte-for-byte and time-for-time as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucp_dcp import (
    Checkpoint,
    CheckpointManager,
    CheckpointSaveError,
    UCPError,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    UCPWarning,
    convert,
    export_hf,
    import_hf,
    inspect_checkpoint,
    load_state_dict,
)
from ucp_dcp.errors import CheckpointWriteError, unwrap
from ucp_dcp.tools.cli import main as cli

FIXTURES = Path(__file__).parent / "fixtures"


def _state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).bfloat16()}}


def _zeros_like(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    return {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items()}


def _fixture_roots() -> list[Path]:
    """Every committed framework checkpoint: the first directory below ``fixtures/<framework>/``
    that opens as one (a folder of ``*_reference.safetensors`` files would open as Hugging Face's)."""
    found: list[Path] = []

    def walk(d: Path) -> None:
        try:
            with Checkpoint(d):
                found.append(d)
                return
        except UCPError:
            pass
        for c in sorted(d.iterdir()):
            if c.is_dir() and not c.name.startswith(("_", ".")):
                walk(c)

    for framework in sorted(FIXTURES.iterdir()):
        if framework.is_dir() and not framework.name.startswith(("_", ".")):
            for c in sorted(framework.iterdir()):
                if c.is_dir() and not c.name.startswith(("_", ".")):
                    walk(c)
    return found


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, modification time and sha256."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _unshare_works() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def _check_reads(ro: Path, out: Path) -> None:
    want = _state(1)
    with Checkpoint(ro / "native") as ck:
        assert ck.verify() == []
        assert all(torch.equal(ck.read_tensor(f"model.{n}"), t) for n, t in want["model"].items())
    for name in ("native", "dcp"):
        got = _zeros_like(want)
        dcp.load(got, storage_reader=UCPStorageReader(ro / name), planner=UCPLoadPlanner(), no_dist=True)
        assert all(torch.equal(got["model"][n], t) for n, t in want["model"].items()), name
    assert torch.equal(load_state_dict(ro / "native", "model.w")["model.w"], want["model"]["w"])
    assert inspect_checkpoint(ro / "native")["totals"]["tensors"] == 2
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli(["verify", str(ro / "native")]) == 0
    convert(ro / "dcp", out / "converted")
    export_hf(ro / "native", out / "hf")
    import_hf(ro / "hf", out / "imported")
    for path in (out / "converted", out / "imported"):
        with Checkpoint(path) as ck:
            assert ck.verify() == [] and torch.equal(ck.read_tensor("model.b"), want["model"]["b"]), path
    with CheckpointManager(str(ro / "managed")) as mgr:
        got = _zeros_like(want)
        assert mgr.steps() == [1, 2] and mgr.load(got) == 2
        assert torch.equal(got["model"]["w"], _state(2)["model"]["w"])


def _check_writes_refused(ro: Path) -> None:
    for name in ("new", "native"):  # a new checkpoint, and one over the committed one
        with pytest.raises(BaseException) as info:
            dcp.save(_state(3), storage_writer=UCPStorageWriter(ro / name), planner=UCPSavePlanner(), no_dist=True)
        err = unwrap(info.value)
        assert isinstance(err, CheckpointWriteError) and str(ro / name) in str(err), repr(info.value)
        assert "Read-only file system" in str(err) and "not writable" in str(err), str(err)
    for what, write in (
        ("convert", lambda: convert(ro / "dcp", ro / "converted")),
        ("export_hf", lambda: export_hf(ro / "native", ro / "hf2")),
        ("import_hf", lambda: import_hf(ro / "hf", ro / "imported")),
    ):
        with pytest.raises(CheckpointWriteError, match=r"Read-only file system.*not writable") as info:
            write()
        assert str(ro) in str(info.value), (what, str(info.value))
    with CheckpointManager(str(ro / "managed")) as mgr:
        with pytest.raises(CheckpointSaveError, match=r"step 3 failed.*Read-only file system"):
            mgr.save(3, _state(3))
            mgr.wait()


def _check_fixtures(ro: Path, roots: list[Path]) -> None:
    for root in roots:
        with Checkpoint(root) as rw, Checkpoint(ro / root.relative_to(FIXTURES)) as ck:
            assert ck.verify() == [], root
            names = ck.tensor_names()
            assert names == rw.tensor_names(), root
            for n in names:
                a, b = ck.read_tensor(n), rw.read_tensor(n)
                assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (root, n)


@pytest.mark.skipif(not _unshare_works(), reason="needs root and `unshare -m` to make a read-only bind mount")
def test_read_only_mount(tmp_path: Path) -> None:
    src, ro, ro_fixtures, out = (tmp_path / n for n in ("src", "ro", "ro_fixtures", "out"))
    for d in (src, ro, ro_fixtures, out):
        d.mkdir()
    dcp.save(_state(1), storage_writer=UCPStorageWriter(src / "native"), planner=UCPSavePlanner(), no_dist=True)
    dcp.save(_state(1), checkpoint_id=src / "dcp", no_dist=True)  # DCP's own FileSystemWriter
    with pytest.warns(UCPWarning, match="config.json"):  # weights only: enough to import
        export_hf(src / "native", src / "hf")
    with CheckpointManager(str(src / "managed")) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
            mgr.wait()
    roots = _fixture_roots()
    assert len(roots) >= 40  # every framework the fixtures hold
    before, fixtures_before = _tree(src), _tree(FIXTURES)
    mount = " && ".join(
        f"mount --bind {a} {b} && mount -o remount,bind,ro {b}" for a, b in ((src, ro), (FIXTURES, ro_fixtures))
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f'{mount} && exec "$0" "$@"', sys.executable, __file__, str(ro), str(ro_fixtures), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"read-only: {len(roots)} fixture checkpoints" in done.stdout, done.stdout
    assert _tree(src) == before and _tree(FIXTURES) == fixtures_before


if __name__ == "__main__":  # in the private mount namespace
    ro_dir, fixtures_dir, out_dir = (Path(a) for a in sys.argv[1:4])
    try:
        (ro_dir / "probe").touch()
        raise SystemExit("the mount is writable")
    except OSError:
        pass
    _check_reads(ro_dir, out_dir)
    _check_writes_refused(ro_dir)
    fixture_roots = _fixture_roots()
    _check_fixtures(fixtures_dir, fixture_roots)
    print(f"read-only: {len(fixture_roots)} fixture checkpoints")
