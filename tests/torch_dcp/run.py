#!/usr/bin/env python
"""Run PyTorch's DCP tests twice, with DCP's defaults and with the UCP classes substituted.

One command, from the repository root::

    python tests/torch_dcp/run.py

It runs ``pytest`` over ``tests/torch_dcp/upstream/`` (PyTorch's
``test/distributed/checkpoint`` files, brought in by ``get_tests.py``) once
with ``UCP_DCP_SUBSTITUTE=0`` and once with ``UCP_DCP_SUBSTITUTE=1``, on CPU
(``CUDA_VISIBLE_DEVICES=""``; multi-process tests use gloo), then writes

* ``tests/torch_dcp/results.json``: per test id, the outcome and failure
  cause of each run, the counts, timings and the test files' hashes;
* ``tests/torch_dcp/RESULTS.md``: the same as tables.

Every test that passes with the defaults must pass substituted or be listed
in ``tests/torch_dcp/EXPECTED.md`` (as not applicable, or as a known library
failure). The exit status is 1 when one is neither, 0 otherwise.

Options: ``--only default|substituted`` runs one pass (the other's outcomes
are taken from the previous results.json), ``-k EXPR`` selects tests,
``--timeout S`` bounds each test (default 300 s).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
UPSTREAM = HERE / "upstream"
DEPS = HERE / "_deps"
RESULTS = HERE / "results.json"
SUMMARY = HERE / "RESULTS.md"
EXPECTED = HERE / "EXPECTED.md"
MANIFEST = HERE / "MANIFEST.json"
SCRATCH = HERE / "_runs"

MODES = ("default", "substituted")
_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|\s*(.*?)\s*\|\s*$")


def short_id(nodeid: str) -> str:
    """Test id relative to upstream/ (what EXPECTED.md and the tables use)."""
    prefix = "tests/torch_dcp/upstream/"
    return nodeid[len(prefix):] if nodeid.startswith(prefix) else nodeid


def read_expected(path: Path = EXPECTED) -> dict[str, dict[str, str]]:
    """EXPECTED.md table rows: ``| `test id` | category | reason |``."""
    out: dict[str, dict[str, str]] = {}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _ROW.match(line)
        if m and "::" in m.group(1):
            out[m.group(1)] = {"category": m.group(2).strip().lower(), "reason": m.group(3).strip()}
    return out


def _env(mode: str, records: Path, sublog: Path, timeout: int) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT / "src")]
    if DEPS.is_dir():
        paths.append(str(DEPS))
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        UCP_DCP_TORCH_TESTS="1",
        UCP_DCP_SUBSTITUTE="1" if mode == "substituted" else "0",
        UCP_DCP_RESULTS=str(records),
        UCP_DCP_SUBSTITUTE_LOG=str(sublog),
        UCP_DCP_TEST_TIMEOUT=str(timeout),
        # MultiProcessTestCase's own per-test limit (its default is 300 s).
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(max(timeout - 10, 30)),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


def _pytest(args: list[str], env: dict[str, str], log: Path | None = None) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    if log is None:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr
    with open(log, "w", encoding="utf-8") as f:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    return p.returncode, log.read_text(encoding="utf-8", errors="replace")


def collect(env: dict[str, str], select: list[str]) -> list[str]:
    rc, out = _pytest(["--collect-only", "-q", *select], env)
    ids = [ln.strip() for ln in out.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))]
    if rc not in (0, 5) and not ids:
        sys.exit(f"collection failed:\n{out[-4000:]}")
    return ids


def run_mode(mode: str, select: list[str], timeout: int) -> dict:
    """One pytest pass; returns {"tests": {id: {...}}, "seconds": s, "substituted_processes": n}."""
    SCRATCH.mkdir(exist_ok=True)
    records = SCRATCH / f"{mode}.jsonl"
    sublog = SCRATCH / f"{mode}.substituted-pids"
    log = SCRATCH / f"{mode}.log"
    for p in (records, sublog):
        p.unlink(missing_ok=True)
    env = _env(mode, records, sublog, timeout)
    ids = collect(env, select)
    print(f"[{mode}] {len(ids)} tests collected; running (log: {log.relative_to(ROOT)})", flush=True)
    t0 = time.monotonic()
    _pytest(["-q", "-rN", *select], env, log)
    seconds = round(time.monotonic() - t0, 1)

    tests: dict[str, dict] = {short_id(i): {"outcome": "not run"} for i in ids}
    if records.exists():
        for line in records.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            t = tests.setdefault(short_id(rec["nodeid"]), {"outcome": "not run"})
            t["seconds"] = round(t.get("seconds", 0.0) + rec.get("duration", 0.0), 2)
            if rec["outcome"] == "failed":
                outcome = "timeout" if rec.get("timeout") else ("failed" if rec["when"] == "call" else "error")
                if t["outcome"] not in ("failed", "error", "timeout"):
                    t["outcome"] = outcome
                    t["cause"] = rec.get("cause", "")
            elif rec["outcome"] == "skipped" and t["outcome"] == "not run":
                t["outcome"] = "skipped"
                t["reason"] = rec.get("reason", "")
            elif rec["outcome"] == "passed" and rec["when"] == "call" and t["outcome"] == "not run":
                t["outcome"] = "passed"
    procs = len(sublog.read_text().splitlines()) if sublog.exists() else 0
    counts: dict[str, int] = {}
    for t in tests.values():
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    print(f"[{mode}] {seconds} s: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())), flush=True)
    return {"tests": tests, "seconds": seconds, "substituted_processes": procs}


def file_hashes() -> dict[str, str]:
    out = {}
    for p in sorted(UPSTREAM.rglob("test_*.py")):
        out[str(p.relative_to(UPSTREAM))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def summarize(runs: dict[str, dict], expected: dict[str, dict[str, str]]) -> dict:
    ids = sorted(set(runs["default"]["tests"]) | set(runs["substituted"]["tests"]))
    table = {}
    for i in ids:
        d = runs["default"]["tests"].get(i, {"outcome": "not run"})
        s = runs["substituted"]["tests"].get(i, {"outcome": "not run"})
        row = {"default": d["outcome"], "substituted": s["outcome"]}
        if d.get("cause"):
            row["default_cause"] = d["cause"]
        if d.get("reason"):
            row["default_reason"] = d["reason"]
        if s.get("cause"):
            row["substituted_cause"] = s["cause"]
        if s.get("reason"):
            row["substituted_reason"] = s["reason"]
        if d["outcome"] == "passed":
            if s["outcome"] == "passed":
                row["status"] = "pass"
            elif i in expected and expected[i]["category"].startswith("not applicable"):
                row["status"] = "not applicable"
                row["expected_reason"] = expected[i]["reason"]
            elif i in expected:
                row["status"] = "known failure"
                row["expected_reason"] = expected[i]["reason"]
            else:
                row["status"] = "UNLISTED FAILURE"
        else:
            row["status"] = "not in baseline"
        table[i] = row
    baseline = [i for i in ids if table[i]["default"] == "passed"]
    fail_sub = [i for i in baseline if table[i]["substituted"] != "passed"]
    counts = {
        "collected": len(ids),
        "default_passed": len(baseline),
        "default_skipped": sum(1 for i in ids if table[i]["default"] == "skipped"),
        "default_failed": sum(1 for i in ids if table[i]["default"] in ("failed", "error", "timeout", "not run")),
        "substituted_passed": len(baseline) - len(fail_sub),
        "substituted_failed": len(fail_sub),
        "not_applicable": sum(1 for i in fail_sub if table[i]["status"] == "not applicable"),
        "known_failures": sum(1 for i in fail_sub if table[i]["status"] == "known failure"),
        "unlisted_failures": sum(1 for i in fail_sub if table[i]["status"] == "UNLISTED FAILURE"),
        "substituted_passed_outside_baseline": sum(
            1 for i in ids if table[i]["default"] != "passed" and table[i]["substituted"] == "passed"
        ),
    }
    # An entry is stale when its test passes substituted, or when its file ran
    # and the test is gone (a run of other files says nothing about it).
    ran_files = {i.split("::")[0] for i in table}
    stale = sorted(
        i for i in expected
        if (i in table and table[i]["status"] == "pass") or (i not in table and i.split("::")[0] in ran_files)
    )
    causes: dict[str, list[str]] = {}
    for i in fail_sub:
        if table[i]["status"] != "not applicable":
            causes.setdefault(_cause_head(table[i].get("substituted_cause", table[i]["substituted"])), []).append(i)
    return {"tests": table, "counts": counts, "stale_expected": stale, "failure_causes": causes}


def _cause_head(cause: str) -> str:
    """Cause with run-specific details (paths, numbers after the head) trimmed, to group tests."""
    head = re.sub(r"/tmp/[^\s'\"]+", "<tmp>", cause)
    return head[:120]


def write_summary(data: dict) -> None:
    c = data["counts"]
    lines = [
        "# PyTorch DCP tests with the UCP classes substituted",
        "",
        f"Generated by `python tests/torch_dcp/run.py` on {data['generated']} "
        f"(torch {data['torch']}, {data['platform']}). See docs/torch-dcp-tests.md.",
        "",
        "| count | tests |",
        "| --- | ---: |",
        f"| collected | {c['collected']} |",
        f"| pass with DCP's defaults (CPU) | {c['default_passed']} |",
        f"| skipped with DCP's defaults (need CUDA / more GPUs) | {c['default_skipped']} |",
        f"| fail with DCP's defaults (test newer/older than this torch, or needs CUDA) | {c['default_failed']} |",
        f"| of the default-passing: pass substituted | {c['substituted_passed']} |",
        f"| of the default-passing: fail substituted | {c['substituted_failed']} |",
        f"| ... of which not applicable (EXPECTED.md) | {c['not_applicable']} |",
        f"| ... of which known library failures (EXPECTED.md) | {c['known_failures']} |",
        f"| ... of which unlisted | {c['unlisted_failures']} |",
        "",
        f"Run time: defaults {data['seconds']['default']} s, substituted {data['seconds']['substituted']} s. "
        f"Processes that ran substituted: {data['substituted_processes']}.",
        "",
    ]
    if data["failure_causes"]:
        lines += ["## Failures substituted, by cause", "", "| tests | cause |", "| ---: | --- |"]
        for cause, ids in sorted(data["failure_causes"].items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| {len(ids)} | {_md(cause)} |")
        lines.append("")
    if data["stale_expected"]:
        lines += ["## EXPECTED.md entries that no longer fail", ""]
        lines += [f"- `{i}`" for i in data["stale_expected"]] + [""]
    lines += ["## Every test", "", "| test | defaults | substituted | status | cause / reason |", "| --- | --- | --- | --- | --- |"]
    for i, row in data["tests"].items():
        why = row.get("expected_reason") or row.get("substituted_cause") or row.get("default_cause") or row.get(
            "default_reason", ""
        )
        lines.append(f"| `{i}` | {row['default']} | {row['substituted']} | {row['status']} | {_md(why)} |")
    SUMMARY.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")[:160]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=MODES, help="run one pass; the other is taken from the previous results.json")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per test (default 300)")
    ap.add_argument("tests", nargs="*", help="test ids or files under tests/torch_dcp/upstream (default: all)")
    args = ap.parse_args(argv)

    if not any(UPSTREAM.rglob("test_*.py")):
        print(
            "No PyTorch test files in tests/torch_dcp/upstream/. Bring them in first:\n"
            "  python tests/torch_dcp/get_tests.py --from /path/to/pytorch   (a PyTorch source tree)\n"
            "See docs/torch-dcp-tests.md.",
            file=sys.stderr,
        )
        return 2
    probe = subprocess.run(
        [sys.executable, "-c", "import expecttest"], env=_env("default", Path(os.devnull), Path(os.devnull), 1)
    )
    if probe.returncode != 0:
        print(
            "torch.testing._internal needs the 'expecttest' package: pip install expecttest "
            "(or pip install --target tests/torch_dcp/_deps expecttest)",
            file=sys.stderr,
        )
        return 2

    select = [str(Path("tests/torch_dcp/upstream") / t) for t in args.tests] or ["tests/torch_dcp/upstream"]
    if args.keyword:
        select += ["-k", args.keyword]

    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else None
    runs: dict[str, dict] = {}
    for mode in MODES:
        if args.only and mode != args.only:
            if not previous:
                sys.exit(f"--only {args.only} needs a previous results.json for the {mode} pass")
            runs[mode] = {
                "tests": {i: {"outcome": r[mode], **({"cause": r[f"{mode}_cause"]} if f"{mode}_cause" in r else {})}
                          for i, r in previous["tests"].items()},
                "seconds": previous["seconds"][mode],
                "substituted_processes": previous.get("substituted_processes", 0) if mode == "substituted" else 0,
            }
            continue
        runs[mode] = run_mode(mode, select, args.timeout)

    if runs["substituted"]["substituted_processes"] == 0:
        print("warning: no process reported an active substitution in the substituted pass", file=sys.stderr)

    import platform

    import torch

    data = {
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "selection": select,
        "seconds": {m: runs[m]["seconds"] for m in MODES},
        "substituted_processes": runs["substituted"]["substituted_processes"],
        "files": file_hashes(),
    }
    data.update(summarize(runs, read_expected()))
    RESULTS.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    write_summary(data)
    c = data["counts"]
    print(
        f"pass with defaults: {c['default_passed']}; pass substituted: {c['substituted_passed']}; "
        f"fail substituted: {c['substituted_failed']} (not applicable {c['not_applicable']}, "
        f"known failures {c['known_failures']}, unlisted {c['unlisted_failures']})"
    )
    print(f"wrote {RESULTS.relative_to(ROOT)} and {SUMMARY.relative_to(ROOT)}")
    for i in data["stale_expected"]:
        print(f"note: EXPECTED.md lists {i}, which no longer fails substituted")
    return 1 if c["unlisted_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
