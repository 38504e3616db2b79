#!/usr/bin/env python
"""The coordinator's index build and one rank's index read, at any world size.

``bench_scale.py`` simulates every rank, which at 16384 ranks takes most of
an hour on 2 cores (it builds every rank's plan, at ~60 ms each). The
index, though, depends only on the mesh groups and the writer rule, so this
script measures it directly: the same 70B-class state and meshes as
``bench_scale.py``, the coordinator's ``compact_records`` + ``build_index``
+ ``write_index`` (what ``UCPStorageWriter.finish`` does after the plans
are settled) and ``load_index`` (what every rank's ``read_metadata`` parses),
plus the expansion of a layout's grid that a loading rank pays once per
distinct (layout, shape).

Usage::

    python benchmarks/bench_index.py                       # W = 64, 1024, 4096, 16384, 65536
    python benchmarks/bench_index.py --world-sizes 16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import TP, mesh_shape_of, placements_for, state_entries  # noqa: E402

from ucp_dcp.dcp.compact import MeshGroup, TensorSpec, compact_records  # noqa: E402
from ucp_dcp.format import FileRecord, Layout, _layout_grid, data_file_name, dtype_name  # noqa: E402
from ucp_dcp.format import build_index, load_index, write_index  # noqa: E402
from ucp_dcp.core.sharding import placement_to_str  # noqa: E402


def run(world: int, mesh_kind: str, layers: int) -> dict[str, float | int | str]:
    entries = state_entries(layers, optimizer=False)
    mesh = mesh_shape_of(mesh_kind, world)
    specs = tuple(sorted(
        (TensorSpec(e.fqn, dtype_name(e.dtype), e.shape,
                    Layout(mesh, tuple(placement_to_str(p) for p in placements_for(mesh_kind, e.role, True))))
         for e in entries),
        key=lambda t: t.fqn,
    ))
    _layout_grid.cache_clear()
    t0 = time.perf_counter()
    group = MeshGroup(mesh, tuple(range(world)), specs)
    owners = {t.fqn: group for t in specs}
    counts = np.zeros(world, dtype=np.int64)
    for t in specs:  # what each rank reports writing (the coordinator checks it)
        counts += np.bincount(group.writer_ranks(t), minlength=world)
    t_counts = time.perf_counter() - t0
    total = sum(e.dtype.itemsize * int(np.prod(e.shape)) for e in entries)
    files = [FileRecord(data_file_name(r, "0123abcd"), r, total // world) for r in range(world) if counts[r]]
    _layout_grid.cache_clear()
    group = MeshGroup(mesh, tuple(range(world)), specs)
    owners = {t.fqn: group for t in specs}
    t0 = time.perf_counter()
    records = compact_records(owners, {r: r for r in range(world)}, files, {r: int(c) for r, c in enumerate(counts)})
    index = build_index(world, files, [[] for _ in files], None, records)
    t_build = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        write_index(d, index)
        t_write = time.perf_counter() - t0
        size = os.path.getsize(os.path.join(d, "ucp_index.json"))
        _layout_grid.cache_clear()
        t0 = time.perf_counter()
        loaded = load_index(d)
        t_read = time.perf_counter() - t0
        t0 = time.perf_counter()
        for rec in loaded.tensors.values():  # a loading rank's one-time grid expansion
            rec.grid()
        t_grids = time.perf_counter() - t0
    return {"mesh": mesh_kind, "world_size": world, "tensors": len(specs), "files": len(files),
            "coordinator_build_s": t_build, "write_index_s": t_write, "index_bytes": size,
            "load_index_s": t_read, "grids_s": t_grids, "expected_counts_s": t_counts}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="64,1024,4096,16384,65536")
    p.add_argument("--meshes", default="fsdp,fsdp_tp")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "index.json"))
    a = p.parse_args()
    rows = []
    print(f"{'mesh':8} {'W':>6} {'files':>6} {'build (coord)':>14} {'write':>8} {'index':>10} {'load_index':>11} {'grids':>8}")
    for w in [int(x) for x in a.world_sizes.split(",")]:
        for m in a.meshes.split(","):
            if m == "fsdp_tp" and w % TP:
                continue
            r = run(w, m, a.layers)
            rows.append(r)
            print(f"{m:8} {w:>6} {r['files']:>6} {r['coordinator_build_s'] * 1e3:>11.1f} ms {r['write_index_s'] * 1e3:>5.1f} ms "
                  f"{r['index_bytes'] / 1e6:>7.2f} MB {r['load_index_s'] * 1e3:>8.1f} ms {r['grids_s'] * 1e3:>5.1f} ms", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": [sys.executable, *sys.argv], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
