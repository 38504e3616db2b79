#!/usr/bin/env python3
"""Issue 22's benchmarks in one unattended run on a bigger machine; results and a summary in ``$OUT``.

Run from the repository root::

    PYTHONPATH=$PWD/src python3 benchmarks/device_run.py          # ~4-5 min on 16 cores; never over --budget-s
    python3 benchmarks/device_run.py --quick --out out/device     # smoke run of the plumbing (~2 min on 2 cores)
    python3 benchmarks/device_run.py --gpu --out benchmarks/results/gpu-<date>/   # the GPU paths (issue 35)
    python3 benchmarks/device_run.py --gpu --dry-run --out out/gpu                # every GPU step listed, skipped

``--gpu`` (issue 35) runs, instead of the parts below, on one GPU in under 8
minutes (``--budget-s`` 450): ``gpu_checks`` (``gpu_checks.py``: bit-exact
round trips of CUDA tensors and DTensors through ``dcp.save``,
``dcp.async_save``, ``dcp.load``, the manager, DeepSpeed and Hugging Face
sources), ``cuda_tests`` (``pytest -m cuda``, JUnit XML kept) and
``gpu_load`` (``bench_gpu.py`` on ``--gpu-gb`` GB, default 2: cold loads
into the same CUDA tensors with the UCP reader and DCP's
``FileSystemReader``, with the same run's cold read and pinned
host-to-device bandwidth). ``summary.json`` records torch's and CUDA's
versions and the card. Without CUDA, or with ``--dry-run``, each part and
each check is listed as skipped and the exit status is 0;
``--gpu-device cpu`` runs the checks and the benchmark on CPU tensors.

The parts run one after another, each (but ``env``) in its own process
with its own timeout, so one that fails or runs out of time still leaves
the others' results. In order of importance:

``env``
    versions, CPUs, memory, the work directory's file system and
    read-ahead, the load average, and checks that the torch APIs the
    benchmarks use are there (in this process).
``reshard_same``
    ``bench_reshard.py`` on the loads without resharding: one process
    (``dp1-dp1``), ``dp4-dp4`` and ``dp2tp2-dp2tp2``, ucp_dcp against DCP's
    ``FileSystemWriter``/``FileSystemReader`` with its default planners, cold
    loads (page cache evicted) in paired repeats of alternating order, and
    the physical limit measured in the same run.
``restart``
    ``bench_reshard.py --pairs fsdp2-1,fsdp2-dp4`` (issue 36): the user's
    restart, a real FSDP2 model (``fully_shard`` on a 1-rank and a 4-rank
    mesh) with AdamW state from ``get_state_dict``, ~300 MB, saved with each
    format's defaults and loaded back in the same layout into a fresh
    model's ``get_state_dict``, cold, ucp_dcp's defaults against DCP's in 5
    paired repeats of alternating order; wall time and CPU seconds (user +
    sys of every rank, threads included) side by side, each against the
    0.9x-DCP target.
``manager``
    ``bench_manager.py --sections vs_dcp``: ``CheckpointManager.load`` from
    the local tier against ``dcp.load`` of the same state with
    ``FileSystemReader`` and with the UCP classes, cold, in paired rounds,
    with the same-run limit (and the S3 tier against downloading the whole
    step where moto and s3fs are installed).
``reshard_pairs``
    ``bench_reshard.py`` on two resharding pairs, ``dp2tp2-dp3`` and
    ``dp4-dp3``, the same way.

Each part gets ``min(its cap, what is left of --budget-s)`` seconds. Only
DCP's synchronous ``dcp.save``/``dcp.load`` are used (no async staging,
whose ``DefaultStager`` fails on some torch releases).

``$OUT`` (or ``--out``) receives at most 7 files, no folders:
``summary.md`` (every table and verdict), ``summary.json`` (the parts'
status, the environment, every issue-22 and issue-36 verdict with its value),
``reshard_same.json``, ``restart.json``, ``manager.json``, ``reshard_pairs.json`` (each
script's full result) and ``logs.txt`` (every part's output). Checkpoints
go to ``--workdir`` (default: a fresh directory under ``/tmp``, or under
``out/`` when ``/tmp`` is tmpfs, where page-cache eviction means nothing),
removed after each part. The exit status is 0 when every part ran to the
end with exact loads; the verdicts never change it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from harness import fs_type, markdown_table, read_ahead_kb  # noqa: E402  (benchmarks/harness)

SAME_PAIRS = "dp1-dp1,dp4-dp4,dp2tp2-dp2tp2"
RESTART_PAIRS = "fsdp2-1,fsdp2-dp4"  # issue 36: bench_reshard's real FSDP2 + AdamW restart pairs
RESHARD_PAIRS = "dp2tp2-dp3,dp4-dp3"


@dataclass(frozen=True)
class Part:
    """One benchmark run: its name, its command line (after ``python``), its time cap, its result file."""

    name: str
    args: list[str]
    cap_s: float
    result: str


def parts(quick: bool, work: Path, out: Path, s3: bool) -> list[Part]:
    """The four benchmark parts, full size or (``quick``) tiny."""
    if quick:
        reshard = ["--size-mb", "20", "--hidden", "1024", "--repeats", "2", "--probe-mb", "8"]
        restart = ["--size-mb", "20", "--repeats", "2", "--probe-mb", "0"]
        manager = ["--quick", "--mb", "8", "--layers", "4", "--repeat", "2", "--probe-mb", "8"]
    else:
        # the state issue 36 measured (~300 MB, 136 tensors), 5 paired cold loads per pair
        restart = ["--size-mb", "300", "--repeats", "5", "--probe-mb", "0"]
        # ~1 GB of fp32 weights + AdamW, 5 paired cold loads per pair; saves are not issue 22's subject
        reshard = ["--size-mb", "1000", "--repeats", "5", "--save-repeats", "2", "--probe-mb", "1024"]
        manager = ["--mb", "1024", "--repeat", "5", "--probe-mb", "1024"]
    common = ["--formats", "dcp,ucp"]
    return [
        Part("reshard_same", ["benchmarks/bench_reshard.py", *reshard, *common, "--pairs", SAME_PAIRS,
                              "--workdir", str(work / "reshard_same"), "--out", str(out / "reshard_same.json")],
             170, "reshard_same.json"),
        Part("restart", ["benchmarks/bench_reshard.py", *restart, "--pairs", RESTART_PAIRS,
                         "--workdir", str(work / "restart"), "--out", str(out / "restart.json")],
             100, "restart.json"),
        Part("manager", ["benchmarks/bench_manager.py", "--sections", "vs_dcp", *manager, "--no-shm",
                         *([] if s3 else ["--no-s3"]), "--dir", str(work / "manager"),
                         "--out", str(out / "manager.json")], 70, "manager.json"),
        Part("reshard_pairs", ["benchmarks/bench_reshard.py", *reshard, *common, "--pairs", RESHARD_PAIRS,
                               "--workdir", str(work / "reshard_pairs"), "--out", str(out / "reshard_pairs.json")],
             120, "reshard_pairs.json"),
    ]


def run_part(name: str, cmd: Sequence[str], timeout_s: float, log: Any, env: dict[str, str] | None = None,
             cwd: str | Path = REPO) -> dict[str, Any]:
    """Run ``cmd`` in its own session with its output appended to ``log``; on timeout, end its whole group.

    Returns ``{"status": "ok" | "failed (exit N)" | "timeout" | "error: ...", "seconds": ..., "rc": ...}``.
    The process group goes too (SIGTERM, then SIGKILL after 10 s), so the
    benchmark's spawned ranks do not outlive it.
    """
    log.write(f"\n===== {name}: {' '.join(cmd)} (timeout {timeout_s:.0f} s) =====\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=cwd, env=env, start_new_session=True)
    except OSError as e:
        return {"status": f"error: {e}", "seconds": 0.0, "rc": None}
    try:
        rc = proc.wait(timeout=max(timeout_s, 1))
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        rc, status = None, "timeout"
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
    seconds = time.perf_counter() - t0
    log.write(f"===== {name}: {status} after {seconds:.1f} s =====\n")
    log.flush()
    return {"status": status, "seconds": seconds, "rc": rc}


def environment(work: Path) -> dict[str, Any]:
    """Versions, machine, work directory and the torch APIs the benchmarks call (each check never raises)."""
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "cpus": os.cpu_count(), "load_avg": list(os.getloadavg()), "workdir": str(work),
                           "workdir_fs": fs_type(str(work)), "read_ahead_kb": read_ahead_kb(str(work)),
                           "PYTHONPATH": os.environ.get("PYTHONPATH"), "checks": {}}
    try:
        with open("/proc/meminfo") as f:
            env["mem_total_gib"] = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    usage = shutil.disk_usage(work)
    env["workdir_free_gib"] = usage.free / 2**30

    def check(name: str, fn: Any) -> None:
        try:
            got = fn()
            env["checks"][name] = "ok" if got is None else got
        except Exception as e:  # recorded, never fatal: the parts report their own failures
            env["checks"][name] = f"FAILED: {type(e).__name__}: {e}"

    def torch_apis() -> str:
        import inspect

        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: F401
        from torch.distributed.tensor import distribute_tensor
        from torch.distributed.tensor.placement_types import _StridedShard

        _StridedShard(0, split_factor=2)
        assert "src_data_rank" in inspect.signature(distribute_tensor).parameters, "distribute_tensor: no src_data_rank"
        assert "process_group" in inspect.signature(dcp.load).parameters, "dcp.load: no process_group"
        dcp.FileSystemReader, dcp.FileSystemWriter  # noqa: B018
        return torch.__version__

    def ucp() -> None:
        """A tiny save and load with the UCP classes in this process (no process group), compared exactly."""
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        from ucp_dcp import CheckpointManager, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader  # noqa: F401
        from ucp_dcp import UCPStorageWriter

        state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "step": 3}
        target = {"w": torch.zeros(3, 4), "step": 0}
        with tempfile.TemporaryDirectory(dir=work) as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=UCPStorageWriter(d), planner=UCPSavePlanner())
            dcp.load(target, storage_reader=UCPStorageReader(d), planner=UCPLoadPlanner())
        assert torch.equal(target["w"], state["w"]) and target["step"] == 3, f"round trip gave {target}"

    def s3() -> str:
        from bench_manager import have_s3

        return have_s3() or "ok"

    check("torch", torch_apis)
    check("ucp_dcp", ucp)
    check("s3", s3)
    return env


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _reshard_section(title: str, doc: dict[str, Any]) -> list[str]:
    best = doc.get("storage_limits", {}).get("best", {})
    lines = [f"## {title}", "",
             f"state {doc['state_bytes'] / 1e6:.0f} MB, repeats {doc['config']['repeats']}, "
             f"read limit {best.get('read_bytes_per_s', 0) / 1e9:.2f} GB/s, write+fsync "
             f"{best.get('write_bytes_per_s', 0) / 1e9:.2f} GB/s, load average {doc['load_avg']['start'][0]:.1f}"
             f" -> {doc['load_avg']['end'][0]:.1f}, wall {doc['wall_s']:.0f} s", ""]
    if doc.get("common_case_md"):
        lines += [doc["common_case_md"], ""]
    if doc.get("storage_speed_md"):
        lines += ["Storage speed (pulled bytes, memory, saves):", "", doc["storage_speed_md"], ""]
    readers = [f"- {rec['pair']}: `{json.dumps(rec['formats']['ucp']['reader_per_rank'][0], sort_keys=True)}`"
               for rec in doc.get("pairs", []) if (rec["formats"].get("ucp") or {}).get("reader_per_rank")]
    if readers:
        lines += ["ucp reader counters after the last cold load (rank 0):", "", *readers, ""]
    left = [f"{layout}/{fmt}: {s['residual_after_evict']} B"
            for layout, per in doc.get("saves", {}).items() for fmt, s in per.items()
            if s.get("residual_after_evict")]
    if left:
        lines += [f"**Eviction left pages resident (loads were not cold):** {', '.join(left)}", ""]
    return lines


def _restart_section(doc: dict[str, Any]) -> list[str]:
    """bench_reshard's restart pairs (issue 36): the table, the model, ucp's reader counters, eviction check."""
    r = doc["restart"]
    m = r["model"]
    lines = ["## The user's restart (issue 36): FSDP2 + AdamW, same layout, cold, ucp vs DCP defaults", "",
             f"model: {m['layers']} blocks, hidden {m['hidden']}, vocab {m['vocab']} (state from `get_state_dict`, "
             f"{doc['config']['size_mb']:g} MB target); repeats {doc['config']['repeats']}, load average "
             f"{doc['load_avg']['start'][0]:.1f} -> {doc['load_avg']['end'][0]:.1f}, wall {doc['wall_s']:.0f} s. "
             "Wall: `dcp.load` on the slowest rank; CPU: user + sys of every rank, threads included, summed; "
             "ratios: medians of the per-repeat ratios (the order alternates).", "", r["markdown"], ""]
    readers = [f"- {pair}: `{json.dumps(rec['formats']['ucp']['reader_per_rank'][0], sort_keys=True)}`"
               for pair, rec in r["pairs"].items() if (rec["formats"].get("ucp") or {}).get("reader_per_rank")]
    if readers:
        lines += ["ucp reader counters after the last cold load (rank 0):", "", *readers, ""]
    left = [f"{pair}/{fmt}: {e['residual_after_evict']} B" for pair, rec in r["pairs"].items()
            for fmt, e in rec["formats"].items() if e.get("residual_after_evict")]
    if left:
        lines += [f"**Eviction left pages resident (loads were not cold):** {', '.join(left)}", ""]
    return lines


def verdict_rows(docs: dict[str, dict[str, Any] | None]) -> list[list[str]]:
    """(target, value, verdict) for every issue-22 and issue-36 target the parts' results hold."""
    rows = []
    for part in ("reshard_same", "reshard_pairs"):
        doc = docs.get(part) or {}
        for pair, c in doc.get("common_case", {}).items():
            for key, v in c["verdicts"].items():
                if key == "one_process_over_limit":
                    rows.append([f"{pair}: ucp / limit <= {c['ucp_over_limit_max']:g}",
                                 _num(c["ucp_over_limit"]), v])
                else:
                    rows.append([f"{pair}: ucp / DCP <= {c['ucp_over_dcp_max']:g}", _num(c["ucp_over_dcp"]), v])
    for pair, rec in ((docs.get("restart") or {}).get("restart") or {}).get("pairs", {}).items():
        for key, what in (("wall_vs_dcp", "wall"), ("cpu_vs_dcp", "CPU seconds")):
            value = rec["wall_ratio"] if key == "wall_vs_dcp" else rec["cpu_ratio"]
            rows.append([f"{pair} restart (issue 36): ucp / DCP {what} <= {rec['target_max']:g}", _num(value),
                         rec["verdicts"][key]])
    vs = (docs.get("manager") or {}).get("vs_dcp") or {}
    names = {"mgr_over_dcp": "manager (local tier) / dcp.load FileSystemReader <= 1",
             "mgr_over_ucp": "manager (local tier) / dcp.load UCP classes <= 1",
             "ucp_over_dcp": "one process, dcp.load UCP classes / FileSystemReader <= 0.8",
             "ucp_over_limit": "one process, dcp.load UCP classes / limit <= 1.2",
             "mgr_s3_over_download": "manager (S3 tier) / whole-step download <= 1"}
    for key, v in (vs.get("verdicts") or {}).items():
        rows.append([f"manager: {names.get(key, key)}", _num(vs["ratio_medians"].get(key)), v])
    return rows


