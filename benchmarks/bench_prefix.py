#!/usr/bin/env python
"""The prefix of a one-process load: the time before the first data byte is asked of storage.

Issue 36 asks that ``UCPStorageReader``'s index parse, planning, header reads and block-check
setup take at most DCP's prefix + 10 ms for states of up to 1,000 tensors, and grow linearly
beyond. This script saves an FSDP2 model (on a 1-rank mesh) with its AdamW state, with
``--tensors`` state-dict tensors, once with ucp_dcp and once with DCP's ``FileSystemWriter``,
then loads each back ``--repeats`` times, cold (``POSIX_FADV_DONTNEED``), alternating which goes
first, and records per load:

* ``prefix``: from ``dcp.load`` to the first payload read: for ucp_dcp the first
  ``RangeReader.read`` (after the index, the plan, the data files' headers and the block-check
  setup); for DCP the start of ``FileSystemReader.read_data`` (after ``.metadata`` and the plan;
  its first read is the next thing it does);
* ``total``: the whole ``dcp.load``.

Prints the medians and the paired differences ucp - DCP of each, and writes them as JSON with
``--out``; ``--profile`` adds a cProfile of one more cold load of each size. Run on an idle
machine::

    python benchmarks/bench_prefix.py --tensors 136,1000,4000 --repeats 9 --out prefix.json
    python benchmarks/bench_prefix.py --tensors 136 --repeats 3 --profile /tmp/prefix.prof
    python -c "import pstats; pstats.Stats('/tmp/prefix.prof.176').print_stats(40)"
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.pagecache import evict_tree  # noqa: E402  (puts this checkout's src/ first)
from harness.states import tensors  # noqa: E402
from profile_same_layout import _state as _fsdp2_state  # noqa: E402

from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter  # noqa: E402
from ucp_dcp.byteio.rangeio import RangeReader  # noqa: E402


def state(tensors: int, elements: int) -> dict[str, Any]:
    """An FSDP2 model of Linear layers (weight and bias: 6 state-dict tensors each with AdamW's
    moments, and its step counters) with about ``tensors`` tensors of about ``elements`` elements
    each, after one AdamW step (:func:`profile_same_layout._state`)."""
    return _fsdp2_state(max(2, int(elements**0.5)), max(1, tensors // 6))


class Clock:
    """The time of the first payload read of a load (patched into both readers)."""

    def __init__(self) -> None:
        self.first: float | None = None
        rr_read = RangeReader.read
        fs_read = dcp.FileSystemReader.read_data
        clock = self

        def ucp_read(self: Any, segments: Any) -> None:
            if clock.first is None and segments:
                clock.first = time.perf_counter()
            rr_read(self, segments)

        def dcp_read(self: Any, plan: Any, planner: Any) -> Any:
            if clock.first is None:
                clock.first = time.perf_counter()
            return fs_read(self, plan, planner)

        RangeReader.read = ucp_read  # type: ignore[method-assign]
        dcp.FileSystemReader.read_data = dcp_read  # type: ignore[method-assign]

    def load(self, kind: str, path: str, sd: dict[str, Any]) -> tuple[float, float]:
        """(prefix, total) seconds of one cold load."""
        evict_tree(path)
        self.first = None
        t0 = time.perf_counter()
        if kind == "ucp":
            dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
        else:
            dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        t1 = time.perf_counter()
        first = self.first if self.first is not None else t1
        return first - t0, t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", default="136,1000", help="comma-separated state sizes in tensors")
    ap.add_argument("--elements", type=int, default=65536, help="elements per weight (about)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--profile",
        default=None,
        help="also write a cProfile of one more cold ucp_dcp load of each size (PROFILE.<tensors>)",
    )
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    work = args.dir or tempfile.mkdtemp(prefix="prefix-")
    clock = Clock()
    results: list[dict[str, Any]] = []
    for n in [int(x) for x in args.tensors.split(",")]:
        sd = state(n, args.elements)
        count = sum(1 for _ in tensors(sd))
        paths = {k: os.path.join(work, f"{n}-{k}") for k in ("ucp", "dcp")}
        dcp.save(sd, storage_writer=UCPStorageWriter(paths["ucp"]), planner=UCPSavePlanner())
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(paths["dcp"]))
        for k in ("ucp", "dcp"):  # warm-up: first-use costs
            clock.load(k, paths[k], sd)
        got: dict[str, list[tuple[float, float]]] = {"ucp": [], "dcp": []}
        for i in range(args.repeats):
            for k in ("ucp", "dcp") if i % 2 == 0 else ("dcp", "ucp"):
                got[k].append(clock.load(k, paths[k], sd))
        row: dict[str, Any] = {"tensors": count}
        for what, j in (("prefix", 0), ("total", 1)):
            for k in ("ucp", "dcp"):
                row[f"{k}_{what}_ms"] = round(1000 * statistics.median(t[j] for t in got[k]), 2)
            diffs = [u[j] - d[j] for u, d in zip(got["ucp"], got["dcp"])]
            row[f"{what}_diff_ms"] = round(1000 * statistics.median(diffs), 2)
        row["loadavg"] = os.getloadavg()[0]
        if args.profile:  # after the timed repeats: the profiler's overhead is in no timing
            prof = cProfile.Profile()
            evict_tree(paths["ucp"])
            prof.enable()
            dcp.load(sd, storage_reader=UCPStorageReader(paths["ucp"]), planner=UCPLoadPlanner())
            prof.disable()
            prof.dump_stats(f"{args.profile}.{count}")
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"repeats": args.repeats, "rows": results}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
