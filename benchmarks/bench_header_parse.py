"""Data-file header parsing: ``read_header`` of one data file, warm and cold, and its phases.

Times, in one process, ``--repeats`` alternating warm (page cache kept) and
cold (``POSIX_FADV_DONTNEED`` first) ``read_header`` calls on data file
``--file`` (default: the second of the checkpoint in ``--dir``), then the
phases on their own: the two reads of the header bytes (warm and cold) and
the two ``json.loads`` (the safetensors header, the ucp_dcp metadata in it).
Prints the medians in ms and the load average as one JSON line. Compare two
checkouts by running each one's copy of this script in turn, alternating:

    python benchmarks/profile_same_layout.py --dir /tmp/psl --world 4   # makes the checkpoint
    python benchmarks/bench_header_parse.py --dir /tmp/psl/world4/ucp --repeats 40
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import struct
import time

from harness.pagecache import evict  # isort: skip (puts this checkout's src/ first)
from ucp_dcp.byteio.rangeio import FileAccess, read_header


def _ms(ts: list[float]) -> float:
    return round(statistics.median(ts) * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a ucp_dcp checkpoint directory")
    ap.add_argument("--file", default=None, help="one data file (default: the checkpoint's second)")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.dir, "*.safetensors")))
    path = args.file or files[min(1, len(files) - 1)]
    read_header(path)  # imports, first-use costs

    def timed(cold: bool) -> float:
        if cold:
            evict([path])
        t = time.perf_counter()
        read_header(path)
        return time.perf_counter() - t

    def phases(cold: bool) -> tuple[float, float, int]:
        if cold:
            evict([path])
        t0 = time.perf_counter()
        with FileAccess(path) as f:
            (n,) = struct.unpack("<Q", f.pread(8, 0))
            raw = f.pread(n, 8)
        t1 = time.perf_counter()
        json.loads(json.loads(raw)["__metadata__"]["ucp_dcp"])
        return t1 - t0, time.perf_counter() - t1, n

    warm, cold = [], []
    for _ in range(args.repeats):
        warm.append(timed(False))
        cold.append(timed(True))
    w = [phases(False) for _ in range(args.repeats)]
    c = [phases(True) for _ in range(args.repeats)]
    out = {
        "file": os.path.basename(path),
        "header_bytes": w[0][2],
        "warm_ms": _ms(warm),
        "cold_ms": _ms(cold),
        "warm_read_ms": _ms([x[0] for x in w]),
        "cold_read_ms": _ms([x[0] for x in c]),
        "json_ms": _ms([x[1] for x in w]),
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
