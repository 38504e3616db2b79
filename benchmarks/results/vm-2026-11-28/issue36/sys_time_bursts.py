"""One-off: wall, user and system time of each cold one-process load (ucp or dcp), to see where
the per-repeat spread of this VM comes from.

    python benchmarks/results/vm-2026-11-28/issue36/sys_time_bursts.py ucp 16 fresh
    python benchmarks/results/vm-2026-11-28/issue36/sys_time_bursts.py dcp 12 fresh
"""
import os, sys, time, resource, tempfile, gc
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "benchmarks"))
import torch, torch.distributed.checkpoint as dcp
from harness.pagecache import evict_tree
from harness.memory import release_free_memory
import profile_same_layout as psl
from ucp_dcp import UCPStorageReader, UCPStorageWriter, UCPSavePlanner, UCPLoadPlanner, ReadOptions
import torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29544")
dist.init_process_group("gloo", rank=0, world_size=1)
state = psl._state(1216, 17)
d = tempfile.mkdtemp(prefix="bimodal-", dir="/tmp")
dcp.save(state, storage_writer=UCPStorageWriter(d + "/ucp"), planner=UCPSavePlanner())
dcp.save(state, storage_writer=dcp.FileSystemWriter(d + "/dcp"))
mode = sys.argv[1] if len(sys.argv) > 1 else "ucp"
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 16):
    fresh = psl._state(1216, 17) if "fresh" in sys.argv else state
    release_free_memory()
    evict_tree(d)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    if mode == "ucp":
        rd = UCPStorageReader(d + "/ucp")
        dcp.load(fresh, storage_reader=rd, planner=UCPLoadPlanner())
    else:
        dcp.load(fresh, storage_reader=dcp.FileSystemReader(d + "/dcp"))
    t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
    extra = ""
    if mode == "ucp":
        rep = rd.last_load
        extra = f"verify {rep.verify_seconds*1e3:.1f}ms calls {rep.read_calls} access {set(rep.file_access.values())}"
    print(f"{mode} {i:2d} wall {t*1e3:6.1f} user {(r1.ru_utime-r0.ru_utime)*1e3:6.1f} sys {(r1.ru_stime-r0.ru_stime)*1e3:6.1f} minflt {r1.ru_minflt-r0.ru_minflt} majflt {r1.ru_majflt-r0.ru_majflt} nvcsw {r1.ru_nvcsw-r0.ru_nvcsw} nivcsw {r1.ru_nivcsw-r0.ru_nivcsw} {extra}", flush=True)
import shutil; shutil.rmtree(d)
