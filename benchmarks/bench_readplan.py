#!/usr/bin/env python
"""Planning time and plan size of the job-wide read plan (dcp/read_once/plan.py) at scale.

No rank processes and no files: one process builds every rank's needed byte ranges of a
native checkpoint of Llama-2-70B's 723 bf16 weights (``harness.states.llama_weights``) and
times what the read-once coordinator does with them, two ways (``--plans``):

* ``rank``: the per-rank plan, ``plan_job_reads`` on every rank's needs (and
  ``schedule_rounds`` where its rows stay under 20M), one transfer row per (piece, receiver);
* ``group``: the compact plan the coordinator makes (dcp/read_once/rounds.py): ranks with
  identical needs grouped by digest (``need_groups``; in a load each rank hashes its own needs),
  ``plan_group_reads``, and the messages (``dcp.read_once.messages``: each rank's part and the
  part every rank gets alike), one transfer row per (piece, receiving group).

With ``--out`` every configuration is run ``--repeats`` times (medians of the seconds, each run
listed) plus once under ``tracemalloc`` for the peak memory the planning allocates beyond its
input (every rank's needs, built before), and the JSON records the command, the load average
and the machine.

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
    python benchmarks/bench_readplan.py --plans group,rank --worlds 1024,4096 --repeats 3 \
        --out benchmarks/results/vm-2026-11-26/readplan_replicated.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from harness.cli import comma_list
from harness.report import write_json
from harness.states import llama_weights

from ucp_dcp.dcp.read_once import messages
from ucp_dcp.dcp.read_once.plan import JobReadPlan, plan_job_reads
from ucp_dcp.dcp.read_once.ranges import expand
from ucp_dcp.dcp.read_once.rounds import (
    GroupReadPlan,
    plan_group_reads,
    stream_positions,
)

# The per-rank plan's rounds, and grouping every rank's needs in one process, are the tests'
# reference (tests/readplan_reference.py), not a load's code.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from readplan_reference import exchange_windows, need_groups, schedule_rounds  # noqa: E402

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


def _group_plan_nbytes(plan: GroupReadPlan) -> int:
    t = plan.transfers
    arrays = [plan.read_rank, plan.read_file, plan.read_start, plan.read_length]
    arrays += [plan.read_offsets, plan.send_offsets, plan.recv_index, plan.recv_offsets]
    arrays += [t.reader, t.group, t.file, t.start, t.length, t.at, plan.groups.group_of]
    return sum(a.nbytes for a in arrays)


def _rank_shares_bytes(plan: JobReadPlan, budget: int) -> tuple[int, int]:
    """The per-rank path's coordinator step before the compact plan (own reads added, windows,
    each rank's sends and receives cut out, the windows in every share): (bytes of all the
    shares, bytes of the largest)."""
    windows = exchange_windows(plan, budget)
    at = stream_positions(plan)
    t, world = plan.transfers, plan.world_size
    sizes = np.zeros(world, np.int64)
    for me, peer in ((t.reader, t.receiver), (t.receiver, t.reader)):
        order = np.lexsort((at, peer, me))
        rows = np.stack([peer, t.file, t.start, t.length, at], axis=1)[order]
        sizes += np.bincount(me, minlength=world) * rows.itemsize * 5
        del rows
    sizes += windows.nbytes
    return int(sizes.sum()), int(sizes.max())


def run_rank(
    target: str, world: int, budget: int, needs: Needs | None = None
) -> dict[str, object]:
    """The per-rank path as the coordinator ran it: plan with own reads, windows and shares (of
    ``needs``, built from ``target`` and ``world`` unless given)."""
    needs = TARGETS[target](world) if needs is None else needs
    t0 = time.perf_counter()
    full = plan_job_reads(needs, own_reads=True)
    t1 = time.perf_counter()
    total, largest = _rank_shares_bytes(full, budget)
    t2 = time.perf_counter()
    t = full.transfers
    rows = np.bincount(t.reader, minlength=world) + np.bincount(t.receiver, minlength=world)
    return {
        "target": target,
        "world": world,
        "plan": "rank",
        "plan_s": t1 - t0,
        "shares_s": t2 - t1,
        "total_s": t2 - t0,
        "transfer_rows": len(t),
        "plan_MB": _plan_nbytes(full) / 1e6,
        "max_share_rows": int(rows.max()),
        "messages_MB": total / 1e6,
        "max_message_MB": largest / 1e6,
        "max_read_over_ideal": float(full.bytes_read_per_rank.max())
        / (full.unique_bytes / world),
    }


def run_group(
    target: str, world: int, budget: int, needs: Needs | None = None
) -> dict[str, object]:
    """The compact path: group by digest, plan, the messages (of ``needs`` as in run_rank)."""
    needs = TARGETS[target](world) if needs is None else needs
    t0 = time.perf_counter()
    groups = need_groups(needs)
    t1 = time.perf_counter()
    plan = plan_group_reads(groups)
    t2 = time.perf_counter()
    parts, common = messages(plan, budget)
    t3 = time.perf_counter()
    t, sizes = plan.transfers, groups.sizes
    share_rows = [
        len(p.sends) + (len(p.recvs) if p.recvs is not None else len(common.group_recvs[int(g)]))
        for p, g in zip(parts, groups.group_of.tolist())
    ]
    own = t.group == groups.group_of[t.reader]
    loads = plan.bytes_read_per_rank
    return {
        "target": target,
        "world": world,
        "plan": "group",
        "groups": len(groups.extents),
        "digest_s": t1 - t0,
        "plan_s": t2 - t1,
        "shares_s": t3 - t2,
        "total_s": t3 - t0,
        "transfer_rows": len(t),
        "read_rows": len(plan.read_rank),
        "plan_MB": _group_plan_nbytes(plan) / 1e6,
        "max_share_rows": max(share_rows),
        "messages_MB": (sum(p.nbytes for p in parts) + common.nbytes) / 1e6,
        "shared_MB": common.nbytes / 1e6,
        "max_message_MB": (max(p.nbytes for p in parts) + common.nbytes) / 1e6,
        "unique_GB": plan.unique_bytes / 1e9,
        "read_over_unique": plan.read_bytes / plan.unique_bytes,
        "max_read_over_ideal": float(loads.max()) / (plan.unique_bytes / world),
        "exchanged_GB": float((t.length * (sizes[t.group] - own)).sum()) / 1e9,
        "rounds": common.count,
    }


RUNS: dict[str, Callable[[str, int, int, Needs | None], dict[str, object]]] = {
    "rank": run_rank,
    "group": run_group,
}


def measure(plan: str, target: str, world: int, budget: int, repeats: int) -> dict[str, Any]:
    """``repeats`` timed runs (medians of the seconds, each run listed), then one under
    tracemalloc for the peak bytes the planning allocates (numpy's arrays included)."""
    runs = [RUNS[plan](target, world, budget, None) for _ in range(repeats)]
    row: dict[str, Any] = dict(runs[0])
    for k in [k for k in row if k.endswith("_s")]:
        row[k] = round(statistics.median(r[k] for r in runs), 3)  # type: ignore[misc]
        row[k + "_runs"] = [round(r[k], 3) for r in runs]  # type: ignore[call-overload]
    needs = TARGETS[target](world)  # the input (every rank's needs), outside the traced peak
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    RUNS[plan](target, world, budget, needs)
    row["peak_MB"] = round((tracemalloc.get_traced_memory()[1] - base) / 1e6, 1)
    tracemalloc.stop()
    for k, v in row.items():
        if isinstance(v, float) and not k.endswith("_s"):
            row[k] = round(v, 4)
    row["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="64,1024,4096", help="even world sizes (64,1024,4096)")
    ap.add_argument("--targets", default=",".join(TARGETS), help="hsdp,replicated (default both)")
    ap.add_argument("--budget-mib", type=int, default=64, help="MiB per rank per round (64)")
    ap.add_argument(
        "--plans", default="", help="rank,group: the coordinator's two paths, measured (--out)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (3)")
    ap.add_argument("--out", default="", help="JSON file for --plans runs")
    args = ap.parse_args()
    worlds = [int(w) for w in comma_list(ap, args.worlds, what="world size")]
    targets = comma_list(ap, args.targets, list(TARGETS), "target")
    if not args.plans:
        for target in targets:
            for world in worlds:
                print(json.dumps(run(target, world, args.budget_mib << 20)), flush=True)
        return
    plans = comma_list(ap, args.plans, list(RUNS), "plan")
    load_start = [round(x, 2) for x in os.getloadavg()]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for target in targets:
        for world in worlds:
            for plan in plans:
                row = measure(plan, target, world, args.budget_mib << 20, args.repeats)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        doc = {
            "command": "python " + " ".join(["benchmarks/bench_readplan.py", *sys.argv[1:]]),
            "started": started,
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
            "env": {
                "python": platform.python_version(),
                "numpy": np.__version__,
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "platform": platform.platform(),
            },
            "budget_bytes": args.budget_mib << 20,
            "rows": rows,
        }
        print(f"wrote {write_json(args.out, doc)}")


if __name__ == "__main__":
    main()
