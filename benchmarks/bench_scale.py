#!/usr/bin/env python
"""Scale simulator: DCP save/load *planning* and metadata at thousands of ranks.

No rank processes are spawned.  One Python process plays every rank of a
virtual world of W ranks (default W = 64, 1024, 4096, 16384) and runs the
planning half of ``dcp.save`` / ``dcp.load`` for two formats:

* ``dcp``: DCP defaults, ``DefaultSavePlanner`` + ``FileSystemWriter`` (pickled
  ``.metadata``), ``DefaultLoadPlanner`` + ``FileSystemReader``;
* ``ucp``: ucp_dcp, ``UCPSavePlanner`` + ``UCPStorageWriter`` (JSON
  ``ucp_index.json``), ``UCPLoadPlanner`` + ``UCPStorageReader``.

No tensor data is ever written or read: only plans, write results and the
metadata file.

Training state
    Llama-2-70B shapes (vocab 32000, hidden 8192, 80 layers, FFN 28672, 64
    heads, 8 KV heads): tok_embeddings [32000, 8192], per layer wq/wo
    [8192, 8192], wk/wv [1024, 8192], w1/w3 [28672, 8192], w2 [8192, 28672],
    attention_norm/ffn_norm [8192], then norm [8192] and output [32000, 8192]:
    723 bf16 tensors under ``{"model": {...}}`` (torchtitan names).
    ``--optimizer`` adds fp32 AdamW ``exp_avg``/``exp_avg_sq`` for each
    weight under ``{"optim": {"state": {fqn: {...}}}}`` (2169 tensors; the
    0-d ``step`` tensors and param_groups are left out).  Save-side DTensors
    hold **meta** local tensors (no memory).  Load-side DTensors hold a
    0-element CPU tensor ``expand``-ed to the local shape: DCP's
    ``DefaultLoadPlanner.set_up_planner`` would otherwise materialise every
    meta DTensor (``_init_state_dict``), which a real load never does.

Meshes (per W)
    ``fsdp``: 1-D mesh (W,), every tensor ``Shard(0)``.
    ``fsdp_tp``: 2-D mesh (W/8, 8) named ("dp", "tp"), torchtitan-style TP:
    column-parallel wq/wk/wv/w1/w3 and output ``Shard(0)`` on tp, row-parallel
    wo/w2 ``Shard(1)``, tok_embeddings ``Shard(0)`` (torchtitan uses
    RowwiseParallel for it), norms ``Replicate()``.  On dp, what FSDP2 really
    produces (``_FSDPParam._init_sharding_spec_tp`` in torch 2.13):
    ``_StridedShard(0, split_factor=8)`` for tensors TP-sharded on dim 0,
    ``Shard(0)`` for the others (``--plain-dp-shard`` uses ``Shard(0)``
    everywhere instead).

Virtual ranks
    ``dist.init_process_group("fake", store=FakeStore(), rank=0,
    world_size=W)``; the DeviceMesh is built once per (mesh, W) with
    ``_init_backend=False`` (no sub-groups: O(W), not one ``new_group`` per
    mesh row/column).  To plan "as rank r", the simulator sets
    ``torch.distributed.get_rank`` (and the c10d/device_mesh aliases of it) to
    return r, and sets the mesh's ``_rank`` and ``_coordinate_on_dim``, which
    is what ``mesh.get_coordinate()`` and DTensor's
    ``compute_local_shape_and_global_offset`` read.  For the first 4 timed
    ranks of every phase the planned chunks (the local plan where it lists
    chunks, and always the final plan after ``finish_plan``) are checked
    against an independent pure-Python computation of rank r's box
    (torch.chunk semantics, strided shards applied after the TP shard), and
    the final load plan's read items must cover exactly the rank's box; a
    mismatch fails the configuration.

What is timed (``time.perf_counter``), per (format, mesh, W)
    save
      * per-rank local plan: ``set_up_planner`` + ``set_up_storage_writer`` +
        ``create_local_plan`` + ``prepare_local_plan``.  **Sampled**: the
        ``--sample-ranks`` spread ranks (0 and W-1 first) are timed until
        ``--rank-budget-s`` is spent (at least 3); every other rank's plan is
        built the same way, untimed, with DTensor's
        ``compute_local_shape_and_global_offset`` memoised per (shape,
        placements, coordinate) (one verified rank must match the un-memoised
        plan exactly).  **Exhaustive**: the pickled size of all W local plans
        (gather payload to the coordinator: sum and max).
      * coordinator: ``create_global_plan`` over all W plans +
        ``prepare_global_plan``; pickled size of the W global plans
        (scatter payload).
      * per-rank ``finish_plan`` (sampled; ucp derives its compact plans'
        write items there, so compare the "critical path" = max local plan +
        global plan + max finish_plan) and the write results each rank would
        report (exhaustive; gather payload).  ucp:
        ``UCPStorageWriter.planned_results`` (the rank's planner is rebuilt
        first, untimed, since it needs the rank's state).  dcp: synthesised
        ``WriteResult``/``_StorageInfo`` per item, as ``FileSystemWriter``
        reports them for one ``__{r}_0.distcp`` file per rank (lengths are the
        raw tensor bytes, without torch.save's few bytes of framing).  The
        final plans of all W ranks must write every element exactly once.
      * coordinator ``finish(metadata, results)``: writes the metadata file into
        a temp dir (no data files); its size on disk.  Then ``dcp.save``
        broadcasts the global Metadata to every rank
        (``_DistWrapper.all_reduce``): its pickled size, the coordinator's
        pickling time and one rank's unpickling time.
    load (into the same mesh and W; ``fsdp_tp`` runs also load the ``fsdp``
    checkpoint of the same W: "xload", FSDP(W) -> FSDP+TP(W))
      * ``read_metadata`` from the file just written (every rank pays this);
      * per-rank ``set_up_planner`` + ``set_up_storage_reader`` +
        ``create_local_plan`` + ``prepare_local_plan`` and the pickled local
        plan: **sampled** within ``--rank-budget-s``; the gather payload is
        mean x W;
      * coordinator ``create_global_plan`` + ``prepare_global_plan`` over W
        plans (the sampled plans repeated to W entries) and per-rank
        ``finish_plan`` (sampled).
    Peak RSS (VmHWM, reset through /proc/self/clear_refs) of the save and
    load halves.

Per-process caches: a real rank plans its first save/load in a fresh
process.  ucp_dcp keeps per-process plan caches (mesh groups, layout grids),
which later virtual ranks would find filled by earlier ones; they are
discovered (lru_cache functions of ucp_dcp, and module-level containers that
a throwaway plan makes grow) and emptied before every timed rank, and every
timed ucp load rank reads the metadata itself (untimed) unless reading it
takes over a second (DCP's reader and metadata carry no caches: one shared
read).  The JSON lists the caches found.  Timed numbers are therefore cold,
first-save numbers; a training loop saving repeatedly may be faster.

Garbage collector: the simulator holds all W ranks' plans in one heap, which
no real rank does.  Untimed bulk work runs with the collector off; per-rank
timed sections freeze the existing heap (``gc.freeze``) and run with the
collector on, so a rank only pays for collecting its own objects; coordinator
steps run with the collector on over a heap holding the W plans, as the real
coordinator's heap does after unpickling them.

Isolation and guards: every (format, mesh, W) runs in a forked child (one
process per configuration, not per rank) so that its memory is returned and an
out-of-memory kill loses one configuration, not the run.  Before a
configuration starts, its time and peak memory are extrapolated from the
same format and mesh at the smaller W (time with the exponent measured
between the last two W, memory linearly in W); it is skipped, with the
estimate printed, when the memory would exceed ~85% of MemAvailable or the
time ``--max-config-min``.

Caveats
    * Collectives are not run: payload sizes are what DCP's gather/scatter
      would carry (pickled with the default protocol), not their time.
    * One process per configuration on a 2-core box; per-rank times are
      single-threaded CPU times of pure-Python planning, comparable between
      formats, not absolute predictions for a given cluster.
    * The coordinator's global plan receives real (distinct) local-plan
      objects for every rank in the save; in the load only the sampled plans
      are real (repeated to W).
    * The rank patching relies on DeviceMesh internals of torch 2.13
      (``_rank``, ``_coordinate_on_dim``); the chunk verification guards it.

Usage::

    python benchmarks/bench_scale.py --quick            # smoke check, < 30 s
    python benchmarks/bench_scale.py                    # W = 64,1024,4096,16384
    python benchmarks/bench_scale.py --world-sizes 1024 --meshes fsdp_tp --formats ucp
    python benchmarks/bench_scale.py --optimizer --world-sizes 64,1024

Writes ``<out>/scale.json`` (every number, machine, torch version, command
line) and ``<out>/scale.png`` (default ``--out benchmarks/results``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pickle
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.planner_helpers as planner_helpers
import torch.distributed.distributed_c10d as c10d
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from harness import (
    GB,
    MB,
    ChildFailed,
    Column,
    comma_list,
    load_planner,
    log,
    make_reader,
    make_writer,
    mem_available,
    metadata_file,
    quick_defaults,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_forked,
    stats,
    text_table,
    write_json,
)
from harness.report import RESULTS_DIR, fmt_bytes, fmt_seconds
from harness.states import MESHES, TP, Entry, llama_entries, mesh_shape_of, placements_for, state_nbytes

FORMATS = ("dcp", "ucp")
VERIFY_RANKS = 4  # timed ranks per phase whose chunks are checked independently


def coord_of(mesh_shape: tuple[int, ...], rank: int) -> tuple[int, ...]:
    """Coordinate of ``rank`` in a mesh laid out as arange(W).view(mesh_shape)."""
    out = []
    for s in reversed(mesh_shape):
        out.append(rank % s)
        rank //= s
    return tuple(reversed(out))


def ref_box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
            placements: tuple[Placement, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of a rank's local box, computed without DTensor.

    Shards split like ``torch.chunk`` (ceil-sized pieces, empty tail pieces);
    a ``_StridedShard`` on a mesh dim is applied after the later mesh dims that
    shard the same tensor dim (FSDP2's "shard the TP-local tensor" order).
    """
    order = [i for i, p in enumerate(placements) if not isinstance(p, _StridedShard)]
    order += [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    lo, hi = [0] * len(shape), list(shape)
    for i in order:
        p = placements[i]
        if not isinstance(p, (Shard, _StridedShard)):  # (not a Shard subclass in torch 2.13)
            continue
        d = p.dim
        c = -(-(hi[d] - lo[d]) // mesh_shape[i])
        a = min(hi[d], lo[d] + coord[i] * c)
        lo[d], hi[d] = a, min(hi[d], a + c)
    return tuple(h - l for h, l in zip(hi, lo)), tuple(lo)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))


