"""The placement digest's cost: hashing rate, and a save and a load with and without it.

One process, the same fp32 transformer-like state as ``bench_save.py`` (plus a bf16 copy for
the hashing rate). Every round times, alternating, ``dcp.save`` with
``UCPStorageWriter(placement_digests=False)`` and ``=True``, then ``dcp.load`` with
``UCPStorageReader(verify_placement=False)`` and ``=True``; reported: medians over the rounds
and the median of the per-round ratios (load from other processes hits both sides alike).

    python benchmarks/bench_placement.py --size-mb 300 --repeats 5

``--reshard`` instead runs real gloo ranks: 4 ranks save the state as FSDP ``Shard(0)``
DTensors (with and without digests), then the pairs of :data:`PAIRS` load it (3 ranks
``Shard(0)``, 3 ranks ``Shard(1)``, 4 ranks as 2 replicas x 2 shards), each load timed with and
without ``verify_placement``, alternating; reported per pair: median seconds and ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from bench_save import make_state

from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.core.placement_digest import box_share


def _rate(t: torch.Tensor, repeats: int) -> float:
    """Best-of-``repeats`` hashing rate of ``t`` in MB/s."""
    best = min(_timed(lambda: box_share(t, (0,) * t.dim(), t.shape)) for _ in range(repeats))
    return t.numel() * t.element_size() / best / 1e6


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


PAIRS = {"dp4-dp3": (3, "S0"), "dp4-cols3": (3, "S1"), "dp4-hsdp2x2": (4, "R,S0")}


def _dstate(state: dict[str, object], mesh_shape: tuple[int, ...], how: str) -> dict[str, object]:
    """``state``'s tensors as DTensors on a fresh mesh (``how``: ``S0``, ``S1`` or ``R,S0``)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from torch.distributed.device_mesh import DeviceMesh

    n = 1
    for d in mesh_shape:
        n *= d
    mesh = DeviceMesh("cpu", torch.arange(n).reshape(mesh_shape))
    out: dict[str, object] = {}
    for k, v in state.items():
        if not torch.is_tensor(v):
            out[k] = v
            continue
        dim = 1 if how == "S1" and v.dim() > 1 else 0
        pl = [Replicate(), Shard(0)] if how == "R,S0" else [Shard(dim)]
        # every rank holds the same full state: each takes its shard, no communication
        out[k] = distribute_tensor(v, mesh, pl, src_data_rank=None)
    return out


