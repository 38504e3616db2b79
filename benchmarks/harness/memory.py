"""Process memory and I/O counters (Linux ``/proc``): RSS, peaks, rchar, and a phase probe.

Everything here reads the calling process only. Peaks use the kernel's
``VmHWM`` high-water mark, reset through ``/proc/self/clear_refs`` (Linux >=
4.0); anonymous memory has no kernel high-water mark, so
:class:`PeakMemorySampler` samples it from a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


LIBC = _load_libc()
"""The C library of this process (for ``malloc_trim``, ``mmap``, ``mincore``), or None."""


def has_malloc_trim() -> bool:
    """Whether the C library has glibc's ``malloc_trim``."""
    return LIBC is not None and hasattr(LIBC, "malloc_trim")


def release_free_memory() -> None:
    """Make RSS reflect live data before a baseline: collect garbage, then ``malloc_trim(0)``.

    Without the trim a "fresh" allocation may be served from pages an earlier
    measurement freed (glibc keeps freed heap memory, and its mmap threshold
    adapts upward), so whether a copy pays for first-touch page faults would
    depend on what ran before it.
    """
    gc.collect()
    if has_malloc_trim():
        LIBC.malloc_trim(0)  # type: ignore[union-attr]


def proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (rchar, wchar, read_bytes, ...)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def proc_read_bytes() -> int:
    """Bytes this process caused to be fetched from the block layer (all threads)."""
    return proc_io().get("read_bytes", 0)


def _kb_field(path: str, field: str) -> int:
    """A ``Name:  123 kB`` line of a /proc file, in bytes; 0 if absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def status_bytes(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes; 0 if absent."""
    return _kb_field("/proc/self/status", field)


def rss_bytes() -> int:
    """Resident set size now."""
    return status_bytes("VmRSS")


def statm_bytes() -> tuple[int, int]:
    """(resident, anonymous) bytes; anonymous = resident - file/shmem-backed."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * PAGE, (resident - shared) * PAGE


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (write 5 to clear_refs); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM: the peak RSS since the last :func:`reset_peak_rss` (or since start)."""
    return status_bytes("VmHWM") or max_rss_bytes()


def max_rss_bytes() -> int:
    """The process's lifetime peak RSS (``getrusage``; never reset)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def meminfo_bytes(field: str) -> int:
    """A field of ``/proc/meminfo`` (``MemAvailable``, ``MemTotal``) in bytes; 0 if absent."""
    return _kb_field("/proc/meminfo", field)


def mem_available() -> int:
    """``MemAvailable`` of the machine, in bytes (0 if unknown)."""
    return meminfo_bytes("MemAvailable")


def loadavg() -> list[str] | None:
    """The 1, 5 and 15 minute load averages as ``/proc/loadavg`` writes them."""
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return None


class PeakMemorySampler:
    """Peak memory growth over a baseline while the block runs.

    Total RSS comes from the kernel's exact high-water mark (VmHWM, reset on
    entry) when available. Anonymous memory, the number that matters since
    file-backed pages of an mmap reader are reclaimable page cache, has no
    kernel high-water mark, so a thread samples /proc/self/statm for it.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.base_rss, self.base_anon = statm_bytes()
        self.peak_rss, self.peak_anon = self.base_rss, self.base_anon
        self._hwm = reset_peak_rss()

    def _sample(self) -> None:
        rss, anon = statm_bytes()
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_anon = max(self.peak_anon, anon)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        if self._hwm:
            self.peak_rss = max(self.peak_rss, peak_rss_bytes())

    @property
    def rss_growth(self) -> int:
        """Peak RSS minus the RSS at construction."""
        return self.peak_rss - self.base_rss

    @property
    def anon_growth(self) -> int:
        """Peak anonymous memory minus the anonymous memory at construction."""
        return self.peak_anon - self.base_anon


@dataclass
class PhaseRecord:
    """What :class:`PhaseProbe` measured over one phase on this process."""

    seconds: float
    rchar: int  # bytes returned by read-family system calls (page-cache hits included)
    wchar: int
    read_bytes: int  # bytes fetched from the block layer (readahead included)
    peak_rss: int  # VmHWM minus base_rss
    base_rss: int


