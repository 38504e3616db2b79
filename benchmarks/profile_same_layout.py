"""Same layout: an FSDP2 model + AdamW saved and loaded with ucp_dcp and with DCP.

One process by default, or ``--world`` ranks. Saves the state once with
``UCPStorageWriter`` and once with DCP's ``FileSystemWriter``, then loads
each back ``--repeats`` times into the same FSDP2 state (paired, alternating
which goes first), the page cache of the checkpoint's files evicted
(``POSIX_FADV_DONTNEED``) before each load. Prints per-repeat times (until
the slowest rank is done), the medians, the ratios and the load average;
``--profile`` writes a cProfile of one extra cold ucp_dcp load instead.

    python benchmarks/profile_same_layout.py --dir /tmp/psl --repeats 7 --access auto,exact
    python benchmarks/profile_same_layout.py --dir /tmp/psl --world 4 --access auto,exact
    python benchmarks/profile_same_layout.py --dir /tmp/psl --profile out.prof
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

from harness.pagecache import evict_tree  # isort: skip (puts this checkout's src/ first)
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter


def _state(hidden: int, layers: int) -> dict[str, Any]:
    """An FSDP2 model of ``layers`` Linear layers and its AdamW state after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    for m in model:
        fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _load(
    kind: str,
    path: str,
    state: dict[str, Any],
    access: str | None,
    io_threads: int | None = None,
    verify: bool = True,
) -> float:
    """One cold load on every rank: the files evicted, then the time until the slowest rank is
    done."""
    if dist.get_rank() == 0:
        evict_tree(path)
    dist.barrier()
    t = time.perf_counter()
    if kind == "ucp":
        kw: dict[str, Any] = {} if access is None else {"access": access}
        if io_threads is not None:
            kw["io_threads"] = io_threads
        if not verify:
            kw["verify"] = False
        dcp.load(state, storage_reader=UCPStorageReader(path, options=ReadOptions(**kw)), planner=UCPLoadPlanner())
    else:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    dist.barrier()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--hidden", type=int, default=1216)
    ap.add_argument("--layers", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--world", type=int, default=1, help="ranks (FSDP2 over all of them)")
    ap.add_argument(
        "--access", default=None, help="comma-separated UCPStorageReader access= values to compare"
    )
    ap.add_argument(
        "--io-threads",
        default=None,
        help="comma-separated UCPStorageReader io_threads= values to compare (default: its own)",
    )
    ap.add_argument(
        "--verify",
        default="on",
        help="comma-separated on/off: UCPStorageReader verify= values to compare (default: on)",
    )
    ap.add_argument("--profile", default=None, help="write a cProfile of one ucp_dcp load here")
    args = ap.parse_args()
    made = args.dir is None  # a temporary directory of ours: removed at the end (about 0.6 GB)
    args.dir = args.dir or tempfile.mkdtemp(prefix="psl-")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    try:
        if args.world == 1:
            _bench(0, args)
        else:
            torch.multiprocessing.spawn(_bench, args=(args,), nprocs=args.world)
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)


def _bench(rank: int, args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    work = os.path.join(args.dir, f"world{args.world}")
    ucp_path, dcp_path = os.path.join(work, "ucp"), os.path.join(work, "dcp")
    state = _state(args.hidden, args.layers)
    saved = os.path.exists(os.path.join(ucp_path, ".done"))
    dist.barrier()
    if not saved:
        dcp.save(state, storage_writer=UCPStorageWriter(ucp_path), planner=UCPSavePlanner())
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_path))
        if rank == 0:
            Path(ucp_path, ".done").touch()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        _load("ucp", ucp_path, state, None if args.access is None else args.access.split(",")[0])
        prof.disable()
        prof.dump_stats(args.profile if rank == 0 else f"{args.profile}.{rank}")
        dist.destroy_process_group()
        return
    # Variants: ucp_dcp with each access mode and thread count named (default: the reader's
    # own), and DCP.
    variants = [
        f"ucp:{a}:{t}:{v}"
        for a in (args.access or "default").split(",")
        for t in (args.io_threads or "default").split(",")
        for v in args.verify.split(",")
    ] + ["dcp"]

    def run(v: str) -> float:
        if v == "dcp":
            return _load("dcp", dcp_path, state, None)
        _, a, t, check = v.split(":")
        access = None if a == "default" else a
        threads = None if t == "default" else int(t)
        return _load("ucp", ucp_path, state, access, threads, verify=check != "off")

    for v in variants:  # warm-up: imports, first-use costs
        run(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.repeats):  # each repeat starts with the next variant in turn
        for v in variants[i % len(variants) :] + variants[: i % len(variants)]:
            times[v].append(run(v))
    out: dict[str, Any] = {f"{v}_s": [round(t, 4) for t in ts] for v, ts in times.items()}
    for v, ts in times.items():
        out[f"{v}_median_s"] = round(statistics.median(ts), 4)
        if v != "dcp":
            ratios = [u / d for u, d in zip(ts, times["dcp"])]
            out[f"{v}_over_dcp_median"] = round(statistics.median(ratios), 3)
    for v in times:  # each verified variant against its unverified twin, paired per repeat
        if v.endswith(":on") and v[:-3] + ":off" in times:
            ratios = [a / b for a, b in zip(times[v], times[v[:-3] + ":off"])]
            out[f"{v[:-3]}:on_over_off_median"] = round(statistics.median(ratios), 3)
    out["world"] = args.world
    out["loadavg"] = os.getloadavg()
    if rank == 0:
        print(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
