#!/usr/bin/env python
"""Flat ZeRO-style shards -> FSDP2: ucp_dcp's FlatShard vs. gathering on one rank.

A ZeRO-1/2/3 (or FSDP1) job holds its fp32 weights and AdamW state as flat
buffers: every parameter flattened, padded to ``--align`` elements, laid back
to back, and each of N ranks owns one contiguous ``ceil(total / N)`` slice,
whose boundaries cut through rows. One run measures three ways of getting that
state (or the same state) into an FSDP2 model with AdamW on M ranks:

(A) **ucp**: each source rank puts its slices into the state dict as
    ``ucp_dcp.FlatShard`` values (param, exp_avg, exp_avg_sq; the per-param
    0-d ``step`` as a replicated ``TensorPieces``; ``param_groups``) and calls
    ``dcp.save`` with ``UCPStorageWriter`` + ``UCPSavePlanner``. The M target
    ranks build the FSDP2 model (``fully_shard`` per layer and at the root on
    a 1-D mesh of M), create the AdamW state with one step on zero gradients,
    take ``get_state_dict(model, optim)`` and ``dcp.load`` it with
    ``UCPStorageReader`` + ``UCPLoadPlanner``. The load is also run with
    ``UCPStorageReader(gap_bytes=0)`` (no coalescing of near byte ranges).
(B) **gather + dcp**, what a user can do today: ``dist.gather`` the padded
    flat partitions into one preallocated buffer on rank 0 (the gather list
    holds views of it, so nothing is concatenated), unflatten into full
    tensors (views, no copy), and ``dcp.save(..., no_dist=True)`` that
    consolidated state from rank 0 alone with DCP's ``FileSystemWriter``
    (the usual way to write a consolidated checkpoint: the other ranks have
    nothing to contribute, so they just wait at a barrier). The M target
    ranks load it with ``FileSystemReader`` and DCP's default planner.
(C) **dcp fsdp2**, the native-DCP reference: the same values held as an FSDP2
    model + AdamW on N ranks, saved with ``FileSystemWriter``, loaded into
    the M-rank FSDP2 target with ``FileSystemReader``. It needs no gather, but
    it is not available to a ZeRO job: it shows what DCP costs on a layout
    it understands.

Measured, per format, in one run (formats interleaved in every repeat):

* **save s**: barrier, save, barrier; the slowest rank. For (B) this includes
  the gather (``gather s`` is also reported alone) and rank 0's save.
  Both writers fsync their files.
* **load s**: barrier, ``dcp.load``, the slowest rank.
* **read MB**: the ``rchar`` delta of ``/proc/self/io`` around ``dcp.load``,
  summed over target ranks. ``rchar`` counts every byte returned by
  read-family system calls of the process (all threads), including page-cache
  hits and the index/metadata reads, and also the few KB of gloo socket
  traffic that the load's collectives read with ``read``/``readv``. The same
  counter is used for every format. For (A), ``UCPStorageReader.bytes_requested``
  (the bytes its range reads asked for, exactly) is reported as well.
  ``read_bytes`` of ``/proc/self/io`` (what the block layer fetched from
  storage, readahead included) is recorded too; it is about 0 unless
  ``--evict`` drops the checkpoint from the page cache before each load.
* **needed MB**: the sum over target ranks of the local shards' ``nbytes``
  (param, exp_avg, exp_avg_sq) plus the 0-d ``step`` tensors.
* **read amp**: read / needed (target for ucp: <= 1.05).
* **peak RSS**: ``VmHWM`` (reset through ``/proc/self/clear_refs``) minus the
  RSS at the reset, per rank, during the save phase and during the load.
  Reported as the maximum over ranks and the sum. The ranks run with
  ``MALLOC_MMAP_THRESHOLD_=65536`` and ``malloc_trim(0)`` before each
  baseline, so freed memory really leaves the process between measurements.

Every load is checked bit for bit: each target rank regenerates the expected
values of its local shards from a closed-form function of the global element
index (the "full reference", never materialised) and compares every local
shard, every ``step`` and ``param_groups``. Loads start from NaN. A mismatch
is printed and the exit status is non-zero.

Usage::

    python benchmarks/bench_flat.py                    # ~256 MiB state, 4 -> 3 ranks, 5 repeats
    python benchmarks/bench_flat.py --quick            # 16 MiB smoke check, 1 repeat
    python benchmarks/bench_flat.py --mb 1024 --src 8 --dst 3 --evict

See benchmarks/README.md ("Flat ZeRO-style shards -> FSDP2") for results and caveats.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from harness import (
    ADAMW_HYPER,
    MB,
    MiB,
    PhaseProbe,
    bit_equal,
    default_out,
    dir_bytes,
    evict_tree,
    fmt_mb,
    fmt_num,
    fresh_dir,
    make_reader,
    markdown_table,
    print_failures,
    quick_defaults,
    rank_log,
    round_trip,
    save_state,
    seed_of,
    set_rank_env,
    spawn_ranks,
    synth_values,
    write_json,
)
from ucp_dcp import FlatParam, FlatShard, Piece, TensorPieces, flat_partition, pack_flat

STEP = 1234.0
KINDS = ("param", "exp_avg", "exp_avg_sq")
KEY = {"param": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}
SAVE_FORMATS = ("ucp", "gather_dcp", "dcp_fsdp2")
LOAD_FORMATS = ("ucp", "ucp_gap0", "gather_dcp", "dcp_fsdp2")
CKPT_OF = {"ucp": "ucp", "ucp_gap0": "ucp", "gather_dcp": "gather_dcp", "dcp_fsdp2": "dcp_fsdp2"}
LABEL = {
    "ucp": "(A) ucp FlatShard -> FSDP2",
    "ucp_gap0": "(A) same, reader gap_bytes=0",
    "gather_dcp": "(B) gather to rank 0 + DCP",
    "dcp_fsdp2": "(C) DCP FSDP2 -> FSDP2",
}
TARGET_READ_AMP = 1.05


# --------------------------------------------------------------------------
# Model and deterministic values
# --------------------------------------------------------------------------


def layer_dims(mb: float, layers: int) -> list[int]:
    """Widths [D, F, D, F, ...] of ``layers`` Linear layers whose fp32 state
    (weight + bias, times 3 for param/exp_avg/exp_avg_sq) is about ``mb`` MiB.

    D and F are odd and F is about 2.7 D, so rows are odd-length and neither
    ZeRO's flat partition nor FSDP2's Shard(0) split lands on round numbers.
    """
    params = mb * MiB / 12
    d = max(8, int(math.sqrt(params / (2.7 * layers)))) | 1
    f = int(2.7 * d) | 1
    # Every F differs a little and the last layer is a narrower "head", so no
    # two layers have the same size and rank boundaries fall inside tensors.
    dims = [d if i % 2 == 0 else f + 6 * i for i in range(layers + 1)]
    dims[-1] = int(0.6 * dims[-1]) | 1
    return dims


class Stack(nn.Module):
    """A stack of Linear layers of the given widths."""

    def __init__(self, dims: Sequence[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))


def named_shapes(dims: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes in ``named_parameters`` order (no model built)."""
    out: list[tuple[str, tuple[int, ...]]] = []
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        out += [(f"layers.{i}.weight", (b, a)), (f"layers.{i}.bias", (b,))]
    return out


