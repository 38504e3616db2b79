"""Smoke test of the storage-speed benchmark: the limits and the reports, never their timings.

Runs ``benchmarks/bench_reshard.py`` from this process once, on a small
resharding pair (dp4 -> dp3) and the three same-layout pairs (one process,
dp4 -> dp4, dp2tp2 -> dp2tp2; ~20 MB, dcp and ucp, 2 paired repeats, 4
gloo ranks) with a small storage probe, then builds the size-sweep table
and plot of ``bench_sweep.py`` from its result. It checks that every number
the storage-speed page and issue 22's table quote is recorded (needed and
pulled bytes, the limit, the ratios, peak memory, the save limits, a
verdict per target, the paired repeats' order) and that the loads were
exact; no timing is asserted. Also checks ``harness.limits.parallel_write`` and
``parallel_sequential_read`` move exactly the bytes they should.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
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
    """Every (readers, block) and writer count is tried; the fastest of each runs again ``confirm`` times and
    the median of those is the limit; no scratch is left."""
    res = limits.storage_limits(str(tmp_path), 4 << 20, files=2, read_threads=(1, 3), read_blocks=(1 << 20,),
                                write_threads=(1, 2), confirm=3)
    assert [(r["threads"], r["block"]) for r in res.read_runs] == [(1, 1 << 20), (3, 1 << 20)]
    assert [r["threads"] for r in res.write_runs] == [1, 2]
    assert res.best_single_read_bytes_per_s == max(r["bytes_per_s"] for r in res.read_runs) > 0
    assert res.best_single_write_bytes_per_s == max(r["bytes_per_s"] for r in res.write_runs) > 0
    best_read = (res.best_read["threads"], res.best_read["block"])
    assert [(r["threads"], r["block"]) for r in res.read_confirm] == [best_read] * 3
    assert [r["threads"] for r in res.write_confirm] == [res.best_write["threads"]] * 3
    assert res.read_bytes_per_s == statistics.median(r["bytes_per_s"] for r in res.read_confirm)
    assert res.write_bytes_per_s == statistics.median(r["bytes_per_s"] for r in res.write_confirm)
    single = limits.storage_limits(str(tmp_path), 1 << 20, files=1, read_threads=(1,), read_blocks=(1 << 20,),
                                   write_threads=(1,), confirm=0)
    assert single.read_confirm == [] and single.read_bytes_per_s == single.best_single_read_bytes_per_s
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def reshard_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict]:
    """One small run (~20 MB, dcp and ucp, 2 paired repeats) of a resharding pair and the three same-layout
    pairs, in one spawn of 4 gloo ranks: (exit status, what it printed, the result JSON)."""
    tmp = tmp_path_factory.mktemp("reshard")
    out = tmp / "reshard.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench_reshard.main(["--size-mb", "20", "--hidden", "1024", "--pairs", ",".join(PAIRS),
                                 "--formats", "dcp,ucp", "--repeats", "2", "--probe-mb", "8",
                                 "--workdir", str(tmp / "ck"), "--out", str(out)])
    return rc, printed.getvalue(), json.loads(out.read_text()) if out.exists() else {}


PAIRS = ("dp4-dp3", "dp1-dp1", "dp4-dp4", "dp2tp2-dp2tp2")


def test_bench_reshard_reports_the_physical_limits(reshard_run: tuple[int, str, dict], tmp_path: Path) -> None:
    """The limit tables are printed and every quoted number is in the JSON; loads exact."""
    rc, printed, doc = reshard_run
    assert rc == 0, printed
    assert "storage speed: ucp against the physical limits" in printed
    assert "load average" in printed
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
    assert set(doc["verdicts"].values()) <= {"met", "MISSED"}
    # 3 per pair, 2 per source layout (dp4, dp1, dp2tp2), then issue 22's: one per pair, + the one-process limit,
    # then issue 36's: wall and CPU seconds against DCP, per pair
    assert len(doc["verdicts"]) == 3 * 4 + 2 * 3 + 4 + 1 + 2 * 4
    for pair, c in doc["common_case"].items():  # CPU seconds of both formats, every rank summed
        assert c["ucp_cpu_s"] > 0 and c["dcp_cpu_s"] > 0, pair
        assert c["ucp_cpu_over_dcp"] == pytest.approx(statistics.median(c["ucp_cpu_over_dcp_runs"])), pair
    assert "| dp4 → dp3 |" in doc["storage_speed_md"]

    # The sweep's table and plot from this one result (the sweep itself just runs main per size).
    points = [bench_sweep.point(20.0, doc, "dp4-dp3")]
    assert "dp4-dp3" in bench_sweep.table(points)
    png = tmp_path / "sweep.png"
    drawn = bench_sweep.plot(points, ["dp4-dp3"], png)
    assert drawn == png.exists()


def test_same_layout_pairs_against_dcp_and_the_limit(reshard_run: tuple[int, str, dict]) -> None:
    """Loads without resharding (one process, dp4 -> dp4, dp2tp2 -> dp2tp2) next to a resharding pair: every load
    bit-exact, both formats cold in alternating order, ucp/DCP and ucp/limit as medians of the per-repeat ratios,
    and a verdict per issue-22 target. No timing is asserted."""
    rc, printed, doc = reshard_run
    assert rc == 0, printed
    assert "issue 22" in printed
    by_pair = {rec["pair"]: rec for rec in doc["pairs"]}
    assert set(by_pair) == set(PAIRS)
    for pair, rec in by_pair.items():
        for fmt in ("dcp", "ucp"):
            f = rec["formats"][fmt]
            assert f["mismatches"] == [] and f["error"] is None, (pair, fmt)  # every load compared bit for bit
            assert len(f["load_s_runs"]) == 2
        # repeat 0 runs dcp first, repeat 1 ucp first
        assert rec["formats"]["dcp"]["run_positions"] == [0, 1] and rec["formats"]["ucp"]["run_positions"] == [1, 0]
        counters = rec["formats"]["ucp"]["reader_per_rank"]
        assert len(counters) == bench_reshard.LAYOUTS[bench_reshard.PAIRS[pair][1]].world
        assert all(c["bytes_requested"] >= 0 for c in counters)
    common = doc["common_case"]
    assert set(common) == set(PAIRS)
    for pair, c in common.items():
        same = pair != "dp4-dp3"
        assert c["same_layout"] is same
        runs = by_pair[pair]["formats"]
        want = [u / d for u, d in zip(runs["ucp"]["load_s_runs"], runs["dcp"]["load_s_runs"])]
        assert c["ucp_over_dcp_runs"] == pytest.approx(want)
        assert c["ucp_over_dcp"] == pytest.approx(sum(want) / 2)  # the median of two
        assert c["ucp_over_limit"] == pytest.approx(sum(runs["ucp"]["load_s_runs"]) / 2 / c["limit_s"])
        assert c["ucp_over_dcp_max"] == (0.8 if same else 1.0)
        keys = ({"same_layout_vs_dcp"} if same else {"not_slower_than_dcp"}) | {"wall_vs_dcp_36", "cpu_vs_dcp_36"}
        if pair == "dp1-dp1":
            keys.add("one_process_over_limit")
            assert c["ranks"] == 1
        assert set(c["verdicts"]) == keys and set(c["verdicts"].values()) <= {"met", "MISSED"}
        assert all(doc["verdicts"][f"{pair}/{k}"] == v for k, v in c["verdicts"].items())
    assert "| dp1 → dp1 (one process) | 1 |" in doc["common_case_md"]
