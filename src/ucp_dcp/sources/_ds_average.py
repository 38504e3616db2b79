"""Tensors that are the mean of tensor-parallel slices, computed when a load reads them.

``ds_to_universal`` merges a parameter under ``parameter_to_average_patterns`` (Megatron-
DeepSpeed's layer norms, position embeddings, row-parallel biases: copies that drift apart
between tensor-parallel ranks) as ``sum(slices) / len(slices)``. That value is in no byte range
of the checkpoint, so the source lists it in one more, *computed* data file
(:class:`MeanFile`): each averaged tensor is a byte range of it, planned, read and exchanged
like any other; :meth:`MeanFile.wrap` gives the reader that serves those ranges by reading the
slices' bytes from the real files and computing the mean with the very operations
``ds_to_universal`` uses (so the result is bit-identical to the Universal folder's).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..byteio.rangeio import ByteSource, Extents, Segment
from ..core.sharding import Box
from ..format import Location

__all__ = ["MeanFile", "MeanTensor", "MEAN_FILE_NAME"]

# The computed file's name in messages and listings (it is on no storage).
MEAN_FILE_NAME = "<mean of tensor-parallel slices>"


@dataclass(frozen=True)
class MeanTensor:
    """One averaged tensor: ``nbytes`` at ``offset`` of the computed file, the mean of
    ``operands`` (one per tensor-parallel rank, in rank order: its chunks, each a box of the
    slice of ``shape`` and where its bytes are)."""

    key: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    operands: tuple[tuple[tuple[Box, Location], ...], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the mean."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class MeanFile:
    """The computed data file (number ``file``) of a source's averaged tensors; ``equal`` lists
    those whose slices turned out bit-equal (filled as they are computed)."""

    file: int
    tensors: list[MeanTensor]
    equal: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        """The file's length: the tensors laid end to end."""
        return sum(t.nbytes for t in self.tensors)

    def wrap(self, base: ByteSource) -> ByteSource:
        """A reader of the real files (``base``) that also serves this file."""
        return _MeanReader(base, self)


class _MeanReader(ByteSource):
    """Segments of the computed file are served from means computed on first use (from the
    slices' bytes, read through ``base``); every other segment goes to ``base``."""

    def __init__(self, base: ByteSource, means: MeanFile) -> None:
        self._base = base
        self._means = means
        self.gap_bytes = base.gap_bytes
        self.stats = base.stats
        self._done: dict[int, np.ndarray] = {}  # tensor position -> its bytes
        self._lock = threading.Lock()

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill each segment: from ``base``, or the means it overlaps."""
        mine = [s for s in segments if s.file == self._means.file]
        if len(mine) < len(segments):
            self._base.read([s for s in segments if s.file != self._means.file])
        for s in mine:
            self._fill(s)
            if s.done is not None:
                s.done(1)

    def _fill(self, s: Segment) -> None:
        out = np.frombuffer(s.dest, dtype=np.uint8)
        lo, hi = s.offset, s.offset + len(out)
        for i, t in enumerate(self._means.tensors):
            a, b = max(lo, t.offset), min(hi, t.offset + t.nbytes)
            if a < b:
                data = self._mean(i, t)
                out[a - lo : b - lo] = data[a - t.offset : b - t.offset]

    def _mean(self, i: int, t: MeanTensor) -> np.ndarray:
        with self._lock:
            got = self._done.get(i)
            if got is None:
                slices = [self._slice(t, chunks) for chunks in t.operands]
                # ds_to_universal's merge_tp_slices, operation for operation: Python's sum
                # (0 + s0 + s1 + ...) then one division, in the slices' dtype.
                mean = sum(slices) / len(slices)
                assert isinstance(mean, torch.Tensor)
                if all(torch.equal(s, slices[0]) for s in slices[1:]):
                    self._means.equal.add(t.key)
                got = mean.to(t.dtype).contiguous().view(torch.uint8).numpy().reshape(-1)
                self._done[i] = got
            return got

    def _slice(self, t: MeanTensor, chunks: tuple[tuple[Box, Location], ...]) -> torch.Tensor:
        """One rank's slice, read from its chunks (each a run of the slice's row-major order)."""
        out = torch.empty(t.shape, dtype=t.dtype)
        raw = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        size = t.dtype.itemsize
        strides = [math.prod(t.shape[d + 1 :]) for d in range(len(t.shape))]
        segs = []
        for box, loc in chunks:
            at = sum(o * s for o, s in zip(box.offsets, strides)) * size
            segs.append(Segment(loc.file, loc.start, raw[at : at + loc.nbytes]))
        self._base.read(segs)
        return out

    def close(self) -> None:
        """Close ``base``; the means are dropped with this reader."""
        self._base.close()

    def plan_access(self, extents: Extents, mode: str = "auto") -> dict[int, str]:
        """``base``'s choice for the real files (the computed file is in memory)."""
        real = {f: e for f, e in extents.items() if f != self._means.file}
        return self._base.plan_access(real, mode)
