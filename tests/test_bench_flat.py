"""Smoke test of the flat-shard benchmark (``benchmarks/bench_flat.py --quick``): it runs to the end,
every load it makes is verified bit-exact, and the report it prints holds every ratio. No timing
is asserted. Its report once failed on ``ReadOptions.gap_bytes`` being None (the storage's
default), and nothing ran it to notice."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_flat  # noqa: E402  (benchmarks/)


def test_quick_run_is_verified_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "flat.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = bench_flat.main(["--quick", "--out", str(out), "--workdir", str(tmp_path / "work")])
    text = printed.getvalue()
    assert rc == 0, text[-3000:]
    assert "every load verified bit-exact against the full reference" in text
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["cut_rows"], result.get("failures")
    table = result["table"]
    for words in ("ucp / gather+dcp", "ucp / dcp fsdp2", "ucp read amp (rchar)", "gap_bytes default"):
        assert words in table, (words, table)
    assert set(result["loads"]) == set(bench_flat.LOAD_FORMATS)