# ============================================================ virtual ranks


class VirtualRanks:
    """Makes the planners see rank r: ``dist.get_rank()`` and the mesh coordinate."""

    def __init__(self) -> None:
        self.rank: int | None = None
        self.meshes: list[DeviceMesh] = []
        self._orig = c10d.get_rank
        orig = self._orig

        def get_rank(group: Any = None) -> int:
            if self.rank is not None and (group is None or group is c10d.GroupMember.WORLD):
                return self.rank
            return orig(group)

        self._patched = get_rank

    def install(self) -> None:
        """Route ``get_rank`` of torch.distributed and ucp_dcp modules through this object."""
        # every module that imported get_rank by name (device_mesh does), plus
        # torch.distributed itself (ucp_dcp calls dist.get_rank())
        for name, mod in list(sys.modules.items()):
            if (name.startswith("torch.distributed") or name.startswith("ucp_dcp")) and \
                    getattr(mod, "get_rank", None) is self._orig:
                setattr(mod, "get_rank", self._patched)

    def set(self, rank: int) -> None:
        """From now on the planners run as ``rank``."""
        self.rank = rank
        for mesh in self.meshes:
            mesh._rank = rank
            mesh._coordinate_on_dim = coord_of(tuple(mesh.shape), rank)


VR = VirtualRanks()


