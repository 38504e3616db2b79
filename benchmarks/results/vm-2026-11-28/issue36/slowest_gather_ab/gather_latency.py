"""One-off: median latency of a tiny all_gather_object, a tensor all_gather and all_gather_into_tensor on 4 gloo ranks (300 calls each, a barrier before each).

    python benchmarks/results/vm-2026-11-28/issue36/slowest_gather_ab/gather_latency.py

On the idle 2-core VM, 2026-11-28 about 22:52: {"obj": 8.009, "list": 3.889, "into": 3.649} (ms).
"""
import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp, statistics
def run(rank):
    os.environ["MASTER_ADDR"]="127.0.0.1"; os.environ["MASTER_PORT"]="29612"
    dist.init_process_group("gloo", rank=rank, world_size=4)
    res={"obj":[], "list":[], "into":[]}
    for i in range(300):
        dist.barrier()
        t=time.perf_counter(); out=[None]*4; dist.all_gather_object(out, ("x"*60, 1.0, 2, 3)); res["obj"].append(time.perf_counter()-t)
        dist.barrier()
        t=time.perf_counter(); outs=[torch.zeros(6, dtype=torch.float64) for _ in range(4)]; dist.all_gather(outs, torch.ones(6, dtype=torch.float64)); res["list"].append(time.perf_counter()-t)
        dist.barrier()
        t=time.perf_counter(); o=torch.empty(24, dtype=torch.float64); dist.all_gather_into_tensor(o, torch.ones(6, dtype=torch.float64)); res["into"].append(time.perf_counter()-t)
    if rank==0: print({k: round(statistics.median(v)*1e3,3) for k,v in res.items() if v})
    dist.destroy_process_group()
if __name__=="__main__": mp.spawn(run, nprocs=4)