def v_table(m: dict[str, Any]) -> str:
    """The manager's vs_dcp table (the JSON's markdown) with the eviction check."""
    v = m["vs_dcp"]
    left = [run["residual_after_evict"] for w in v["ways"].values() for run in w["runs"]
            if run.get("residual_after_evict")]
    warn = f"\n\n**Eviction left {max(left)} B resident (loads were not cold).**" if left else ""
    runs = v["ways"]["ucp"]["runs"]
    reader = (f"\n\nucp reader counters after the last UCP-classes load: "
              f"`{json.dumps(runs[-1]['reader'], sort_keys=True)}`") if runs and runs[-1].get("reader") else ""
    return m.get("vs_dcp_markdown", "") + warn + reader


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def summary(status: dict[str, Any], env: dict[str, Any], docs: dict[str, dict[str, Any] | None],
            wall_s: float) -> str:
    """The markdown summary: parts, environment, issue-22 verdicts, then each part's tables."""
    torch_v = env["checks"].get("torch", "?")
    lines = ["# ucp_dcp issue 22 benchmarks (benchmarks/device_run.py)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {env['cpus']} CPUs, "
             f"{env.get('mem_total_gib', 0):.0f} GiB; Python {env['python']}, torch {torch_v}; work dir "
             f"{env['workdir']} ({env['workdir_fs']}, read_ahead_kb {env['read_ahead_kb']}); load average at "
             f"start {env['load_avg'][0]:.1f}, at end {env.get('load_avg_end', [0])[0]:.1f}; wall {wall_s:.0f} s", "",
             markdown_table(["part", "status", "seconds"],
                            [[n, s["status"], f"{s['seconds']:.0f}"] for n, s in status.items()]), ""]
    bad = {k: v for k, v in env["checks"].items() if str(v).startswith("FAILED")}
    if bad:
        lines += [f"**Environment checks failed:** {bad}", ""]
    rows = verdict_rows(docs)
    missed = sum(r[2] == "MISSED" for r in rows)
    lines += ["## Issue 22 and 36 targets (medians of paired ratios; informational)", "",
              markdown_table(["target", "value", "verdict"], rows) if rows else "(no results)", "",
              f"{len(rows) - missed} met, {missed} MISSED", ""]
    failures = [f"{part}: {f}" for part, doc in docs.items() if doc for f in doc.get("failures", [])]
    if failures:
        lines += ["## Failures", "", *(f"- {f[:500]}" for f in failures), ""]
    if docs.get("reshard_same"):
        lines += _reshard_section("Same layout: one process, dp4 -> dp4, dp2tp2 -> dp2tp2", docs["reshard_same"])
    if (docs.get("restart") or {}).get("restart"):
        lines += _restart_section(docs["restart"])
    m = docs.get("manager")
    if m and m.get("vs_dcp", {}).get("median_s"):
        v = m["vs_dcp"]
        lines += ["## Manager restore vs dcp.load (cold, paired rounds)", "",
                  f"state {m['state']['MiB']:.0f} MiB ({m['state']['tensors']} tensors, {', '.join(m['state']['dtypes'])}),"
                  f" {m['config']['repeat']} rounds, read limit {(v.get('read_bytes_per_s') or 0) / 1e9:.2f} GB/s "
                  f"(limit {v['limit_s'] or 0:.3f} s), wall {m['wall_s']:.0f} s"
                  + (f"; S3 skipped: {v['s3_skipped']}" if v.get("s3_skipped") else ""), "",
                  v_table(m), ""]
    if docs.get("reshard_pairs"):
        lines += _reshard_section("Resharding: dp2tp2 -> dp3, dp4 -> dp3", docs["reshard_pairs"])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- --gpu (issue 35)

