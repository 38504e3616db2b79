"""Survive a crash, a lost node disk and a smaller restart with ``CheckpointManager``.

What this shows
---------------
The TinyLM of ``train_demo.py`` trains with FSDP2 on 4 CPU ranks that play 2
nodes of 2 ranks each. A :class:`ucp_dcp.CheckpointManager` checkpoints after
every step it is due: to a node-local tier (``local/node{0,1}``) every 2
steps, with each node's files replicated to the other node, and to a shared
persistent tier every 6 steps (drained from the local copy). Saves are
asynchronous: ``save`` returns once the state is staged in host memory, and
training goes on while the background thread writes, hashes, replicates,
commits and uploads. Then, phase by phase (each a ``torchrun`` launch):

1. ``train``: steps 0..N-1, then a crash: every rank ``os._exit``\\ s right
   after handing the last save to the background thread, without ``wait()``.
2. The driver deletes ``local/node1``: node 1's disk is lost.
3. ``restart``: 4 ranks. ``load`` picks the newest committed step, which
   lives in the local tier; node 1's files come back from node 0's replica.
   Training continues to N+4.
4. The driver deletes the whole local tier.
5. ``shrink``: 3 ranks. ``load`` falls to the persistent tier and reshards
   4 -> 3 ranks (an ``on_reshard`` callback sees it). Training goes to N+8.

Every run must retrace an uninterrupted 4-rank run without checkpoints
(``reference``) to ``train_demo``'s tolerance: the global batch of a step
is fixed and split over the ranks, so the losses do not depend on the world
size beyond float rounding (see ``train_demo.py``).

Run it
------
    python examples/manager_demo.py [--out-dir out/manager_demo] [--steps 16]

It prints a table (restored step, tier, failed restore attempts, mean save
blocking and background write time, largest loss deviation from the
reference) and the goodput estimate for a one-hour MTBF, and exits non-zero
if any check fails. About 1-2 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from demo_model import ModelConfig, ShardedLoader, TinyLM
from train_demo import DEFAULT_TOL, GLOBAL_BATCH, PEAK_LR, Laps, end_worker, lr_at, max_rel_dev, reshard_loader_state, torchrun

RANKS_PER_NODE = 2
LOCAL_INTERVAL = 2
PERSISTENT_INTERVAL = 6
MTBF_S = 3600.0


# ----------------------------------------------------------------------------
# Worker: one torchrun rank
# ----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucp_dcp import RankLocal
    from ucp_dcp.manager.manager import CheckpointManager, ReshardEvent

    lap = Laps()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig()
    torch.manual_seed(0)
    model = TinyLM(cfg)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    loader = ShardedLoader(cfg, GLOBAL_BATCH, rank, world)

    def state(step: int) -> dict[str, Any]:
        # A fresh dict per save: the step and the loader cursor are plain
        # values, not tensors updated in place. The manager stages a copy.
        model_sd, optim_sd = get_state_dict(model, optim)
        loader_state = RankLocal(loader.state_dict(), reshard=reshard_loader_state)
        return {"model": model_sd, "optim": optim_sd, "step": step, "loader": loader_state}

    events: list[ReshardEvent] = []

    def on_reshard(event: ReshardEvent) -> None:
        # Called by load() when the restored step was saved by another world
        # size. The LR needs no rescaling here (the global batch is kept);
        # the per-rank batch does, and the loader's RankLocal hook has already
        # mapped the saved cursor onto this layout. Record it for the checks.
        events.append(event)
        if rank == 0:
            old_b, new_b = GLOBAL_BATCH // event.old_world_size, GLOBAL_BATCH // event.new_world_size
            print(f"on_reshard: step {event.step} from the {event.tier} tier: world "
                  f"{event.old_world_size} -> {event.new_world_size}, per-rank batch {old_b} -> {new_b} "
                  f"(global batch {GLOBAL_BATCH} kept)", flush=True)

    mgr = None
    if args.phase != "reference":
        mgr = CheckpointManager(
            args.tier_shared,
            local=args.tier_local,
            ranks_per_node=RANKS_PER_NODE,
            local_interval=LOCAL_INTERVAL,
            persistent_interval=PERSISTENT_INTERVAL,
            keep_last=2,
            on_reshard=[on_reshard],
        )
    lap("setup")

    result: dict[str, Any] = {"phase": args.phase, "world": world}
    start = 0
    if args.phase in ("restart", "shrink"):
        assert mgr is not None
        sd = state(0)
        start = mgr.load(sd)
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if int(sd["step"]) != start:
            raise RuntimeError(f"rank {rank}: state says step {sd['step']}, load() returned {start}")
        loader.load_state_dict(sd["loader"].value)
        expected = start * GLOBAL_BATCH + loader.dp_rank * loader.local_batch
        if loader.next_sample != expected:
            raise RuntimeError(f"rank {rank}: data cursor is {loader.next_sample} after load, expected {expected}")
        rec = mgr.last_restore
        assert rec is not None
        # Was the step repaired into this node's local tier (node 1 lost its disk)?
        local_steps: list[Any] = [None] * world
        dist.all_gather_object(local_steps, (mgr.node, mgr.local.steps()) if mgr.local else None)
        result["restore"] = {
            "step": rec.step, "tier": rec.tier, "seconds": rec.seconds,
            "failed_attempts": list(rec.failed_attempts), "verified_bytes": rec.verified_bytes,
            "nodes_with_step": sorted({x[0] for x in local_steps if x and start in x[1]}),
        }  # fmt: skip
        result["reshard_events"] = [
            {"step": e.step, "old": e.old_world_size, "new": e.new_world_size, "tier": e.tier} for e in events
        ]
        if rank == 0:
            print(f"restored step {rec.step} from the {rec.tier} tier in {rec.seconds:.2f}s "
                  f"({rec.verified_bytes} bytes verified, {len(rec.failed_attempts)} failed attempts)", flush=True)
            for a in rec.failed_attempts:
                print(f"  failed: {a}", flush=True)
        lap("load")

    losses: dict[int, float] = {}
    save_calls = 0.0
    for step in range(start, args.stop):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.total)
        inputs, targets = loader.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses[step] = global_loss.item() / world
        if mgr is not None:
            t0 = time.perf_counter()
            mgr.save(step + 1, state(step + 1))  # returns once staged; the write goes on behind us
            save_calls += time.perf_counter() - t0
    lap("train")
    result.update(start=start, losses=losses, timings=lap.timings, save_call_s=save_calls)

    if args.phase == "train":
        assert mgr is not None
        # The crash. The save of step `stop` has just been handed to the
        # background thread; nobody waits for it. Records of the saves that
        # finished so far (those save() collected) are all we get.
        result["stats"] = [asdict(r) for r in mgr.stats()]
        result["steps_before_crash"] = mgr.steps()
        if rank == 0:
            Path(args.result).write_text(json.dumps(result))
        dist.barrier()
        os._exit(0)  # no wait(), no close(), no destroy_process_group(): a crash

    if mgr is not None:
        mgr.wait()
        result["stats"] = [asdict(r) for r in mgr.stats()]
        result["steps_after"] = mgr.steps()
        mgr.close()
        lap("final wait")
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    end_worker()


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    nproc: int
    stop: int
    what: str


def launch(phase: Phase, args: argparse.Namespace, out: Path) -> tuple[dict[str, Any], float]:
    result, log = out / f"{phase.name}.json", out / f"{phase.name}.log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={phase.nproc}", __file__, "--worker", f"--phase={phase.name}",
        f"--stop={phase.stop}", f"--total={args.steps + 8}", f"--result={result}",
        f"--tier-shared={out / 'shared'}", f"--tier-local={out / 'local' / 'node{node}'}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    data = torchrun(cmd, result, log, f"phase '{phase.name}'")
    wall = time.perf_counter() - t0
    # Lines the workers printed (restore summary, on_reshard) are worth showing.
    for line in log.read_text().splitlines():
        if "restored step" in line or "on_reshard" in line or "failed:" in line:
            print(f"      {line.split(']:', 1)[-1].strip()}")
    return data, wall


def driver(args: argparse.Namespace) -> int:
    out = Path(args.out_dir).resolve()
    n = args.steps
    # Checkpoints of an earlier invocation would be restored instead: start clean.
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"ucp_dcp CheckpointManager demo: {n} steps then a crash, output in {out}\n"
          f"  local tier {out / 'local' / 'node{0,1}'} every {LOCAL_INTERVAL} steps (replicated to the "
          f"other node), persistent tier {out / 'shared'} every {PERSISTENT_INTERVAL} steps")
    phases = [
        Phase("reference", 4, n + 8, "uninterrupted, no checkpoints"),
        Phase("train", 4, n, "async saves, then a crash mid-save"),
        Phase("restart", 4, n + 4, "node 1's local disk lost"),
        Phase("shrink", 3, n + 8, "whole local tier lost, 4 -> 3 ranks"),
    ]
    t_all = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    walls: dict[str, float] = {}
    for i, ph in enumerate(phases, 1):
        if ph.name == "restart":
            shutil.rmtree(out / "local" / "node1")
            print("      deleted local/node1 (node 1's disk is gone)")
        if ph.name == "shrink":
            shutil.rmtree(out / "local")
            print("      deleted local/ (every node-local copy is gone)")
        print(f"[{i}/{len(phases)}] {ph.name:<9} {ph.nproc} ranks, to step {ph.stop}: {ph.what}", flush=True)
        res, walls[ph.name] = launch(ph, args, out)
        results[ph.name] = res
        losses, timings = res["losses"], res["timings"]
        phases_txt = "".join(f", {k} {v:.2f}s" for k, v in timings.items() if k != "setup")
        print(f"      {walls[ph.name]:4.1f}s{phases_txt}; steps {min(losses)}-{max(losses)}, "
              f"loss {losses[min(losses)]:.4f} -> {losses[max(losses)]:.4f}", flush=True)
        if ph.name == "train":
            # What the crash left: committed steps, plus the in-flight save's
            # staging directory (.tmp-...) if it had got that far.
            for d in sorted((out / "local").iterdir()):
                print(f"      after the crash, local/{d.name}: {', '.join(sorted(p.name for p in d.iterdir()))}")
            print(f"      after the crash, shared: {', '.join(sorted(p.name for p in (out / 'shared').iterdir()))}")

    ref = results["reference"]["losses"]
    failed: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)

    # --- checks
    train, restart, shrink = results["train"], results["restart"], results["shrink"]
    rr, sr = restart["restore"], shrink["restore"]
    check(rr["tier"] == "local", f"restart restored from the {rr['tier']} tier, expected local")
    # The save of step n was in flight at the crash; the newest committed local step is n-2
    # (or n, had the in-flight save committed before the ranks exited).
    check(rr["step"] in (n - LOCAL_INTERVAL, n), f"restart restored step {rr['step']}, expected {n - 2} or {n}")
    check(sorted(rr["nodes_with_step"]) == [0, 1],
          f"after the restart, nodes {rr['nodes_with_step']} hold step {rr['step']} locally, expected [0, 1]")
    check(sr["tier"] == "persistent", f"shrink restored from the {sr['tier']} tier, expected persistent")
    ev = shrink["reshard_events"]
    check(len(ev) == 1 and (ev[0]["old"], ev[0]["new"]) == (4, 3), f"on_reshard events {ev}, expected one 4 -> 3")
    check(not restart["reshard_events"], f"restart at an unchanged world size called on_reshard: "
                                         f"{restart['reshard_events']}")
    overlap = {s: v for s, v in restart["losses"].items() if s in train["losses"]}
    if overlap:
        dev = max_rel_dev(overlap, train["losses"])
        check(dev <= args.tol, f"restart vs the crashed run on steps {min(overlap)}-{max(overlap)}: {dev:.2e}")
        print(f"\nrestart retraces the crashed run on steps {min(overlap)}-{max(overlap)}: max rel dev {dev:.2e}")

    # --- table
    header = (f"{'phase':<10}{'ranks':>6}{'restored':>9}  {'tier':<11}{'failed':>7}"
              f"{'save block ms':>14}{'write ms':>10}{'saves':>6}  max rel dev")
    print(f"\n{header}\n{'-' * len(header)}")
    for ph in phases:
        res = results[ph.name]
        rest = res.get("restore")
        stats = res.get("stats", [])
        block = f"{1e3 * sum(r['blocking_s'] for r in stats) / len(stats):.1f}" if stats else "-"
        write = f"{1e3 * sum(r['write_s'] for r in stats) / len(stats):.1f}" if stats else "-"
        if ph.name == "reference":
            dev_txt = "(reference)"
        else:
            dev = max_rel_dev(res["losses"], ref)
            dev_txt = f"{dev:.2e}" + (" FAIL" if dev > args.tol else "")
            check(dev <= args.tol, f"{ph.name} deviates from the reference by {dev:.2e}")
        print(f"{ph.name:<10}{ph.nproc:>6}{rest['step'] if rest else '-':>9}  "
              f"{rest['tier'] if rest else '-':<11}{len(rest['failed_attempts']) if rest else '-':>7}"
              f"{block:>14}{write:>10}{len(stats) if stats else '-':>6}  {dev_txt}")
    print(f"restored: step loaded; failed: restore attempts that fell back; save block / write: mean time "
          f"save() blocked training / the background write took, over the saves committed ('saves')\n"
          f"max rel dev: per-step loss vs the uninterrupted reference; tolerance {args.tol:g}")

    # --- goodput from the crashed run's save costs; restart cost = the restart phase up to
    # the restored state (torchrun, imports, set-up, load), as measured here.
    from ucp_dcp.manager.config import estimate

    stats = train["stats"]
    if stats:
        t = restart["timings"]
        restart_s = walls["restart"] - t.get("train", 0.0) - t.get("final wait", 0.0)
        g = estimate([r["blocking_s"] for r in stats], [r["write_s"] for r in stats], [r["nbytes"] for r in stats],
                     mtbf_s=MTBF_S, restart_s=restart_s)
        print(f"\ngoodput, MTBF {MTBF_S / 3600:g} h (from the {g.saves} saves of 'train' that committed "
              f"before the crash, {g.bytes / 1e6:.2f} MB/rank each): a save blocks {1e3 * g.blocking_s:.1f} ms, "
              f"writes {1e3 * g.write_s:.0f} ms in the background;\n  restart {restart_s:.1f} s -> optimal "
              f"interval {g.optimal_interval_s:.1f} s, expected goodput {100 * g.effective_ratio:.2f}%")
    else:
        check(False, "no save of 'train' was recorded before the crash")

    print(f"total wall time {time.perf_counter() - t_all:.1f}s")
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed))
        return 1
    print("OK: crash, lost node disk and 4 -> 3 reshard all recovered onto the reference loss curve")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="out/manager_demo", help="tiers, logs, JSON results (wiped first)")
    p.add_argument("--steps", type=int, default=16, help="steps before the crash (even, >= 4)")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help="max relative loss deviation")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("reference", "train", "restart", "shrink"), help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tier-shared", help=argparse.SUPPRESS)
    p.add_argument("--tier-local", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 4 or args.steps % LOCAL_INTERVAL:
        p.error(f"--steps must be even and >= 4 (the crash hits the save of step N, due every {LOCAL_INTERVAL})")
    if args.worker:
        worker(args)
    else:
        sys.exit(driver(args))


if __name__ == "__main__":
    main()
