"""One-process cold load of a 700 MB state (132 tensors), ucp variants and DCP alternating: wall,
user, sys. Variants: dcp, ucp:t=THREADS[:v=0 for verify off]. Usage: lanes.py VARIANTS REPEATS"""
import os, sys, time, resource, statistics, glob
sys.path.insert(0, "/work/main/benchmarks")
import torch
import torch.distributed.checkpoint as dcp
from harness.pagecache import evict, fsync_and_evict
from ucp_dcp import UCPStorageWriter, UCPStorageReader, UCPSavePlanner, UCPLoadPlanner, ReadOptions
import warnings; warnings.filterwarnings("ignore")
root = "/tmp/ab/lanes_ck"
torch.manual_seed(0)
shapes = [(3072, 768), (768, 768), (768,), (3072, 768), (768, 3072), (768,)] * 7 + [(3072, 768)] * 2
sd = {}
for i, s in enumerate(shapes):
    for kind in ("w", "exp_avg", "exp_avg_sq"):
        sd[f"{kind}.{i}"] = torch.randn(s)
print(len(sd), sum(t.numel() * 4 for t in sd.values()) / 1e6, "MB")
if not os.path.exists(root + "/ucp"):
    dcp.save(sd, storage_writer=UCPStorageWriter(root + "/ucp"), planner=UCPSavePlanner(), no_dist=True)
    dcp.save(sd, checkpoint_id=root + "/dcp", no_dist=True)
files = {f: glob.glob(f"{root}/{f}/*") for f in ("ucp", "dcp")}
fsync_and_evict(files["ucp"] + files["dcp"])
target = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
variants = sys.argv[1].split(",")
res = {v: [] for v in variants}
for rep in range(int(sys.argv[2])):
    order = variants if rep % 2 == 0 else variants[::-1]
    for v in order:
        fmt = "dcp" if v == "dcp" else "ucp"
        evict(files[fmt])
        r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        if v == "dcp":
            dcp.load(target, checkpoint_id=root + "/dcp", no_dist=True)
        else:
            kw = dict(x.split("=") for x in v.split(":")[1:])
            opts = ReadOptions(io_threads=int(kw.get("t", 2)), access=kw.get("a", "auto"), verify=kw.get("v", "1") == "1")
            dcp.load(target, storage_reader=UCPStorageReader(root + "/ucp", options=opts), planner=UCPLoadPlanner(), no_dist=True)
        w = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
        res[v].append((w, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))
for v, rs in res.items():
    ws = [r[0] for r in rs]; us = [r[1] for r in rs]; ss = [r[2] for r in rs]
    print(f"{v:16s} wall med {statistics.median(ws):.3f} [{min(ws):.3f}-{max(ws):.3f}] user {statistics.median(us):.3f} sys med {statistics.median(ss):.3f} max {max(ss):.3f} slow(sys>0.08) {sum(s > 0.08 for s in ss)}/{len(ss)}")
