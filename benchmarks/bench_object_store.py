#!/usr/bin/env python
"""Object-storage benchmark: ucp_dcp vs. DCP's fsspec writer/reader against a loopback S3 server.

One run starts moto's S3 server on 127.0.0.1 (a child process), puts a
counting proxy in front of it (``harness.objstore``: one port per rank, every
byte relayed unchanged, HTTP framed to count requests and body bytes), saves
a synthetic training state from dp4 (FSDP2-style ``Shard(0)`` DTensors, 4
gloo ranks; the states and layouts of ``bench_reshard.py``) with

* ``ucp``: ``UCPStorageWriter(url, storage_options=...)`` + ``UCPSavePlanner``
  (each rank streams its data file as a multipart upload), and
* ``dcp``: ``FsspecWriter(url, sync_files=False, **storage_options)`` + DCP's
  default planner (``sync_files=False``: on a URL DCP's default calls
  ``os.sync()`` of the local machine per file, which makes no S3 object more
  durable),

then loads each checkpoint resharded (dp4 -> dp3, dp4 -> (dp2,tp2)) with
``UCPStorageReader(url, storage_options=...)`` + ``UCPLoadPlanner`` vs.
``FsspecReader(url, **storage_options)`` + DCP's default planner.

Per timed save or load, every rank reads its port's counters before and
after (barrier, save/load, barrier), so each rank's requests (GET, PUT,
POST, HEAD, listings, DELETE) and body bytes (fetched, sent) are its own.
Times are the slowest rank's. Repeats are paired (repeat ``i`` runs every
format once, in an order rotated by ``i``); medians are reported. Every
loaded tensor is compared bit-exactly with its expected value; a mismatch
fails the run.

Usage::

    python benchmarks/bench_object_store.py                   # ~300 MB, 3 repeats
    python benchmarks/bench_object_store.py --quick           # ~8 MB, 1 repeat, dp4 -> dp3 only
    python benchmarks/bench_object_store.py --size-mb 100 --pairs dp4-dp3

Needs ``moto[server]`` and ``s3fs``. See docs/object-storage.md ("Benchmark").
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_reshard import (
    LAYOUTS,
    Ctx,
    TensorSpec,
    build_state,
    make_mesh,
    model_specs,
    verify,
)
from harness import (
    MB,
    comma_list,
    fmt_num,
    markdown_table,
    print_failures,
    quick_defaults,
    rank_log,
    set_rank_env,
    spawn_ranks,
    tensor_bytes,
    write_json,
)
from harness.objstore import (
    Counters,
    CountingProxy,
    MotoServer,
    read_counters,
    s3_environment,
    storage_options,
)

FORMATS = ("ucp", "dcp")
SOURCE = "dp4"
PAIRS: dict[str, tuple[str, str]] = {"dp4-dp3": ("dp4", "dp3"), "dp4-dp2tp2": ("dp4", "dp2tp2")}
WORLD = 4


@dataclass
class Config:
    """What every rank needs: the state, where the store is, what to run."""

    specs: list[TensorSpec]
    bucket_url: str
    endpoints: list[str]
    control_url: str
    formats: list[str]
    pairs: list[str]
    repeats: int


# --------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------


def ckpt_url(cfg: Config, layout: str, fmt: str, warmup: bool = False) -> str:
    """Where the checkpoint of ``layout`` in ``fmt`` goes."""
    return f"{cfg.bucket_url}/{'_warmup/' if warmup else ''}{layout}/{fmt}"


def make_writer(fmt: str, url: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """(storage writer, planner) of ``fmt`` for ``url``."""
    if fmt == "ucp":
        from ucp_dcp import UCPSavePlanner, UCPStorageWriter

        return UCPStorageWriter(url, storage_options=options), UCPSavePlanner()
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, sync_files=False, **options), None


def make_reader(fmt: str, url: str, options: dict[str, Any]) -> tuple[Any, Any]:
    """(storage reader, planner) of ``fmt`` for ``url``."""
    if fmt == "ucp":
        from ucp_dcp import UCPLoadPlanner, UCPStorageReader

        return UCPStorageReader(url, storage_options=options), UCPLoadPlanner()
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **options), None


def remove_prefix(url: str, options: dict[str, Any]) -> None:
    """Delete every object under ``url`` (nothing there is fine)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache()


