"""Smoke test of bench_manager's section 5: the manager's cold restore against plain ``dcp.load``, paired.

Runs ``benchmarks/bench_manager.py --sections vs_dcp`` from this process on
a tiny state with two rounds and a small storage probe, and checks the
report's structure: every way ran once per round in a rotated order, every
load was compared bit for bit (no mismatch), the manager restored from the
local tier, the paired ratios are the medians of the per-round ratios, a
verdict per issue-22 target, and the markdown table. With moto and s3fs
installed, the S3 restore and the whole-step download are paired too. No
timing is asserted.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
from s3_server import _have_s3

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_manager  # noqa: E402  (benchmarks/)


def test_manager_restore_against_dcp_is_paired_and_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "manager.json"
    argv = ["--sections", "vs_dcp", "--quick", "--mb", "6", "--layers", "4", "--repeat", "2", "--probe-mb", "4",
            "--dir", str(tmp_path / "work"), "--out", str(out)]
    s3 = _have_s3()
    rc = bench_manager.main(argv if s3 else [*argv, "--no-s3"])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    r = doc["vs_dcp"]
    ways = r["ways"]
    assert list(ways) == ["dcp", "ucp", "mgr"]
    # round 0 runs dcp, ucp, mgr; round 1 ucp, mgr, dcp
    assert [ways[w]["positions"] for w in ways] == [[0, 2], [1, 0], [2, 1]]
    for w, v in ways.items():
        assert v["error"] is None and v["mismatches"] == [], w  # every load compared bit for bit
        assert len(v["s"]) == 2
    assert all(run["restore"]["tier"] == "local" and run["restore"]["step"] == 7 for run in ways["mgr"]["runs"])
    assert all(run["residual_after_evict"] == 0 for w in ("dcp", "ucp") for run in ways[w]["runs"])
    assert ways["ucp"]["runs"][0]["reader"]["bytes_requested"] > 0
    for key, (a, b) in {"mgr_over_dcp": ("mgr", "dcp"), "mgr_over_ucp": ("mgr", "ucp"),
                        "ucp_over_dcp": ("ucp", "dcp")}.items():
        per_round = [x / y for x, y in zip(ways[a]["s"], ways[b]["s"])]
        assert r["paired_ratios"][key] == pytest.approx(per_round)
        assert r["ratio_medians"][key] == pytest.approx(statistics.median(per_round))
    assert r["limit_s"] == pytest.approx(r["bytes"] / r["read_bytes_per_s"])
    assert r["ratio_medians"]["ucp_over_limit"] == pytest.approx(statistics.median(ways["ucp"]["s"]) / r["limit_s"])
    want = {"mgr_over_dcp", "mgr_over_ucp", "ucp_over_dcp", "ucp_over_limit"} | ({"mgr_s3_over_download"} if s3 else set())
    assert set(r["verdicts"]) == want and set(r["verdicts"].values()) <= {"met", "MISSED"}
    assert "`CheckpointManager.load`, local tier" in doc["vs_dcp_markdown"]
    assert "issue 22 targets" in printed.out
    if s3:
        assert r["s3"]["mgr_s3"]["mismatches"] == [] and len(r["s3"]["download"]["s"]) == 2
        assert r["s3"]["download"]["runs"][0]["bytes"] >= r["bytes"]
        assert all(run["restore"]["tier"] == "persistent" for run in r["s3"]["mgr_s3"]["runs"])
    else:
        assert r["s3"] is None and r["s3_skipped"]
