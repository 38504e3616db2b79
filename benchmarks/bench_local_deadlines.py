"""What deadlines on local reads cost (issue 25): this checkout's RangeReader against a baseline
commit's (before local deadlines, ``--baseline``), in alternating rounds.

Since local reads have deadlines, every ``RangeReader.read`` call runs on I/O threads, none on the
loading thread (which waits and keeps the deadlines), and each read is timed. Three variants:
``this`` (the default policy), ``this-off`` (``RequestPolicy(local_deadlines=False)``: the
loading thread reads a share itself, nothing timed) and ``baseline``. Three measurements, each in
a fresh process per variant and round (page cache warm, one process):

* ``small_reads``: ``--calls`` calls of ``read()`` of one 4 KiB segment each (the hand-off's cost
  per call, the worst case: nothing to amortise it over), microseconds per call;
* ``load``: ``dcp.load`` of a ``--size-mb`` state (fp32, 8 tensors) with UCPStorageReader and
  UCPLoadPlanner, seconds;
* ``cast_load``: ``dcp.load`` of 2000 fp32 tensors of 64 x 64 into float64 ones (each cast
  tensor staged and read on its own: many ``read()`` calls, counted), seconds.

Reported: per variant the median over ``--repeats`` rounds, and the median of the per-round
ratios (variant / baseline); the order of the variants alternates between rounds.

    python benchmarks/bench_local_deadlines.py --baseline 2a36d20 --repeats 7 \\
        --out benchmarks/results/vm-2026-11-26/local_deadlines.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
import torch.distributed.checkpoint as dcp
from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPStorageReader
from ucp_dcp.byteio.rangeio import RangeReader
from ucp_dcp.byteio.segments import Segment
torch.set_num_threads(1)
ckpt, blob, calls, variant = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
opts = {}
if variant != "baseline":
    from ucp_dcp import RequestPolicy
    opts["requests"] = RequestPolicy(local_deadlines=variant == "this")
out = {}
with RangeReader([blob], threads=2, **opts) as r:
    buf = memoryview(bytearray(4096))
    for i in range(200):  # warm up
        r.read([Segment(0, (i % 256) * 4096, buf)])
    t0 = time.perf_counter()
    for i in range(calls):
        r.read([Segment(0, (i % 256) * 4096, buf)])
    out["small_reads_us"] = (time.perf_counter() - t0) / calls * 1e6
with open(os.path.join(ckpt, "shapes.json")) as f:
    shapes = json.load(f)
state = {k: torch.empty(shape) for k, shape in shapes.items()}
dcp.load(state, storage_reader=UCPStorageReader(ckpt, options=ReadOptions(**opts)), planner=UCPLoadPlanner())  # warm
t0 = time.perf_counter()
dcp.load(state, storage_reader=UCPStorageReader(ckpt, options=ReadOptions(**opts)), planner=UCPLoadPlanner())
out["load_s"] = time.perf_counter() - t0
small = os.path.join(os.path.dirname(ckpt), "small")
calls = [0]
real = RangeReader.read
def counted(self, segments):
    calls[0] += 1
    return real(self, segments)
RangeReader.read = counted
many = {f"t{i}": torch.empty(64, 64, dtype=torch.float64) for i in range(2000)}
dcp.load(many, storage_reader=UCPStorageReader(small, options=ReadOptions(**opts)), planner=UCPLoadPlanner())  # warm
calls[0] = 0
t0 = time.perf_counter()
dcp.load(many, storage_reader=UCPStorageReader(small, options=ReadOptions(**opts)), planner=UCPLoadPlanner())
out["cast_load_s"] = time.perf_counter() - t0
out["cast_load_read_calls"] = calls[0]
print(json.dumps(out))
"""


def _export(rev: str, dest: str) -> str:
    """``src/`` of commit ``rev`` unpacked under ``dest``; its path."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return os.path.join(dest, "src")


def _child(src: str, ckpt: str, blob: str, calls: int, variant: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, ckpt, blob, str(calls), variant], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision before local deadlines")
    ap.add_argument("--size-mb", type=int, default=200)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    load_start = os.getloadavg()
    root = tempfile.mkdtemp(prefix="bench-local-deadlines-")
    try:
        srcs = {"this": str(REPO / "src"), "this-off": str(REPO / "src"),
                "baseline": _export(args.baseline, root)}
        ckpt, blob = os.path.join(root, "ckpt"), os.path.join(root, "blob")
        with open(blob, "wb") as f:
            f.write(os.urandom(1 << 20))
        rows = args.size_mb * 1_000_000 // (8 * 1024 * 4)
        save = (
            "import json, sys, torch, torch.distributed.checkpoint as dcp\n"
            "from ucp_dcp import UCPSavePlanner, UCPStorageWriter\n"
            f"sd = {{f'w{{i}}': torch.randn({rows}, 1024) for i in range(8)}}\n"
            "dcp.save(sd, storage_writer=UCPStorageWriter(sys.argv[1]), planner=UCPSavePlanner())\n"
            "json.dump({k: list(v.shape) for k, v in sd.items()}, open(sys.argv[1] + '/shapes.json', 'w'))\n"
            "many = {f't{i}': torch.randn(64, 64) for i in range(2000)}\n"
            "dcp.save(many, storage_writer=UCPStorageWriter(sys.argv[2]), planner=UCPSavePlanner())\n"
        )
        subprocess.run([sys.executable, "-c", save, ckpt, os.path.join(root, "small")], env={**os.environ, "PYTHONPATH": srcs["this"]},
                       check=True)
        runs: dict[str, list[dict[str, float]]] = {"this": [], "this-off": [], "baseline": []}
        order = list(runs)
        for k in range(args.repeats):
            for name in order if k % 2 == 0 else order[::-1]:
                runs[name].append(_child(srcs[name], ckpt, blob, args.calls, name))
            print(f"round {k + 1}: " + ", ".join(f"{n} {runs[n][-1]}" for n in runs), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = {}
    for key in ("small_reads_us", "load_s", "cast_load_s"):
        base = [r[key] for r in runs["baseline"]]
        summary[key] = {"baseline_median": statistics.median(base)}
        for name in ("this", "this-off"):
            ours = [r[key] for r in runs[name]]
            summary[key][f"{name}_median"] = statistics.median(ours)
            summary[key][f"{name}_median_ratio"] = statistics.median(a / b for a, b in zip(ours, base))
        print(f"{key}: " + ", ".join(f"{k} {v:.4g}" for k, v in summary[key].items()))
    doc = {
        "command": " ".join(["python", "benchmarks/bench_local_deadlines.py", *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "baseline": args.baseline, "size_mb": args.size_mb, "calls": args.calls, "repeats": args.repeats,
        "runs": runs, "summary": summary,
    }
    print(f"load average {load_start} -> {os.getloadavg()}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