def stored_objects(url: str, options: dict[str, Any]) -> dict[str, int]:
    """Object name -> size under ``url``."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return {p[len(path) + 1:]: int(info["size"]) for p, info in fs.find(path, detail=True).items()}


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _counted(cfg: Config, ctx: Ctx, rank: int, fn: Any) -> dict[str, Any]:
    """Barrier, ``fn()`` timed, barrier; this rank's seconds and request counters in between."""
    before = read_counters(cfg.control_url, rank)
    ctx.barrier()
    t0 = time.perf_counter()
    extra = fn()
    seconds = time.perf_counter() - t0
    ctx.barrier()
    counters = asdict(read_counters(cfg.control_url, rank).minus(before))
    return {"s": seconds, "counters": counters, **(extra if isinstance(extra, dict) else {})}


def _warm_up(cfg: Config, ctx: Ctx, options: dict[str, Any], fmt: str, save: bool, target: str) -> None:
    """A tiny save (from dp4) or load (into ``target``) of ``fmt`` before anything is timed.

    The first save/load in a process pays imports, connection setup and
    first collectives; without a warm-up the format timed first carries them.
    """
    spec = [TensorSpec("warmup.weight", (64, 64), "col")]
    url = ckpt_url(cfg, SOURCE, fmt, warmup=True)
    layout = LAYOUTS[SOURCE if save else target]
    if save:
        writer, planner = make_writer(fmt, url, options)
        dcp.save(build_state(spec, layout, ctx.mesh, filled=True), storage_writer=writer, planner=planner,
                 process_group=ctx.group)
    else:
        reader, planner = make_reader(fmt, url, options)
        state = build_state(spec, layout, ctx.mesh, filled=False)
        dcp.load(state, storage_reader=reader, planner=planner, process_group=ctx.group)
        bad = verify(state, build_state(spec, layout, ctx.mesh, filled=True))
        if bad:
            raise AssertionError(f"warm-up load of {fmt} into {target}: {bad[:3]}")
    ctx.barrier()


def _paired(cfg: Config, ctx: Ctx, out: dict[str, Any], step: Any) -> None:
    """Repeat ``i`` runs ``step(fmt)`` for every live format, in an order rotated by ``i``.

    A format that fails (on any rank) or loads wrong bytes drops out of the later repeats.
    """
    active = [f for f in cfg.formats if out[f]["error"] is None]
    for i in range(cfg.repeats):
        k = i % max(len(active), 1)
        for fmt in active[k:] + active[:k]:
            err = None
            try:
                run = step(fmt)
                out[fmt]["runs"].append(run)
                if run.get("mismatches"):
                    err = "mismatch: " + "; ".join(run["mismatches"][:3])
            except Exception:
                err = traceback.format_exc()
            out[fmt]["error"] = ctx.agree(err)
            if out[fmt]["error"] is not None:
                active.remove(fmt)


def run_save(cfg: Config, ctx: Ctx, rank: int) -> dict[str, Any]:
    """Warm-ups, then paired timed saves of the dp4 state in every format; the last save of each is kept."""
    options = storage_options(cfg.endpoints[rank])
    state = build_state(cfg.specs, LAYOUTS[SOURCE], ctx.mesh, filled=True)
    out: dict[str, Any] = {}
    for fmt in cfg.formats:
        err = None
        try:
            if rank == 0:
                remove_prefix(ckpt_url(cfg, SOURCE, fmt, warmup=True), options)
            ctx.barrier()
            _warm_up(cfg, ctx, options, fmt, True, SOURCE)
        except Exception:
            err = traceback.format_exc()
        out[fmt] = {"runs": [], "error": ctx.agree(err), "bytes_local": tensor_bytes(state)}

    def step(fmt: str) -> dict[str, Any]:
        url = ckpt_url(cfg, SOURCE, fmt)
        if rank == 0:  # every timed save writes into an empty prefix
            remove_prefix(url, options)
        writer, planner = make_writer(fmt, url, options)

        def save() -> None:
            dcp.save(state, storage_writer=writer, planner=planner, process_group=ctx.group)

        run = _counted(cfg, ctx, rank, save)
        rank_log(f"save {fmt}: {run['s']:.2f}s")
        return run

    _paired(cfg, ctx, out, step)
    if rank == 0:
        for fmt in cfg.formats:
            out[fmt]["stored"] = stored_objects(ckpt_url(cfg, SOURCE, fmt), options)
    return out


