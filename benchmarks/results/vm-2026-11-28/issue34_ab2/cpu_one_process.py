"""CPU seconds (process_time: all threads) and wall of a one-process ucp load, cold, N times."""
import os, sys, time, json, statistics, tempfile, shutil
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from harness.pagecache import evict_tree  # puts this checkout's src first
import torch, torch.distributed.checkpoint as dcp
from ucp_dcp import UCPStorageReader, UCPStorageWriter, UCPLoadPlanner, UCPSavePlanner
import ucp_dcp
torch.manual_seed(0)
sd = {f"l{i}.w": torch.randn(1024, 1024) for i in range(64)}  # 256 MiB
sd.update({f"l{i}.b": torch.randn(1024) for i in range(64)})
d = tempfile.mkdtemp(dir="/tmp")
dcp.save(sd, storage_writer=UCPStorageWriter(d), planner=UCPSavePlanner())
cpu, wall = [], []
for _ in range(int(sys.argv[1])):
    evict_tree(d)
    dest = {k: torch.empty_like(v) for k, v in sd.items()}
    c0, t0 = time.process_time(), time.perf_counter()
    dcp.load(dest, storage_reader=UCPStorageReader(d), planner=UCPLoadPlanner())
    cpu.append(time.process_time() - c0); wall.append(time.perf_counter() - t0)
assert all(torch.equal(dest[k], sd[k]) for k in sd)
shutil.rmtree(d)
print(json.dumps({"src": ucp_dcp.__file__, "cpu_median": round(statistics.median(cpu), 4), "wall_median": round(statistics.median(wall), 4), "cpu": [round(c, 4) for c in cpu]}))
