"""One-off: a same-layout FSDP2 + AdamW restart on N ranks (gloo, one machine), saved with small
replicated tensors spread over the ranks (the rule before 2026-11-29) and on their lowest holder
(after): data files each rank opens, time parsing headers, load time. Prints one JSON line.

    python benchmarks/results/vm-2026-11-28/issue36/small_replicated_on_lowest/scale_headers.py --world 16 --repeats 5
"""
import argparse, functools, json, os, statistics, sys, tempfile, time, shutil
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "..", "..", "benchmarks"))
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from harness.pagecache import evict_tree
import ucp_dcp.dcp._save_global as G
import ucp_dcp.sources.native as N
from ucp_dcp import UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter

SPENT = [0.0]
_rh = N.read_header
@functools.wraps(_rh)
def timed(*a, **k):
    t = time.perf_counter()
    try: return _rh(*a, **k)
    finally: SPENT[0] += time.perf_counter() - t
N.read_header = timed

def state(hidden, layers, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])
    for m in model: fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward(); opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}

def run(rank, args):
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    out = {}
    for rule, small in (("spread", 0), ("lowest", 64 << 10)):
        G.SMALL_TENSOR_BYTES = small
        path = os.path.join(args.dir, rule)
        dcp.save(state(args.hidden, args.layers, 0), storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
        dist.barrier()
        files, spent, wall = [], [], []
        target = state(args.hidden, args.layers, 1)
        for i in range(args.repeats + 1):
            if rank == 0: evict_tree(path)
            dist.barrier()
            SPENT[0] = 0.0
            reader = UCPStorageReader(path)
            t = time.perf_counter()
            dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
            w = torch.tensor([time.perf_counter() - t]); dist.all_reduce(w, op=dist.ReduceOp.MAX)
            if i:  # the first load warms imports and caches
                files.append(len(reader.last_load.file_access)); spent.append(SPENT[0]); wall.append(w.item())
        got = [None] * args.world
        dist.all_gather_object(got, (max(files), statistics.median(spent)))
        out[rule] = {"files_per_rank_max": max(g[0] for g in got), "header_ms_median_of_ranks": round(statistics.median(g[1] for g in got) * 1e3, 1),
                     "header_ms_max_rank": round(max(g[1] for g in got) * 1e3, 1), "load_ms_median": round(statistics.median(wall) * 1e3, 1)}
    if rank == 0:
        print(json.dumps({"world": args.world, "hidden": args.hidden, "layers": args.layers, "repeats": args.repeats, **out, "loadavg": os.getloadavg()}))
    dist.destroy_process_group()

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=16); ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256); ap.add_argument("--layers", type=int, default=16)
    args = ap.parse_args()
    args.dir = tempfile.mkdtemp(prefix="scaleh-")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29577")
    try:
        torch.multiprocessing.spawn(run, args=(args,), nprocs=args.world)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
