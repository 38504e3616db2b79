#!/usr/bin/env python
"""Loads from a loopback S3 server under faults: deadlines and hedged reads vs. DCP's FsspecReader.

One run starts moto's S3 server on 127.0.0.1 (a child process,
``harness.objstore.MotoServer``) and the tests' fault proxy
(``tests/fault_proxy.py``, in this process) in front of it. A state of
``--size-mb`` MB (fp32 tensors, ``Shard(0)`` DTensors) is saved from 4 gloo
ranks twice, fault-free: with ``UCPStorageWriter`` and with DCP's
``FsspecWriter``. Then each reader loads it resharded on 3 ranks, into
NaN-filled targets, checked bit-exactly, under each fault scenario:

* ``none``: no fault;
* ``slow1`` / ``slow5``: each ranged GET is slowed with probability 1% / 5%
  to ``--slow-factor`` (20) times the median time of a ranged GET of the
  fault-free ucp load: with ``--slow-kind slow`` (the default) the proxy holds
  the whole answer that long, with ``--slow-kind trickle`` it sends the first
  64 KiB at once and spreads the rest over that long (a slow transfer, whose
  cancelled loser has sent part of its bytes);
* ``slow5+stall``: as ``slow5``, and the first ranged GET of the load never
  answers (the proxy holds it ``--stall-s`` (30 s) then closes it, unless
  the client gives up first).

Readers: ``ucp`` (``UCPStorageReader`` with ``RequestPolicy(deadline_floor_s=1,
deadline_factor=4)`` by default, ``--floor-s``/``--deadline-factor``: hedged reads and
deadlines), ``ucp-nohedge`` (the same, ``hedge=False``:
deadlines only) and ``dcp`` (``FsspecReader`` + DCP's default planner). A
load's time is the slowest rank's (barrier, ``dcp.load``, barrier); it is
reported relative to the same reader's fault-free load. Each (reader,
scenario) is one spawn of 3 ranks and one load, ``--repeats`` times
(interleaved: every repeat runs every cell once, so the shared machine's
noise falls on all cells alike); the summary gives each cell's median and
its median relative to the same reader's median fault-free time. Slowed
GETs are drawn with a seed per (scenario, reader, repeat).

The server is moto with ranged GETs that read only their range
(``harness.objstore._RANGED_READS``; stock moto reads the whole object for
every ranged GET, which makes a load's cost grow with its number of
requests as S3's does not); ``--stock-moto`` runs stock moto, as the older
result files did.

Usage::

    python benchmarks/bench_faults.py                  # 48 MB, every scenario and reader
    python benchmarks/bench_faults.py --size-mb 192 --repeats 3 --out benchmarks/results/vm-2026-11-26/bench_faults_hedged.json
    python benchmarks/bench_faults.py --size-mb 16 --readers ucp --scenarios none,slow5+stall

Needs ``moto[server]`` and ``s3fs``. See docs/object-storage.md ("Deadlines, hedged reads and
throttling").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import _srcpath  # noqa: F401  (the checkout's src/ first on sys.path)
from harness.launch import spawn_ranks
from harness.objstore import MotoServer, s3_environment, storage_options

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from fault_proxy import FaultProxy  # noqa: E402  (the tests' proxy: stall and slow faults)
from ucp_dcp import ReadOptions

SCENARIOS = ("none", "slow1", "slow5", "slow5+stall")
READERS = ("ucp", "ucp-nohedge", "dcp")
ROWS = 1024  # every tensor is (ROWS * k, 1024) fp32


def _tensors(size_mb: int) -> dict[str, tuple[int, int]]:
    """Six tensors of about ``size_mb`` MB in all."""
    rows = max(ROWS, (size_mb << 20) // 6 // 4096 // 12 * 12)  # divisible by 4 and 3 ranks
    return {f"w{i}": (rows, 1024) for i in range(6)}


def _full(name: str, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _state(mesh: Any, shapes: dict[str, tuple[int, int]], fill: float | None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    for name, shape in shapes.items():
        full = _full(name, shape)
        n, r = mesh.size(), mesh.get_local_rank()
        local = full.chunk(n, 0)[r].clone()
        if fill is not None:
            local.fill_(fill)
        out[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                       stride=full.stride())
    return out


def save_rank(rank: int, world: int, urls: dict[str, str], options: dict[str, Any],
              shapes: dict[str, tuple[int, int]]) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.device_mesh import init_device_mesh

    from ucp_dcp import UCPSavePlanner, UCPStorageWriter

    mesh = init_device_mesh("cpu", (world,))
    sd = {"model": _state(mesh, shapes, None)}
    dcp.save(sd, storage_writer=UCPStorageWriter(urls["ucp"], storage_options=options), planner=UCPSavePlanner())
    dcp.save(sd, storage_writer=FsspecWriter(urls["dcp"], sync_files=False, **options))


def load_rank(rank: int, world: int, reader_kind: str, url: str, options: dict[str, Any],
              shapes: dict[str, tuple[int, int]], policy_args: dict[str, float]) -> dict[str, Any]:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.device_mesh import init_device_mesh

    from ucp_dcp import RequestPolicy, UCPLoadPlanner, UCPStorageReader

    mesh = init_device_mesh("cpu", (world,))
    target = {"model": _state(mesh, shapes, float("nan"))}
    # The client's modules are imported before the clock starts, for every reader: FsspecReader's
    # constructor imports s3fs, UCPStorageReader opens its store in read_metadata (timed), and a
    # fresh process's import of s3fs and aiobotocore (0.4-0.7 s here) is not a load's cost.
    import aiobotocore.session  # noqa: F401
    import s3fs  # noqa: F401

    if reader_kind == "dcp":
        reader: Any = FsspecReader(url, **options)
        planner = None
    else:
        policy = RequestPolicy(**policy_args, hedge=reader_kind == "ucp")
        reader = UCPStorageReader(url, storage_options=options, options=ReadOptions(requests=policy))
        planner = UCPLoadPlanner()
    dist.barrier()
    t0 = time.perf_counter()
    err = ""
    try:
        dcp.load(target, storage_reader=reader, planner=planner)
    except BaseException as e:  # noqa: BLE001 (reported, the run goes on)
        err = f"{type(e).__name__}: {e}"[:400]
    took = time.perf_counter() - t0
    dist.barrier()
    slowest = torch.tensor([took])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    wrong = [] if err else [
        k for k, v in target["model"].items()
        if not torch.equal(v.to_local().view(torch.int32), _full(k, shapes[k]).chunk(world, 0)[rank].view(torch.int32))
    ]
    out: dict[str, Any] = {"seconds": float(slowest), "own_seconds": took, "error": err, "wrong": wrong}
    store = getattr(getattr(reader, "source", None), "store", None)
    if store is not None:
        from dataclasses import asdict

        out["object_stats"] = asdict(store.stats)
    return out


def _ranged_get(m: str, p: str, h: Any) -> bool:
    return m == "GET" and h.get("Range") is not None


def run(args: argparse.Namespace) -> dict[str, Any]:
    s3_environment()
    shapes = _tensors(args.size_mb)
    nbytes = sum(r * c * 4 for r, c in shapes.values())
    doc: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/bench_faults.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_start": os.getloadavg()},
        "policy": {"deadline_floor_s": args.floor_s, "deadline_factor": args.deadline_factor,
                   **({"max_part_bytes": args.max_request_kib << 10} if args.max_request_kib else {}),
                   **({"min_part_bytes": args.min_request_kib << 10} if args.min_request_kib else {}),
                   **({"hedge_fraction": args.hedge_fraction} if args.hedge_fraction is not None else {}),
                   **{k: float(v) for k, v in (kv.split("=", 1) for kv in args.policy)}},
        "repeats": args.repeats, "slow_kind": args.slow_kind,
        "server": "moto, stock (a ranged GET reads the whole object)" if args.stock_moto
        else "moto, ranged GETs read only their range (harness.objstore._RANGED_READS)",
        "state_bytes": nbytes, "save_ranks": 4, "load_ranks": 3, "runs": [],
    }
    with MotoServer(ranged_reads=not args.stock_moto) as server:
        base = server.create_bucket(f"bench-faults-{uuid.uuid4().hex[:8]}")
        with FaultProxy(server.endpoint) as proxy:
            options = storage_options(proxy.url)
            urls = {"ucp": f"{base}/ucp", "dcp": f"{base}/dcp"}
            spawn_ranks(save_rank, 4, urls, options, shapes)
            delay = args.slow_delay_s
            for rep in range(args.repeats):  # interleaved: the machine's noise falls on every cell alike
                for scenario in args.scenarios:
                    for kind in args.readers:
                        delay = _one_load(doc, proxy, urls, options, shapes, scenario, kind, rep, delay, args)
    doc["summary"] = summarize(doc["runs"])
    doc["machine"]["load_average_end"] = os.getloadavg()
    return doc


def _one_load(doc: dict[str, Any], proxy: Any, urls: dict[str, str], options: dict[str, Any],
              shapes: dict[str, tuple[int, int]], scenario: str, kind: str, rep: int, delay: float | None,
              args: argparse.Namespace) -> float | None:
    """One spawn of 3 ranks loading under ``scenario``; appends its record to ``doc["runs"]``.
    Returns the slow delay (measured by the first fault-free ucp load unless ``--slow-delay-s``)."""
    proxy.clear()
    proxy.reset_records()
    if scenario != "none":
        assert delay is not None, "the fault-free ucp load measures the slow delay"
        p = 0.01 if scenario == "slow1" else 0.05
        rng = random.Random(f"{scenario}-{kind}-{rep}")
        if scenario.endswith("+stall"):
            proxy.inject("stall", count=1, match=_ranged_get, delay_s=args.stall_s)
        proxy.inject(args.slow_kind, count=10**6, delay_s=delay,
                     match=lambda m, path, h, rng=rng, p=p: _ranged_get(m, path, h) and rng.random() < p)
    url = urls["dcp" if kind == "dcp" else "ucp"]
    t_load = time.monotonic()
    per_rank = spawn_ranks(load_rank, 3, kind, url, options, shapes, doc["policy"])
    recs = proxy.select("GET")
    ranged = [r for r in recs if r.range is not None]
    if scenario == "none" and kind == "ucp" and delay is None:
        median = statistics.median(r.elapsed_s for r in ranged if r.fault is None)
        delay = args.slow_factor * median
        doc["median_ranged_get_s"], doc["slow_delay_s"] = median, delay
    run_rec: dict[str, Any] = {
        "scenario": scenario, "reader": kind, "repeat": rep, "seconds": per_rank[0]["seconds"],
        "errors": [r["error"] for r in per_rank if r["error"]],
        "wrong": sorted({w for r in per_rank for w in r["wrong"]}),
        "gets": len(recs), "ranged_gets": len(ranged),
        "bytes_fetched": sum(r.response_bytes for r in recs),
        "slowed": sum(r.fault == args.slow_kind for r in recs),
        "stalled": sum(r.fault == "stall" for r in recs),
        # Slowed or stalled GETs nobody hedged (their range asked for once): what hedging missed.
        "unhedged": [f"{r.path.rsplit('/', 1)[-1]} {r.range} {r.fault} +{r.started_s - t_load:.2f}s"
                     for r in recs if r.fault is not None
                     and sum((q.path, q.range) == (r.path, r.range) for q in recs) == 1],
        "load_average": os.getloadavg()[0],
    }
    stats = [r["object_stats"] for r in per_rank if "object_stats" in r]
    if stats:
        run_rec["object_stats"] = {k: sum(s[k] for s in stats) for k in
                                   ("requests", "bytes_requested", "hedges", "hedged_bytes",
                                    "hedge_extra_bytes", "hedge_wins", "timeouts", "retries",
                                    "throttles")}
        run_rec["slowest_request_s"] = max(s["slowest_s"] for s in stats)
        req = run_rec["object_stats"]["bytes_requested"]
        run_rec["hedged_fraction"] = run_rec["object_stats"]["hedged_bytes"] / req if req else 0.0
        # What hedging cost, as the readers counted it (the losers' bytes received).
        extra = run_rec["object_stats"]["hedge_extra_bytes"]
        run_rec["hedge_extra_fraction"] = extra / req if req else 0.0
    doc["runs"].append(run_rec)
    print(json.dumps(run_rec), flush=True)
    return delay


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (scenario, reader): the median load time over repeats, relative to the same reader's
    median fault-free time, and the largest hedged fraction of bytes of any repeat."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["scenario"], r["reader"]), []).append(r)
    base = {k[1]: statistics.median(x["seconds"] for x in v) for k, v in cells.items() if k[0] == "none"}
    # The bytes hedges really cost: what the server sent beyond the fewest bytes any fault-free
    # load of the same reader fetched (a hedge's loser is cancelled; it costs what it sent by then).
    fetched = {k[1]: min(x["bytes_fetched"] for x in v) for k, v in cells.items() if k[0] == "none"}
    out = []
    for (scenario, reader), rs in cells.items():
        med = statistics.median(x["seconds"] for x in rs)
        out.append({
            "scenario": scenario, "reader": reader, "repeats": len(rs), "median_seconds": med,
            "seconds": [x["seconds"] for x in rs],
            "relative_to_fault_free": med / base[reader] if reader in base else None,
            "relative_each": [x["seconds"] / base[reader] for x in rs] if reader in base else None,
            "max_hedged_fraction": max((x.get("hedged_fraction", 0.0) for x in rs), default=0.0)
            if "hedged_fraction" in rs[0] else None,
            "max_hedge_extra_fraction": max(x.get("hedge_extra_fraction", 0.0) for x in rs)
            if "hedge_extra_fraction" in rs[0] else None,
            "max_extra_fetched_fraction": max(x["bytes_fetched"] / fetched[reader] - 1 for x in rs)
            if reader in fetched else None,
            "hedges": [x["object_stats"]["hedges"] for x in rs] if "object_stats" in rs[0] else None,
            "timeouts": [x["object_stats"]["timeouts"] for x in rs] if "object_stats" in rs[0] else None,
            "slowed": [x["slowed"] for x in rs], "stalled": [x["stalled"] for x in rs],
            "failed": sum(bool(x["errors"] or x["wrong"]) for x in rs),
        })
    return out


def table(doc: dict[str, Any]) -> str:
    lines = ["| scenario | reader | median load s (each) | vs fault-free | slowed | stalled | hedges | max hedged bytes % "
             "| max hedge cost % | max extra fetched % | timeouts | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in doc["summary"]:
        each = ", ".join(f"{x:.2f}" for x in c["seconds"])
        hf = "-" if c["max_hedged_fraction"] is None else f"{100 * c['max_hedged_fraction']:.1f}"
        ef = "-" if c["max_extra_fetched_fraction"] is None else f"{100 * c['max_extra_fetched_fraction']:.1f}"
        xf = "-" if c.get("max_hedge_extra_fraction") is None else f"{100 * c['max_hedge_extra_fraction']:.1f}"
        lines.append(
            f"| {c['scenario']} | {c['reader']} | {c['median_seconds']:.2f} ({each}) | {c['relative_to_fault_free']:.2f}x "
            f"| {c['slowed']} | {c['stalled']} | {c['hedges'] or '-'} | {hf} | {xf} | {ef} | {c['timeouts'] or '-'} "
            f"| {c['failed']} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=48)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--slow-factor", type=float, default=20.0)
    ap.add_argument("--slow-kind", choices=("slow", "trickle"), default="slow",
                    help="how a slowed GET is slow: its whole answer late, or its body sent slowly")
    ap.add_argument("--stall-s", type=float, default=30.0)
    ap.add_argument("--floor-s", type=float, default=1.0, help="RequestPolicy.deadline_floor_s of the ucp readers")
    ap.add_argument("--deadline-factor", type=float, default=4.0, help="RequestPolicy.deadline_factor of the ucp readers")
    ap.add_argument("--max-request-kib", type=int, default=None,
                    help="RequestPolicy.max_part_bytes of the ucp readers, in KiB (default: the policy's)")
    ap.add_argument("--min-request-kib", type=int, default=None,
                    help="RequestPolicy.min_part_bytes of the ucp readers, in KiB (default: the policy's)")
    ap.add_argument("--policy", action="append", default=[], metavar="NAME=VALUE",
                    help="another RequestPolicy field of the ucp readers (a number), e.g. hedge_factor=3")
    ap.add_argument("--hedge-fraction", type=float, default=None,
                    help="RequestPolicy.hedge_fraction of the ucp readers (default: the policy's)")
    ap.add_argument("--repeats", type=int, default=1, help="loads per (scenario, reader), interleaved; medians reported")
    ap.add_argument("--slow-delay-s", type=float, default=None,
                    help="hold slowed GETs this long (default: --slow-factor times the fault-free ucp load's median ranged GET)")
    ap.add_argument("--stock-moto", action="store_true",
                    help="leave moto reading the whole object for every ranged GET (the older result files)")
    ap.add_argument("--out", default="out/bench_faults.json")
    args = ap.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.readers = [r for r in args.readers.split(",") if r]
    if args.scenarios[0] != "none" or "ucp" not in args.readers:
        ap.error("the first scenario must be 'none' and the readers must include 'ucp' (it measures the delay)")
    doc = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(table(doc))
    print(f"wrote {args.out}")
    return 0 if all(not r["errors"] and not r["wrong"] for r in doc["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