GPU_PARTS = ("gpu_checks", "cuda_tests", "gpu_load")


def gpu_parts(out: Path, work: Path, gb: float, device: str = "cuda") -> list[Part]:
    """The GPU parts: the round-trip checks, the CUDA tests, the load benchmark (``gb`` GB of state).

    ``device="cpu"``: the checks and the benchmark on CPU tensors (a self-test of the plumbing)."""
    return [
        Part("gpu_checks", ["benchmarks/gpu_checks.py", "--device", device, "--out", str(out / "gpu_checks.json")],
             120, "gpu_checks.json"),
        # --continue-on-collection-errors: a test module that cannot import here (an optional
        # dependency the lent machine lacks) must not stop the CUDA tests of the others.
        Part("cuda_tests", ["-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                            "--continue-on-collection-errors", "--junitxml", str(out / "cuda_tests.xml"), "tests"], 150, "cuda_tests.xml"),
        Part("gpu_load", ["benchmarks/bench_gpu.py", "--device", device, "--gb", f"{gb:g}", "--repeats", "2",
                          "--dir", str(work / "gpu_load"), "--out", str(out / "gpu_load.json")], 190, "gpu_load.json"),
    ]


def cuda_test_files() -> list[str]:
    """The test files that mark tests ``cuda`` (what ``pytest -m cuda`` selects from), by their text."""
    return sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.cuda" in f.read_text())


def gpu_environment() -> dict[str, Any]:
    """torch's and CUDA's versions, and the card (name, memory, capability, driver), each never raising."""
    import torch

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
    if not env["cuda_available"]:
        return env
    try:
        env["device_count"] = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 2),
                   capability=f"{props.major}.{props.minor}", cudnn=torch.backends.cudnn.version())
        nccl = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except Exception as e:  # recorded: the parts say what fails
        env["error"] = f"{type(e).__name__}: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        env["nvidia_smi"] = f"unavailable: {e}"
    return env