def _rank(rank: int, world: int, init: str, root: str, size_mb: int, repeats: int, out: str) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    full = make_state(size_mb, hidden=1024)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    saves: list[tuple[float, float]] = []
    state = _dstate(full, (4,), "S0")
    for _ in range(repeats):
        pair = []
        for digests in (False, True):
            path = os.path.join(root, f"ck{int(digests)}")
            writer = UCPStorageWriter(path, placement_digests=digests)
            dist.barrier()
            pair.append(_timed(lambda: dcp.save(state, storage_writer=writer, planner=UCPSavePlanner())))
        saves.append((pair[0], pair[1]))
    results: dict[str, object] = {"save": saves}
    for name, (n, how) in PAIRS.items():
        group = dist.new_group(list(range(n)))
        # Every rank makes the mesh (its process groups are made by all ranks); ranks outside
        # it hold nothing and do not load.
        target = _dstate(full, (2, 2) if how == "R,S0" else (n,), how)
        if rank < n:
            times = []
            for i in range(repeats):
                pair = {}
                for verify in ((False, True) if i % 2 == 0 else (True, False)):
                    reader = UCPStorageReader(os.path.join(root, "ck1"), options=ReadOptions(verify_placement=verify),
                                              process_group=group)
                    dist.barrier(group)
                    pair[verify] = _timed(lambda: dcp.load(target, storage_reader=reader,
                                                           planner=UCPLoadPlanner(), process_group=group))
                times.append((pair[False], pair[True]))
            results[name] = times
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _write(path: str | None, doc: dict) -> None:
    """The run's numbers as JSON at ``path`` (nothing if None)."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"results written to {path}")


def reshard(size_mb: int, repeats: int, out_json: str | None = None) -> None:
    """The ``--reshard`` run (see the module docstring)."""
    import torch.multiprocessing as mp

    load_start = os.getloadavg()

    root = tempfile.mkdtemp()
    try:
        out = os.path.join(root, "out.json")
        mp.spawn(_rank, args=(4, os.path.join(root, "init"), root, size_mb, repeats, out), nprocs=4)
        with open(out) as f:
            res = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    st = make_state(size_mb, hidden=1024)
    nbytes = sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    print(f"state: {nbytes / 1e6:.0f} MB fp32, {repeats} rounds, load average {os.getloadavg()}")
    summary = {}
    for name, times in res.items():
        off = statistics.median(a for a, _ in times)
        on = statistics.median(b for _, b in times)
        ratio = statistics.median(b / a for a, b in times)
        summary[name] = {"without_s": off, "with_s": on, "median_ratio": ratio}
        what = "placement_digests" if name == "save" else "verify_placement"
        print(f"{name}: {off:.3f} s, with {what} {on:.3f} s (median ratio {ratio:.2f}x)")
    _write(out_json, {"mode": "reshard", "size_mb": size_mb, "repeats": repeats, "state_bytes": nbytes,
                      "load_avg": {"start": load_start, "end": os.getloadavg()},
                      "times_without_with": res, "summary": summary})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure")
    ap.add_argument("--reshard", action="store_true", help="real ranks: see the module docstring")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    if args.reshard:
        reshard(args.size_mb, args.repeats, args.out)
        return
    load_start = os.getloadavg()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    x = torch.randn(4096, 4096)
    rates = {"fp32": _rate(x, 3), "bf16": _rate(x.bfloat16(), 3)}
    print(f"hashing: fp32 {rates['fp32']:.0f} MB/s, bf16 {rates['bf16']:.0f} MB/s")
    state = make_state(args.size_mb)
    nbytes = sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    root = tempfile.mkdtemp(dir=args.dir)
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+d", "load", "load+v")}
    try:
        for _ in range(args.repeats):
            for digests in (False, True):
                path = os.path.join(root, f"ck{int(digests)}")
                shutil.rmtree(path, ignore_errors=True)
                writer = UCPStorageWriter(path, placement_digests=digests)
                times["save+d" if digests else "save"].append(
                    _timed(lambda: dcp.save(state, storage_writer=writer, planner=UCPSavePlanner()))
                )
            path = os.path.join(root, "ck1")
            for verify in (False, True):
                target = {k: torch.empty_like(v) if torch.is_tensor(v) else v for k, v in state.items()}
                reader = UCPStorageReader(path, options=ReadOptions(verify_placement=verify))
                times["load+v" if verify else "load"].append(
                    _timed(lambda: dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner()))
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio_s = statistics.median(a / b for a, b in zip(times["save+d"], times["save"]))
    ratio_l = statistics.median(a / b for a, b in zip(times["load+v"], times["load"]))
    print(f"state: {nbytes / 1e6:.0f} MB fp32, {args.repeats} rounds, load average {os.getloadavg()}")
    print(f"save: {med['save']:.3f} s, with placement_digests {med['save+d']:.3f} s "
          f"(median ratio {ratio_s:.2f}x)")
    print(f"load: {med['load']:.3f} s, with verify_placement {med['load+v']:.3f} s "
          f"(median ratio {ratio_l:.2f}x)")
    _write(args.out, {"mode": "one process", "size_mb": args.size_mb, "repeats": args.repeats,
                      "state_bytes": nbytes, "hashing_mb_per_s": rates,
                      "load_avg": {"start": load_start, "end": os.getloadavg()}, "times_s": times,
                      "medians_s": med, "median_ratio": {"save": ratio_s, "load": ratio_l}})


if __name__ == "__main__":
    main()
