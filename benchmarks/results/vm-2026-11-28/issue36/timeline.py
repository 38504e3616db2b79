"""One-off: per-phase times of ucp vs DCP loads in profile_same_layout.py, via patched timers.

Run from the repository root: python benchmarks/results/vm-2026-11-28/issue36/timeline.py --world 4 --repeats 9
Each rank writes /tmp/tl/raw.<rank>.json (every repeat's marks, seconds from the load's start)."""
import sys, os, time, functools, collections, json, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "benchmarks"))
os.makedirs("/tmp/tl", exist_ok=True)
import profile_same_layout as psl
import torch.distributed as dist
from ucp_dcp.dcp import reader as R
from ucp_dcp.byteio import engine as E, rangeio as RI
import ucp_dcp.sources.native as N
from torch.distributed.checkpoint import filesystem as FS

ACC = collections.defaultdict(float)
def wrap(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: ACC[label] += time.perf_counter() - t
    setattr(obj, name, w)
for n in ["read_metadata","set_up_storage_reader","prepare_local_plan","prepare_global_plan","read_data"]:
    wrap(R.UCPStorageReader, n, "ucp."+n)
    wrap(FS.FileSystemReader, n, "dcp."+n)
wrap(E.ChunkReads, "flush", "ucp.flush")
wrap(E.ChunkReads, "add", "ucp.engine_add")
wrap(E.ChunkReads, "close", "ucp.engine_close")
wrap(R, "chunk_part", "ucp.chunk_part")
wrap(R, "name_slowest", "ucp.name_slowest")
wrap(R, "read_values", "ucp.read_values")
wrap(R.UCPStorageReader, "_plan_access", "ucp.plan_access")
wrap(R.UCPStorageReader, "_exchange", "ucp.exchange")
wrap(R.UCPStorageReader, "_items", "ucp.items")
wrap(R.UCPStorageReader, "_may_exchange", "ucp.may_exchange")
import ucp_dcp.sources.base as SB
for cls in [N.NativeSource] if hasattr(N, "NativeSource") else []:
    wrap(cls, "prepare", "ucp.src_prepare"); wrap(cls, "block_sums", "ucp.block_sums")

wrap(RI, "read_header", "ucp.read_header")
wrap(N, "read_header", "ucp.read_header_n") if hasattr(N, "read_header") else None
orig = psl._load
REC = collections.defaultdict(list)
T0 = [0.0]
def mark(obj, name, label):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        ACC[label + ".enter"] = time.perf_counter() - T0[0]
        try: return f(*a, **k)
        finally: ACC[label + ".exit"] = time.perf_counter() - T0[0]
    setattr(obj, name, w)
mark(R.UCPStorageReader, "read_data", "U.rd")
mark(FS.FileSystemReader, "read_data", "D.rd")
mark(E.ChunkReads, "flush", "U.flush")
mark(E.ChunkReads, "close", "U.eclose")
mark(R, "read_values", "U.values")
mark(R, "name_slowest", "U.slowest")
mark(R.UCPStorageReader, "_read_data", "U._rd")
mark(E.ChunkReads, "__init__", "U.cr_init")
mark(R.UCPStorageReader, "_plan_access", "U.pa")
mark(R.UCPStorageReader, "_exchange", "U.ex")
mark(R.UCPStorageReader, "_items", "U.items")
mark(N.NativeSource, "prepare", "U.prep")
from ucp_dcp.dcp import options as O
mark(O.ReadOptions, "open_reader", "U.open_reader")
import ucp_dcp.dcp.placement as PL

import torch.distributed.checkpoint as dcpm
def _load(kind, *a, **k):
    ACC.clear(); T0[0] = time.perf_counter()
    t = orig(kind, *a, **k)
    d = dict(ACC); d["total"] = t
    REC[kind].append(d)
    return t
psl._load = _load
orig_destroy = dist.destroy_process_group
def destroy(*a, **k):
    r = dist.get_rank()
    out = {}
    for kind, recs in REC.items():
        keys = sorted({k for d in recs for k in d})
        out[kind] = {k: round(1000*statistics.median([d.get(k, 0) for d in recs[1:]]), 1) for k in keys}
    open(f"/tmp/tl/out.{r}.json","w").write(json.dumps(out))
    open(f"/tmp/tl/raw.{r}.json","w").write(json.dumps(REC))
    return orig_destroy(*a, **k)
dist.destroy_process_group = destroy
psl.dist.destroy_process_group = destroy
if __name__ == "__main__":
    psl.main()