def junit_counts(path: Path) -> dict[str, int] | None:
    """tests, failures, errors and skipped of a pytest JUnit XML file (None if absent or unreadable)."""
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def load_rows(doc: dict[str, Any] | None) -> list[list[str]]:
    """The GPU load benchmark's headline rows: limits (pinned host->device, cold storage read) and loads."""
    rows = []
    for r in (doc or {}).get("rows", []):
        limit = r["step"] == "1 raw" and r["what"].startswith("host->device") or r["step"] == "3 storage"
        if limit or r["step"] == "4 load":
            ratio = f"{r['ratio']:.2f} of {r['ratio_to']}" if r.get("ratio") is not None else "(limit)"
            rows.append([r["what"], f"{r['bytes'] / 1e9:.2f}", f"{r['seconds']:.3f}", f"{r['gbps']:.2f}", ratio])
    return rows


def gpu_summary(doc: dict[str, Any]) -> str:
    """The markdown summary of a ``--gpu`` run (or of its dry run)."""
    g = doc["gpu"]
    card = (f"{g.get('device_name')}, {g.get('device_memory_gib')} GiB, capability {g.get('capability')}; "
            f"nvidia-smi: {g.get('nvidia_smi')}") if g.get("device_name") else "no CUDA device"
    lines = ["# ucp_dcp GPU paths (benchmarks/device_run.py --gpu)", "",
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {g['torch']}, CUDA {g['cuda']}; "
             f"{card}; wall {doc['wall_s']:.0f} s", ""]
    if doc["dry_run"] or not g["cuda_available"] and doc["device"] == "cuda":
        lines += ["**Nothing ran on a GPU** (" + ("dry run" if doc["dry_run"] else "no CUDA device") +
                  "): every step below is listed and skipped.", ""]
    elif doc["device"] == "cpu":
        lines += ["**Nothing ran on a GPU**: `--gpu-device cpu`, the same parts on CPU tensors "
                  "(a self-test of the plumbing; no number here is a GPU's).", ""]
    lines += [markdown_table(["part", "status", "seconds", "command"],
                             [[n, s["status"], f"{s['seconds']:.0f}", f"`{s['command']}`"]
                              for n, s in doc["parts"].items()]), ""]
    counts = doc.get("cuda_tests")
    lines += ["## CUDA tests (`pytest -m cuda`)", "",
              f"files with `cuda`-marked tests: {', '.join(doc['cuda_test_files'])}", "",
              (f"{counts['tests']} tests: {counts['failures']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped (cuda_tests.xml)") if counts else "(not run)", ""]
    checks = (doc.get("checks") or {}).get("checks", [])
    lines += ["## Round trips on the device (gpu_checks.py, bit-exact)", "",
              markdown_table(["check", "status", "detail"],
                             [[c["name"], c["status"], c["detail"].splitlines()[0][:200] if c["detail"] else ""]
                              for c in checks]) if checks else "(not run)", ""]
    rows = load_rows(doc.get("load"))
    load = doc.get("load") or {}
    cold = {r["what"]: r["seconds"] for r in load.get("rows", []) if r["step"] == "4 load"}
    if cold.get("UCPStorageReader, cold") and cold.get("FileSystemReader, cold"):
        rows.append(["FileSystemReader / UCPStorageReader time, cold", "", "", "",
                     f"{cold['FileSystemReader, cold'] / cold['UCPStorageReader, cold']:.2f}x"])
    lines += ["## Load into device memory, cold (bench_gpu.py; gpu_load.json)", "",
              (f"state {load['state_bytes'] / 1e9:.2f} GB; storage {load.get('storage', {}).get('fs_type', '?')}, "
               f"resident after eviction {load.get('storage', {}).get('resident_after_evict')}; failures "
               f"{load.get('failures')}\n\n" if load else "")
              + (markdown_table(["measurement", "GB", "s", "GB/s", "ratio"], rows) if rows else "(not run)"), ""]
    return "\n".join(lines) + "\n"


