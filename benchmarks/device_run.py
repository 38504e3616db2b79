#!/usr/bin/env python3
"""Issue 22's benchmarks in one unattended run on a bigger machine; results and a summary in ``$OUT``.

Run from the repository root::

    PYTHONPATH=$PWD/src python3 benchmarks/device_run.py          # ~3-4 min on 16 cores; never over --budget-s
    python3 benchmarks/device_run.py --quick --out out/device     # smoke run of the plumbing (~2 min on 2 cores)

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

``$OUT`` (or ``--out``) receives at most 6 files, no folders:
``summary.md`` (every table and verdict), ``summary.json`` (the parts'
status, the environment, every issue-22 verdict with its value),
``reshard_same.json``, ``manager.json``, ``reshard_pairs.json`` (each
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
RESHARD_PAIRS = "dp2tp2-dp3,dp4-dp3"


@dataclass(frozen=True)
class Part:
    """One benchmark run: its name, its command line (after ``python``), its time cap, its result file."""

    name: str
    args: list[str]
    cap_s: float
    result: str


def parts(quick: bool, work: Path, out: Path, s3: bool) -> list[Part]:
    """The three benchmark parts, full size or (``quick``) tiny."""
    if quick:
        reshard = ["--size-mb", "20", "--hidden", "1024", "--repeats", "2", "--probe-mb", "8"]
        manager = ["--quick", "--mb", "8", "--layers", "4", "--repeat", "2", "--probe-mb", "8"]
    else:
        # ~1 GB of fp32 weights + AdamW, 5 paired cold loads per pair; saves are not issue 22's subject
        reshard = ["--size-mb", "1000", "--repeats", "5", "--save-repeats", "2", "--probe-mb", "1024"]
        manager = ["--mb", "1024", "--repeat", "5", "--probe-mb", "1024"]
    common = ["--formats", "dcp,ucp"]
    return [
        Part("reshard_same", ["benchmarks/bench_reshard.py", *reshard, *common, "--pairs", SAME_PAIRS,
                              "--workdir", str(work / "reshard_same"), "--out", str(out / "reshard_same.json")],
             170, "reshard_same.json"),
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


def verdict_rows(docs: dict[str, dict[str, Any] | None]) -> list[list[str]]:
    """(target, value, verdict) for every issue-22 target the parts' results hold."""
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
    lines += ["## Issue 22 targets (medians of paired ratios; informational)", "",
              markdown_table(["target", "value", "verdict"], rows) if rows else "(no results)", "",
              f"{len(rows) - missed} met, {missed} MISSED", ""]
    failures = [f"{part}: {f}" for part, doc in docs.items() if doc for f in doc.get("failures", [])]
    if failures:
        lines += ["## Failures", "", *(f"- {f[:500]}" for f in failures), ""]
    if docs.get("reshard_same"):
        lines += _reshard_section("Same layout: one process, dp4 -> dp4, dp2tp2 -> dp2tp2", docs["reshard_same"])
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
    p.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of all parts (default 330)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats: checks the plumbing only")
    p.add_argument("--parts", default="reshard_same,manager,reshard_pairs",
                   help="comma-separated subset of reshard_same, manager, reshard_pairs")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out or REPO / "out" / "device").resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir).resolve() if args.workdir else default_workdir()
    work.mkdir(parents=True, exist_ok=True)
    env_vars = dict(os.environ)
    src = str(REPO / "src")
    if src not in env_vars.get("PYTHONPATH", "").split(os.pathsep):
        env_vars["PYTHONPATH"] = os.pathsep.join(x for x in (src, env_vars.get("PYTHONPATH")) if x)
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
