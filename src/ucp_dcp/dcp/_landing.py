"""Read-once loads, where received bytes land: the destination runs of this rank's regions.

:class:`LocalNeeds` lists, for every region of a saved chunk this rank fills
(:class:`Region`), the runs of the file it needs and where each lands in the
destination's storage. It answers two questions of the exchange
(:mod:`ucp_dcp.dcp._exchange`): which byte ranges to ask the job for
(:meth:`LocalNeeds.needs`, rounded out to whole checksum blocks), and where
the bytes of a received piece go (:meth:`LocalNeeds.copy_in`): straight into
the storage of a CPU tensor of the saved dtype, or cast and copied run by run
into any other destination.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..byteio.blocksums import BlockSums
from ..byteio.rangeio import storage_view
from ..byteio.transfer import ChunkRegion
from ..core.contiguous import runs
from ..core.ranges import merge_ranges
from ..errors import ReadOnceError

__all__ = ["LocalNeeds", "Region"]


@dataclass(frozen=True, slots=True)
class Region:
    """A region of a saved chunk to fill in place: ``part`` into CPU tensor ``dest`` (saved dtype,
    chunk stored row-major). ``sums``: the chunk's block checksums (None: nothing to check);
    ``name`` and ``chunk_offsets`` name it in errors; ``done`` runs once every rank succeeded."""

    part: ChunkRegion
    dest: torch.Tensor
    name: str
    chunk_offsets: tuple[int, ...]
    sums: BlockSums | None
    done: Callable[[], None] | None


class _InPlace:
    """A CPU destination of the saved dtype: bytes copied into its storage."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.view = storage_view(dest)
        self.es = dest.element_size()

    def put(self, elem: int, data: np.ndarray) -> None:
        d = elem * self.es
        self.view[d : d + len(data)] = data.data


class _Converted:
    """Any other destination (another dtype, a device): whole elements of the saved dtype copied
    (and cast) into the destination's storage, run by run."""

    def __init__(self, dest: torch.Tensor, saved: torch.dtype) -> None:
        st = dest.untyped_storage()
        flat = torch.empty(0, dtype=dest.dtype, device=dest.device)
        self.flat = flat.set_(st, 0, (st.nbytes() // dest.element_size(),), (1,))
        self.saved = saved

    def put(self, elem: int, data: np.ndarray) -> None:
        src = torch.frombuffer(data, dtype=self.saved)  # no copy; unaligned is fine
        self.flat[elem : elem + len(src)].copy_(src)


@dataclass
class LocalNeeds:
    """The byte ranges of the files this rank's regions need, and where each lands.

    :meth:`needs` rounds each run out to whole checksum blocks of its chunk
    (a received piece is checked before any of it is used) and merges them
    per file: what this rank asks the job for. The destination runs are
    kept sorted by file and start, to find by bisection where a received
    piece goes: into the destination's storage directly (a CPU tensor of the
    saved dtype) or cast and copied run by run (another dtype, a device; such
    regions need block checksums, whose checked blocks are whole elements).
    """

    regions: Sequence[Region]
    file: np.ndarray = field(init=False)
    start: np.ndarray = field(init=False)
    length: np.ndarray = field(init=False)
    region: np.ndarray = field(init=False)
    dst: np.ndarray = field(init=False)  # element offset in the destination's storage
    reach: np.ndarray = field(init=False)
    sinks: list[_InPlace | _Converted] = field(init=False)

    def __post_init__(self) -> None:
        cols: list[list[np.ndarray]] = [[], [], [], [], []]
        self.sinks = []
        for i, r in enumerate(self.regions):
            es = r.part.dtype.itemsize
            grid = runs(
                r.part.chunk_sizes, r.part.region, r.dest.stride(), int(r.dest.storage_offset())
            )
            in_place = r.dest.device.type == "cpu" and r.dest.dtype == r.part.dtype
            self.sinks.append(_InPlace(r.dest) if in_place else _Converted(r.dest, r.part.dtype))
            k = len(grid.src)
            if not k or not grid.count:
                continue
            cols[0].append(np.full(k, r.part.location.file, np.int64))
            cols[1].append(grid.src * es + r.part.location.start)
            cols[2].append(np.full(k, grid.count * es, np.int64))
            cols[3].append(np.full(k, i, np.int64))
            cols[4].append(grid.dst)
        file, start, length, region, dst = (
            np.concatenate(c) if c else np.zeros(0, np.int64) for c in cols
        )
        order = np.lexsort((start, file))
        self.file, self.start, self.length = file[order], start[order], length[order]
        self.region, self.dst = region[order], dst[order]
        # Per file, the running maximum of the runs' ends (see copy_in).
        ends = self.start + self.length
        self.reach = np.empty_like(ends)
        for f in np.unique(self.file).tolist():
            sel = np.flatnonzero(self.file == f)
            self.reach[sel] = np.maximum.accumulate(ends[sel])

    def needs(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Per file, the merged ``(starts, lengths)`` this rank needs, runs rounded out to whole
        blocks of their chunks."""
        # Each run's chunk start, size and block (0: no checksums, the run kept as it is), so
        # that every run is rounded in one pass, whatever the number of regions.
        locs = [r.part.location for r in self.regions]
        base = np.array([loc.start for loc in locs], np.int64)[self.region]
        size = np.array([loc.nbytes for loc in locs], np.int64)[self.region]
        bs = np.array([r.sums.block if r.sums else 0 for r in self.regions], np.int64)[self.region]
        starts, ends = self.start.copy(), self.start + self.length
        on = bs > 0
        b = bs[on]
        starts[on] = base[on] + (starts[on] - base[on]) // b * b
        ends[on] = base[on] + np.minimum(-(-(ends[on] - base[on]) // b) * b, size[on])
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        cuts = np.flatnonzero(np.diff(self.file)) + 1  # runs are sorted by file
        for f, s, e in zip(np.split(self.file, cuts), np.split(starts, cuts), np.split(ends, cuts)):
            if len(f):
                a, z = merge_ranges(s, e)
                out[int(f[0])] = (a, z - a)
        return out

    def copy_in(self, file: int, start: int, data: np.ndarray) -> int:
        """Copy ``data`` (bytes ``[start, start + len(data))`` of ``file``) into every destination
        run it overlaps; the bytes copied."""
        end = start + len(data)
        lo = int(np.searchsorted(self.file, file, "left"))
        hi = int(np.searchsorted(self.file, file, "right"))
        # Runs sorted by start; the running maximum of their ends is sorted too, so the runs a
        # piece may overlap are one slice (two read items may read the same bytes).
        i = lo + int(np.searchsorted(self.reach[lo:hi], start, "right"))
        j = lo + int(np.searchsorted(self.start[lo:hi], end, "left"))
        copied = 0
        for k in range(i, j):
            a = max(int(self.start[k]), start)
            b = min(int(self.start[k] + self.length[k]), end)
            if a < b:
                r = int(self.region[k])
                es = self.regions[r].part.dtype.itemsize
                if (a - int(self.start[k])) % es or (b - a) % es:
                    raise ReadOnceError(
                        f"{self.regions[r].name}: bytes [{a}, {b}) of file {file} arrived cut "
                        f"inside an element of {es} bytes"
                    )
                elem = int(self.dst[k]) + (a - int(self.start[k])) // es
                self.sinks[r].put(elem, data[a - start : b - start])
                copied += b - a
        return copied
