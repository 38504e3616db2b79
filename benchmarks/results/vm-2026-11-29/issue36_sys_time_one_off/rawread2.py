import os, time, resource, sys, threading
import numpy as np
path = sys.argv[1]; nthreads = int(sys.argv[2]); reps = int(sys.argv[3]); chunk = int(sys.argv[4]) << 20 if len(sys.argv) > 4 else 8 << 20
size = 300 << 20
buf = np.zeros(size, dtype=np.uint8)
mv = memoryview(buf)
res = []
for i in range(reps):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    def work(k):
        off = k * chunk
        while off < size:
            n = min(chunk, size - off)
            got = 0
            while got < n:
                got += os.preadv(fd, [mv[off + got:off + n]], off + got)
            off += nthreads * chunk
    ts = [threading.Thread(target=work, args=(k,)) for k in range(nthreads)]
    [t.start() for t in ts]; [t.join() for t in ts]
    t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.close(fd)
    res.append((t, r1.ru_stime - r0.ru_stime))
ws = sorted(w for w, _ in res); ss = sorted(s for _, s in res)
print(f"threads {nthreads} chunk {chunk>>20}MB: wall median {ws[len(ws)//2]:.3f} min {ws[0]:.3f} max {ws[-1]:.3f}; sys median {ss[len(ss)//2]:.3f} max {ss[-1]:.3f}; slow(sys>0.05) {sum(s > 0.05 for s in ss)}/{len(ss)}")
