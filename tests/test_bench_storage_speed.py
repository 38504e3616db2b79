"""Smoke test of the storage-speed benchmark: the limits and the reports, never their timings.

Runs ``benchmarks/bench_reshard.py`` from this process on one small pair
(dp4 -> dp3, ~20 MB, dcp and ucp, 4 gloo ranks) with a small storage probe,
then builds the size-sweep table and plot of ``bench_sweep.py`` from its
result. It checks that every number the storage-speed page quotes is
recorded (needed and pulled bytes, the limit, the ratios, peak memory, the
save limits, a verdict per target) and that the loads were exact; no
timing is asserted. Also checks ``harness.limits.parallel_write`` and
``parallel_sequential_read`` move exactly the bytes they should.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_reshard  # noqa: E402  (benchmarks/)
import bench_sweep  # noqa: E402
from harness import limits  # noqa: E402


def test_parallel_write_and_read_move_every_byte(tmp_path: Path) -> None:
    """3 writers write 5 MiB + 7 bytes in all, fsynced; 4 readers with 1 MiB reads read it all back."""
    total = (5 << 20) + 7
    paths = limits.parallel_write(str(tmp_path), total, 3, block=1 << 20)
    assert len(paths) == 3 and sum(os.path.getsize(p) for p in paths) == total
    expected = bytes(range(256)) * 2
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(512) == expected[:min(512, os.path.getsize(p))]
    assert limits.parallel_sequential_read(paths, 4, block=1 << 20) == total
    assert limits.parallel_sequential_read(paths, 1, block=4096) == total


def test_storage_limits_records_every_configuration(tmp_path: Path) -> None:
    """Every (readers, block) and writer count is tried; the best of each is the limit; no scratch is left."""
    res = limits.storage_limits(str(tmp_path), 4 << 20, files=2, read_threads=(1, 3), read_blocks=(1 << 20,),
                                write_threads=(1, 2))
    assert [(r["threads"], r["block"]) for r in res.read_runs] == [(1, 1 << 20), (3, 1 << 20)]
    assert [r["threads"] for r in res.write_runs] == [1, 2]
    assert res.read_bytes_per_s == max(r["bytes_per_s"] for r in res.read_runs) > 0
    assert res.write_bytes_per_s == max(r["bytes_per_s"] for r in res.write_runs) > 0
    assert list(tmp_path.iterdir()) == []


def test_bench_reshard_reports_the_physical_limits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One small pair: the limit tables are printed and every quoted number is in the JSON; loads exact."""
    out = tmp_path / "reshard.json"
    rc = bench_reshard.main(["--size-mb", "20", "--hidden", "1024", "--pairs", "dp4-dp3", "--formats", "dcp,ucp",
                             "--repeats", "1", "--probe-mb", "8", "--workdir", str(tmp_path / "ck"),
                             "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    assert "storage speed: ucp against the physical limits" in printed.out
    assert "load average" in printed.out
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    best = doc["storage_limits"]["best"]
    assert best["read_bytes_per_s"] == max(doc["storage_limits"][k]["read_bytes_per_s"] for k in ("start", "end"))
    lim = doc["pairs"][0]["limits"]
    assert lim["needed_bytes"] > 0 and lim["ucp_pulled_bytes"] >= lim["needed_bytes"]
    assert lim["limit_s"] == pytest.approx(lim["needed_bytes"] / best["read_bytes_per_s"])
    assert lim["ucp_over_limit"] == pytest.approx(lim["ucp_load_s"] / lim["limit_s"])
    for key in ("dcp_load_s", "dcp_pulled_bytes", "dcp_over_limit", "ucp_over_dcp", "ucp_peak_anon_per_rank_max"):
        assert lim[key] is not None, key
    assert set(lim["verdicts"]) >= {"load_over_limit", "vs_dcp", "memory"}
    save = doc["save_limits"]["dp4"]
    assert save["limit_s"] == pytest.approx(save["ucp_bytes"] / best["write_bytes_per_s"])
    assert save["dcp_save_s"] is not None
    assert set(doc["verdicts"].values()) <= {"met", "MISSED"} and len(doc["verdicts"]) == 5
    assert "| dp4 → dp3 |" in doc["storage_speed_md"]

    # The sweep's table and plot from this one result (the sweep itself just runs main per size).
    points = [bench_sweep.point(20.0, doc, "dp4-dp3")]
    assert "dp4-dp3" in bench_sweep.table(points)
    png = tmp_path / "sweep.png"
    drawn = bench_sweep.plot(points, ["dp4-dp3"], png)
    assert drawn == png.exists()
