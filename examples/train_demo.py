"""Train, checkpoint, and resume under a different parallel layout with ``ucp_dcp``.

What this shows
---------------
A tiny transformer LM is trained with FSDP2 (``fully_shard``) on 4 CPU ranks.
At the midpoint it saves model + AdamW state, the step counter and each rank's
dataloader cursor (a ``RankLocal``) with ``UCPStorageWriter``/``UCPSavePlanner``.
That checkpoint is then resumed on 2 and 3 ranks (FSDP) and on a 2x2
(dp, tp) mesh (tensor parallel + FSDP); a checkpoint saved by the 2x2 mesh is
resumed on 4 FSDP ranks, so a layout change is exercised both ways. Every
resumed run must retrace the uninterrupted run's loss curve: the data of a step
is a fixed global batch split over the dp ranks, and FSDP averages gradients,
so the trajectory does not depend on the layout beyond float reduction order.

Run it
------
    python examples/train_demo.py [--out-dir out/demo] [--steps 40]

The script is its own driver: it launches every phase with ``torchrun``
(``python -m torch.distributed.run --standalone``) on itself with
``--worker``; workers write their losses to JSON files in the output dir. It
prints a comparison table, writes ``loss_curves.png`` (if matplotlib is
installed) and exits non-zero if any run strays from the reference by more
than ``--tol``. About 1-2 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from demo_model import ModelConfig, ShardedLoader, TinyLM, apply_tensor_parallel

GLOBAL_BATCH = 24  # divisible by every dp size used below: 4, 3, 2
PEAK_LR = 1e-2
WARMUP_STEPS = 5
# Relative tolerance on each step's loss vs the reference. A run with another
# dp size (or TP) sums gradients and partial matmuls in another order, so its
# float32 losses differ from the reference in the last bit or two: measured
# <= 3e-7 here, over 40 and over 120 steps (this small, well-conditioned run
# does not amplify them). Real resharding bugs are five orders larger: resuming
# with zeroed Adam moments gives 1e-1, a data cursor one batch off 1.4e-1.
# 1e-4 sits ~300x above the noise and ~1000x below those.
DEFAULT_TOL = 1e-4


def lr_at(step: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of peak: a function of the step
    alone, so restoring the step counter restores the schedule."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


class Laps:
    """Seconds a worker spends per phase, each call closing the phase since the last one.

    ``lap = Laps(); ...; lap("load"); ...; lap("train")``; ``lap.timings``
    sums the time per phase name (a name may recur).
    """

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - self._clock
        self._clock = now


# ----------------------------------------------------------------------------
# Worker: one torchrun rank
# ----------------------------------------------------------------------------


def reshard_loader_state(key: str, saved: dict[int, Any], rank: int, world_size: int) -> Any:
    """``RankLocal`` reshard hook, called when the world size changed.

    The new rank has no saved cursor of its own; hand it any saved rank's
    state (which records that rank's dp layout) and let
    ``ShardedLoader.load_state_dict`` move it to this rank's slot.
    """
    return saved[min(saved)]


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ucp_dcp import (
        RankLocal,
        UCPLoadPlanner,
        UCPSavePlanner,
        UCPStorageReader,
        UCPStorageWriter,
    )

    # Rank 0's time per phase; the driver reports the rest as launch overhead.
    lap = Laps()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelConfig()

    # Same seed on every rank and in every layout: the model is built whole,
    # then sharded, so every run starts from identical weights.
    torch.manual_seed(0)
    model = TinyLM(cfg)
    if args.layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, mesh["tp"])  # TP first, then FSDP over dp (torchtitan order)
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    # One FSDP unit per block plus the root: parameters are all-gathered block
    # by block. FSDP's reduce-scatter averages gradients over dp, so the
    # update equals that of the mean loss over the global batch.
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, weight_decay=0.01)
    dp_group = dp_mesh.get_group()
    loader = ShardedLoader(cfg, GLOBAL_BATCH, dp_mesh.get_local_rank(), dp_mesh.size())
    lap("setup")

    def state(step: int) -> dict[str, Any]:
        # get_state_dict gives DTensor-valued model and optimizer state with
        # fully-qualified names, independent of the FSDP/TP wrapping: that is
        # what lets DCP match tensors across layouts. (On a fresh optimizer it
        # also creates the Adam moments, so a load has somewhere to go.)
        model_sd, optim_sd = get_state_dict(model, optim)
        loader_state = RankLocal(loader.state_dict(), reshard=reshard_loader_state)
        return {"model": model_sd, "optim": optim_sd, "step": step, "loader": loader_state}

    start = 0
    if args.resume_from:
        sd = state(0)
        dcp.load(sd, storage_reader=UCPStorageReader(args.resume_from), planner=UCPLoadPlanner())
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = int(sd["step"])
        # RankLocal gives back each rank's own value at the same world size and
        # our reshard hook's otherwise; a 4-rank FSDP <-> 2x2 change keeps the
        # world size but not the dp layout, which load_state_dict remaps.
        loader.load_state_dict(sd["loader"].value)
        expected = start * GLOBAL_BATCH + loader.dp_rank * loader.local_batch
        if loader.next_sample != expected:
            raise RuntimeError(
                f"rank {rank}: data cursor is {loader.next_sample} after load, expected {expected}"
            )
        lap("load")

    losses: dict[int, float] = {}
    for step in range(start, args.stop):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, args.steps)
        inputs, targets = loader.next_batch()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        # Report the global-batch loss (TP ranks of one dp rank hold the same value).
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=dp_group)
        losses[step] = global_loss.item() / dp_mesh.size()
        if args.save_to and step + 1 == args.save_at:
            lap("train")
            dcp.save(
                state(step + 1),
                storage_writer=UCPStorageWriter(args.save_to),
                planner=UCPSavePlanner(),
            )
            lap("save")
    lap("train")

    if rank == 0:
        result = {"start": start, "losses": losses, "timings": lap.timings}
        Path(args.result).write_text(json.dumps(result))
    end_worker()


def end_worker() -> None:
    """Tear a worker down together with its peers, then end the process at once.

    Under load, a gloo rank that runs the interpreter's normal exit after
    ``destroy_process_group`` sometimes aborts ("terminate called without
    an active exception", SIGABRT) after its work is done (2 of 25 runs on a
    loaded 2-core machine). Everything is written and flushed by now, so the
    process skips the exit-time destructors with ``os._exit(0)``.
    """
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------
# Driver: launch the phases with torchrun, compare, plot
# ----------------------------------------------------------------------------


@dataclass
class Run:
    name: str
    layout: str  # "fsdp" (1-D dp mesh) or "2d" (dp x tp = world/2 x 2)
    nproc: int
    stop: int  # train up to (excluding) this step
    resume_from: str | None = None  # checkpoint dir name under out dir
    save_to: str | None = None

    @property
    def mesh(self) -> str:
        return f"(dp,tp)=({self.nproc // 2},2)" if self.layout == "2d" else f"fsdp dp={self.nproc}"


def launch(run: Run, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    result = out / f"{run.name}.json"
    log = out / f"{run.name}.log"
    # --standalone: torchrun runs its own rendezvous on a free local port.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={run.nproc}", __file__, "--worker", f"--layout={run.layout}",
        f"--steps={args.steps}", f"--stop={run.stop}", f"--save-at={args.save_at}",
        f"--result={result}",
    ]  # fmt: skip
    if run.resume_from:
        cmd.append(f"--resume-from={out / run.resume_from}")
    if run.save_to:
        # UCPStorageWriter refuses to replace a committed checkpoint; the
        # demo's own checkpoints from an earlier invocation are fair game.
        shutil.rmtree(out / run.save_to, ignore_errors=True)
        cmd.append(f"--save-to={out / run.save_to}")
    return torchrun(cmd, result, log, f"run '{run.name}'")


def torchrun(cmd: list[str], result: Path, log: Path, what: str) -> dict[str, Any]:
    """Run a torchrun command line, its output into ``log``; return the JSON rank 0 wrote to ``result``.

    Exits the driver with the first traceback of the log if the run fails
    (``what``, e.g. "run 'reference'", names it). Losses come back keyed by int step.
    """
    # One thread per rank: the ranks already oversubscribe the cores, and
    # intra-op threads would only fight each other.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result.unlink(missing_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not result.exists():
        raise SystemExit(
            f"\n{what} failed (exit {proc.returncode}); full log: {log}\n" + first_traceback(log.read_text())
        )
    data = json.loads(result.read_text())
    data["losses"] = {int(k): v for k, v in data["losses"].items()}
    return data


def first_traceback(log_text: str, limit: int = 40) -> str:
    """The end of the first rank's traceback in a torchrun log (torchrun's own
    summary after it only says which rank failed), else the log's last lines."""
    lines = log_text.splitlines()
    start = next((i for i, line in enumerate(lines) if "Traceback" in line), None)
    if start is None:
        return "\n".join(lines[-limit:])
    prefix = lines[start].split(" ")[0] if lines[start].startswith("[rank") else ""
    return "\n".join([line for line in lines[start:] if line.startswith(prefix)][-limit:])