def run_load(cfg: Config, ctx: Ctx, rank: int, pair: str) -> dict[str, Any]:
    """Warm-ups, then paired timed loads of the dp4 checkpoints into the pair's target layout, verified."""
    src, dst = PAIRS[pair]
    options = storage_options(cfg.endpoints[rank])
    layout = LAYOUTS[dst]
    expected = build_state(cfg.specs, layout, ctx.mesh, filled=True)
    out: dict[str, Any] = {}
    for fmt in cfg.formats:
        err = None
        try:
            _warm_up(cfg, ctx, options, fmt, False, dst)
        except Exception:
            err = traceback.format_exc()
        out[fmt] = {"runs": [], "error": ctx.agree(err), "needed_bytes": tensor_bytes(expected)}

    def step(fmt: str) -> dict[str, Any]:
        reader, planner = make_reader(fmt, ckpt_url(cfg, src, fmt), options)
        target = build_state(cfg.specs, layout, ctx.mesh, filled=False)

        def load() -> dict[str, Any]:
            dcp.load(target, storage_reader=reader, planner=planner, process_group=ctx.group)
            # ucp's own count of what it asked for: a cross-check of the proxy's count
            report = getattr(reader, "last_load", None)  # ucp's LoadReport; DCP keeps none
            return {"reader_calls": getattr(report, "read_calls", None),
                    "reader_bytes": getattr(report, "bytes_requested", None)}

        run = _counted(cfg, ctx, rank, load)
        run["mismatches"] = verify(target, expected)
        rank_log(f"load {pair}/{fmt}: {run['s']:.2f}s")
        return run

    _paired(cfg, ctx, out, step)
    return out


def rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """One spawned rank: the save, then every load pair; per job, per format, this rank's runs."""
    # new_group and DeviceMesh construction are collective over the whole world, so
    # every rank builds every group and mesh in the same order.
    groups = {n: dist.group.WORLD if n == world else dist.new_group(list(range(n)))
              for n in sorted({LAYOUTS[SOURCE].world, *(LAYOUTS[PAIRS[p][1]].world for p in cfg.pairs)})}
    result: dict[str, Any] = {}
    for job, layout in [("save", SOURCE), *((p, PAIRS[p][1]) for p in cfg.pairs)]:
        lay = LAYOUTS[layout]
        mesh = make_mesh(lay)
        if rank < lay.world:
            ctx = Ctx(groups[lay.world], mesh)
            result[job] = run_save(cfg, ctx, rank) if job == "save" else run_load(cfg, ctx, rank, job)
        dist.barrier()  # idle ranks wait here, outside any measurement
    return result


# --------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------


def _median_counters(runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Per field, the median (low) over runs of one rank's counters."""
    keys = list(asdict(Counters()))
    return {k: statistics.median_low(r["counters"][k] for r in runs) for k in keys}


def merge(per_rank: list[dict[str, Any]], job: str, formats: Sequence[str]) -> dict[str, Any]:
    """Per format: runs' slowest-rank times and their median, and each rank's median counters."""
    ranks = [r[job] for r in per_rank if job in r]
    merged: dict[str, Any] = {}
    for fmt in formats:
        rs = [r[fmt] for r in ranks]
        entry: dict[str, Any] = {"error": rs[0]["error"]}
        times = [max(v) for v in zip(*([run["s"] for run in r["runs"]] for r in rs))]
        entry["s_runs"] = times
        entry["s"] = statistics.median(times) if times else None
        entry["ranks"] = []
        for i, r in enumerate(rs):
            rec: dict[str, Any] = {"rank": i}
            if r["runs"]:
                rec.update(_median_counters(r["runs"]))
                rec["requests"] = Counters(**{k: rec[k] for k in asdict(Counters())}).requests
                for k in ("reader_calls", "reader_bytes"):
                    if r["runs"][-1].get(k) is not None:
                        rec[k] = r["runs"][-1][k]
            for k in ("needed_bytes", "bytes_local"):
                if k in r:
                    rec[k] = r[k]
            entry["ranks"].append(rec)
        entry["mismatches"] = [f"rank {i}: {m}" for i, r in enumerate(rs) for run in r["runs"]
                               for m in run.get("mismatches", [])]
        if "stored" in rs[0]:
            entry["stored_objects"] = rs[0]["stored"]
            entry["stored_bytes"] = sum(rs[0]["stored"].values())
        merged[fmt] = entry
    return merged


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / MB:.1f}"


