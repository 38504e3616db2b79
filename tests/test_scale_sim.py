"""The scale simulator's sizes, as regression tests (sizes only: timings belong in benchmarks/).

Runs the ``--quick`` scenarios of ``benchmarks/bench_scale.py`` from this
process (``bench_scale.run``, each configuration in a forked child as the
script does: W=64 and 256 virtual ranks, a 4-layer 70B-shaped model, our
formats only) and checks what must not grow with the world size: the plan
a rank sends carries no per-chunk item, the description of a mesh is sent
once, the index stays a few hundred bytes per tensor plus one record per
file, and load plans stay on their ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_scale  # noqa: E402  (benchmarks/)


def test_plans_and_index_do_not_grow_per_chunk(tmp_path: Path) -> None:
    """ucp at 64 and 256 virtual ranks, FSDP and FSDP+TP: compact plans, compact index, local load plans."""
    # --no-isolate: the configurations run in this process. Children forked from a pytest process
    # that had run the S3-server tests took 30 s instead of 6 (measured); nothing asserted here
    # needs a child's fresh memory accounting.
    args = bench_scale.parse_args(["--quick", "--formats", "ucp", "--sample-ranks", "3", "--no-isolate", "--out", str(tmp_path)])
    doc = bench_scale.run(args)
    assert (tmp_path / "scale.json").exists()
    by = {(c["mesh"], c["world_size"]): c for c in doc["configs"]}
    assert set(by) == {(m, w) for m in ("fsdp", "fsdp_tp") for w in (64, 256)}
    for (mesh, w), c in by.items():
        assert c["status"] == "ok", c
        save, load = c["save"], c["load"]
        assert save["local_items"] == 0 and save["global_items"] == 0, (mesh, w)  # nothing per chunk travels
        assert save["final_items"] > 0  # ... but every rank derived its writes
        assert load["local_plan_bytes"]["max"] < 1000, (mesh, w)  # load items stay on the rank
    for mesh in ("fsdp", "fsdp_tp"):
        small, big = by[(mesh, 64)]["save"], by[(mesh, 256)]["save"]
        # Per rank: the same small plan whatever W (the mesh's first rank also sends the description once).
        assert big["local_plan_bytes"]["median"] <= small["local_plan_bytes"]["median"] + 64
        assert big["local_plan_bytes"]["max"] <= small["local_plan_bytes"]["max"] + 2048
        assert big["write_results_bytes"]["max"] <= small["write_results_bytes"]["max"] + 64
        # The index grows by one file record per rank, not by tensors x ranks.
        per_rank = (big["metadata_bytes"] - small["metadata_bytes"]) / (256 - 64)
        assert per_rank < 120, per_rank