def max_rel_dev(losses: dict[int, float], ref: dict[int, float]) -> float:
    return max(abs(v - ref[s]) / abs(ref[s]) for s, v in losses.items())


def plot(results: dict[str, dict[str, Any]], save_at: int, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return False
    ref = results["reference"]["losses"]
    fig, (ax, ax_dev) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    for name, res in results.items():
        steps = sorted(res["losses"])
        ref_style = {"lw": 3, "alpha": 0.35, "color": "k"}
        style = ref_style if name == "reference" else {"marker": ".", "lw": 1}
        ax.plot(steps, [res["losses"][s] for s in steps], label=name, **style)
        if name != "reference":
            # Floor at 1e-9 so bit-identical steps still show on the log scale.
            dev = [max(abs(res["losses"][s] - ref[s]) / ref[s], 1e-9) for s in steps]
            ax_dev.semilogy(steps, dev, marker=".", lw=1, label=name)
    for a in (ax, ax_dev):
        a.axvline(save_at - 0.5, color="gray", ls=":")
    ax.set_ylabel("training loss")
    ax.set_title("Resumed runs vs uninterrupted 4-rank FSDP run (dotted: checkpoint)")
    ax.legend(fontsize=8)
    ax_dev.set_ylabel("|rel. deviation| (1e-9: identical)")
    ax_dev.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def driver(args: argparse.Namespace) -> int:
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    n, mid = args.steps, args.save_at
    runs = [
        Run("reference", "fsdp", 4, n, save_to="ckpt_fsdp4"),
        Run("2x2 from scratch", "2d", 4, mid, save_to="ckpt_2x2"),
        Run("fsdp4 ckpt -> fsdp2", "fsdp", 2, n, resume_from="ckpt_fsdp4"),
        Run("fsdp4 ckpt -> fsdp3", "fsdp", 3, n, resume_from="ckpt_fsdp4"),
        Run("fsdp4 ckpt -> 2x2", "2d", 4, n, resume_from="ckpt_fsdp4"),
        Run("2x2 ckpt -> fsdp4", "fsdp", 4, n, resume_from="ckpt_2x2"),
    ]
    print(f"ucp_dcp resharding demo: {n} steps, checkpoint after step {mid}, output in {out}")
    t_all = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for i, run in enumerate(runs, 1):
        what = f"resume {run.resume_from} at step {mid}" if run.resume_from else "train from step 0"
        print(f"[{i}/{len(runs)}] {run.name:<20} {run.mesh:<14} {what} to {run.stop}", flush=True)
        t0 = time.perf_counter()
        res = results[run.name] = launch(run, args, out)
        wall, losses, timings = time.perf_counter() - t0, res["losses"], res["timings"]
        # Everything outside the timed phases is torchrun, imports and teardown.
        startup = wall - sum(timings.values()) + timings.pop("setup")
        phases = "".join(f", {k} {v:.2f}s" for k, v in timings.items())
        print(f"      {wall:4.1f}s (startup {startup:.1f}s{phases}); "
              f"loss {losses[min(losses)]:.4f} -> {losses[max(losses)]:.4f}")

    ref = results["reference"]["losses"]
    header = f"{'run':<22}{'world: mesh':<16}{'first loss':>11}{'final loss':>11}  max rel dev"
    print(f"\n{header}\n{'-' * len(header)}")
    failed = []
    for run in runs:
        losses = results[run.name]["losses"]
        s0, s1 = min(losses), max(losses)
        if run.name == "reference":
            dev_txt = "(reference)"
        else:
            dev = max_rel_dev(losses, ref)
            dev_txt = f"{dev:.2e}" + (" FAIL" if dev > args.tol else "")
            if dev > args.tol:
                failed.append(run.name)
        world = f"{run.nproc}: {run.mesh}"
        print(f"{run.name:<22}{world:<16}{losses[s0]:>11.5f}{losses[s1]:>11.5f}  {dev_txt}")
    print(f"first loss: step {mid} for resumed runs, else step 0; final loss: step {max(ref)}\n"
          f"max rel dev: over the steps the run trained, vs the reference; tolerance {args.tol:g}")

    png = out / "loss_curves.png"
    if plot(results, mid, png):
        print(f"plot: {png}")
    print(f"total wall time {time.perf_counter() - t_all:.1f}s")
    if failed:
        print(f"FAILED: {', '.join(failed)} deviate from the reference by more than {args.tol:g}")
        return 1
    print("OK: every resumed run follows the uninterrupted run within tolerance")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="out/demo", help="checkpoints, logs, JSON results, plot")
    p.add_argument("--steps", type=int, default=40, help="total training steps")
    p.add_argument("--save-at", type=int, help="checkpoint after this many steps (default: half)")
    p.add_argument("--tol", type=float, default=DEFAULT_TOL, help="max relative loss deviation")
    # Worker-only flags, set by the driver.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", choices=("fsdp", "2d"), help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--resume-from", help=argparse.SUPPRESS)
    p.add_argument("--save-to", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.save_at is None:
        args.save_at = args.steps // 2
    if not 0 < args.save_at < args.steps:
        p.error("--save-at must be between 0 and --steps")
    if args.worker:
        worker(args)
    else:
        sys.exit(driver(args))


if __name__ == "__main__":
    main()
