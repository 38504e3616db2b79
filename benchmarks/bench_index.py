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
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
from harness import Column, text_table, write_json
from harness.report import RESULTS_DIR
from harness.states import TP, llama_entries, mesh_shape_of, placements_for

from ucp_dcp.byteio.location import write_index
from ucp_dcp.core.sharding import placement_to_str
from ucp_dcp.dcp._mesh_groups import MeshGroup, TensorSpec, compact_records
from ucp_dcp.format import FileRecord, Layout, build_index, data_file_name, dtype_name
from ucp_dcp.format.records import _layout_grid  # its cache is emptied before each timed step
from ucp_dcp.sources.native import load_index

COLUMNS = [Column("mesh", 8, "<"), Column("W", 6, gap=1), Column("files", 6, gap=1), Column("build (coord)", 14, gap=1),
           Column("write", 8, gap=1), Column("index", 10, gap=1), Column("load_index", 11, gap=1),
           Column("grids", 8, gap=1)]


@dataclass
class IndexRow:
    """One (mesh, W): the coordinator's index build and one rank's read of it."""

    mesh: str
    world_size: int
    tensors: int
    files: int
    coordinator_build_s: float  # compact_records + build_index
    write_index_s: float
    index_bytes: int  # size of ucp_index.json
    load_index_s: float  # one rank's parse and validation
    grids_s: float  # one rank's grid expansion of every tensor
    expected_counts_s: float  # the per-rank write counts the coordinator checks against

    def cells(self) -> list[str]:
        """The row's table cells."""
        return [self.mesh, str(self.world_size), str(self.files), f"{self.coordinator_build_s * 1e3:.1f} ms",
                f"{self.write_index_s * 1e3:.1f} ms", f"{self.index_bytes / 1e6:.2f} MB",
                f"{self.load_index_s * 1e3:.1f} ms", f"{self.grids_s * 1e3:.1f} ms"]


def run(world: int, mesh_kind: str, layers: int) -> IndexRow:
    """Build, write and read back the index of the 70B-class model on ``mesh_kind`` at ``world`` ranks."""
    entries = llama_entries(layers, optimizer=False)
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
    return IndexRow(mesh_kind, world, len(specs), len(files), t_build, t_write, size, t_read, t_grids, t_counts)


def main(argv: list[str] | None = None) -> int:
    """Command line: every (W, mesh), a table on stdout, the rows in ``--out``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="64,1024,4096,16384,65536")
    p.add_argument("--meshes", default="fsdp,fsdp_tp")
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--out", default=str(RESULTS_DIR / "index.json"))
    a = p.parse_args(argv)
    rows = []
    print(text_table(COLUMNS, [])[0])
    for w in [int(x) for x in a.world_sizes.split(",")]:
        for m in a.meshes.split(","):
            if m == "fsdp_tp" and w % TP:
                continue
            r = run(w, m, a.layers)
            rows.append(asdict(r))
            print(text_table(COLUMNS, [r.cells()])[1], flush=True)
    write_json(a.out, {"command": [sys.executable, *sys.argv], "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
