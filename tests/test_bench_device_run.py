"""The device script (benchmarks/device_run.py): parts in their own process groups, results and summary in OUT.

A part that outlives its timeout is ended with every process it started
(the benchmarks spawn ranks); a failing part is recorded and the next one
runs. A tiny run of the manager part checks what lands in OUT: at most 8
plain files, a summary with the part's table and the issue-22 verdicts, and
the environment checks. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_run  # noqa: E402  (benchmarks/)


def test_a_part_past_its_timeout_ends_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    with open(tmp_path / "log.txt", "w") as log:
        res = device_run.run_part("sleepy", [sys.executable, "-c", script], 3, log)
    assert res["status"] == "timeout" and res["rc"] is None
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild got SIGTERM with its group; give the kernel a moment to reap it
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} outlived its part")
    assert "sleepy: timeout" in (tmp_path / "log.txt").read_text()


def test_exit_status_is_recorded(tmp_path: Path) -> None:
    with open(tmp_path / "log.txt", "w") as log:
        ok = device_run.run_part("ok", [sys.executable, "-c", "print('hello')"], 30, log)
        bad = device_run.run_part("bad", [sys.executable, "-c", "raise SystemExit(3)"], 30, log)
    assert ok["status"] == "ok" and bad["status"] == "failed (exit 3)" and bad["rc"] == 3
    assert "hello" in (tmp_path / "log.txt").read_text()


def test_quick_manager_part_writes_its_results_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = device_run.main(["--quick", "--parts", "manager", "--out", str(out), "--workdir", str(tmp_path / "w")])
    assert rc == 0, (out / "logs.txt").read_text()
    files = sorted(p.name for p in out.iterdir())
    assert files == ["logs.txt", "manager.json", "summary.json", "summary.md"]
    assert all(p.is_file() for p in out.iterdir())
    doc = json.loads((out / "summary.json").read_text())
    assert doc["parts"]["manager"]["status"] == "ok"
    assert doc["env"]["checks"]["torch"] == torch.__version__ and doc["env"]["checks"]["ucp_dcp"] == "ok"
    targets = {v["target"] for v in doc["verdicts"]}
    assert "manager: manager (local tier) / dcp.load FileSystemReader <= 1" in targets
    assert all(v["verdict"] in ("met", "MISSED") for v in doc["verdicts"])
    text = (out / "summary.md").read_text()
    assert "## Manager restore vs dcp.load" in text and "`CheckpointManager.load`, local tier" in text
    assert not (tmp_path / "w" / "manager").exists()  # the part's checkpoints are removed