def _others(rec: dict[str, Any], *skip: str) -> str:
    """The request kinds not in their own column, e.g. ``2 HEAD, 1 LIST``."""
    parts = [f"{rec[k]} {k.upper()}" for k in ("get", "head", "list", "put", "post", "delete", "other")
             if k not in skip and rec.get(k)]
    return ", ".join(parts) or "-"


def save_table(save: dict[str, Any], formats: Sequence[str]) -> str:
    """Markdown: one row per (format, rank) of the dp4 save."""
    rows = []
    for fmt in formats:
        e = save[fmt]
        for rec in e["ranks"]:
            rows.append([fmt if rec["rank"] == 0 else "", fmt_num(e["s"], ".2f") if rec["rank"] == 0 else "",
                         rec["rank"], _mb(rec.get("bytes_local")), rec.get("put", "-"), rec.get("post", "-"),
                         _mb(rec.get("bytes_sent")), _others(rec, "put", "post")])
        rows.append(["", "", "all", _mb(sum(r.get("bytes_local", 0) for r in e["ranks"])),
                     sum(r.get("put", 0) for r in e["ranks"]), sum(r.get("post", 0) for r in e["ranks"]),
                     _mb(sum(r.get("bytes_sent", 0) for r in e["ranks"])),
                     f"stored {_mb(e.get('stored_bytes'))} MB in {len(e.get('stored_objects', {}))} objects"])
    return markdown_table(["format", "save s", "rank", "state MB", "PUT", "POST", "MB sent", "other requests"], rows)


def load_table(pair: str, load: dict[str, Any], formats: Sequence[str]) -> str:
    """Markdown: one row per (format, rank) of one resharded load."""
    rows = []
    for fmt in formats:
        e = load[fmt]
        for rec in e["ranks"]:
            fetched, needed = rec.get("bytes_fetched"), rec.get("needed_bytes")
            rows.append([fmt if rec["rank"] == 0 else "", fmt_num(e["s"], ".2f") if rec["rank"] == 0 else "",
                         rec["rank"], rec.get("get", "-"), _mb(fetched), _mb(needed),
                         fmt_num(None if fetched is None or not needed else fetched / needed, ".2f"),
                         _others(rec, "get")])
        tot_f = sum(r.get("bytes_fetched", 0) for r in e["ranks"])
        tot_n = sum(r.get("needed_bytes", 0) for r in e["ranks"])
        rows.append(["", "", "all", sum(r.get("get", 0) for r in e["ranks"]), _mb(tot_f), _mb(tot_n),
                     fmt_num(tot_f / tot_n if tot_n else None, ".2f"), ""])
    src, dst = PAIRS[pair]
    return (f"load {src} -> {LAYOUTS[dst].label}\n\n"
            + markdown_table(["format", "load s", "rank", "GET", "MB fetched", "MB needed", "fetched/needed",
                              "other requests"], rows))


