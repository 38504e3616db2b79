"""The placement digest's cost: hashing rate, and a save and a load with and without it.

One process, the same fp32 transformer-like state as ``bench_save.py`` (plus a bf16 copy for
the hashing rate). Every round times, alternating, ``dcp.save`` with
``UCPStorageWriter(placement_digests=False)`` and ``=True``, then ``dcp.load`` with
``UCPStorageReader(verify_placement=False)`` and ``=True``; reported: medians over the rounds
and the median of the per-round ratios (load from other processes hits both sides alike).

    python benchmarks/bench_placement.py --size-mb 300 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp
from bench_save import make_state

from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.core.placement_digest import box_share


def _rate(t: torch.Tensor, repeats: int) -> float:
    """Best-of-``repeats`` hashing rate of ``t`` in MB/s."""
    best = min(_timed(lambda: box_share(t, (0,) * t.dim(), t.shape)) for _ in range(repeats))
    return t.numel() * t.element_size() / best / 1e6


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    x = torch.randn(4096, 4096)
    print(f"hashing: fp32 {_rate(x, 3):.0f} MB/s, bf16 {_rate(x.bfloat16(), 3):.0f} MB/s")
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
                reader = UCPStorageReader(path, verify_placement=verify)
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


if __name__ == "__main__":
    main()
