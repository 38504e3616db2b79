"""Page cache: fsync + eviction (``POSIX_FADV_DONTNEED``), residency (``mincore``), bytes a read pulled.

Eviction needs no root for files whose pages are clean, hence the fsync
first; it does nothing on tmpfs (check :func:`resident_bytes` after it).
:class:`TurnTakingReader` counts the bytes each rank's ``read_data`` pulled
into the page cache, one rank at a time.
"""

from __future__ import annotations

import dataclasses

import ctypes
import inspect
import mmap
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .memory import LIBC, PAGE, proc_read_bytes

if LIBC is not None:
    LIBC.mmap.restype = ctypes.c_void_p
    LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def files_under(root: str | Path) -> list[str]:
    """Every regular file under ``root``, sorted."""
    return sorted(str(p) for p in Path(root).rglob("*") if p.is_file())


def dir_bytes(root: str | Path) -> int:
    """Total size of the files under ``root``."""
    return sum(os.path.getsize(p) for p in files_under(root))


def _each_fd(files: Sequence[str], fsync: bool, evict: bool) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if fsync:
                os.fsync(fd)
            if evict:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_files(files: Sequence[str]) -> None:
    """fsync every file (its dirty pages reach the disk, so eviction can drop them)."""
    _each_fd(files, fsync=True, evict=False)


def evict(files: Sequence[str]) -> None:
    """Drop the files' clean pages from the page cache (dirty pages stay: fsync first)."""
    _each_fd(files, fsync=False, evict=True)


def fsync_and_evict(files: Sequence[str]) -> None:
    """fsync, then evict, each file."""
    _each_fd(files, fsync=True, evict=True)


def evict_tree(root: str | Path) -> None:
    """fsync, then drop from the page cache, every file under ``root`` (no-op on tmpfs)."""
    fsync_and_evict(files_under(root))


def resident_pages(path: str) -> tuple[int, int]:
    """(resident, total) pages of ``path`` in the page cache, via mmap + mincore.

    Python's mmap object is not writable with PROT_READ, so ctypes cannot take
    its address; the file is mapped with libc directly instead. Mapping does
    not fault pages in, so the probe itself pulls nothing from storage.
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    if LIBC is None:
        raise OSError("no C library for mmap/mincore")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap({path}) failed")
        try:
            vec = (ctypes.c_ubyte * ((size + PAGE - 1) // PAGE))()
            if LIBC.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore({path}) failed")
            return sum(1 for b in bytes(vec) if b & 1), len(vec)
        finally:
            LIBC.munmap(addr, size)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` present in the page cache (whole pages)."""
    return resident_pages(path)[0] * PAGE


def total_resident_bytes(files: Sequence[str]) -> int:
    """Bytes of all ``files`` present in the page cache."""
    return sum(resident_bytes(p) for p in files)


def resident_fraction(files: Sequence[str]) -> float | None:
    """Fraction of the files' pages in the page cache; None if it cannot be measured."""
    try:
        counts = [resident_pages(p) for p in files]
    except (OSError, AttributeError):
        return None
    total = sum(t for _, t in counts)
    return sum(r for r, _ in counts) / total if total else 0.0


def read_ahead_kb(path: str) -> int | None:
    """read_ahead_kb of the block device under ``path`` (readahead inflates pulled bytes)."""
    st = os.stat(path)
    base = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for cand in (base / "queue/read_ahead_kb", base / "../queue/read_ahead_kb"):
        try:
            return int(cand.read_text())
        except OSError:
            continue
    return None


def fs_type(path: str) -> str | None:
    """File system type of the mount holding ``path`` (from /proc/mounts), or None."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")):
                    if len(parts[1]) >= len(best):
                        best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


@dataclass
class PulledBytes:
    """What one rank's turn of :class:`TurnTakingReader` pulled into the page cache."""

    pulled_bytes: int = 0
    pulled_bytes_by_file: dict[str, int] = field(default_factory=dict)
    io_read_bytes: int = 0  # /proc/self/io read_bytes over the turn (also sees O_DIRECT)
    residual_bytes: int = 0  # resident right after eviction: not charged to the rank
    read_items: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return asdict(self)


class TurnTakingReader(StorageReader):
    """Delegating StorageReader that serialises ``read_data`` across ranks.

    On its turn a rank evicts every checkpoint file, runs the wrapped reader's
    read_data to completion, and counts what became resident: with only one
    rank reading at a time, that is exactly what this rank pulled from storage
    (readahead included, since that is real I/O). Works for any reader because
    only the public StorageReader interface is used. ``stats`` holds the count.
    """

    def __init__(self, inner: StorageReader, root: str, group: dist.ProcessGroup | None = None) -> None:
        self.inner = inner
        self.root = root
        self.files = files_under(root)
        self.group = group
        self.stats = PulledBytes()

    def __getattr__(self, name: str) -> Any:
        # Anything outside the StorageReader interface (e.g. checkpoint_id,
        # which dcp.load probes with getattr) comes from the wrapped reader.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Delegated."""
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Delegated."""
        return self.inner.read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Delegated, with rank/use_collectives only for readers whose signature takes ``**kwargs``."""
        if "kwargs" in inspect.signature(self.inner.set_up_storage_reader).parameters:
            self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        else:
            self.inner.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Delegated."""
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Delegated, then the plans' ``storage_data`` cleared: ranks take turns in ``read_data``,
        where a reader's end-of-load collective (UCPStorageReader's gather of the slowest rank,
        asked for by its plans' ``LoadRun``) would wait for ranks whose turn has not come."""
        return [dataclasses.replace(p, storage_data=None) for p in self.inner.prepare_global_plan(plans)]

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Never chosen by checkpoint id."""
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Ranks take turns: evict, read through the wrapped reader, count what became resident."""
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        error: BaseException | None = None
        for turn in range(world):
            dist.barrier(group=self.group)  # previous rank's turn is over
            if turn != rank:
                continue
            try:
                evict(self.files)
                # Pages that survive eviction (still mapped somewhere, or
                # tmpfs) are subtracted so they are not charged to this rank.
                residual = {p: resident_bytes(p) for p in self.files}
                io0 = proc_read_bytes()
                self.inner.read_data(plan, planner).wait()
                io1 = proc_read_bytes()
                pulled = {os.path.relpath(p, self.root): max(0, resident_bytes(p) - residual[p])
                          for p in self.files}
                self.stats = PulledBytes(sum(pulled.values()), {k: v for k, v in pulled.items() if v},
                                         io1 - io0, sum(residual.values()), len(plan.items))
            except BaseException as e:  # keep attending barriers, re-raise below
                error = e
        dist.barrier(group=self.group)
        if error is not None:
            raise error
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
