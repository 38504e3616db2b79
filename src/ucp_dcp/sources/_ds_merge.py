"""Tensors merged from all their tensor-parallel slices when a load reads them.

Two of ``ds_to_universal``'s merge rules need every slice, not a byte range of one:

* ``parameter_to_average_patterns`` (Megatron-DeepSpeed's layer norms, position embeddings,
  row-parallel biases: copies that drift apart between tensor-parallel ranks) is
  ``sum(slices) / len(slices)``;
* ``tp_replicated_parameter_patterns`` takes one slice, after asserting all are equal.

Such a tensor is in no byte range of the checkpoint, so the source lists it in one more,
*computed* data file (:class:`MergeFile`): each merged tensor is a byte range of it, planned,
read and exchanged like any other. :meth:`MergeFile.wrap` gives the reader that serves those
ranges: it reads the slices' bytes from the real files and computes the mean with the very
operations ``ds_to_universal`` uses (so the result is bit-identical to the Universal folder's),
or, for a replicated tensor, reads slice 0 and, when the load verifies, the others too, and
refuses a slice that differs, naming the parameter and both tensor-parallel ranks.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from ..byteio.rangeio import ByteSource, Extents, storage_view
from ..byteio.segments import Segment
from ..core.boxes import row_major_strides
from ..core.sharding import Box
from ..errors import CheckpointFormatError
from ..format import Location

__all__ = ["MERGE_FILE_NAME", "MergeFile", "MergedTensor"]

# The computed file's name in messages and listings (it is on no storage).
MERGE_FILE_NAME = "<merged tensor-parallel slices>"

MergeOp = Literal["mean", "replica"]


@dataclass(frozen=True)
class MergedTensor:
    """One merged tensor: ``nbytes`` at ``offset`` of the computed file, ``op`` of ``operands``
    (one per tensor-parallel rank, in rank order: its chunks, each a box of the slice of
    ``shape`` and where its bytes are)."""

    key: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    op: MergeOp
    operands: tuple[tuple[tuple[Box, Location], ...], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the merged tensor."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class MergeFile:
    """The computed data file (number ``file``) of a source's merged tensors, read from
    ``where``; ``equal`` lists the averaged tensors whose slices a load found bit-equal (so the
    mean is each of them), filled as they are computed."""

    file: int
    tensors: list[MergedTensor]
    where: str
    equal: set[str] = field(default_factory=set)

    @property
    def size(self) -> int:
        """The file's length: the tensors laid end to end."""
        return sum(t.nbytes for t in self.tensors)

    def wrap(self, base: ByteSource, verify: bool = True) -> ByteSource:
        """A reader of the real files (``base``) that also serves this file (``verify``: check
        that a replicated tensor's slices are equal)."""
        return _MergeReader(base, self, verify)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


class _MergeReader(ByteSource):
    """Segments of the computed file are served from tensors merged on first use (from the
    slices' bytes, read through ``base``); every other segment goes to ``base``."""

    def __init__(self, base: ByteSource, merges: MergeFile, verify: bool) -> None:
        self._base = base
        self._merges = merges
        self._verify = verify
        self.gap_bytes = base.gap_bytes
        self.stats = base.stats
        self._done: dict[int, np.ndarray] = {}  # tensor position -> its bytes
        self._starts = [t.offset for t in merges.tensors]  # end to end: ascending
        self._lock = threading.Lock()

    def read(self, segments: Sequence[Segment]) -> None:
        """Fill each segment: from ``base``, or the merged tensors it overlaps."""
        mine = [s for s in segments if s.file == self._merges.file]
        if len(mine) < len(segments):
            self._base.read([s for s in segments if s.file != self._merges.file])
        for s in mine:
            self._fill(s)
            if s.done is not None:
                s.done(1)

    def _fill(self, s: Segment) -> None:
        out = np.frombuffer(s.dest, dtype=np.uint8)
        lo, hi = s.offset, s.offset + len(out)
        tensors = self._merges.tensors
        # The tensors the segment overlaps: from the last one starting at or before it on.
        for i in range(max(bisect.bisect_right(self._starts, lo) - 1, 0), len(tensors)):
            t = tensors[i]
            if t.offset >= hi:
                break
            a, b = max(lo, t.offset), min(hi, t.offset + t.nbytes)
            if a < b:
                data = self._merged(i, t)
                out[a - lo : b - lo] = data[a - t.offset : b - t.offset]

    def _merged(self, i: int, t: MergedTensor) -> np.ndarray:
        with self._lock:
            got = self._done.get(i)
            if got is None:
                got = self._merge(t).contiguous().view(-1).view(torch.uint8).numpy()
                self._done[i] = got
            return got

    def _merge(self, t: MergedTensor) -> torch.Tensor:
        if t.op == "replica":
            first = self._slice(t, t.operands[0])
            if self._verify:
                for rank, chunks in enumerate(t.operands[1:], 1):
                    other = self._slice(t, chunks)
                    if not _same_bits(first, other):
                        diff = (first.double() - other.double()).abs().max().item()
                        raise CheckpointFormatError(
                            f"{self._merges.where}: {t.key} is tensor-parallel replicated "
                            f"(tp_replicated_parameter_patterns), but tensor-parallel ranks 0 "
                            f"and {rank} hold different values (max |difference| {diff:.3g}); "
                            "ds_to_universal refuses it too"
                        )
            return first
        slices = [self._slice(t, chunks) for chunks in t.operands]
        # ds_to_universal's merge_tp_slices, operation for operation: Python's sum
        # (0 + s0 + s1 + ...) then one division, in the slices' dtype.
        mean = sum(slices) / len(slices)
        assert isinstance(mean, torch.Tensor)
        if all(_same_bits(s, slices[0]) for s in slices[1:]):
            self._merges.equal.add(t.key)
        return mean.to(t.dtype)

    def _slice(self, t: MergedTensor, chunks: tuple[tuple[Box, Location], ...]) -> torch.Tensor:
        """One rank's slice, read from its chunks (each a run of the slice's row-major order)."""
        out = torch.empty(t.shape, dtype=t.dtype)
        raw = storage_view(out)
        size = t.dtype.itemsize
        strides = row_major_strides(t.shape)
        segs = []
        for box, loc in chunks:
            at = sum(o * s for o, s in zip(box.offsets, strides)) * size
            segs.append(Segment(loc.file, loc.start, raw[at : at + loc.nbytes]))
        self._base.read(segs)
        return out

    def close(self) -> None:
        """Close ``base``; the merged tensors are dropped with this reader."""
        self._base.close()

    def plan_access(
        self, extents: Extents, mode: str = "auto", shared: Extents | None = None
    ) -> dict[int, str]:
        """``base``'s choice for the real files (the computed file is in memory)."""
        real = {f: e for f, e in extents.items() if f != self._merges.file}
        return self._base.plan_access(real, mode, shared)
