import os, time, resource, sys
import numpy as np
path = sys.argv[1]; size = 300 << 20; chunk = 8 << 20
buf = np.ones(size, dtype=np.uint8); mv = memoryview(buf)
import mmap
def back(n):
    if n <= 0: return
    m = mmap.mmap(-1, n); v = np.frombuffer(m, dtype=np.uint8); v[::mmap.PAGESIZE] = 1; del v; m.close()
def cpu():
    f = open("/proc/stat").readline().split()[1:]
    return [int(x) for x in f]  # user nice system idle iowait irq softirq steal
for i in range(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
    fd = os.open(path, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); time.sleep(float(os.environ.get("PAUSE", "0"))); back(int(os.environ.get("BACK", "0")) << 20)
    c0 = cpu(); r0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
    off = 0
    while off < size:
        off += os.preadv(fd, [mv[off:off + chunk]], off)
    t = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF); c1 = cpu(); os.close(fd)
    d = [b - a for a, b in zip(c0, c1)]
    print(f"wall {t:.3f} sys {r1.ru_stime - r0.ru_stime:.3f} | jiffies user {d[0]} sys {d[2]} idle {d[3]} iowait {d[4]} irq {d[5]} softirq {d[6]} steal {d[7]}")
