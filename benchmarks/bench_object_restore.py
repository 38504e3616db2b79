"""CheckpointManager restore from an S3 persistent tier: whole-step download vs ranged direct load.

A row-sharded state (DTensors, ~270 MB by default) is saved by a manager on
``--save-world`` gloo ranks into moto's S3 server on loopback (started here,
as tests/s3_server.py does; nothing leaves the machine), then restored by a
manager with only that tier at each world size of ``--worlds``, two ways:

* ``download``: ``direct_restore=False``, the way before ranged reads: every
  rank downloads the whole step into a temporary directory, then loads it.
* ``direct``: the default: every rank fetches only the byte ranges its shards
  need (coalesced, concurrent ranged GETs), verified as they arrive.

Reported per restore: wall time of ``mgr.load`` (the slowest rank), bytes
fetched from S3 by all ranks together (every byte s3fs returned, counted in
each rank), and the bytes the ranks' shards need. Every restore is checked
bit-exact. Run from the repository root::

    PYTHONPATH=src python benchmarks/bench_object_restore.py            # ~270 MB, worlds 2 and 3
    PYTHONPATH=src python benchmarks/bench_object_restore.py --mb 32    # smoke check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_manager import have_s3, moto_s3  # noqa: E402

N_TENSORS = 8
COLS = 1376


def rows_for(mb: float) -> int:
    """Rows per tensor (a multiple of 6, so they shard evenly over 1, 2, 3 and 6 ranks) for ``mb`` MiB in all."""
    return max(6, int(mb * 2**20 / (N_TENSORS * COLS * 4)) // 6 * 6)


def local_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    n = rows // world
    return rank * n, n


def make_state(rows: int, rank: int, world: int, fill: bool) -> dict[str, Any]:
    """Row-sharded DTensors; tensor ``k`` holds ``k * 2**23 + row * COLS + col`` (exact in float32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    start, n = local_rows(rows, rank, world)
    model = {}
    for k in range(N_TENSORS):
        if fill:
            local = (torch.arange(start * COLS, (start + n) * COLS, dtype=torch.float64) + k * 2**23).float()
            local = local.reshape(n, COLS)
        else:
            local = torch.zeros(n, COLS)
        model[f"layer{k}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                       shape=torch.Size((rows, COLS)), stride=(COLS, 1))
    return {"model": model, "step": 1 if fill else -1}


def count_s3_bytes() -> dict[str, int]:
    """Count every byte s3fs fetches from now on in this process: each GET's answer (ranged, whole,
    or part of a whole-object download)."""
    import s3fs

    counted = {"bytes": 0}
    real_call = s3fs.S3FileSystem._call_s3

    async def call_s3(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        out = await real_call(self, method, *args, **kwargs)
        if method == "get_object":
            counted["bytes"] += int(out["ContentLength"])
        return out

    s3fs.S3FileSystem._call_s3 = call_s3  # type: ignore[method-assign]
    # A filesystem binds its sync methods when it is created: drop the cached ones.
    s3fs.S3FileSystem.clear_instance_cache()
    return counted


def _rank(rank: int, world: int, init: str, job: dict[str, Any]) -> None:
    from ucp_dcp import CheckpointManager

    os.environ.update(job["env"])
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        rows, root, options = job["rows"], job["root"], job["options"]
        if job["mode"] == "save":
            with CheckpointManager(root, storage_options=options) as mgr:
                mgr.save(1, make_state(rows, rank, world, fill=True))
                mgr.wait()
            return
        state = make_state(rows, rank, world, fill=False)
        counted = count_s3_bytes()
        with CheckpointManager(root, storage_options=options, direct_restore=job["mode"] == "direct") as mgr:
            dist.barrier()
            t0 = time.perf_counter()
            step = mgr.load(state)
            seconds = time.perf_counter() - t0
        assert step == 1 and state["step"] == 1
        want = make_state(rows, rank, world, fill=True)
        need = 0
        for k, t in state["model"].items():
            assert torch.equal(t.to_local(), want["model"][k].to_local()), f"rank {rank}: {k} differs"
            need += t.to_local().nbytes
        out = [None] * world
        dist.all_gather_object(out, (seconds, counted["bytes"], need))
        if rank == 0:
            with open(job["out"], "w") as f:
                json.dump({"seconds": max(o[0] for o in out), "fetched": sum(o[1] for o in out),
                           "need": sum(o[2] for o in out)}, f)
    finally:
        dist.destroy_process_group()


def run(world: int, job: dict[str, Any]) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory() as d:
        job = {**job, "out": os.path.join(d, "out.json"), "env": dict(os.environ)}
        mp.spawn(_rank, args=(world, os.path.join(d, "init"), job), nprocs=world, join=True)
        if os.path.exists(job["out"]):
            with open(job["out"]) as f:
                return json.load(f)
    return None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=256, help="state size in MiB (default 256)")
    p.add_argument("--save-world", type=int, default=2, help="ranks saving (default 2)")
    p.add_argument("--worlds", default="2,3", help="ranks restoring, comma-separated (default 2,3)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    why = have_s3()
    if why:
        sys.exit(f"cannot run: {why}")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_start = list(os.getloadavg())
    rows = rows_for(args.mb)
    total = N_TENSORS * rows * COLS * 4
    results: list[dict[str, Any]] = []
    with moto_s3() as (url, options):
        root = f"{url}/bench-{uuid.uuid4().hex[:8]}"
        base = {"rows": rows, "root": root, "options": options}
        t0 = time.perf_counter()
        run(args.save_world, {**base, "mode": "save"})
        print(f"state {total / 1e6:.0f} MB ({N_TENSORS} x {rows} x {COLS} float32), saved on {args.save_world} "
              f"ranks to moto S3 in {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"{'ranks':>5}  {'restore':<9} {'time s':>7} {'fetched MB':>11} {'needed MB':>10} {'fetched/needed':>15}")
        for world in (int(w) for w in args.worlds.split(",")):
            for mode in ("download", "direct"):
                r = run(world, {**base, "mode": mode})
                assert r is not None
                r.update(world=world, mode=mode)
                results.append(r)
                print(f"{world:>5}  {mode:<9} {r['seconds']:7.2f} {r['fetched'] / 1e6:11.1f} {r['need'] / 1e6:10.1f} "
                      f"{r['fetched'] / r['need']:15.3f}", flush=True)
    if args.json:
        doc = {"command": " ".join(["python", *sys.argv]), "started": started, "load_avg": {
            "start": load_start, "end": list(os.getloadavg())}, "cpus": os.cpu_count(),
            "state_bytes": total, "save_world": args.save_world, "results": results}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