def gpu_main(args: argparse.Namespace, out: Path, t_start: float) -> int:
    """``--gpu``: the GPU parts within the budget, or (dry run, no CUDA) each listed and skipped."""
    gpu = gpu_environment()
    skip = None
    if args.dry_run:
        skip = "skipped: dry run" + ("" if gpu["cuda_available"] else " (no CUDA)")
    elif not gpu["cuda_available"] and args.gpu_device == "cuda":
        skip = "skipped: no CUDA"
    work = (Path(args.workdir).resolve() if args.workdir else default_workdir()) if not skip else Path("WORK")
    wanted = set(args.parts.split(",")) if args.parts else set(GPU_PARTS)
    unknown = wanted - set(GPU_PARTS)
    if unknown:
        raise SystemExit(f"device_run: unknown --gpu parts {sorted(unknown)}; choose from {', '.join(GPU_PARTS)}")
    budget = args.budget_s if args.budget_s is not None else 450.0
    print(f"device_run --gpu: torch {gpu['torch']}, CUDA {gpu['cuda']}, device {gpu.get('device_name', 'none')}, "
          f"results to {out}" + (f" ({skip})" if skip else ""), flush=True)
    env_vars = _env_vars()
    status: dict[str, Any] = {}
    with open(out / "logs.txt", "w") as log:
        for part in gpu_parts(out, work, args.gpu_gb, args.gpu_device):
            if part.name not in wanted:
                continue
            command = " ".join(["python", *part.args])
            (out / part.result).unlink(missing_ok=True)  # a stale result must not pass for this run's
            if skip:
                status[part.name] = {"status": skip, "seconds": 0.0, "rc": None, "command": command}
                if part.name == "gpu_checks":  # lists every check, skipped (a real run of the script's plumbing)
                    how = ["--dry-run"] if args.dry_run else ["--device", args.gpu_device]
                    res = run_part("gpu_checks (listing)", [sys.executable, "benchmarks/gpu_checks.py", *how,
                                                            "--out", str(out / part.result)], 120, log, env=env_vars)
                    if res["status"] != "ok":
                        status[part.name]["status"] = f"{skip}; listing the checks: {res['status']}"
                print(f"device_run --gpu: {part.name}: {status[part.name]['status']}", flush=True)
                continue
            left = budget - (time.perf_counter() - t_start)
            if left < 20:
                status[part.name] = {"status": "skipped: budget spent", "seconds": 0.0, "rc": None, "command": command}
                continue
            print(f"device_run --gpu: {part.name} (up to {min(part.cap_s, left):.0f} s) ...", flush=True)
            status[part.name] = {**run_part(part.name, [sys.executable, *part.args], min(part.cap_s, left), log,
                                            env=env_vars), "command": command}
            shutil.rmtree(work / part.name, ignore_errors=True)
            print(f"device_run --gpu: {part.name}: {status[part.name]['status']} in "
                  f"{status[part.name]['seconds']:.0f} s", flush=True)
    if not skip and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {"mode": "gpu", "device": args.gpu_device, "dry_run": args.dry_run,
                           "ran_on_gpu": skip is None and args.gpu_device == "cuda", "gpu": gpu,
                           "parts": status, "cuda_test_files": cuda_test_files(),
                           "cuda_tests": junit_counts(out / "cuda_tests.xml"),
                           "checks": _load(out / "gpu_checks.json"), "load": _load(out / "gpu_load.json"),
                           "gpu_gb": args.gpu_gb, "budget_s": budget}
    doc["wall_s"] = time.perf_counter() - t_start
    text = gpu_summary(doc)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    print(text)
    if skip:
        return 0
    clean = all(s["status"] == "ok" for s in status.values()) and len(status) == len(wanted)
    return 0 if clean else 1


