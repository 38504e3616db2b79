#!/usr/bin/env python
"""Planning time and plan size of the job-wide read plan (core/readplan.py) at scale.

No rank processes and no files: one process builds every rank's needed byte ranges of a
native checkpoint of Llama-2-70B's 723 bf16 weights (``harness.states.llama_weights``) and
times ``plan_job_reads`` and ``schedule_rounds`` on them.

Checkpoint layout: each data file is a header (512 bytes per chunk, rounded up to a page),
then its chunks back to back, each starting on a 4 KiB page (as native files lay them out).

Targets, at world size W:

* ``hsdp``: saved ``Shard(0)`` on W ranks (file r holds chunk r of every weight, torch.chunk
  rows), loaded ``[Replicate(), Shard(0)]`` on a (2, W/2) mesh: every shard needed by two
  ranks, ~2 ranges per weight per rank.
* ``replicated``: saved from one rank (one file, whole weights), loaded fully replicated
  (every rank needs all 723 weights): W x 723 ranges.

Prints one line per (target, W): input ranges, seconds to plan and to schedule (64 MiB
rounds), plan rows and bytes, the most any rank reads against the unique bytes / W, and the
load average. Timings are noisy on a shared machine: run it alone when you compare.

    python benchmarks/bench_readplan.py                      # W = 64, 1024, 4096
    python benchmarks/bench_readplan.py --worlds 64,256 --targets hsdp
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
from harness.cli import comma_list
from harness.states import llama_weights

from ucp_dcp.core.exchange_rounds import exchange_windows, schedule_rounds, stream_positions
from ucp_dcp.core.ranges import expand
from ucp_dcp.core.readplan import JobReadPlan, plan_job_reads

Needs = list[dict[int, tuple[np.ndarray, np.ndarray]]]
PAGE = 4096
HEADER_PER_CHUNK = 512
BF16 = 2


def _rows_bytes() -> tuple[np.ndarray, np.ndarray]:
    """Rows and bytes per row of each of the 723 weights."""
    shapes = [shape for _, shape, _ in llama_weights(80)]
    rows = np.array([s[0] for s in shapes], np.int64)
    row_bytes = np.array([math.prod(s[1:]) * BF16 for s in shapes], np.int64)
    return rows, row_bytes


def _layout(chunk_bytes: np.ndarray) -> np.ndarray:
    """Offsets of chunks (rows: files, columns: chunks; 0 bytes = absent) in their files."""
    present = chunk_bytes > 0
    header = -(-(present.sum(axis=1) * HEADER_PER_CHUNK) // PAGE) * PAGE
    padded = -(-chunk_bytes // PAGE) * PAGE
    return header[:, None] + np.cumsum(padded, axis=1) - padded


def _to_needs(
    world: int, rank: np.ndarray, file: np.ndarray, start: np.ndarray, length: np.ndarray
) -> Needs:
    """Rows of (rank, file, start, length) as one Extents dict per rank."""
    order = np.lexsort((start, file, rank))
    rank, file, start, length = rank[order], file[order], start[order], length[order]
    edges = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (file[1:] != file[:-1]), True])
    needs: Needs = [{} for _ in range(world)]
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist()):
        needs[int(rank[a])][int(file[a])] = (start[a:b], length[a:b])
    return needs


def hsdp_needs(world: int) -> Needs:
    """Saved Shard(0) on ``world`` ranks, loaded [Replicate(), Shard(0)] on (2, world / 2)."""
    rows, row_bytes = _rows_bytes()
    chunk = -(-rows // world)  # torch.chunk rows per saved chunk
    src = np.arange(world)[:, None]
    lo, hi = np.minimum(src * chunk, rows), np.minimum((src + 1) * chunk, rows)
    offsets = _layout((hi - lo) * row_bytes)  # [file, weight]
    shards = world // 2
    tchunk = -(-rows // shards)
    out = []
    for w in range(len(rows)):
        t0 = np.minimum(np.arange(shards) * tchunk[w], rows[w])
        t1 = np.minimum(t0 + tchunk[w], rows[w])
        f0, f1 = t0 // chunk[w], np.where(t1 > t0, (t1 - 1) // chunk[w] + 1, t0 // chunk[w])
        shard, f = expand(f0, f1)
        r0 = np.maximum(t0[shard], f * chunk[w])
        r1 = np.minimum(t1[shard], (f + 1) * chunk[w])
        start = offsets[f, w] + (r0 - f * chunk[w]) * row_bytes[w]
        length = (r1 - r0) * row_bytes[w]
        for g in range(2):
            out.append((shard + g * shards, f, start, length))
    cat = [np.concatenate([o[i] for o in out]) for i in range(4)]
    return _to_needs(world, *cat)


def replicated_needs(world: int) -> Needs:
    """Saved from one rank (one file), needed whole by every rank."""
    rows, row_bytes = _rows_bytes()
    sizes = rows * row_bytes
    offsets = _layout(sizes[None, :])[0]
    return [{0: (offsets.copy(), sizes.copy())} for _ in range(world)]


def _plan_nbytes(plan: JobReadPlan) -> int:
    arrays = [
        plan.read_rank,
        plan.read_file,
        plan.read_start,
        plan.read_length,
        plan.read_offsets,
        plan.send_offsets,
        plan.recv_index,
        plan.recv_offsets,
    ]
    t = plan.transfers
    arrays += [t.reader, t.receiver, t.file, t.start, t.length]
    return sum(a.nbytes for a in arrays)


def _least_rounds(plan: JobReadPlan, budget: int) -> int:
    """The most any rank reads, sends or receives, in rounds of ``budget``: a floor under any
    schedule that sends a byte in the round it is read."""
    t = plan.transfers
    if not len(t):
        return 0
    most = max(
        np.bincount(t.reader, t.length).max(),
        np.bincount(t.receiver, t.length).max(),
        plan.bytes_read_per_rank.max(),
    )
    return -(-int(most) // budget)


TARGETS = {"hsdp": hsdp_needs, "replicated": replicated_needs}


MAX_ROUND_ROWS = 20_000_000  # schedule_rounds is materialised only below this many rows


def run(target: str, world: int, budget: int) -> dict[str, object]:
    """Plan and schedule one target at one world size; the numbers of one printed line."""
    needs = TARGETS[target](world)
    ranges = sum(len(s) for extents in needs for s, _ in extents.values())
    t0 = time.perf_counter()
    plan = plan_job_reads(needs)
    t1 = time.perf_counter()
    windows = exchange_windows(plan, budget)
    u0 = stream_positions(plan)
    t2 = time.perf_counter()
    t = plan.transfers
    w = windows[t.reader]
    first, last = u0 // w, (u0 + t.length - 1) // w
    round_rows = int((last - first + 1).sum())
    rounds_s = None
    if round_rows <= MAX_ROUND_ROWS:
        t3 = time.perf_counter()
        rounds = schedule_rounds(plan, budget)
        rounds_s = round(time.perf_counter() - t3, 3)
        assert len(rounds) == (int(last.max()) + 1 if len(t) else 0)
    loads = plan.bytes_read_per_rank
    return {
        "target": target,
        "world": world,
        "input_ranges": ranges,
        "plan_s": round(t1 - t0, 3),
        "windows_s": round(t2 - t1, 3),
        "rounds_s": rounds_s,
        "read_rows": len(plan.read_rank),
        "transfer_rows": len(t),
        "plan_MB": round(_plan_nbytes(plan) / 1e6, 1),
        "unique_GB": round(plan.unique_bytes / 1e9, 2),
        "read_over_unique": round(plan.read_bytes / plan.unique_bytes, 4),
        "max_read_over_ideal": round(float(loads.max()) / (plan.unique_bytes / world), 4),
        "exchanged_GB": round(t.nbytes / 1e9, 2),
        "rounds": int(last.max()) + 1 if len(t) else 0,
        "least_rounds": _least_rounds(plan, budget),
        "round_rows": round_rows,
        "loadavg": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="64,1024,4096", help="even world sizes (64,1024,4096)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="hsdp,replicated (default both)")
    ap.add_argument("--budget-mib", type=int, default=64, help="MiB per rank per round (64)")
    args = ap.parse_args()
    worlds = [int(w) for w in comma_list(ap, args.worlds, what="world size")]
    for target in comma_list(ap, args.targets, list(TARGETS), "target"):
        for world in worlds:
            print(json.dumps(run(target, world, args.budget_mib << 20)), flush=True)


if __name__ == "__main__":
    main()