def build_mesh(mesh_kind: str, world: int) -> DeviceMesh:
    """The world's mesh, without process groups, its coordinate driven by :data:`VR`."""
    shape = mesh_shape_of(mesh_kind, world)
    names = ("dp",) if mesh_kind == "fsdp" else ("dp", "tp")
    mesh = DeviceMesh("cpu", torch.arange(world, dtype=torch.int).view(shape), mesh_dim_names=names,
                      _init_backend=False, _rank=0)
    VR.meshes.append(mesh)
    # our coordinate arithmetic must agree with DeviceMesh's own
    for r in {0, 1, world // 2 + 3, world - 1}:
        want = DeviceMesh._compute_coordinates_from_mesh(torch.arange(world).view(shape), r)
        VR.set(r)
        assert mesh.get_coordinate() == want, (mesh.get_coordinate(), want)
        assert dist.get_rank() == r
    return mesh


# ---- memoised chunk geometry for the untimed bulk of ranks

_ORIG_CLSGO = planner_helpers.compute_local_shape_and_global_offset


class _Memo:
    enabled = False
    cache: dict[Any, Any] = {}
    calls = 0


def _memo_clsgo(global_shape: Any, mesh: DeviceMesh, placements: Any, skip_offset: bool = False) -> Any:
    _Memo.calls += 1
    if not _Memo.enabled:
        return _ORIG_CLSGO(global_shape, mesh, placements, skip_offset)
    key = (tuple(global_shape), id(mesh), mesh._coordinate_on_dim, tuple(placements), skip_offset)
    v = _Memo.cache.get(key)
    if v is None:
        v = _Memo.cache[key] = _ORIG_CLSGO(global_shape, mesh, placements, skip_offset)
    return v


def install_memo() -> None:
    """Route DCP's planner helpers through the memo (in the configuration's process only)."""
    planner_helpers.compute_local_shape_and_global_offset = _memo_clsgo


@contextlib.contextmanager
def memo(on: bool) -> Iterator[None]:
    """Memoise chunk geometry while ``on`` (the untimed bulk of ranks)."""
    prev, _Memo.enabled = _Memo.enabled, on
    try:
        yield
    finally:
        _Memo.enabled = prev


# ---- garbage collector policies (see module docstring)


# Outside timed sections the collector is off and the heap is frozen (frozen
# objects are still freed by reference counting; only cyclic garbage waits for
# the next coordinator section, which unfreezes and collects everything).


@contextlib.contextmanager
def rank_gc() -> Iterator[None]:
    """GC as a lone rank sees it: the simulator's heap (other ranks' plans) is frozen."""
    gc.freeze()
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


@contextlib.contextmanager
def coordinator_gc() -> Iterator[None]:
    """GC on, over the whole heap (which holds the W plans, as on the coordinator)."""
    gc.unfreeze()
    gc.collect()
    gc.enable()
    try:
        yield
    finally:
        gc.disable()
        gc.freeze()


def full_collect(world: int) -> None:
    """Reclaim cyclic garbage (frozen objects are only freed by refcounting); large W only."""
    if world >= 1024:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


class _Caches:
    """ucp_dcp's per-process caches, emptied before every timed rank.

    A real rank is its own process and plans its first save or load with cold
    caches; in the simulator every virtual rank would otherwise find what the
    previous ones cached. Caches are found, not named: functools.lru_cache
    functions defined in ucp_dcp, and module-level dicts/lists/sets of
    ucp_dcp modules that grew during a throwaway plan.
    """

    def __init__(self) -> None:
        self.found: list[tuple[str, Any]] = []

    @staticmethod
    def _containers() -> dict[str, Any]:
        out = {}
        for name, mod in list(sys.modules.items()):
            if not name.startswith("ucp_dcp") or mod is None:
                continue
            for attr, v in list(vars(mod).items()):
                if isinstance(v, (dict, list, set)) and not attr.startswith("__"):
                    out[f"{name}.{attr}"] = v
                elif callable(getattr(v, "cache_clear", None)) and getattr(v, "__module__", "") == name:
                    out[f"{name}.{attr}()"] = v
        return out

    def discover(self, plan_once: Callable[[], Any]) -> None:
        before = {k: (len(v) if not callable(v) else 0) for k, v in self._containers().items()}
        with memo(False):
            plan_once()
        known = {k for k, _ in self.found}
        for k, v in self._containers().items():
            if k not in known and (callable(v) or len(v) != before.get(k, 0)):
                self.found.append((k, v))

    def names(self) -> list[str]:
        return [k for k, _ in self.found]

    def clear(self) -> None:
        for _, v in self.found:
            if callable(getattr(v, "cache_clear", None)):
                v.cache_clear()
            else:
                v.clear()


CACHES = _Caches()


# ============================================================ state dicts


class RankStates:
    """Per-rank state dicts of DTensors; one DTensor per distinct (entry, local shape)."""

    def __init__(self, mesh: DeviceMesh, mesh_kind: str, entries: list[Entry], strided: bool, side: str) -> None:
        self.mesh = mesh
        self.mesh_kind = mesh_kind
        self.mesh_shape = tuple(mesh.shape)
        self.entries = entries
        self.side = side  # "save" (meta locals) or "load" (expanded 0-element CPU locals)
        self.placements = [placements_for(mesh_kind, e.role, strided) for e in entries]
        self.by_fqn = {e.fqn: (e, p) for e, p in zip(entries, self.placements)}
        classes: dict[Any, int] = {}
        self.cls = [classes.setdefault((e.shape, p), len(classes)) for e, p in zip(entries, self.placements)]
        self.class_keys = list(classes)
        self._cache: dict[tuple[int, tuple[int, ...]], DTensor] = {}

    def _dtensor(self, i: int, local_shape: tuple[int, ...]) -> DTensor:
        key = (i, local_shape)
        dt = self._cache.get(key)
        if dt is None:
            e = self.entries[i]
            if self.side == "save":
                local = torch.empty(local_shape, dtype=e.dtype, device="meta")
            else:
                local = torch.empty((), dtype=e.dtype).expand(local_shape)
            dt = DTensor.from_local(local, self.mesh, self.placements[i], run_check=False,
                                    shape=torch.Size(e.shape), stride=contiguous_stride(e.shape))
            self._cache[key] = dt
        return dt

    def box(self, fqn: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(sizes, offsets) of rank ``rank``'s box of ``fqn``, computed without DTensor."""
        e, p = self.by_fqn[fqn]
        return ref_box(e.shape, self.mesh_shape, coord_of(self.mesh_shape, rank), p)

    def state_dict(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s nested state dict."""
        coord = coord_of(self.mesh_shape, rank)
        shapes = [ref_box(shape, self.mesh_shape, coord, p)[0] for shape, p in self.class_keys]
        sd: dict[str, Any] = {}
        for i, e in enumerate(self.entries):
            d = sd
            for k in e.path[:-1]:
                d = d.setdefault(k, {})
            d[e.path[-1]] = self._dtensor(i, shapes[self.cls[i]])
        return sd


# ============================================================ formats


def new_save(fmt: str, path: str) -> tuple[Any, Any]:
    """(writer, planner) of one rank's save; DCP's with an explicit ``DefaultSavePlanner``."""
    return make_writer(fmt, path, default_planner=True)


def local_save_step(writer: Any, planner: Any, sd: dict[str, Any], rank: int) -> Any:
    """What dcp.save's local_step does on rank ``rank``."""
    planner.set_up_planner(sd, writer.storage_meta(), rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    plan = planner.create_local_plan()
    return writer.prepare_local_plan(plan)


def dcp_results(plan: Any, rank: int) -> list[WriteResult]:
    """What FileSystemWriter.write_data reports (one file per rank)."""
    rel = f"{plan.storage_data.prefix}0.distcp"
    out, off = [], 0
    for item in plan.items:
        n = (item.tensor_storage_size() or 0) if item.type != WriteItemType.BYTE_IO else 0
        out.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(rel, off, n)))
        off += n
    return out


# ============================================================ helpers


def spread_ranks(world: int, n: int) -> list[int]:
    """Up to n ranks spread over [0, W): 0 and W-1 first, then by bisection."""
    if n <= 0 or n >= world:
        pts = list(range(world))
    else:
        pts = sorted({round(i * (world - 1) / (n - 1)) for i in range(n)} if n > 1 else {0})
    if not pts:
        return []
    first = [pts[0]] + ([pts[-1]] if len(pts) > 1 else [])
    rest = pts[1:-1]
    order: list[int] = []
    # bisection order over the middle points
    queue = [(0, len(rest))]
    while queue:
        lo, hi = queue.pop(0)
        if lo >= hi:
            continue
        mid = (lo + hi) // 2
        order.append(rest[mid])
        queue += [(lo, mid), (mid + 1, hi)]
    return first + order


class Progress:
    """Progress lines every ``every_s`` seconds over a loop of ranks."""

    def __init__(self, label: str, total: int, every_s: float = 20.0) -> None:
        self.label, self.total, self.every = label, total, every_s
        self.t0 = self.last = time.perf_counter()

    def tick(self, done: int) -> None:
        """``done`` ranks are done."""
        now = time.perf_counter()
        if now - self.last >= self.every and done:
            self.last = now
            el = now - self.t0
            log(f"  {self.label}: {done}/{self.total} ranks, {el:.0f} s, eta {el / done * (self.total - done):.0f} s")


# ============================================================ verification


def check_save_plan(fmt: str, plan: Any, states: RankStates, rank: int) -> None:
    """The plan's chunks must be exactly rank ``rank``'s boxes."""
    got: dict[str, Any] = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        fqn = item.index.fqn
        assert fqn not in got, f"rank {rank}: two write items for {fqn}"
        got[fqn] = item.tensor_data.chunk
    for fqn in states.by_fqn:
        sizes, offsets = states.box(fqn, rank)
        empty = math.prod(sizes) == 0
        if fqn not in got:
            assert fmt == "ucp" and empty, f"rank {rank}: no write item for {fqn} (box {sizes} at {offsets})"
            continue
        c = got[fqn]
        assert tuple(c.sizes) == sizes, f"rank {rank} {fqn}: planned sizes {tuple(c.sizes)} != {sizes}"
        assert empty or tuple(c.offsets) == offsets, \
            f"rank {rank} {fqn}: planned offsets {tuple(c.offsets)} != rank {rank}'s {offsets}"
    extra = set(got) - set(states.by_fqn)
    assert not extra, f"rank {rank}: unexpected write items {sorted(extra)[:3]}"


def check_load_plan(plan: Any, states: RankStates, rank: int) -> None:
    """The plan's reads must cover exactly rank ``rank``'s boxes."""
    cover: dict[str, int] = {}
    for ri in plan.items:
        if ri.type != LoadItemType.TENSOR:
            continue
        fqn = ri.dest_index.fqn
        sizes, offsets = states.box(fqn, rank)
        assert tuple(ri.dest_index.offset) == offsets, \
            f"rank {rank} {fqn}: read into box at {tuple(ri.dest_index.offset)}, rank {rank}'s is at {offsets}"
        cover[fqn] = cover.get(fqn, 0) + math.prod(ri.lengths)
    for fqn in states.by_fqn:
        sizes, _ = states.box(fqn, rank)
        assert cover.get(fqn, 0) == math.prod(sizes), \
            f"rank {rank} {fqn}: reads cover {cover.get(fqn, 0)} elements, the box has {math.prod(sizes)}"


def plan_signature(plan: Any) -> list[tuple[Any, ...]]:
    """What identifies a plan's write items (to compare two builds of it)."""
    return [(i.index.fqn, tuple(i.index.offset or ()), tuple(i.tensor_data.chunk.sizes) if i.tensor_data else ())
            for i in plan.items]


# ============================================================ one configuration


@dataclass
class Job:
    """One configuration: format, mesh, world size and where its metadata goes."""

    fmt: str
    mesh: str
    world: int
    ckpt: str
    xload_from: str | None
    layers: int
    optimizer: bool
    strided: bool
    sample: int
    budget_s: float


def run_save(job: Job, states: RankStates) -> dict[str, Any]:
    """The save half: every rank's local plan, the coordinator's global plan, finish, metadata."""
    W, fmt = job.world, job.fmt
    out: dict[str, Any] = {}
    sample = spread_ranks(W, job.sample)
    sampled = set(sample)
    timed: list[int] = []
    t_local: list[float] = []
    plans: list[Any] = [None] * W
    psize = [0] * W
    coord: tuple[Any, Any] | None = None
    spent = 0.0
    # a throwaway plan of rank 0 finds the planner's per-process caches
    VR.set(0)
    CACHES.discover(lambda: local_save_step(*new_save(fmt, job.ckpt), states.state_dict(0), 0))
    out["cold_caches"] = CACHES.names()
    prog = Progress(f"{fmt} {job.mesh} W={W} save local plans", W)
    t_build = time.perf_counter()
    # sampled ranks first (in spread order) so that the time budget cuts the tail of the sample
    for done, r in enumerate(sample + [r for r in range(W) if r not in sampled], 1):
        VR.set(r)
        sd = states.state_dict(r)
        writer, planner = new_save(fmt, job.ckpt)
        if r in sampled and (spent < job.budget_s or len(timed) < 3):
            CACHES.clear()  # a rank's process plans its first save cold
            with memo(False), rank_gc():
                t0 = time.perf_counter()
                plan = local_save_step(writer, planner, sd, r)
                dt = time.perf_counter() - t0
            spent += dt
            t_local.append(dt)
            timed.append(r)
            if len(timed) <= VERIFY_RANKS:
                if any(i.type != WriteItemType.BYTE_IO for i in plan.items):
                    check_save_plan(fmt, plan, states, r)
                elif len(timed) == 1:
                    log(f"  note: {fmt}'s local plans carry no tensor write items; final plans are checked")
            if len(timed) == 2:  # the memoised build must produce the same plan
                w2, p2 = new_save(fmt, job.ckpt)
                with memo(True):
                    again = local_save_step(w2, p2, states.state_dict(r), r)
                assert plan_signature(again) == plan_signature(plan), f"rank {r}: memoised plan differs"
        else:
            with memo(True):
                plan = local_save_step(writer, planner, sd, r)
        if r == 0:
            coord = (planner, writer)
        plans[r] = plan
        psize[r] = len(pickle.dumps(plan))
        prog.tick(done)
    out["local_build_s"] = time.perf_counter() - t_build
    out["local_plan_s"] = stats(t_local)
    out["local_plan_timed_ranks"] = timed
    out["local_plan_bytes"] = stats([float(x) for x in psize])
    out["local_items"] = sum(len(p.items) for p in plans)
    log(f"  {fmt} {job.mesh} W={W}: {W} local plans built in {out['local_build_s']:.1f} s "
        f"({len(timed)} timed, mean {statistics.fmean(t_local) * 1e3:.1f} ms); "
        f"{out['local_items']} write items, gather {sum(psize) / MB:.1f} MB")
    assert coord is not None
    cplanner, cwriter = coord

    # ---- coordinator: global plan
    VR.set(0)
    with coordinator_gc():
        t0 = time.perf_counter()
        central, md = cplanner.create_global_plan(plans)
        central = cwriter.prepare_global_plan(central)
        out["global_plan_s"] = time.perf_counter() - t0
    del plans
    gsize = [len(pickle.dumps(p)) for p in central]
    out["global_plan_bytes"] = stats([float(x) for x in gsize])
    out["global_items"] = sum(len(p.items) for p in central)
    log(f"  {fmt} {job.mesh} W={W}: global plan {out['global_plan_s']:.2f} s, "
        f"{out['global_items']} items, scatter {sum(gsize) / MB:.1f} MB")

    def finish_once() -> None:  # finds caches that only finish_plan fills
        wr, pl = new_save(fmt, job.ckpt)
        local_save_step(wr, pl, states.state_dict(0), 0)
        pl.finish_plan(central[0])
    CACHES.discover(finish_once)
    out["cold_caches"] = CACHES.names()

    # ---- every rank: finish_plan, write results
    results: list[Any] = [None] * W
    rsize = [0] * W
    t_finish: list[float] = []
    timed_set = set(timed)
    verify = set(timed[:VERIFY_RANKS])
    covered: dict[str, int] = {}
    final_items = 0
    prog = Progress(f"{fmt} {job.mesh} W={W} write results", W)
    t_build = time.perf_counter()
    for r in range(W):
        VR.set(r)
        if r in timed_set:
            # as in the rank's own process: its local plan, then finish_plan
            CACHES.clear()
        if r == 0:
            planner, writer = cplanner, cwriter
        elif fmt == "ucp" or r in timed_set:
            writer, planner = new_save(fmt, job.ckpt)
            with memo(r not in timed_set):
                local_save_step(writer, planner, states.state_dict(r), r)
        else:
            planner, writer = DefaultSavePlanner(), None  # finish_plan only stores the plan
        if r in timed_set:
            with memo(False), rank_gc():
                t0 = time.perf_counter()
                final = planner.finish_plan(central[r])
                t_finish.append(time.perf_counter() - t0)
        else:
            with memo(True):
                final = planner.finish_plan(central[r])
        final_items += len(final.items)
        for item in final.items:
            if item.type != WriteItemType.BYTE_IO:
                c = item.tensor_data.chunk
                covered[item.index.fqn] = covered.get(item.index.fqn, 0) + math.prod(c.sizes)
                if r in verify:
                    sizes, offsets = states.box(item.index.fqn, r)
                    assert (tuple(c.sizes), tuple(c.offsets)) == (sizes, offsets) or not math.prod(sizes), \
                        f"rank {r} {item.index.fqn}: writes {tuple(c.sizes)} at {tuple(c.offsets)}, " \
                        f"its box is {sizes} at {offsets}"
        res = writer.planned_results(final, planner) if fmt == "ucp" else dcp_results(final, r)
        central[r] = None
        results[r] = res
        rsize[r] = len(pickle.dumps(res))
        prog.tick(r + 1)
    del central
    for fqn, (e, _) in states.by_fqn.items():  # every element written exactly once
        assert covered.get(fqn, 0) == math.prod(e.shape), \
            f"{fqn}: the final plans write {covered.get(fqn, 0)} of {math.prod(e.shape)} elements"
    out["results_build_s"] = time.perf_counter() - t_build
    out["finish_plan_s"] = stats(t_finish)
    out["final_items"] = final_items
    out["write_results_bytes"] = stats([float(x) for x in rsize])

    # ---- coordinator: finish (writes the metadata file), then dcp.save
    # broadcasts the Metadata to every rank (_DistWrapper.all_reduce)
    VR.set(0)
    with coordinator_gc():
        t0 = time.perf_counter()
        cwriter.finish(md, results)
        out["finish_s"] = time.perf_counter() - t0
        del results
        t0 = time.perf_counter()
        bcast = pickle.dumps(md)
        out["metadata_bcast_pickle_s"] = time.perf_counter() - t0
    files = {p.name: p.stat().st_size for p in Path(job.ckpt).iterdir() if p.is_file()}
    out["metadata_files"] = files
    out["metadata_bytes"] = sum(files.values())
    out["metadata_bcast_bytes"] = len(bcast)
    del md, cplanner, cwriter
    full_collect(W)
    with rank_gc():
        t0 = time.perf_counter()
        md = pickle.loads(bcast)
        out["metadata_bcast_unpickle_s"] = time.perf_counter() - t0
    del bcast
    out["metadata_chunks"] = sum(len(v.chunks) for v in md.state_dict_metadata.values()
                                 if isinstance(v, TensorStorageMetadata))
    log(f"  {fmt} {job.mesh} W={W}: finish {out['finish_s']:.2f} s, {metadata_file(fmt)} "
        f"{out['metadata_bytes'] / MB:.1f} MB; metadata broadcast {out['metadata_bcast_bytes'] / MB:.1f} MB, "
        f"unpickled in {out['metadata_bcast_unpickle_s']:.2f} s; {out['metadata_chunks']} chunks")
    del md
    full_collect(W)
    return out


def run_load(job: Job, ckpt: str, states: RankStates, label: str) -> dict[str, Any]:
    """The load half into ``states``: read_metadata, sampled local plans, global plan, finish_plan."""
    W, fmt = job.world, job.fmt
    out: dict[str, Any] = {}
    VR.set(0)

    def read() -> tuple[Any, Any, float]:
        CACHES.clear()
        reader = make_reader(fmt, ckpt)[0]
        with rank_gc():
            t0 = time.perf_counter()
            md = reader.read_metadata()
            dt = time.perf_counter() - t0
        return reader, md, dt

    if fmt == "ucp":  # a throwaway read and plan finds the reader's and load planner's caches
        def plan_once() -> None:
            rd = make_reader(fmt, ckpt)[0]
            m = rd.read_metadata()
            pl = load_planner(fmt)
            pl.set_up_planner(states.state_dict(0), m, True)
            rd.set_up_storage_reader(m, True, rank=0, use_collectives=True)
            rd.prepare_local_plan(pl.create_local_plan())
        CACHES.discover(plan_once)
    out["cold_caches"] = CACHES.names()

    reads: list[float] = []
    while not reads or (sum(reads) < 0.5 and len(reads) < 5):
        reader, md, dt = read()
        reads.append(dt)
    out["read_metadata_s"] = stats(reads)
    # Each rank reads the metadata itself; ucp's reader and metadata carry
    # lazily built caches (grids), so every timed ucp rank gets its own read
    # (untimed) unless reading is slow. DCP's reader and metadata are plain
    # data: one read is shared (keeping 32 copies alive would only cost memory).
    fresh = fmt == "ucp" and min(reads) < 1.0
    out["fresh_metadata_per_rank"] = fresh
    log(f"  {fmt} {label} W={W}: read_metadata {min(reads):.3f} s (x{len(reads)})")

    sample = spread_ranks(W, job.sample)
    plans: dict[int, Any] = {}
    planners: dict[int, Any] = {}
    t_local: list[float] = []
    sizes: list[float] = []
    nitems: list[float] = []
    spent = 0.0
    for r in sample:
        if spent >= job.budget_s and len(plans) >= 3:
            break
        VR.set(r)
        if fresh and plans:
            reader, md, _ = read()
        else:
            CACHES.clear()
        sd = states.state_dict(r)
        planner = load_planner(fmt)
        with memo(False), rank_gc():
            t0 = time.perf_counter()
            planner.set_up_planner(sd, md, r == 0)
            reader.set_up_storage_reader(md, r == 0, rank=r, use_collectives=True)
            plan = planner.create_local_plan()
            plan = reader.prepare_local_plan(plan)
            dt = time.perf_counter() - t0
        spent += dt
        t_local.append(dt)
        plans[r], planners[r] = plan, planner
        sizes.append(float(len(pickle.dumps(plan))))
    out["local_plan_s"] = stats(t_local)
    out["local_plan_timed_ranks"] = list(plans)
    out["local_plan_bytes"] = stats(sizes)
    out["local_plan_bytes"]["est_gather"] = statistics.fmean(sizes) * W
    log(f"  {fmt} {label} W={W}: {len(plans)} local load plans, mean {statistics.fmean(t_local) * 1e3:.1f} ms, "
        f"max {max(t_local) * 1e3:.1f} ms, gather ~{statistics.fmean(sizes) * W / MB:.1f} MB")

    order = list(plans)
    all_plans = [plans[r] if r in plans else plans[order[r % len(order)]] for r in range(W)]
    VR.set(0)
    with coordinator_gc():
        t0 = time.perf_counter()
        central = planners[0].create_global_plan(all_plans)
        central = reader.prepare_global_plan(central)
        out["global_plan_s"] = time.perf_counter() - t0
    t_finish = []
    for k, (r, planner) in enumerate(planners.items()):
        VR.set(r)
        with rank_gc():
            t0 = time.perf_counter()
            final = planner.finish_plan(central[r])
            t_finish.append(time.perf_counter() - t0)
        # the plan read_data gets: checked and counted after finish_plan (a
        # planner may keep its items local instead of sending them around)
        if k < VERIFY_RANKS:
            check_load_plan(final, states, r)
        nitems.append(float(len(final.items)))
    out["finish_plan_s"] = stats(t_finish)
    out["read_items"] = stats(nitems)
    del central, all_plans, plans, planners, md, reader
    full_collect(W)
    return out


def run_job(job: Job) -> dict[str, Any]:
    """One (format, mesh, W): save, load back, and the FSDP -> FSDP+TP load."""
    torch.set_num_threads(1)
    res: dict[str, Any] = {"format": job.fmt, "mesh": job.mesh, "world_size": job.world}
    t_all = time.perf_counter()
    res["base_rss_bytes"] = rss_bytes()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.world)
    gc.collect()
    gc.freeze()  # the interpreter's and torch's own objects: never scanned again
    gc.disable()
    try:
        if job.fmt == "ucp":
            import ucp_dcp  # noqa: F401, PLC0415 (before VR.install patches its get_rank)
        install_memo()
        VR.install()
        entries = llama_entries(job.layers, job.optimizer)
        mesh = build_mesh(job.mesh, job.world)
        save_states = RankStates(mesh, job.mesh, entries, job.strided, "save")
        load_states = RankStates(mesh, job.mesh, entries, job.strided, "load")
        os.makedirs(job.ckpt, exist_ok=True)
        reset_peak_rss()
        t0 = time.perf_counter()
        res["save"] = run_save(job, save_states)
        res["save"]["wall_s"] = time.perf_counter() - t0
        res["save"]["peak_rss_bytes"] = peak_rss_bytes()
        _Memo.cache.clear()
        del save_states
        full_collect(job.world)
        reset_peak_rss()
        t0 = time.perf_counter()
        res["load"] = run_load(job, job.ckpt, load_states, job.mesh)
        res["load"]["wall_s"] = time.perf_counter() - t0
        res["load"]["peak_rss_bytes"] = peak_rss_bytes()
        if job.xload_from and not os.path.exists(os.path.join(job.xload_from, metadata_file(job.fmt))):
            log(f"  {job.fmt} fsdp->fsdp_tp W={job.world}: no fsdp checkpoint of this run (failed or reused): "
                "no xload")
        elif job.xload_from:
            reset_peak_rss()
            t0 = time.perf_counter()
            res["xload"] = run_load(job, job.xload_from, load_states, "fsdp->fsdp_tp")
            res["xload"]["wall_s"] = time.perf_counter() - t0
            res["xload"]["peak_rss_bytes"] = peak_rss_bytes()
        res["status"] = "ok"
    finally:
        VR.rank = None
        dist.destroy_process_group()
        gc.unfreeze()
        gc.enable()
        res["wall_s"] = time.perf_counter() - t_all
    return res


def run_isolated(job: Job, isolate: bool) -> dict[str, Any]:
    """One configuration, in a forked child unless ``isolate`` is False; an error becomes a record."""
    try:
        return run_forked(run_job, job) if isolate else run_job(job)
    except ChildFailed as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
    return {"format": job.fmt, "mesh": job.mesh, "world_size": job.world, "status": "error", "error": error[:2000]}


# ============================================================ guards


def estimate(prev: list[dict[str, Any]], world: int) -> tuple[float, float] | None:
    """(seconds, peak bytes) extrapolated from the same format/mesh at smaller W."""
    ok = sorted((r for r in prev if r.get("status") == "ok"), key=lambda r: r["world_size"])
    if not ok:
        return None
    last = ok[-1]
    w1, t1 = last["world_size"], last["wall_s"]
    k = 1.0
    if len(ok) >= 2:
        w0, t0 = ok[-2]["world_size"], ok[-2]["wall_s"]
        if t0 > 0 and w1 > w0:
            k = min(2.0, max(1.0, math.log(t1 / t0) / math.log(w1 / w0)))
    t = t1 * (world / w1) ** k
    peak = max(last[s].get("peak_rss_bytes", 0) for s in ("save", "load", "xload") if s in last)
    base = last.get("base_rss_bytes") or 0.3 * GB  # interpreter + torch, not scaling with W
    m = base + max(0.0, peak - base) * world / w1
    return t, m


# ============================================================ report


def _rows() -> list[tuple[str, Callable[[dict[str, Any]], tuple[str, float] | None]]]:
    def g(*keys: str) -> Callable[[dict[str, Any]], Any]:
        def get(d: dict[str, Any]) -> Any:
            for k in keys:
                if not isinstance(d, dict) or k not in d:
                    return None
                d = d[k]
            return d
        return get

    def per_rank(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            s = g(*keys)(d)
            if not s or not s.get("n"):
                return None
            return f"{fmt_seconds(s['mean'])} / {fmt_seconds(s['max'])} (n={s['n']})", s["max"]
        return f

    def secs(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            v = g(*keys)(d)
            return None if v is None else (fmt_seconds(v), v)
        return f

    def rd(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            s = g(*keys)(d)
            return None if not s or not s.get("n") else (f"{fmt_seconds(s['min'])} (x{s['n']})", s["min"])
        return f

    def payload(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            s = g(*keys)(d)
            if not s or not s.get("n"):
                return None
            total = s.get("est_gather", s["sum"])
            tag = "~" if "est_gather" in s else ""
            return f"{tag}{fmt_bytes(total)} / max {fmt_bytes(s['max'])}", total
        return f

    def nbytes(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            v = g(*keys)(d)
            return None if v is None else (fmt_bytes(v), v)
        return f

    def count(*keys: str) -> Callable[[dict[str, Any]], tuple[str, float] | None]:
        def f(d: dict[str, Any]) -> tuple[str, float] | None:
            v = g(*keys)(d)
            if isinstance(v, dict):
                v = v.get("mean")
            return None if v is None else (f"{v:,.0f}", v)
        return f

    rows = [
        ("save local plan/rank mean/max", per_rank("save", "local_plan_s")),
        ("save gather local plans sum/max", payload("save", "local_plan_bytes")),
        ("save write items in local plans", count("save", "local_items")),
        ("save global plan (coord)", secs("save", "global_plan_s")),
        ("save scatter global plans", payload("save", "global_plan_bytes")),
        ("save finish_plan/rank mean/max", per_rank("save", "finish_plan_s")),
        ("save gather write results", payload("save", "write_results_bytes")),
        ("save finish (coord, writes md)", secs("save", "finish_s")),
        ("save final write items (all ranks)", count("save", "final_items")),
        ("save metadata file", nbytes("save", "metadata_bytes")),
        ("save md bcast size (pickled)", nbytes("save", "metadata_bcast_bytes")),
        ("save md bcast pickle (coord)", secs("save", "metadata_bcast_pickle_s")),
        ("save md bcast unpickle (every rank)", secs("save", "metadata_bcast_unpickle_s")),
        ("save planning critical path", lambda d: (lambda v: None if v is None else (fmt_seconds(v), v))(
            save_critical_path(d))),
        ("save peak RSS", nbytes("save", "peak_rss_bytes")),
        ("save wall (simulator)", secs("save", "wall_s")),
    ]
    for ph, name in (("load", "load"), ("xload", "xload fsdp->tp")):
        rows += [
            (f"{name} read_metadata (every rank)", rd(ph, "read_metadata_s")),
            (f"{name} local plan/rank mean/max", per_rank(ph, "local_plan_s")),
            (f"{name} read items/rank", count(ph, "read_items")),
            (f"{name} gather local plans (~W*mean)", payload(ph, "local_plan_bytes")),
            (f"{name} global plan (coord)", secs(ph, "global_plan_s")),
            (f"{name} finish_plan/rank mean/max", per_rank(ph, "finish_plan_s")),
            (f"{name} peak RSS", nbytes(ph, "peak_rss_bytes")),
        ]
    return rows


def save_critical_path(c: dict[str, Any]) -> float | None:
    """max per-rank local plan + coordinator global plan + max per-rank finish_plan."""
    try:
        sv = c["save"]
        return sv["local_plan_s"]["max"] + sv["global_plan_s"] + sv["finish_plan_s"]["max"]
    except (KeyError, TypeError):
        return None


TABLE_COLUMNS = [Column("mesh", 8, "<"), Column("W", 6, gap=1), Column("phase", 36, "<", 2), Column("dcp", 30, gap=1),
                 Column("ucp", 30, gap=1), Column("ucp/dcp", 8, gap=1)]


def print_table(configs: list[dict[str, Any]]) -> str:
    """Prints (and returns) every phase of every configuration, dcp and ucp side by side."""
    by = {(c["format"], c["mesh"], c["world_size"]): c for c in configs}
    meshes = sorted({c["mesh"] for c in configs}, key=lambda m: MESHES.index(m) if m in MESHES else 9)
    worlds = sorted({c["world_size"] for c in configs})
    head = text_table(TABLE_COLUMNS, [])[0]
    lines = [head, "-" * len(head)]
    for m in meshes:
        for w in worlds:
            cs = {f: by.get((f, m, w)) for f in FORMATS}
            if not any(cs.values()):
                continue
            for f, c in cs.items():
                if c and c.get("status") != "ok":
                    lines.append(f"{m:8} {w:>6}  {f + ' ' + c.get('status', '?'):36} {c.get('error', c.get('reason', ''))[:140]}")
            for label, fn in _rows():
                vals = {f: (fn(c) if c and c.get("status") == "ok" else None) for f, c in cs.items()}
                if not any(vals.values()):
                    continue
                ratio = ""
                tiny = all(v[0].startswith("0.0 ms") for v in vals.values() if v)
                if vals["dcp"] and vals["ucp"] and vals["dcp"][1] and not tiny:
                    ratio = f"{vals['ucp'][1] / vals['dcp'][1]:.2f}"
                lines += text_table(TABLE_COLUMNS, [[m, str(w), label, (vals["dcp"] or ("-",))[0],
                                                     (vals["ucp"] or ("-",))[0], ratio]])[1:]
            lines.append("")
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(configs: list[dict[str, Any]], path: Path) -> None:
    """Planning time, metadata size and read_metadata time against W, to ``path`` (needs matplotlib)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plot", flush=True)
        return
    panels = [
        ("save planning time: max rank local plan\n+ coordinator global plan + max rank finish_plan", "s",
         save_critical_path),
        ("metadata file size", "MB", lambda c: c["save"]["metadata_bytes"] / MB),
        ("read_metadata time (every rank)", "s", lambda c: c["load"]["read_metadata_s"]["min"]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    colors = {"dcp": "tab:blue", "ucp": "tab:orange"}
    styles = {"fsdp": "-", "fsdp_tp": "--"}
    for ax, (title, unit, fn) in zip(axes, panels):
        for fmt in FORMATS:
            for mesh in MESHES:
                pts = []
                for c in configs:
                    if (c["format"], c["mesh"]) == (fmt, mesh) and c.get("status") == "ok":
                        try:
                            v = fn(c)
                        except (KeyError, TypeError):
                            v = None
                        if v:
                            pts.append((c["world_size"], v))
                if pts:
                    pts.sort()
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[mesh], marker="o",
                            color=colors[fmt], label=f"{fmt} {mesh}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size W")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}", flush=True)


# ============================================================ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with --quick defaults filled in and choices checked."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default=None, help="comma-separated, default 64,1024,4096,16384")
    p.add_argument("--meshes", default="fsdp,fsdp_tp")
    p.add_argument("--formats", default="dcp,ucp")
    p.add_argument("--optimizer", action="store_true", help="add fp32 AdamW exp_avg/exp_avg_sq (3x tensors)")
    p.add_argument("--quick", action="store_true", help="W=64,256 and a 4-layer model: smoke check")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 80, 4 with --quick)")
    p.add_argument("--sample-ranks", type=int, default=None,
                   help="ranks timed per per-rank phase (default 32, 6 with --quick; 0 = all)")
    p.add_argument("--rank-budget-s", type=float, default=60.0,
                   help="stop timing further sampled ranks of a phase after this many seconds (min 3 ranks)")
    p.add_argument("--max-config-min", type=float, default=45.0,
                   help="skip a configuration whose extrapolated time exceeds this")
    p.add_argument("--plain-dp-shard", action="store_true",
                   help="fsdp_tp: Shard(0) on dp instead of FSDP2's _StridedShard(0, 8)")
    p.add_argument("--no-xload", action="store_true", help="skip the FSDP(W) -> FSDP+TP(W) load")
    p.add_argument("--no-isolate", action="store_true", help="run configurations in this process")
    p.add_argument("--workdir", default=None, help="where metadata files go (default: a temp dir)")
    p.add_argument("--out", default=str(RESULTS_DIR))
    p.add_argument("--reuse", default=None, metavar="JSON",
                   help="take over the finished configurations of an earlier scale.json (same model settings) "
                        "instead of running them again: resume an interrupted run, or compare a changed "
                        "ucp_dcp with a DCP baseline measured before (with --reuse-formats dcp)")
    p.add_argument("--reuse-formats", default=None,
                   help="with --reuse: only take over these formats (comma-separated; default all)")
    a = p.parse_args(argv)
    a.world_sizes = [int(x) for x in (a.world_sizes or ("64,256" if a.quick else "64,1024,4096,16384")).split(",")]
    a.meshes = comma_list(p, a.meshes, MESHES, "mesh")
    a.formats = comma_list(p, a.formats, FORMATS, "format")
    for w in a.world_sizes:
        if "fsdp_tp" in a.meshes and w % TP:
            p.error(f"world size {w} is not a multiple of tp={TP}")
    quick_defaults(a, layers=(4, 80), sample_ranks=(6, 32))
    return a


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every configuration ``args`` asks for; the result document, also kept in ``<out>/scale.json``.

    Raises ValueError when ``--reuse`` names a run of a different model.
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entries = llama_entries(args.layers, args.optimizer)
    doc: dict[str, Any] = {
        "command": [sys.executable, *sys.argv],
        "args": {k: v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "mem_available_bytes": mem_available(),
                    "python": platform.python_version()},
        "torch": torch.__version__,
        "model": {"layers": args.layers, "tensors": len(entries), "bytes": state_nbytes(entries),
                  "optimizer": args.optimizer, "tp": TP,
                  "fsdp_tp_dp_placement": "Shard(0)" if args.plain_dp_shard else "_StridedShard(0, split_factor=8)"},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "configs": [],
    }
    try:
        import ucp_dcp  # noqa: PLC0415 (imported once here, before the children fork)

        doc["ucp_dcp"] = getattr(ucp_dcp, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        doc["ucp_dcp"] = f"import failed: {e}"
    log(f"{len(entries)} tensors, {doc['model']['bytes'] / GB:.0f} GB, W={args.world_sizes}, "
        f"meshes={args.meshes}, formats={args.formats}")
    json_path = out / "scale.json"
    configs: list[dict[str, Any]] = doc["configs"]

    def save_json() -> None:
        doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        write_json(json_path, doc, indent=1, default=str)

    reused: dict[tuple[str, str, int], dict[str, Any]] = {}
    if args.reuse:
        old = json.loads(Path(args.reuse).read_text())
        if old.get("model") != doc["model"]:
            raise ValueError(f"--reuse {args.reuse}: different model settings {old.get('model')}")
        fmts = args.reuse_formats.split(",") if args.reuse_formats else list(FORMATS)
        for c in old.get("configs", []):
            if c.get("status") in ("ok", "skipped") and c["format"] in fmts and c["mesh"] in args.meshes \
                    and c["world_size"] in args.world_sizes:
                c["reused_from"] = f"{args.reuse} (started {old.get('started')})"
                reused[(c["format"], c["mesh"], c["world_size"])] = c
        # formats not run now are listed up front, the others where they would have run
        configs.extend(c for k, c in reused.items() if k[0] not in args.formats)
        doc["reused"] = {"from": args.reuse, "started": old.get("started"), "torch": old.get("torch"),
                         "configs": sorted(f"{f} {m} {w}" for f, m, w in reused)}
        log(f"reusing {len(reused)} finished configurations from {args.reuse}")

    workroot = tempfile.mkdtemp(prefix="bench_scale_", dir=args.workdir)
    try:
        for w in args.world_sizes:
            wdir = os.path.join(workroot, f"w{w}")
            for mesh in args.meshes:
                for fmt in args.formats:
                    if (fmt, mesh, w) in reused:
                        configs.append(reused[(fmt, mesh, w)])
                        log(f"{fmt} {mesh} W={w}: reused ({reused[(fmt, mesh, w)].get('status')})")
                        continue
                    prev = [c for c in configs if (c["format"], c["mesh"]) == (fmt, mesh)]
                    est = estimate(prev, w)
                    tag = f"{fmt} {mesh} W={w}"
                    if est is not None:
                        t_est, m_est = est
                        avail = mem_available()
                        reason = None
                        if avail and m_est > 0.85 * avail:
                            reason = (f"estimated peak memory {m_est / GB:.1f} GB (linear in W from "
                                      f"W={prev[-1]['world_size']}) > 85% of MemAvailable {avail / GB:.1f} GB")
                        elif t_est > args.max_config_min * 60:
                            reason = f"estimated time {t_est / 60:.0f} min > --max-config-min {args.max_config_min:g}"
                        log(f"{tag}: estimated {t_est:.0f} s, {m_est / GB:.1f} GB peak")
                        if reason:
                            log(f"{tag}: SKIPPED: {reason}")
                            configs.append({"format": fmt, "mesh": mesh, "world_size": w, "status": "skipped",
                                            "reason": reason, "estimate_s": t_est, "estimate_peak_bytes": m_est})
                            save_json()
                            continue
                    xload = None
                    if mesh == "fsdp_tp" and "fsdp" in args.meshes and not args.no_xload:
                        xload = os.path.join(wdir, f"{fmt}_fsdp")
                    job = Job(fmt, mesh, w, os.path.join(wdir, f"{fmt}_{mesh}"), xload, args.layers,
                              args.optimizer, not args.plain_dp_shard, args.sample_ranks, args.rank_budget_s)
                    log(f"{tag}: start")
                    t0 = time.perf_counter()
                    res = run_isolated(job, not args.no_isolate)
                    res.setdefault("wall_s", time.perf_counter() - t0)
                    res["config_wall_s"] = time.perf_counter() - t0
                    configs.append(res)
                    if res.get("status") == "ok":
                        log(f"{tag}: done in {res['config_wall_s']:.1f} s")
                    else:
                        log(f"{tag}: FAILED after {res['config_wall_s']:.1f} s: {res.get('error')}")
                    save_json()
            shutil.rmtree(wdir, ignore_errors=True)
    finally:
        shutil.rmtree(workroot, ignore_errors=True)
    print()
    doc["table"] = print_table(configs)
    save_json()
    print(f"json: {json_path}", flush=True)
    return doc


def main(argv: list[str] | None = None) -> int:
    """Command line: run, then plot; 0 when every configuration ran or was skipped."""
    args = parse_args(argv)
    try:
        doc = run(args)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    plot(doc["configs"], Path(args.out) / "scale.png")
    return 0 if all(c.get("status") in ("ok", "skipped") for c in doc["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