class PhaseProbe:
    """Wall time, ``/proc/self/io`` deltas and peak RSS growth of one measured phase.

    On entry: free memory is released, ``barrier`` (if given) is attended,
    VmHWM is reset and the baselines are taken. ``record()`` returns the
    measurements as a dict, with any extra keys appended.
    """

    def __init__(self, barrier: Callable[[], Any] | None = None) -> None:
        self.barrier = barrier
        self.result: PhaseRecord | None = None

    def __enter__(self) -> PhaseProbe:
        release_free_memory()
        if self.barrier is not None:
            self.barrier()
        reset_peak_rss()
        self.base_rss = rss_bytes()
        self.io0 = proc_io()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self.t0
        io1 = proc_io()
        self.result = PhaseRecord(seconds, io1["rchar"] - self.io0["rchar"], io1["wchar"] - self.io0["wchar"],
                                  io1["read_bytes"] - self.io0["read_bytes"], peak_rss_bytes() - self.base_rss,
                                  self.base_rss)

    def peak_growth(self) -> int:
        """Peak RSS growth so far, inside the phase."""
        return peak_rss_bytes() - self.base_rss

    def record(self, **extra: Any) -> dict[str, Any]:
        """The phase's measurements (after the block) plus ``extra``, as a JSON-able dict."""
        assert self.result is not None, "record() is for after the with-block"
        return {**asdict(self.result), **extra}


def _children_of() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process visible in /proc."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                # The command name (field 2) may hold spaces: fields after the last ')'.
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def tree_pss_bytes(pid: int) -> int:
    """Proportional set size of ``pid`` and all its descendants (``smaps_rollup`` ``Pss``); 0 once gone.

    PSS, not RSS: worker processes forked from one parent share its pages
    copy-on-write, and summing their RSS would count those pages once per
    worker.
    """
    kids = _children_of()
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(kids.get(p, []))
        total += _kb_field(f"/proc/{p}/smaps_rollup", "Pss")
    return total


class ProcessTreeSampler:
    """Peak PSS of a child process and its descendants, sampled from a thread while it runs.

    For conversion tools run as subprocesses (which may start worker pools):
    the kernel keeps no high-water mark over a process tree, so the tree's
    PSS is summed every ``interval_s``. Short spikes between samples are
    missed; the result is a lower bound.
    """

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_bytes(self.pid))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ProcessTreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# A Firecracker guest (the development VM) reports free memory to its host, which takes it back;
# the guest's next use of such a page waits for the host to back it again, counted as the guest's
# system time. A cold read then costs 0.39-0.61 s instead of 0.108 s for a plain 300 MB preadv
# (benchmarks/results/vm-2026-11-29/issue36_no_page_reporting/). Machines users train on do not
# do this. Pages freed less than min_free_ms ago are not reported.
PAGE_REPORTING = "/sys/module/page_reporting/parameters"


def page_reporting() -> dict[str, str] | None:
    """The guest's free-page reporting parameters (``min_free_ms``, ``reported_kib``...), or
    None where the kernel has none: recorded with results, whose cold reads it slows."""
    try:
        names = sorted(os.listdir(PAGE_REPORTING))
    except OSError:
        return None
    out = {}
    for name in names:
        try:
            with open(os.path.join(PAGE_REPORTING, name)) as f:
                out[name] = f.read().strip()
        except OSError:
            pass
    return out


@contextlib.contextmanager
def page_reporting_held(hold_ms: int = 300_000, warm_bytes: int = 4 << 30) -> Iterator[None]:
    """Hold off the guest's free-page reporting for the block: ``min_free_ms`` raised to 5 min
    (the most this kernel takes), restored after; needs root. First ``warm_bytes`` are touched
    and freed, so the pages the block allocates first are ones the host backs (pages reported
    before stay unbacked until reused). It changes the whole VM while it runs: only for an
    opt-in benchmark flag."""
    path = os.path.join(PAGE_REPORTING, "min_free_ms")
    with open(path) as f:
        before = f.read().strip()
    with open(path, "w") as f:
        f.write(str(hold_ms))
    try:
        if warm_bytes > 0:
            import mmap

            m = mmap.mmap(-1, warm_bytes)
            for off in range(0, warm_bytes, PAGE):
                m[off] = 1
            m.close()
        yield
    finally:
        with open(path, "w") as f:
            f.write(before)
