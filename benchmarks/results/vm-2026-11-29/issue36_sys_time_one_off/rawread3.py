import os, time, resource, sys, threading
import numpy as np
path = sys.argv[1]; mode = sys.argv[2]; reps = int(sys.argv[3])
size = 300 << 20; chunk = 8 << 20
buf = np.zeros(size, dtype=np.uint8); mv = memoryview(buf)
res = []
for i in range(reps):
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if mode.endswith("seq"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    def rd(a, b):
        off = a
        while off < b:
            off += os.preadv(fd, [mv[off:min(off + chunk, b)]], off)
    if mode.startswith("halves"):
        ts = [threading.Thread(target=rd, args=(0, size // 2)), threading.Thread(target=rd, args=(size // 2, size))]
        [t.start() for t in ts]; [t.join() for t in ts]
    else:
        rd(0, size)
    t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
    os.close(fd); res.append((t, r1.ru_stime - r0.ru_stime))
ws = sorted(w for w, _ in res); ss = sorted(s for _, s in res)
print(f"{mode}: wall median {ws[len(ws)//2]:.3f} min {ws[0]:.3f} max {ws[-1]:.3f}; sys median {ss[len(ss)//2]:.3f} max {ss[-1]:.3f}; slow(sys>0.05) {sum(s > 0.05 for s in ss)}/{len(ss)}")