def summary_table(doc: dict[str, Any]) -> str:
    """Markdown: per job, each format's median time (runs), requests and MB moved, and ucp/dcp."""
    rows = []
    jobs = [("save dp4", doc["save"], "bytes_sent")] + [(f"load {p}", doc["loads"][p], "bytes_fetched")
                                                        for p in doc["config"]["pairs"]]
    for name, res, moved in jobs:
        for fmt in doc["config"]["formats"]:
            e = res[fmt]
            reqs = sum(r.get("requests", 0) for r in e["ranks"])
            rows.append([name, fmt, fmt_num(e["s"], ".2f"), " / ".join(f"{t:.2f}" for t in e["s_runs"]), reqs,
                         _mb(sum(r.get(moved, 0) for r in e["ranks"])), "FAILED" if e["error"] else "ok"])
        if all(res[f]["s"] for f in ("ucp", "dcp") if f in res) and {"ucp", "dcp"} <= set(res):
            rows.append([name, "ucp/dcp", fmt_num(res["ucp"]["s"] / res["dcp"]["s"], ".2f"), "", "", "", ""])
    return markdown_table(["job", "format", "median s", "runs s", "requests", "MB moved", "status"], rows)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with --quick defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=None,
                   help="training-state size (weights + AdamW, fp32), default 300 (8 with --quick)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size; default 2048, or 512 below 50 MB")
    p.add_argument("--pairs", default=None,
                   help=f"comma-separated subset of: {', '.join(PAIRS)} (default all; dp4-dp3 with --quick)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of: ucp, dcp")
    p.add_argument("--repeats", type=int, default=None, help="paired timed runs, median reported (default 3, "
                                                             "1 with --quick)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--verbose", action="store_true", help="progress lines from the ranks")
    p.add_argument("--out", default=None, help="JSON results (default out/bench_object_store[_quick].json)")
    args = p.parse_args(argv)
    quick_defaults(args, size_mb=(8.0, 300.0), repeats=(1, 3), pairs=("dp4-dp3", ",".join(PAIRS)))
    if args.hidden is None:
        args.hidden = 2048 if args.size_mb >= 50 else 512
    if args.out is None:
        args.out = "out/bench_object_store_quick.json" if args.quick else "out/bench_object_store.json"
    args.pairs = comma_list(p, args.pairs, list(PAIRS), "pair")
    args.formats = comma_list(p, args.formats, FORMATS, "format")
    return args


def collect_failures(doc: dict[str, Any]) -> list[str]:
    """Failed saves and loads and every mismatch, one line each."""
    out = []
    for name, res in [("save dp4", doc["save"]), *((f"load {p}", r) for p, r in doc["loads"].items())]:
        for fmt, e in res.items():
            if e["error"]:
                out.append(f"{name}/{fmt}: {e['error']}")
            out.extend(f"MISMATCH {name}/{fmt}: {m}" for m in e["mismatches"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Start the store and the proxy, spawn the ranks, print the tables, write the JSON; 0 if all was exact."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    set_rank_env(args.verbose)
    s3_environment()  # inherited by the spawned ranks
    specs = model_specs(args.size_mb, args.hidden)
    state_bytes = 3 * 4 * sum(s.numel for s in specs)
    print(f"state: {len(specs)} weights (+ exp_avg, exp_avg_sq, step), hidden={args.hidden}, "
          f"{state_bytes / MB:.1f} MB fp32", flush=True)
    load_avg = [os.getloadavg()]
    with MotoServer() as server, CountingProxy(server.port, WORLD) as proxy:
        bucket = server.create_bucket(f"ucp-bench-{uuid.uuid4().hex[:8]}")
        print(f"moto S3 at {server.endpoint}, bucket {bucket}; counting proxy ports "
              + ", ".join(e.rsplit(":", 1)[1] for e in proxy.endpoints), flush=True)
        cfg = Config(specs, bucket, proxy.endpoints, proxy.control_url, args.formats, args.pairs, args.repeats)
        per_rank = spawn_ranks(rank_main, WORLD, cfg, timeout_min=15)
    load_avg.append(os.getloadavg())
    doc: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()},
        "env": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()},
        "state_bytes": state_bytes,
        "specs": [asdict(s) for s in specs],
        "load_avg": {"start": load_avg[0], "end": load_avg[1]},
        "save": merge(per_rank, "save", args.formats),
        "loads": {p: merge(per_rank, p, args.formats) for p in args.pairs},
    }
    doc["summary_md"] = summary_table(doc)
    doc["save_md"] = save_table(doc["save"], args.formats)
    doc["loads_md"] = {p: load_table(p, doc["loads"][p], args.formats) for p in args.pairs}
    print("\n=== summary (times: slowest rank, median of paired repeats) ===\n" + doc["summary_md"])
    print(f"\n=== save from {LAYOUTS[SOURCE].label}, per rank (median counters over repeats) ===\n"
          + doc["save_md"])
    for p in args.pairs:
        print(f"\n=== {doc['loads_md'][p]}")
    print(f"\nload average (1, 5, 15 min): start {', '.join(f'{x:.2f}' for x in load_avg[0])}; "
          f"end {', '.join(f'{x:.2f}' for x in load_avg[1])}")
    doc["failures"] = collect_failures(doc)
    doc["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, doc)
    print(f"wall time {doc['wall_s']:.1f}s; results written to {args.out}")
    print_failures(doc["failures"], bar=True)
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
