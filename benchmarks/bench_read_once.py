#!/usr/bin/env python
"""Read-once benchmark (issue 23): bytes the job reads from storage, with and without exchanging.

One run saves a synthetic FSDP2 model + AdamW state (``bench_reshard.py``'s
states: 2-D weights, exp_avg, exp_avg_sq, a 0-d step each, exact values)
from 4 gloo ranks, ``Shard(0)`` (dp4), and loads it into targets whose
ranks overlap:

* ``replicated``: every rank the whole state (DDP-style),
* ``hsdp2x2``: HSDP, 2 replicas x 2 shards (``[Replicate(), Shard(0)]``),
* ``columns``: every 2-D tensor ``Shard(1)`` (pieces of rows, narrower than
  a page), the norms ``Shard(0)`` (``bench_reshard.py``'s ``tp4s1``),
* ``dp3``: the resharding pair dp4 -> dp3 (3 ranks, little overlap),

each in four ways:

* ``dcp``: DCP's ``FileSystemReader`` + ``DefaultLoadPlanner`` (DCP's checkpoint),
* ``ucp``: ``UCPStorageReader(read_once=False)`` + ``UCPLoadPlanner`` (ucp's),
* ``once``: ``UCPStorageReader(read_once=True)``: every needed byte read by
  one rank and exchanged over the load's process group,
* ``auto``: ``UCPStorageReader(read_once="auto")``, the default (on a local
  disk it reads directly, see docs/read-once.md).

Per target and way, summed over the ranks: bytes read from storage over the
unique bytes the job needs (the state's tensor bytes: every target holds
every element somewhere), and requests, counted inside ``read_data``
(metadata left out) by the process's own read accounting: for ucp every
``os.preadv``/``os.pread`` call (data, block checksums, headers), next to
the reader's own counters (``bytes_requested``, ``read_calls``: data only);
for DCP a counting file under its ``FileSystemReader`` (every read of a
checkpoint file). ``/proc/self/io`` deltas are recorded raw (``rchar`` also
counts socket reads). Also per way: cold
load time (every rank evicts the checkpoint from the page cache, barrier,
``dcp.load``; slowest rank; median of paired repeats, the ways' order
rotating from repeat to repeat), and peak extra anonymous memory per rank
over the load (sampled; the target tensors exist before it starts). The
first load of every way and target is untimed: a warm-up, and the one whose
bytes and memory are reported. Every load is compared bit for bit with the
expected shards.

Then, unless ``--no-s3``, the same state in moto's S3 server on 127.0.0.1
behind ``harness.objstore.CountingProxy`` with a cap on the bytes it serves,
all ranks together (``--cap-mbps``, default 200 MB/s): storage whose
bandwidth the job shares, where bytes decide time. ``dcp`` is DCP's
``FsspecReader`` on a checkpoint ``FsspecWriter`` saved there; the ucp ways
read ucp's checkpoint there. Bytes and requests are counted at the proxy,
per rank. Every rank first fetches one whole data object at once through
the cap (the probe: the bandwidth the store delivers to the job).

Targets (printed met/MISSED, never asserted): bytes over unique <= 1.05 with
``read_once=True`` on every target; at most 64 MiB extra per rank; under
the cap, load time within 1.2x unique bytes / bandwidth, and on HSDP at
least 1.8x faster than DCP or than ``read_once=False``; ``"auto"`` on the
local disk no slower than ``read_once=False`` beyond the noise (1.1x).

Usage::

    python benchmarks/bench_read_once.py                  # ~48 MB, 3 repeats, ~2.5 min on 2 cores
    python benchmarks/bench_read_once.py --quick          # ~8 MB, 1 repeat, ~1-2 min
    python benchmarks/bench_read_once.py --targets hsdp2x2 --no-s3 --repeats 5
    python benchmarks/bench_read_once.py --cap-mbps 100 --s3-targets hsdp2x2,replicated

See docs/read-once.md.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import platform
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from bench_reshard import (
    LAYOUTS,
    Ctx,
    Layout,
    TensorSpec,
    build_state,
    make_mesh,
    model_specs,
    verify,
)
from harness import (
    MB,
    MiB,
    PeakMemorySampler,
    comma_list,
    evict,
    files_under,
    fmt_num,
    fresh_dir,
    fsync_files,
    markdown_table,
    median,
    paired_ratio,
    print_failures,
    proc_io,
    quick_defaults,
    rank_log,
    ratio,
    release_free_memory,
    set_rank_env,
    spawn_ranks,
    tensors,
    verdict,
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
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.tensor import Replicate, Shard
from ucp_dcp import ReadOptions

WORLD = 4
SOURCE = "dp4"

TARGETS: dict[str, Layout] = {
    "replicated": Layout(
        "replicated",
        "replicated (every rank the whole state)",
        (4,),
        ("dp",),
        {r: (Replicate(),) for r in ("col", "row", "norm")},
    ),
    "hsdp2x2": Layout(
        "hsdp2x2",
        "HSDP 2 replicas x 2 shards ([Replicate(), Shard(0)])",
        (2, 2),
        ("replicate", "shard"),
        {r: (Replicate(), Shard(0)) for r in ("col", "row", "norm")},
    ),
    "columns": Layout(
        "columns",
        "every 2-D tensor Shard(1) (norms Shard(0))",
        (4,),
        ("tp",),
        dict(LAYOUTS["tp4s1"].placements),
    ),
    "dp3": LAYOUTS["dp3"],
    "dp2tp2": LAYOUTS["dp2tp2"],
}
DEFAULT_TARGETS = ("replicated", "hsdp2x2", "columns", "dp3")

WAYS = ("dcp", "ucp", "once", "auto")
_READ_ONCE = {"ucp": False, "once": True, "auto": "auto"}

# Targets the library aims for (issue 23); printed, never asserted.
TARGET_BYTES_OVER_UNIQUE = 1.05  # read_once=True, every target
TARGET_EXTRA_MEMORY = 64 * MiB  # peak extra anonymous memory per rank, read_once=True
TARGET_TIME_OVER_CAP = 1.2  # under the cap: load time / (unique bytes / bandwidth)
TARGET_HSDP_SPEEDUP = 1.8  # under the cap, HSDP: DCP's or read_once=False's time / read_once=True's
TARGET_AUTO_NOISE = 1.1  # local disk: "auto" / read_once=False, paired


@dataclass
class Config:
    """What every rank needs: the state, the targets, the ways, where the checkpoints are."""

    specs: list[TensorSpec]
    workdir: str
    targets: list[str]
    ways: list[str]
    repeats: int
    sample_interval_s: float
    s3_targets: list[str]
    bucket_url: str | None = None
    endpoints: list[str] | None = None
    control_url: str | None = None


# --------------------------------------------------------------------------
# Counting reads (in every rank)
# --------------------------------------------------------------------------


class ReadCount:
    """Bytes and calls of the reads a rank makes from checkpoint files while counting is on.

    :func:`install_os_counters` routes ``os.preadv``/``os.pread`` (ucp's
    reads) through :meth:`add`; :class:`CountingFileSystem` does the same for
    the files DCP's ``FileSystemReader`` opens. :func:`counted` turns
    counting on for a reader's ``read_data`` only, so metadata reads are
    left out for both.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.on = False
        self.bytes = 0
        self.calls = 0

    def add(self, n: int) -> None:
        """One read call of ``n`` bytes (counted only while on)."""
        if self.on:
            with self.lock:
                self.bytes += n
                self.calls += 1

    def reset(self) -> None:
        """Zero the counts."""
        with self.lock:
            self.bytes = self.calls = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the reads made inside the block."""
        self.on = True
        try:
            yield
        finally:
            self.on = False


COUNT = ReadCount()


def install_os_counters() -> None:
    """Route ``os.preadv`` and ``os.pread`` through :data:`COUNT` for the rest of this process."""
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, bufs: Any, offset: int, *flags: int) -> int:
        n = real_preadv(fd, bufs, offset, *flags)
        COUNT.add(n)
        return n

    def pread(fd: int, n: int, offset: int) -> bytes:
        data = real_pread(fd, n, offset)
        COUNT.add(len(data))
        return data

    os.preadv, os.pread = preadv, pread  # type: ignore[assignment]


class _CountingRaw(io.RawIOBase):
    """A file's raw reads, counted in :data:`COUNT`."""

    def __init__(self, path: str) -> None:
        self.f = io.FileIO(path, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:  # type: ignore[override]
        n = self.f.readinto(b) or 0
        COUNT.add(n)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def close(self) -> None:
        self.f.close()
        super().close()


class CountingFileSystem(FileSystem):
    """DCP's local ``FileSystem`` whose read streams count their raw reads in :data:`COUNT`.

    The stream is buffered as ``Path.open`` buffers it (the file system's
    block size), so the counted bytes are what DCP's reads take from the file.
    """

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:  # type: ignore[override]
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        raw = _CountingRaw(os.fspath(path))
        with io.BufferedReader(
            raw, buffer_size=os.fstat(raw.f.fileno()).st_blksize or io.DEFAULT_BUFFER_SIZE
        ) as s:
            yield s


def counted(reader: Any, snapshot: Callable[[], Counters] | None = None) -> Any:
    """``reader`` with :data:`COUNT` on during its ``read_data``; with ``snapshot`` (this rank's
    proxy counters), what the proxy counted during ``read_data`` goes to
    ``reader.proxy_in_read``."""
    inner = reader.read_data

    def read_data(plan: Any, planner: Any) -> Any:
        before = snapshot() if snapshot is not None else None
        try:
            with COUNT.counting():
                return inner(plan, planner)
        finally:
            if snapshot is not None and before is not None:
                reader.proxy_in_read = snapshot().minus(before)

    reader.read_data = read_data
    reader.proxy_in_read = None
    return reader


# --------------------------------------------------------------------------
# Readers and writers of each way
# --------------------------------------------------------------------------


def ckpt_path(cfg: Config, fmt: str, s3: bool) -> str:
    """The dp4 checkpoint in ``fmt`` (``dcp`` or ``ucp``), on the local disk or in the bucket."""
    if s3:
        assert cfg.bucket_url is not None
        return f"{cfg.bucket_url}/{SOURCE}/{fmt}"
    return os.path.join(cfg.workdir, SOURCE, fmt)


def make_writer(fmt: str, path: str, options: dict[str, Any] | None) -> tuple[Any, Any]:
    """(storage writer, planner) saving ``fmt`` to ``path`` (a URL where ``options`` is given)."""
    if fmt == "ucp":
        from ucp_dcp import UCPSavePlanner, UCPStorageWriter

        return UCPStorageWriter(path, storage_options=options), UCPSavePlanner()
    if options is not None:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(path, sync_files=False, **options), None
    return dcp.FileSystemWriter(path), None


def make_reader(
    way: str,
    cfg: Config,
    group: dist.ProcessGroup,
    options: dict[str, Any] | None,
    snapshot: Callable[[], Counters] | None = None,
) -> tuple[Any, Any]:
    """(storage reader, planner) of ``way``, counting its reads (see :func:`counted`); reading
    the bucket where ``options`` is given."""
    s3 = options is not None
    if way == "dcp":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        path = ckpt_path(cfg, "dcp", s3)
        if s3:
            reader: Any = FsspecReader(path, **(options or {}))
        else:
            reader = FileSystemReader(path)
            reader.fs = CountingFileSystem()
        return counted(reader, snapshot), DefaultLoadPlanner()
    from ucp_dcp import UCPLoadPlanner, UCPStorageReader

    reader = UCPStorageReader(
        ckpt_path(cfg, "ucp", s3),
        storage_options=options,
        options=ReadOptions(read_once=_READ_ONCE[way]),
        process_group=group,
    )
    return counted(reader, snapshot), UCPLoadPlanner()


def reader_record(way: str, reader: Any) -> dict[str, Any]:
    """What a ucp reader counted in its last load (empty for DCP)."""
    if way == "dcp":
        return {}
    decision, totals = reader.last_load.read_once, reader.last_load.exchange
    return {
        "bytes_requested": reader.last_load.bytes_requested,
        "read_calls": reader.last_load.read_calls,
        "decision": None if decision is None else {k: v for k, v in asdict(decision).items()},
        "exchange": None if totals is None else asdict(totals),
    }


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def global_tensor_bytes(state: Any) -> int:
    """Bytes of every tensor of ``state`` at its global shape (a DTensor once, whoever holds it)."""
    return sum(t.numel() * t.element_size() for t in tensors(state))


def save_checkpoints(cfg: Config, ctx: Ctx, mesh: Any, s3: bool) -> None:
    """The dp4 state saved untimed in DCP's format and ucp's: on the local disk (fsynced) or in
    the bucket."""
    state = build_state(cfg.specs, LAYOUTS[SOURCE], mesh, filled=True)
    options = storage_options(cfg.endpoints[ctx.rank]) if s3 and cfg.endpoints else None
    for fmt in ("dcp", "ucp"):
        path = ckpt_path(cfg, fmt, s3)
        if not s3:
            fresh_dir(path, ctx.group)
        writer, planner = make_writer(fmt, path, options)
        dcp.save(state, storage_writer=writer, planner=planner, process_group=ctx.group)
        ctx.barrier()
        if not s3 and ctx.rank == 0:
            fsync_files(files_under(path))
        ctx.barrier()
        rank_log(f"saved {SOURCE} ({fmt}) to {path}")


def one_load(
    cfg: Config,
    ctx: Ctx,
    mesh: Any,
    layout: Layout,
    way: str,
    expected: dict[str, Any],
    s3: bool,
    measure_memory: bool,
) -> dict[str, Any]:
    """One cold load of ``way`` into a fresh NaN target of ``layout``, timed and counted, then
    checked. ``measure_memory``: the untimed load whose bytes and memory are reported (on S3 the
    proxy's counters are also read around ``read_data``: two local requests inside the load)."""
    me = dist.get_rank()
    options = storage_options(cfg.endpoints[me]) if s3 and cfg.endpoints else None
    control = cfg.control_url if s3 else None
    snapshot = functools.partial(read_counters, control, me) if control and measure_memory else None
    reader, planner = make_reader(way, cfg, ctx.group, options, snapshot)
    target = build_state(cfg.specs, layout, mesh, filled=False)
    release_free_memory()
    if not s3:  # every rank evicts: no doubt about which rank's eviction ran last
        evict(files_under(ckpt_path(cfg, "ucp" if way != "dcp" else "dcp", False)))
    before = read_counters(control, me) if control else None
    COUNT.reset()
    ctx.barrier()
    io0 = proc_io()
    mem = PeakMemorySampler(cfg.sample_interval_s) if measure_memory else contextlib.nullcontext()
    with mem:
        c0, t0 = time.process_time(), time.perf_counter()
        dcp.load(target, storage_reader=reader, planner=planner, process_group=ctx.group)
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - c0
    io1 = proc_io()
    ctx.barrier()
    run: dict[str, Any] = {
        "s": seconds,
        "cpu_s": cpu_s,
        "os_bytes": COUNT.bytes,
        "os_calls": COUNT.calls,
        "rchar": io1["rchar"] - io0["rchar"],
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        **reader_record(way, reader),
    }
    if control and before is not None:
        run["proxy"] = asdict(read_counters(control, me).minus(before))
    if reader.proxy_in_read is not None:
        run["proxy_in_read"] = asdict(reader.proxy_in_read)
    if isinstance(mem, PeakMemorySampler):
        run["peak_anon_growth"], run["peak_rss_growth"] = mem.anon_growth, mem.rss_growth
    run["mismatches"] = verify(target, expected)[:5]
    return run


def run_target(cfg: Config, ctx: Ctx, mesh: Any, name: str, s3: bool) -> dict[str, Any]:
    """One target: a measured load per way (untimed), then paired timed cold loads, all checked.

    Repeat ``i`` loads every live way once, in an order rotated by ``i``. A
    way that fails or loads wrong bytes on any rank drops out.
    """
    layout = TARGETS[name]
    expected = build_state(cfg.specs, layout, mesh, filled=True)
    out: dict[str, Any] = {"unique_bytes": global_tensor_bytes(expected), "ways": {}}
    active: list[str] = []

    def attempt(way: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        err, run = None, None
        try:
            run = fn()
            if run["mismatches"]:
                err = "mismatch: " + "; ".join(run["mismatches"][:3])
        except Exception:
            err = traceback.format_exc()
        agreed = ctx.agree(err)
        if agreed is not None:
            out["ways"][way]["error"] = agreed
            if way in active:
                active.remove(way)
            return None
        return run

    for way in cfg.ways:
        out["ways"][way] = {"error": None, "runs": []}
        run = attempt(
            way, functools.partial(one_load, cfg, ctx, mesh, layout, way, expected, s3, True)
        )
        if run is not None:
            out["ways"][way]["measured"] = run
            active.append(way)
            rank_log(f"{'s3 ' if s3 else ''}{name}/{way}: measured load {run['s']:.2f}s")
    for i in range(cfg.repeats):
        k = i % max(len(active), 1)
        for way in active[k:] + active[:k]:
            run = attempt(
                way, functools.partial(one_load, cfg, ctx, mesh, layout, way, expected, s3, False)
            )
            if run is not None:
                run["position"] = (active[k:] + active[:k]).index(way)
                out["ways"][way]["runs"].append(run)
                rank_log(f"{'s3 ' if s3 else ''}{name}/{way}: cold load {run['s']:.2f}s")
    return out


PROBE_ROUNDS = 3  # the first round also pays for connecting: the last one is reported


def probe_store(cfg: Config, ctx: Ctx) -> dict[str, Any]:
    """Every rank fetches one whole data object of ucp's checkpoint at once, ``PROBE_ROUNDS``
    times: this rank's bytes and seconds of the last round (the bandwidth the store gives the job
    is their sum over the slowest rank's time)."""
    import fsspec

    options = storage_options(cfg.endpoints[ctx.rank]) if cfg.endpoints else {}
    fs, root = fsspec.core.url_to_fs(
        ckpt_path(cfg, "ucp", True), skip_instance_cache=True, **options
    )
    sizes = {p: int(i["size"]) for p, i in fs.find(root, detail=True).items()}
    objects = sorted(p for p in sizes if p.endswith(".safetensors"))
    mine = objects[ctx.rank % len(objects)]
    rounds = []
    for _ in range(PROBE_ROUNDS):
        ctx.barrier()
        t0 = time.perf_counter()
        n = len(fs.cat_file(mine))
        rounds.append(time.perf_counter() - t0)
    ctx.barrier()
    return {
        "object": mine.rsplit("/", 1)[-1],
        "bytes": n,
        "s": rounds[-1],
        "s_rounds": rounds,
        "data_objects": {p.rsplit("/", 1)[-1]: sizes[p] for p in objects},
    }


def rank_main(rank: int, world: int, cfg: Config) -> dict[str, Any]:
    """One spawned rank: saves, then every target on the local disk, then (with a bucket) on S3."""
    install_os_counters()
    layouts = {SOURCE: LAYOUTS[SOURCE], **{n: TARGETS[n] for n in (*cfg.targets, *cfg.s3_targets)}}
    sizes = sorted({lay.world for lay in layouts.values()})
    # new_group and DeviceMesh construction are collective over the whole world: every rank builds
    # every group and mesh, in the same order; a job smaller than the world runs on ranks 0..n-1.
    groups = {n: dist.group.WORLD if n == world else dist.new_group(list(range(n))) for n in sizes}
    meshes = {n: make_mesh(layouts[n]) for n in sorted(layouts)}
    result: dict[str, Any] = {"local": {}, "s3": {}}
    parts = [(False, cfg.targets)] + ([(True, cfg.s3_targets)] if cfg.bucket_url else [])
    for s3, targets in parts:
        if not targets:
            continue
        src = Ctx(groups[world], meshes[SOURCE])
        save_checkpoints(cfg, src, meshes[SOURCE], s3)
        if s3:
            result["probe"] = probe_store(cfg, src)
        for name in targets:
            layout = TARGETS[name]
            if rank < layout.world:
                ctx = Ctx(groups[layout.world], meshes[name])
                result["s3" if s3 else "local"][name] = run_target(cfg, ctx, meshes[name], name, s3)
            dist.barrier()  # idle ranks wait here, outside any measurement
    return result


# --------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------


def _storage_bytes(run: dict[str, Any], s3: bool) -> tuple[int, int]:
    """(bytes, requests) one rank's ``read_data`` took from storage: at the proxy on S3, else the
    process's reads of checkpoint files (ucp: every ``preadv``/``pread``, checksums and headers
    included, which ``bytes_requested`` leaves out; DCP: its counted file reads)."""
    if s3:
        return run["proxy_in_read"]["bytes_fetched"], run["proxy_in_read"]["get"]
    return run["os_bytes"], run["os_calls"]


def merge_way(way: str, ranks: list[dict[str, Any]], unique: int, s3: bool) -> dict[str, Any]:
    """One way of one target over its ranks: sums of bytes and requests, the slowest rank's
    times, peaks."""
    entry: dict[str, Any] = {"error": ranks[0]["error"]}
    ms: list[dict[str, Any]] = [r["measured"] for r in ranks if r.get("measured")]
    if len(ms) == len(ranks):
        per = [_storage_bytes(m, s3) for m in ms]
        entry["storage_bytes_per_rank"] = [b for b, _ in per]
        entry["storage_bytes"] = sum(b for b, _ in per)
        entry["requests"] = sum(c for _, c in per)
        entry["bytes_over_unique"] = entry["storage_bytes"] / unique
        for key in ("os_bytes", "os_calls", "rchar", "read_bytes"):
            entry[key] = sum(m[key] for m in ms)
        entry["peak_anon_growth_per_rank"] = [m["peak_anon_growth"] for m in ms]
        entry["peak_anon_growth_max"] = max(entry["peak_anon_growth_per_rank"])
        entry["peak_rss_growth_max"] = max(m["peak_rss_growth"] for m in ms)
        if way != "dcp":  # the reader's own counters, and what it exchanged
            entry["reader_bytes"] = sum(m["bytes_requested"] for m in ms)
            entry["reader_calls"] = sum(m["read_calls"] for m in ms)
            entry["decision"] = ms[0]["decision"]
            ex = [m["exchange"] for m in ms]
            if all(ex):
                keys = ("read", "sent", "received", "copied", "checked")
                entry["exchange"] = {k: sum(e[k] for e in ex) for k in keys}
                entry["exchange"]["rounds"] = ex[0]["rounds"]
        if s3:  # the whole load at the proxy: metadata (index, headers) and listings included
            entry["load_bytes_fetched"] = sum(m["proxy"]["bytes_fetched"] for m in ms)
            entry["load_requests"] = sum(
                m["proxy"]["get"] + m["proxy"]["head"] + m["proxy"]["list"] for m in ms
            )
    runs = [max(v) for v in zip(*([run["s"] for run in r["runs"]] for r in ranks))]
    entry["s_runs"] = runs
    entry["s"] = median(runs)
    # CPU time of the load (all threads of every rank): steadier than wall time on a busy machine
    entry["cpu_s_runs"] = [
        sum(v) for v in zip(*([run["cpu_s"] for run in r["runs"]] for r in ranks))
    ]
    entry["cpu_s"] = median(entry["cpu_s_runs"])
    entry["positions"] = [run["position"] for run in ranks[0]["runs"]]
    entry["mismatches"] = [
        f"rank {i}: {m}"
        for i, r in enumerate(ranks)
        for run in [r.get("measured") or {}, *r["runs"]]
        for m in run.get("mismatches", [])
    ]
    return entry


def merge_target(
    per_rank: list[dict[str, Any]], part: str, name: str, ways: Sequence[str], cap: float | None
) -> dict[str, Any]:
    """One target of one part (``local`` or ``s3``) over its ranks, with the ratios between ways."""
    ranks = [r[part][name] for r in per_rank if name in r.get(part, {})]
    unique = ranks[0]["unique_bytes"]
    rec: dict[str, Any] = {
        "label": TARGETS[name].label,
        "ranks": len(ranks),
        "unique_bytes": unique,
        "ways": {},
    }
    for way in ways:
        rec["ways"][way] = merge_way(way, [r["ways"][way] for r in ranks], unique, part == "s3")
    w = rec["ways"]

    def paired(a: str, b: str, key: str = "s_runs") -> float | None:
        return paired_ratio(w.get(a, {}).get(key), w.get(b, {}).get(key))

    # time ratios: medians of per-repeat ratios (repeat i of both ran back to back)
    pairs = (("once", "dcp"), ("once", "ucp"), ("auto", "ucp"), ("ucp", "dcp"))
    rec["time_ratios"] = {f"{a}/{b}": paired(a, b) for a, b in pairs}
    rec["cpu_ratios"] = {f"{a}/{b}": paired(a, b, "cpu_s_runs") for a, b in pairs}
    rec["byte_ratios"] = {
        f"{a}/{b}": ratio(w.get(a, {}).get("storage_bytes"), w.get(b, {}).get("storage_bytes"))
        for a, b in (("once", "dcp"), ("once", "ucp"), ("ucp", "dcp"))
    }
    if cap:
        rec["limit_s"] = unique / cap
        rec["time_over_limit"] = {way: ratio(w[way].get("s"), rec["limit_s"]) for way in ways}
    return rec


def verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of issue 23 this run measured: what, value, limit, met/MISSED."""
    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, limit: float, higher_is_better: bool = False) -> None:
        v = None if value is None else (1 / value if higher_is_better and value else value)
        lim = 1 / limit if higher_is_better else limit
        out.append({"what": what, "value": value, "limit": limit, "verdict": verdict(v, lim)})

    for part in ("local", "s3"):
        for name, rec in (doc.get(part) or {}).get("targets", {}).items():
            once = rec["ways"].get("once", {})
            where = f"{part} {name}"
            add(
                f"{where}: once bytes/unique <= {TARGET_BYTES_OVER_UNIQUE}",
                once.get("bytes_over_unique"),
                TARGET_BYTES_OVER_UNIQUE,
            )
            mem = once.get("peak_anon_growth_max")
            add(
                f"{where}: once peak extra MiB/rank <= {TARGET_EXTRA_MEMORY // MiB}",
                None if mem is None else mem / MiB,
                TARGET_EXTRA_MEMORY / MiB,
            )
            if part == "local" and "auto" in rec["ways"]:
                add(
                    f"{where}: auto/ucp time <= {TARGET_AUTO_NOISE} (noise)",
                    rec["time_ratios"]["auto/ucp"],
                    TARGET_AUTO_NOISE,
                )
            if part == "s3":
                add(
                    f"{where}: once time / (unique / cap) <= {TARGET_TIME_OVER_CAP}",
                    rec.get("time_over_limit", {}).get("once"),
                    TARGET_TIME_OVER_CAP,
                )
                bw = doc["s3"].get("probe_bytes_per_s")
                if bw:
                    add(
                        f"{where}: once time / (unique / probed bandwidth)"
                        f" <= {TARGET_TIME_OVER_CAP}",
                        ratio(once.get("s"), rec["unique_bytes"] / bw),
                        TARGET_TIME_OVER_CAP,
                    )
                if name == "hsdp2x2":
                    r = rec["time_ratios"]
                    best = max((1 / x for x in (r["once/dcp"], r["once/ucp"]) if x), default=None)
                    add(
                        f"{where}: speedup vs dcp or ucp >= {TARGET_HSDP_SPEEDUP}",
                        best,
                        TARGET_HSDP_SPEEDUP,
                        higher_is_better=True,
                    )
    return out


def target_table(part: dict[str, Any], ways: Sequence[str], s3: bool) -> str:
    """Markdown: per target and way, bytes, ratio, requests, time, memory."""
    rows = []
    for name, rec in part["targets"].items():
        for way in ways:
            e = rec["ways"][way]
            ex = e.get("exchange") or {}
            status = (
                "FAILED"
                if e["error"]
                else (f"MISMATCH ({len(e['mismatches'])})" if e["mismatches"] else "ok")
            )
            rows.append(
                [
                    name if way == ways[0] else "",
                    way,
                    fmt_num(_mb(e.get("storage_bytes")), ".1f"),
                    fmt_num(e.get("bytes_over_unique"), ".3f"),
                    e.get("requests", "-"),
                    fmt_num(_mb(ex.get("received")), ".1f") if ex else "-",
                    fmt_num(e.get("s"), ".3f"),
                    " / ".join(f"{x:.3f}" for x in e.get("s_runs", [])),
                    fmt_num(_mib(e.get("peak_anon_growth_max")), ".1f"),
                    *(
                        [
                            fmt_num(_mb(e.get("load_bytes_fetched")), ".1f"),
                            fmt_num(rec.get("time_over_limit", {}).get(way), ".2f"),
                        ]
                        if s3
                        else []
                    ),
                    status,
                ]
            )
    header = [
        "target",
        "way",
        "MB read",
        "read/unique",
        "requests",
        "MB exchanged",
        "load s",
        "runs s",
        "peak extra MiB/rank",
        *(["MB whole load", "s / (unique/cap)"] if s3 else []),
        "status",
    ]
    return markdown_table(header, rows)


def ratio_table(part: dict[str, Any]) -> str:
    """Markdown: per target, the unique bytes and the paired time ratios."""
    rows = []
    for name, rec in part["targets"].items():
        r = rec["time_ratios"]
        rows.append(
            [
                name,
                rec["ranks"],
                fmt_num(_mb(rec["unique_bytes"]), ".1f"),
                *(fmt_num(r[k], ".2f") for k in ("once/dcp", "once/ucp", "auto/ucp", "ucp/dcp")),
            ]
        )
    return markdown_table(
        ["target", "ranks", "unique MB", "once/dcp s", "once/ucp s", "auto/ucp s", "ucp/dcp s"],
        rows,
    )


def _mb(n: float | None) -> float | None:
    return None if n is None else n / MB


def _mib(n: float | None) -> float | None:
    return None if n is None else n / MiB


def collect_failures(doc: dict[str, Any]) -> list[str]:
    """Failed loads and every mismatch, one line each."""
    out = []
    for part in ("local", "s3"):
        for name, rec in (doc.get(part) or {}).get("targets", {}).items():
            for way, e in rec["ways"].items():
                if e["error"]:
                    out.append(f"{part} {name}/{way}: {e['error']}")
                out.extend(f"MISMATCH {part} {name}/{way}: {m}" for m in e["mismatches"])
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with --quick defaults filled in."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--mb",
        type=float,
        default=None,
        help="state size, MB (weights + AdamW, fp32); 48, 8 with --quick",
    )
    p.add_argument(
        "--hidden", type=int, default=512, help="hidden size of the synthetic model (default 512)"
    )
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"local-disk targets, comma-separated, of: {', '.join(TARGETS)}",
    )
    p.add_argument(
        "--s3-targets",
        default=None,
        help="S3 targets (default hsdp2x2,replicated; hsdp2x2 with --quick)",
    )
    p.add_argument(
        "--ways", default=",".join(WAYS), help=f"comma-separated subset of: {', '.join(WAYS)}"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="paired timed cold loads per target (3; 1 with --quick)",
    )
    p.add_argument(
        "--cap-mbps", type=float, default=200.0, help="S3 bandwidth for all ranks together, MB/s"
    )
    p.add_argument("--no-s3", action="store_true", help="skip the loads from S3")
    p.add_argument(
        "--workdir",
        default=None,
        help="where local checkpoints go (disk-backed; default a temp dir)",
    )
    p.add_argument("--quick", action="store_true", help="small smoke run (~1-2 min)")
    p.add_argument("--verbose", action="store_true", help="progress lines from rank 0")
    p.add_argument(
        "--out", default=None, help="JSON results (default out/bench_read_once[_quick].json)"
    )
    args = p.parse_args(argv)
    quick_defaults(
        args, mb=(8.0, 48.0), repeats=(1, 3), s3_targets=("hsdp2x2", "hsdp2x2,replicated")
    )
    args.targets = comma_list(p, args.targets, list(TARGETS), "target")
    args.s3_targets = [] if args.no_s3 else comma_list(p, args.s3_targets, list(TARGETS), "target")
    args.ways = comma_list(p, args.ways, WAYS, "way")
    if args.out is None:
        args.out = f"out/bench_read_once{'_quick' if args.quick else ''}.json"
    return args


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the tables and verdicts; write and return the JSON document."""
    import tempfile

    args = parse_args(argv)
    t_start = time.perf_counter()
    set_rank_env(args.verbose)
    specs = model_specs(args.mb, args.hidden)
    state_bytes = 3 * 4 * sum(s.numel for s in specs)
    print(
        f"state: {len(specs)} weights (+ exp_avg, exp_avg_sq, step), hidden={args.hidden}, "
        f"{state_bytes / MB:.1f} MB fp32, saved {LAYOUTS[SOURCE].label}",
        flush=True,
    )
    load_avg = {"start": _loadavg()}
    cap = args.cap_mbps * MB if args.s3_targets else None
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="bench_read_once_")
        )
        cfg = Config(specs, workdir, args.targets, args.ways, args.repeats, 0.002, args.s3_targets)
        if args.s3_targets:
            s3_environment()  # inherited by the spawned ranks
            server = stack.enter_context(MotoServer())
            proxy = stack.enter_context(CountingProxy(server.port, WORLD, cap_bytes_per_s=cap))
            cfg.bucket_url = server.create_bucket(f"ucp-read-once-{uuid.uuid4().hex[:8]}")
            cfg.endpoints, cfg.control_url = proxy.endpoints, proxy.control_url
            print(
                f"moto S3 at {server.endpoint}, proxy capped at {args.cap_mbps:g} MB/s"
                " for all ranks together",
                flush=True,
            )
        per_rank = spawn_ranks(rank_main, WORLD, cfg, timeout_min=15)
    load_avg["end"] = _loadavg()
    doc: dict[str, Any] = {
        "config": dict(vars(args)),
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "state_bytes": state_bytes,
        "tensors": len(specs),
        "load_avg": load_avg,
        "local": {
            "targets": {
                n: merge_target(per_rank, "local", n, args.ways, None) for n in args.targets
            }
        },
        "s3": None,
    }
    if args.s3_targets:
        probes = [r["probe"] for r in per_rank]
        probe_bw = sum(p["bytes"] for p in probes) / max(p["s"] for p in probes)  # last round
        doc["s3"] = {
            "cap_bytes_per_s": cap,
            "data_objects": probes[0].pop("data_objects"),
            "probe": probes,
            "probe_bytes_per_s": probe_bw,
            "targets": {
                n: merge_target(per_rank, "s3", n, args.ways, cap) for n in args.s3_targets
            },
        }
    doc["verdicts"] = verdicts(doc)
    doc["tables_md"] = {
        "local": target_table(doc["local"], args.ways, False),
        "local_ratios": ratio_table(doc["local"]),
    }
    if doc["s3"]:
        doc["tables_md"]["s3"] = target_table(doc["s3"], args.ways, True)
        doc["tables_md"]["s3_ratios"] = ratio_table(doc["s3"])
    print(
        f"\n=== local disk, {WORLD} ranks: bytes read summed over ranks; load s: slowest rank,"
        " median of "
        f"{args.repeats} paired cold repeats ===\n" + doc["tables_md"]["local"]
    )
    print("\n=== local disk: paired time ratios ===\n" + doc["tables_md"]["local_ratios"])
    if doc["s3"]:
        print(
            f"\n=== S3 (moto) behind a {args.cap_mbps:g} MB/s cap for all ranks; probe: "
            f"{doc['s3']['probe_bytes_per_s'] / MB:.1f} MB/s (every rank one whole object at once)"
            " ===\n" + doc["tables_md"]["s3"]
        )
        print("\n=== S3: paired time ratios ===\n" + doc["tables_md"]["s3_ratios"])
    print("\n=== targets (issue 23; informational) ===")
    for v in doc["verdicts"]:
        print(f"  {v['verdict']:7s} {v['what']}: {fmt_num(v['value'], '.3f')}")
    print(f"\nload average (1, 5, 15 min): start {load_avg['start']}, end {load_avg['end']}")
    doc["failures"] = collect_failures(doc)
    doc["wall_s"] = time.perf_counter() - t_start
    write_json(args.out, doc)
    print(f"wall time {doc['wall_s']:.1f}s; results written to {args.out}")
    print_failures(doc["failures"], bar=True)
    return doc


if __name__ == "__main__":
    sys.exit(1 if main()["failures"] else 0)