def local_range(t: DTensor) -> tuple[int, int]:
    """Flat element range [lo, hi) of the global tensor held by this rank (Shard(0))."""
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    row = math.prod(t.shape[1:])
    return offsets[0] * row, (offsets[0] + sizes[0]) * row


def fill_flat(buf: torch.Tensor, params: Sequence[FlatParam], start: int, kind: str) -> None:
    """This rank's slice of the flat buffer of ``kind`` (padding zero)."""
    buf.zero_()
    stop = start + buf.numel()
    for p in params:
        lo, hi = max(p.offset, start), min(p.end, stop)
        if lo < hi:
            buf[lo - start : hi - start] = synth_values(seed_of(p.fqn, kind), torch.arange(lo - p.offset, hi - p.offset))


# --------------------------------------------------------------------------
# FSDP2 model + AdamW state
# --------------------------------------------------------------------------


def build_fsdp(dims: Sequence[int], mesh: DeviceMesh, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 model (meta init, fully_shard per layer and at the root) with AdamW state created."""
    with torch.device("meta"):
        model = Stack(dims)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    optim = torch.optim.AdamW(model.parameters(), **{**ADAMW_HYPER, "lr": lr})
    for p in model.parameters():  # one step on zero gradients creates exp_avg, exp_avg_sq, step
        p.grad = torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def train_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """``get_state_dict(model, optim)`` nested as ``{"model": ..., "optim": ...}``."""
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def fill_fsdp(state: dict[str, Any], fqns: Sequence[str], value: float | None) -> None:
    """Local shards: expected values (value None) or a constant (a load target)."""
    flat, _ = flatten_state_dict(state)
    for fqn in fqns:
        for kind in KINDS:
            t = flat[KEY[kind].format(fqn)]
            local = t.to_local().view(-1)
            if value is None:
                lo, hi = local_range(t)
                local.copy_(synth_values(seed_of(fqn, kind), torch.arange(lo, hi)))
            else:
                local.fill_(value)
        flat[f"optim.state.{fqn}.step"].fill_(STEP if value is None else value)


def verify(state: dict[str, Any], fqns: Sequence[str], param_groups: Any, what: str) -> list[str]:
    """Every local shard against the matching slice of the (closed-form) full tensor."""
    errors: list[str] = []
    flat, _ = flatten_state_dict(state)
    for fqn in fqns:
        for kind in KINDS:
            key = KEY[kind].format(fqn)
            t = flat[key]
            lo, hi = local_range(t)
            want = synth_values(seed_of(fqn, kind), torch.arange(lo, hi)).view(t.to_local().shape)
            if not bit_equal(t.to_local(), want):
                errors.append(f"{what}: rank {dist.get_rank()}: local shard of {key} differs")
        step = flat[f"optim.state.{fqn}.step"]
        if not bit_equal(step, torch.tensor(STEP, dtype=step.dtype)):
            errors.append(f"{what}: rank {dist.get_rank()}: optim.state.{fqn}.step = {step.item()}")
    if state["optim"]["param_groups"] != param_groups:
        got = state["optim"]["param_groups"]
        errors.append(f"{what}: rank {dist.get_rank()}: param_groups {got} != {param_groups}")
    return errors


def needed_bytes(state: dict[str, Any], fqns: Sequence[str]) -> int:
    """Bytes of this rank's local shards (param, exp_avg, exp_avg_sq) plus the 0-d steps."""
    flat, _ = flatten_state_dict(state)
    n = 0
    for fqn in fqns:
        for kind in KINDS:
            t = flat[KEY[kind].format(fqn)].to_local()
            n += t.numel() * t.element_size()
        n += flat[f"optim.state.{fqn}.step"].nbytes
    return n


# --------------------------------------------------------------------------
# Source ranks: the three saves
# --------------------------------------------------------------------------


def _warm_up(workdir: str, load: bool) -> None:
    """A tiny round trip with every writer/reader, so lazy imports and first
    collectives are not charged to whichever format is measured first."""
    rank, world = dist.get_rank(), dist.get_world_size()
    params, total = pack_flat([("w", (7, 5))], align=4)
    start, stop = flat_partition(total, world, rank)
    buf = torch.zeros(stop - start)
    for fmt in ("ucp", "dcp"):
        path = os.path.join(workdir, f"warmup.{fmt}")
        fresh_dir(path)
        if fmt == "ucp":
            round_trip(fmt, path, {"flat": FlatShard(buf, params, start, prefix="m.")},
                       {"m": {"w": torch.zeros(7, 5)}} if load else None)
        else:
            round_trip(fmt, path, {"m.w": torch.zeros(3, 5)}, {"m.w": torch.zeros(3, 5)} if load else None)
            if rank == 0:
                save_state(fmt, {"x": torch.zeros(2)}, path + ".nodist", no_dist=True)
        dist.barrier()


def source_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One source rank: every save of every format and repeat; its per-run records."""
    dims, workdir, align = cfg["dims"], cfg["workdir"], cfg["align"]
    rank_log("source ranks up")
    mesh = init_device_mesh("cpu", (world,))
    # (C)'s state: FSDP2 + AdamW on the source ranks, filled with the expected values.
    model, optim = build_fsdp(dims, mesh, lr=ADAMW_HYPER["lr"])
    fsdp_state = train_state(model, optim)
    fqns = [n for n, _ in named_shapes(dims)]
    fill_fsdp(fsdp_state, fqns, None)
    param_groups = copy.deepcopy(fsdp_state["optim"]["param_groups"])

    # (A)/(B)'s state: this rank's ZeRO partition of flat buffers.
    params, total = pack_flat(named_shapes(dims), align=align)
    start, stop = flat_partition(total, world, rank)
    bufs = {k: torch.empty(stop - start) for k in KINDS}
    for k in KINDS:
        fill_flat(bufs[k], params, start, k)
    step = torch.tensor(STEP)

    def flat_state() -> dict[str, Any]:
        return {
            "model": {"flat": FlatShard(bufs["param"], params, start, prefix="model.")},
            "optim": {
                "flat": {k: FlatShard(bufs[k], params, start, prefix="optim.state.", suffix=f".{k}")
                         for k in ("exp_avg", "exp_avg_sq")},
                "step": TensorPieces([Piece(f"optim.state.{f}.step", (), (), step) for f in fqns], replicated=True),
                "param_groups": param_groups,
            },
        }

    rank_log("source state built")
    _warm_up(workdir, load=False)
    rank_log("warmed up")
    runs: list[dict[str, Any]] = []
    for rep in range(cfg["repeat"]):
        for fmt in SAVE_FORMATS:
            rank_log(f"save {fmt}, repeat {rep}")
            path = os.path.join(workdir, fmt)
            fresh_dir(path)
            extra: dict[str, Any] = {}
            if fmt == "ucp":
                with PhaseProbe(dist.barrier) as pr:
                    save_state("ucp", flat_state(), path)
                    dist.barrier()
            elif fmt == "dcp_fsdp2":
                with PhaseProbe(dist.barrier) as pr:
                    save_state("dcp", fsdp_state, path)
                    dist.barrier()
            else:  # gather_dcp
                with PhaseProbe(dist.barrier) as pr:
                    t0 = time.perf_counter()
                    per = stop - start
                    full: dict[str, torch.Tensor] = {}
                    for k in KINDS:
                        if rank == 0:
                            full[k] = torch.empty(world * per)
                            dist.gather(bufs[k], list(full[k].split(per)), dst=0)
                        else:
                            dist.gather(bufs[k], dst=0)
                    extra["gather_seconds"] = time.perf_counter() - t0
                    extra["peak_rss_after_gather"] = pr.peak_growth()
                    if rank == 0:
                        t1 = time.perf_counter()
                        ostate: dict[str, Any] = {}
                        for p in params:
                            ostate[p.fqn] = {
                                "step": torch.tensor(STEP),
                                "exp_avg": full["exp_avg"][p.offset : p.end].view(p.shape),
                                "exp_avg_sq": full["exp_avg_sq"][p.offset : p.end].view(p.shape),
                            }
                        sd = {"model": {p.fqn: full["param"][p.offset : p.end].view(p.shape) for p in params},
                              "optim": {"state": ostate, "param_groups": param_groups}}
                        save_state("dcp", sd, path, no_dist=True)
                        extra["rank0_save_seconds"] = time.perf_counter() - t1
                        del sd, ostate
                    del full
                    dist.barrier()
            rec = pr.record(fmt=fmt, rep=rep, **extra)
            if rank == 0:
                rec["checkpoint_bytes"] = dir_bytes(path)
            runs.append(rec)
    return {"rank": rank, "role": "source", "runs": runs, "cut_rows": _cut_rows(params, total, world)}


def _cut_rows(params: Sequence[FlatParam], total: int, world: int) -> list[str]:
    """Parameters whose rows a source rank boundary cuts (the point of the layout)."""
    out = []
    for r in range(1, world):
        b, _ = flat_partition(total, world, r)
        for p in params:
            row = math.prod(p.shape[1:])
            if p.offset < b < p.end and (b - p.offset) % row:
                out.append(f"rank {r - 1}|{r} boundary cuts a row of {p.fqn} {list(p.shape)}")
    return out


# --------------------------------------------------------------------------
# Target ranks: the loads
# --------------------------------------------------------------------------


def target_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One target rank: every load of every format and repeat, each verified; its per-run records."""
    dims, workdir = cfg["dims"], cfg["workdir"]
    rank_log("target ranks up")
    mesh = init_device_mesh("cpu", (world,))
    model, optim = build_fsdp(dims, mesh, lr=0.0)
    state = train_state(model, optim)
    fqns = [n for n, _ in named_shapes(dims)]
    expected_groups = copy.deepcopy(state["optim"]["param_groups"])
    for g in expected_groups:
        g.update(ADAMW_HYPER)
    blank_groups = copy.deepcopy(state["optim"]["param_groups"])
    needed = needed_bytes(state, fqns)
    rank_log("target state built")
    _warm_up(workdir, load=True)
    rank_log("warmed up")
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    for rep in range(cfg["repeat"]):
        for fmt in LOAD_FORMATS:
            rank_log(f"load {fmt}, repeat {rep}")
            path = os.path.join(workdir, CKPT_OF[fmt])
            fill_fsdp(state, fqns, float("nan"))
            state["optim"]["param_groups"] = copy.deepcopy(blank_groups)
            if cfg["evict"]:
                evict_tree(path)
            extra: dict[str, Any] = {}
            ucp = fmt.startswith("ucp")
            reader, planner = (make_reader("ucp", path, gap_bytes=0 if fmt == "ucp_gap0" else None) if ucp
                               else make_reader("dcp", path))
            with PhaseProbe(dist.barrier) as pr:
                dcp.load(state, storage_reader=reader, planner=planner)
            if ucp:
                extra |= {"bytes_requested": reader.last_load.bytes_requested, "read_calls": reader.last_load.read_calls,
                          "gap_bytes": reader.options.gap_bytes}
            errs = verify(state, fqns, expected_groups, f"{fmt} load (repeat {rep})")
            errors += errs
            runs.append(pr.record(fmt=fmt, rep=rep, needed=needed, ok=not errs, **extra))
            dist.barrier()
    return {"rank": rank, "role": "target", "runs": runs, "errors": errors, "needed": needed}


# --------------------------------------------------------------------------
# Spawning
# --------------------------------------------------------------------------


def rank_main(rank: int, world: int, role: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One spawned rank of ``role`` (source or target); a crash is returned as a ``crash`` record."""
    # DCP's notes about no_dist and overwriting are expected here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    try:
        return (source_main if role == "source" else target_main)(rank, world, cfg)
    except Exception:
        out = {"rank": rank, "role": role, "crash": traceback.format_exc()}
        print(f"[{role} rank {rank}] crashed:\n{out['crash']}", file=sys.stderr, flush=True)
        return out


# --------------------------------------------------------------------------
# Merging and reporting
# --------------------------------------------------------------------------


def _by(per_rank: list[dict[str, Any]], fmt: str, rep: int) -> list[dict[str, Any]]:
    return [next(r for r in pr["runs"] if r["fmt"] == fmt and r["rep"] == rep) for pr in per_rank]


def merge(per_rank: list[dict[str, Any]], fmts: Sequence[str], repeat: int) -> dict[str, Any]:
    """Per format: one record per repeat (max / sum over ranks), and medians."""
    out: dict[str, Any] = {}
    for fmt in fmts:
        reps = []
        for rep in range(repeat):
            rs = _by(per_rank, fmt, rep)
            m: dict[str, Any] = {
                "seconds": max(r["seconds"] for r in rs),
                "rchar": sum(r["rchar"] for r in rs),
                "wchar": sum(r["wchar"] for r in rs),
                "read_bytes": sum(r["read_bytes"] for r in rs),
                "peak_rss_max": max(r["peak_rss"] for r in rs),
                "peak_rss_sum": sum(r["peak_rss"] for r in rs),
                "peak_rss_per_rank": [r["peak_rss"] for r in rs],
                "seconds_per_rank": [r["seconds"] for r in rs],
                "rchar_per_rank": [r["rchar"] for r in rs],
            }
            for k in ("gather_seconds", "peak_rss_after_gather"):
                if k in rs[0]:
                    m[k] = max(r[k] for r in rs)
            for r in rs:
                for k in ("rank0_save_seconds", "checkpoint_bytes"):
                    if k in r:
                        m[k] = r[k]
            if "needed" in rs[0]:
                m["needed"] = sum(r["needed"] for r in rs)
                m["read_amp"] = m["rchar"] / m["needed"]
                m["ok"] = all(r["ok"] for r in rs)
            if "bytes_requested" in rs[0]:
                m["bytes_requested"] = sum(r["bytes_requested"] for r in rs)
                m["bytes_requested_per_rank"] = [r["bytes_requested"] for r in rs]
                m["read_calls"] = sum(r["read_calls"] for r in rs)
                m["requested_amp"] = m["bytes_requested"] / m["needed"]
                m["gap_bytes"] = rs[0]["gap_bytes"]
            reps.append(m)
        med = {k: statistics.median(r[k] for r in reps)
               for k, v in reps[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        out[fmt] = {"median": med, "repeats": reps}
    return out


TABLE_HEADER = ("format", "save s", "load s", "read MB (rchar)", "ucp requested MB", "needed MB", "read amp (rchar)",
                "read amp (requested)", "save peak RSS MB, max rank (sum)", "load peak RSS MB, max rank (sum)")


def report(saves: dict[str, Any], loads: dict[str, Any], state_bytes: int) -> str:
    """The markdown table of medians, then the ratios and per-rank notes of this run."""
    s = {k: v["median"] for k, v in saves.items()}
    sb_reps = saves["gather_dcp"]["repeats"]
    ld = {k: v["median"] for k, v in loads.items()}
    rows = []
    for fmt in LOAD_FORMATS:
        sv = s.get(CKPT_OF[fmt]) if fmt != "ucp_gap0" else None
        lv = ld[fmt]
        save_col = "-"
        if sv is not None:
            save_col = fmt_num(sv["seconds"], ".3f")
            if "gather_seconds" in sv:
                save_col += f" (gather {sv['gather_seconds']:.3f} + rank-0 save {sv['rank0_save_seconds']:.3f})"
        save_mem = "-" if sv is None else f"{fmt_mb(sv['peak_rss_max'])} ({fmt_mb(sv['peak_rss_sum'])})"
        rows.append([LABEL[fmt], save_col, f"{lv['seconds']:.3f}", fmt_mb(lv["rchar"]), fmt_mb(lv.get("bytes_requested")),
                     fmt_mb(lv["needed"]), f"{lv['read_amp']:.3f}", fmt_num(lv.get("requested_amp"), ".4f"), save_mem,
                     f"{fmt_mb(lv['peak_rss_max'])} ({fmt_mb(lv['peak_rss_sum'])})"])
    a, b, c = ld["ucp"], ld["gather_dcp"], ld["dcp_fsdp2"]
    sa, sb, sc = s["ucp"], s["gather_dcp"], s["dcp_fsdp2"]
    lines = [markdown_table(TABLE_HEADER, rows), ""]
    lines.append("Ratios (medians of this run):")
    lines.append(f"  save:  ucp / gather+dcp = {sa['seconds'] / sb['seconds']:.2f}x   "
                 f"ucp / dcp fsdp2 = {sa['seconds'] / sc['seconds']:.2f}x")
    lines.append(f"  load:  ucp / gather+dcp = {a['seconds'] / b['seconds']:.2f}x   "
                 f"ucp / dcp fsdp2 = {a['seconds'] / c['seconds']:.2f}x")
    lines.append(f"  read:  ucp / gather+dcp = {a['rchar'] / b['rchar']:.3f}x   "
                 f"ucp / dcp fsdp2 = {a['rchar'] / c['rchar']:.3f}x")
    lines.append(f"  save peak RSS (max rank): ucp / gather+dcp = {sa['peak_rss_max'] / sb['peak_rss_max']:.4f}x")
    lines.append(f"  load peak RSS (sum):      ucp / gather+dcp = "
                 f"{a['peak_rss_sum'] / max(b['peak_rss_sum'], 1):.3f}x   ucp / dcp fsdp2 = "
                 f"{a['peak_rss_sum'] / max(c['peak_rss_sum'], 1):.3f}x")
    lines.append("  block-layer read_bytes during the loads (storage, readahead included; ~0 unless --evict), MB: "
                 + ", ".join(f"{f} {ld[f]['read_bytes'] / MB:.1f}" for f in LOAD_FORMATS))
    per_rank = [round(statistics.median(r["peak_rss_per_rank"][i] for r in sb_reps) / MB, 1)
                for i in range(len(sb_reps[0]["peak_rss_per_rank"]))]
    lines.append(f"  (B) save-phase peak RSS per rank (median), MB: {per_rank}; "
                 f"rank 0 after the gather alone: {sb['peak_rss_after_gather'] / MB:.1f} MB "
                 f"(the full state is {state_bytes / MB:.1f} MB)")
    amp = a["read_amp"]

    def _gap(m: dict[str, Any]) -> str:
        # ReadOptions.gap_bytes None is the storage's default (a page less a byte on local files),
        # which the medians (numbers only) leave out.
        g = m.get("gap_bytes")
        return "gap_bytes default: a page less a byte" if g is None else f"gap_bytes={int(g)}"

    lines.append(f"  ucp read amp (rchar) {amp:.4f} vs target <= {TARGET_READ_AMP}: "
                 f"{'met' if amp <= TARGET_READ_AMP else 'MISSED'}; "
                 f"requested {a['requested_amp']:.4f} ({_gap(a)}), "
                 f"{ld['ucp_gap0']['requested_amp']:.4f} with gap_bytes=0")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with --quick defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=None,
                   help="fp32 param + exp_avg + exp_avg_sq across all ranks, MiB (default 256; 16 with --quick)")
    p.add_argument("--layers", type=int, default=8, help="Linear layers (default 8)")
    p.add_argument("--src", type=int, default=4, help="source (ZeRO) ranks N (default 4)")
    p.add_argument("--dst", type=int, default=3, help="target (FSDP2) ranks M (default 3)")
    p.add_argument("--align", type=int, default=64, help="flat-buffer alignment in elements (default 64)")
    p.add_argument("--repeat", type=int, default=None,
                   help="timed saves and loads per format, interleaved; medians reported (default 5; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="smoke check: 16 MiB, 1 repeat")
    p.add_argument("--evict", action="store_true",
                   help="evict the checkpoint's files from the page cache before each load (cold reads)")
    p.add_argument("--workdir", default=None,
                   help="where checkpoints go (disk-backed); default a fresh temp dir, removed afterwards")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--verbose", action="store_true", help="progress lines from rank 0")
    p.add_argument("--out", default=None,
                   help="JSON results (default benchmarks/results/flat.json; out/bench_flat_quick.json with --quick)")
    args = p.parse_args(argv)
    quick_defaults(args, mb=(16.0, 256.0), repeat=(1, 5))
    if args.out is None:
        args.out = default_out("flat.json", args.quick, "bench_flat_quick.json")
    if args.repeat < 1 or args.src < 1 or args.dst < 1 or args.layers < 1 or args.align < 1:
        p.error("--repeat, --src, --dst, --layers and --align must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Spawn the source ranks (saves), then the target ranks (loads); print, write JSON; 0 if all verified."""
    args = parse_args(argv)
    t_start = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    set_rank_env(args.verbose)  # inherited by the spawned ranks
    dims = layer_dims(args.mb, args.layers)
    shapes = named_shapes(dims)
    params, total = pack_flat(shapes, align=args.align)
    n_elems = sum(p.numel for p in params)
    state_bytes = 3 * 4 * n_elems
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_flat.")
    os.makedirs(workdir, exist_ok=True)
    cfg = {"dims": dims, "workdir": workdir, "align": args.align, "repeat": args.repeat, "evict": args.evict}
    print(f"state: {args.layers} Linear layers, widths {dims[:3]}..., {len(shapes)} tensors, "
          f"{state_bytes / MB:.1f} MB fp32 (param + exp_avg + exp_avg_sq; flat buffer {total} elements, align "
          f"{args.align}); {args.src} ZeRO ranks -> {args.dst} FSDP2 ranks; {args.repeat} repeat(s); workdir {workdir}",
          flush=True)
    failures: list[str] = []
    try:
        src = spawn_ranks(rank_main, args.src, "source", cfg)
        failures += [f"source rank {r['rank']} crashed:\n{r['crash']}" for r in src if "crash" in r]
        dst = spawn_ranks(rank_main, args.dst, "target", cfg) if not failures else []
        failures += [f"target rank {r['rank']} crashed:\n{r['crash']}" for r in dst if "crash" in r]
        failures += [e for r in dst for e in r.get("errors", [])]
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    wall = time.perf_counter() - t_start
    result: dict[str, Any] = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0]) if sys.argv else "bench_flat.py",
                                          *(argv if argv is not None else sys.argv[1:])]),
        "started_utc": started,
        "wall_seconds": wall,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "kernel": platform.release()},
        "config": {"mb": args.mb, "layers": args.layers, "dims": dims, "tensors": len(shapes), "src": args.src,
                   "dst": args.dst, "align": args.align, "repeat": args.repeat, "evict": args.evict,
                   "flat_total_elements": total, "param_elements": n_elems, "state_bytes": state_bytes},
        "failures": failures,
    }
    if not failures:
        saves = merge(src, SAVE_FORMATS, args.repeat)
        loads = merge(dst, LOAD_FORMATS, args.repeat)
        result |= {"cut_rows": src[0]["cut_rows"], "saves": saves, "loads": loads}
        table = report(saves, loads, state_bytes)
        result["table"] = table
        print()
        print(table)
        print()
        print(f"source rank boundaries cutting rows: {len(src[0]['cut_rows'])} "
              f"({'; '.join(src[0]['cut_rows'][:3])}{'; ...' if len(src[0]['cut_rows']) > 3 else ''})")
        if not src[0]["cut_rows"]:
            failures.append("no source rank boundary cuts a row: the layout does not exercise mid-row cuts")
    print(f"wall time {wall:.1f} s")
    write_json(args.out, result)
    print(f"results: {args.out}")
    if failures:
        print_failures(failures)
        return 1
    print("every load verified bit-exact against the full reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
