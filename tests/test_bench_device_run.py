"""The device script (benchmarks/device_run.py): parts in their own process groups, results and summary in OUT.

A part that outlives its timeout is ended with every process it started
(the benchmarks spawn ranks); a failing part is recorded and the next one
runs. A tiny run of the manager part checks what lands in OUT: at most 8
plain files, a summary with the part's table and the issue-22 verdicts, and
the environment checks. No timing is asserted.

``--gpu`` (issue 35) cannot rot: its dry run lists every step and every
round-trip check, each skipped, and exits 0; ``--gpu-device cpu`` runs the
round-trip checks on CPU tensors (a self-test of their logic, so the first
lent GPU does not fail on a silly mistake); the load benchmark's summary
rows come from bench_gpu's own records; every CUDA-only test carries the
``cuda`` mark.
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


# ---------------------------------------------------------------- --gpu (issue 35)

CHECK_NAMES = ["dcp_tensors", "dcp_tensors_async", "dtensor", "dtensor_async", "manager", "manager_dtensor",
               "deepspeed_source", "hf_source"]


def test_gpu_dry_run_lists_every_step_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc = device_run.main(["--gpu", "--dry-run", "--out", str(out)])
    assert rc == 0, (out / "logs.txt").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["gpu_checks.json", "logs.txt", "summary.json", "summary.md"]
    doc = json.loads((out / "summary.json").read_text())
    assert doc["dry_run"] and not doc["ran_on_gpu"]
    assert list(doc["parts"]) == ["gpu_checks", "cuda_tests", "gpu_load"]
    for name, part in doc["parts"].items():
        assert part["status"].startswith("skipped: dry run"), (name, part)
        assert torch.cuda.is_available() or part["status"] == "skipped: dry run (no CUDA)"
    assert "pytest -m cuda" in doc["parts"]["cuda_tests"]["command"]
    assert "bench_gpu.py --device cuda --gb 2 " in doc["parts"]["gpu_load"]["command"]
    assert [c["name"] for c in doc["checks"]["checks"]] == CHECK_NAMES
    assert all(c["status"] == "skipped" for c in doc["checks"]["checks"])
    assert doc["gpu"]["torch"] == torch.__version__ and doc["gpu"]["cuda"] == torch.version.cuda
    assert "tests/test_staging.py" in doc["cuda_test_files"] and "tests/test_snapshot.py" in doc["cuda_test_files"]
    text = (out / "summary.md").read_text()
    assert "**Nothing ran on a GPU** (dry run)" in text
    for name in [*doc["parts"], *CHECK_NAMES]:
        assert f"| {name} |" in text, name


def test_gpu_parts_on_cpu_run_every_round_trip_check(tmp_path: Path) -> None:
    """The checks' logic on CPU tensors: every check passes, and the summary says no GPU ran."""
    out = tmp_path / "out"
    rc = device_run.main(["--gpu", "--gpu-device", "cpu", "--parts", "gpu_checks", "--out", str(out),
                          "--workdir", str(tmp_path / "w")])
    assert rc == 0, (out / "logs.txt").read_text()
    doc = json.loads((out / "summary.json").read_text())
    assert doc["parts"]["gpu_checks"]["status"] == "ok" and not doc["ran_on_gpu"]
    checks = doc["checks"]["checks"]
    assert [c["name"] for c in checks] == CHECK_NAMES
    assert all(c["status"] == "pass" for c in checks), [c for c in checks if c["status"] != "pass"]
    assert "`--gpu-device cpu`" in (out / "summary.md").read_text()


def test_round_trip_comparison_sees_one_flipped_bit() -> None:
    import gpu_checks

    ref = gpu_checks.reference_state()
    got = {k: v.clone() for k, v in ref.items()}
    gpu_checks.assert_loaded(got, ref, torch.device("cpu"))
    got["layers.1.w"].view(torch.int16).view(-1)[17] ^= 1  # one bit of one bf16 (a NaN payload counts too)
    try:
        gpu_checks.assert_loaded(got, ref, torch.device("cpu"))
    except gpu_checks.CheckFailed as e:
        assert "layers.1.w: bits differ" in str(e)
    else:
        raise AssertionError("a flipped bit passed")


def test_gpu_load_rows_come_from_bench_gpu_records() -> None:
    import bench_gpu

    rows = [bench_gpu.Row("1 raw", "host->device, pinned", 2 * 10**9, 0.1, 20.0, None, None, {}),
            bench_gpu.Row("1 raw", "device->host, pinned", 2 * 10**9, 0.1, 20.0, None, None, {}),
            bench_gpu.Row("3 storage", "sequential read, 1 thread, cold", 4 * 10**9, 2.0, 2.0, None, None, {}),
            bench_gpu.Row("4 load", "UCPStorageReader, cold", 2 * 10**9, 1.25, 1.6, 0.8, "3 storage best", {}),
            bench_gpu.Row("4 load", "FileSystemReader, cold", 2 * 10**9, 2.5, 0.8, 0.4, "3 storage best", {})]
    doc = {"rows": [r.as_dict() for r in rows], "state_bytes": 2 * 10**9, "failures": [],
           "storage": {"fs_type": "ext4", "resident_after_evict": 0.0}}
    got = device_run.load_rows(doc)
    assert [r[0] for r in got] == ["host->device, pinned", "sequential read, 1 thread, cold",
                                   "UCPStorageReader, cold", "FileSystemReader, cold"]
    assert got[2][4] == "0.80 of 3 storage best"
    text = device_run.gpu_summary({"gpu": {"torch": "t", "cuda": "12.8", "cuda_available": True,
                                           "device_name": "H100", "device_memory_gib": 79.1, "capability": "9.0"},
                                   "device": "cuda", "dry_run": False, "wall_s": 1.0, "parts": {},
                                   "cuda_test_files": [], "cuda_tests": None, "checks": None, "load": doc})
    assert "Nothing ran on a GPU" not in text and "H100" in text
    assert "| FileSystemReader / UCPStorageReader time, cold |  |  |  | 2.00x |" in text


def test_every_cuda_only_test_is_marked() -> None:
    """A test that needs CUDA says so with ``@pytest.mark.cuda`` (``pytest -m cuda`` selects it), not its own skipif."""
    assert "cuda:" in (ROOT / "setup.cfg").read_text()
    for f in (ROOT / "tests").glob("test_*.py"):
        text = f.read_text()
        assert "skipif(not torch." + "cuda.is_available()" not in text, f"{f.name}: use @pytest.mark.cuda"
    assert {"tests/test_staging.py", "tests/test_snapshot.py", "tests/test_placement_cuda.py"} <= set(
        device_run.cuda_test_files())