def _env_vars() -> dict[str, str]:
    """This process's environment with the checkout's src/ first on PYTHONPATH."""
    env_vars = dict(os.environ)
    src = str(REPO / "src")
    if src not in env_vars.get("PYTHONPATH", "").split(os.pathsep):
        env_vars["PYTHONPATH"] = os.pathsep.join(x for x in (src, env_vars.get("PYTHONPATH")) if x)
    return env_vars


def default_workdir() -> Path:
    """A fresh directory on a disk-backed file system: /tmp, or out/ in the checkout where /tmp is tmpfs."""
    root = Path(tempfile.gettempdir())
    if fs_type(str(root)) == "tmpfs":
        root = REPO / "out"
        root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="ucp_device_run_", dir=root))


def main(argv: Sequence[str] | None = None) -> int:
    """Run every part within the budget, write the results and the summary; 0 if every part finished cleanly."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"), help="result folder (default: $OUT, else out/device)")
    p.add_argument("--workdir", default=os.environ.get("WORK"),
                   help="where checkpoints go, on the disk to measure (default: a fresh folder under /tmp)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-clock budget of all parts (default 430; with --gpu 450)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats: checks the plumbing only")
    p.add_argument("--parts", default=None,
                   help="comma-separated subset of reshard_same, restart, manager, reshard_pairs "
                        "(with --gpu: of gpu_checks, cuda_tests, gpu_load)")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU parts instead (issue 35): gpu_checks.py, pytest -m cuda, bench_gpu.py")
    p.add_argument("--gpu-gb", type=float, default=2.0, help="with --gpu: the load benchmark's state, GB (default 2)")
    p.add_argument("--gpu-device", choices=["cuda", "cpu"], default="cuda",
                   help="with --gpu: cpu runs the checks and the benchmark on CPU tensors (a self-test)")
    p.add_argument("--dry-run", action="store_true",
                   help="with --gpu: list every step (and every round-trip check), each skipped; run nothing heavy")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out or REPO / "out" / "device").resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        return gpu_main(args, out, t_start)
    if args.dry_run:
        p.error("--dry-run goes with --gpu")
    if args.budget_s is None:
        args.budget_s = 430.0
    if args.parts is None:
        args.parts = "reshard_same,restart,manager,reshard_pairs"
    work = Path(args.workdir).resolve() if args.workdir else default_workdir()
    work.mkdir(parents=True, exist_ok=True)
    env_vars = _env_vars()
    env = environment(work)
    print(f"device_run: {env['cpus']} CPUs, torch {env['checks'].get('torch')}, work dir {work} "
          f"({env['workdir_fs']}), results to {out}", flush=True)
    wanted = set(args.parts.split(","))
    status: dict[str, Any] = {}
    docs: dict[str, dict[str, Any] | None] = {}
    with open(out / "logs.txt", "w") as log:
        for part in parts(args.quick, work, out, env["checks"].get("s3") == "ok"):
            if part.name not in wanted:
                continue
            left = args.budget_s - (time.perf_counter() - t_start)
            if left < 20:
                status[part.name] = {"status": "skipped: budget spent", "seconds": 0.0, "rc": None}
                continue
            (out / part.result).unlink(missing_ok=True)  # a stale result must not pass for this run's
            print(f"device_run: {part.name} (up to {min(part.cap_s, left):.0f} s) ...", flush=True)
            status[part.name] = run_part(part.name, [sys.executable, *part.args], min(part.cap_s, left), log,
                                         env=env_vars)
            shutil.rmtree(work / part.name, ignore_errors=True)
            docs[part.name] = _load(out / part.result)
            print(f"device_run: {part.name}: {status[part.name]['status']} in "
                  f"{status[part.name]['seconds']:.0f} s", flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    env["load_avg_end"] = list(os.getloadavg())
    wall = time.perf_counter() - t_start
    text = summary(status, env, docs, wall)
    (out / "summary.md").write_text(text)
    verdicts = [{"target": t, "value": v, "verdict": x} for t, v, x in verdict_rows(docs)]
    (out / "summary.json").write_text(json.dumps({"parts": status, "env": env, "verdicts": verdicts,
                                                  "wall_s": wall, "quick": args.quick}, indent=1))
    print(text)
    clean = all(s["status"] == "ok" for s in status.values()) and len(status) == len(wanted)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
