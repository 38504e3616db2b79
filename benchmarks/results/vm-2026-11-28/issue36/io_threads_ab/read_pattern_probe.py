import os, sys, time, threading, multiprocessing as mp, statistics
D = "/tmp/rdtest"; N = 4; SIZE = 82 << 20
def mk():
    os.makedirs(D, exist_ok=True)
    for r in range(N):
        p = f"{D}/f{r}"
        if not os.path.exists(p) or os.path.getsize(p) != SIZE:
            with open(p, "wb") as f: f.write(os.urandom(SIZE))
            os.fsync(f.fileno()) if False else None
def evict():
    for r in range(N):
        fd = os.open(f"{D}/f{r}", os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
def worker(r, piece, threads, seq_hint, bar, q):
    fd = os.open(f"{D}/f{r}", os.O_RDONLY)
    if seq_hint: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buf = bytearray(b'\x01') * SIZE; mv = memoryview(buf)
    offs = list(range(0, SIZE, piece)); lock = threading.Lock(); it = iter(offs)
    def run():
        while True:
            with lock:
                o = next(it, None)
            if o is None: return
            os.preadv(fd, [mv[o:o+piece]], o)
    bar.wait(); t = time.perf_counter()
    ts = [threading.Thread(target=run) for _ in range(threads)]
    [x.start() for x in ts]; [x.join() for x in ts]
    q.put(time.perf_counter() - t); os.close(fd)
def trial(piece, threads, seq_hint):
    evict(); bar = mp.Barrier(N); q = mp.Queue()
    ps = [mp.Process(target=worker, args=(r, piece, threads, seq_hint, bar, q)) for r in range(N)]
    [p.start() for p in ps]; ts = [q.get() for _ in ps]; [p.join() for p in ps]
    return max(ts)
if __name__ == "__main__":
    mk()
    cfgs = [(1<<20, 2, True), (1<<20, 1, True), (2<<20, 1, True), (2<<20, 2, True), (8<<20, 1, True)]
    res = {c: [] for c in cfgs}
    for rep in range(15):
        for c in cfgs[rep % len(cfgs):] + cfgs[:rep % len(cfgs)]:
            res[c].append(trial(*c))
    for c, v in res.items():
        print(f"piece {c[0]>>20} MiB threads {c[1]} seqhint {c[2]}: median {statistics.median(v)*1e3:.1f} ms  min {min(v)*1e3:.1f}")
