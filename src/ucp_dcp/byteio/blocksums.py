"""Block checksums recorded at save: an xxh3-64 of every fixed-size block of every tensor chunk.

A chunk's whole-entry xxh3-64 can only be checked by a read of the whole
chunk, and a resharding load reads parts of chunks. So every data file also
records the xxh3-64 of each ``block`` bytes of each tensor chunk (blocks
start at the chunk's first byte; the last may be shorter), and a load checks
exactly the blocks its reads touch (:mod:`~ucp_dcp.byteio.blockverify`).

:class:`BlockHasher` computes them while :class:`~ucp_dcp.byteio.datafile.DataFileWriter`
writes the chunk, in pieces of any size; :class:`BlockSums` holds one chunk's
recorded sums (:mod:`~ucp_dcp.byteio.blockverify` checks reads against them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import xxhash

from ..errors import InvalidArgumentError

__all__ = ["BlockSums", "BlockHasher"]

# The same function, for numpy arrays (the rows of a 2-D view, hashed in place). Arrays have the
# buffer protocol, but numpy's stubs declare it (``__buffer__``) only for Python 3.12+ and mypy
# checks for 3.10; taking ``.data`` of every row instead would double the cost of hashing a block.
_hash_array = cast("Callable[[np.ndarray], int]", xxhash.xxh3_64_intdigest)


@dataclass(frozen=True, eq=False)
class BlockSums:
    """The recorded xxh3-64 of every ``block`` bytes of one saved chunk (``sums[k]``: block
    ``k``)."""

    block: int
    sums: np.ndarray  # uint64, ceil(nbytes / block) of them


class BlockHasher:
    """The xxh3-64 of every ``block`` bytes of an ``nbytes``-long stream fed to :meth:`update` in
    pieces of any size."""

    def __init__(self, nbytes: int, block: int) -> None:
        self.block = block
        self.sums = np.zeros(-(-nbytes // block), dtype=np.uint64)
        self._k = 0  # the block being filled
        self._fill = 0  # its bytes hashed so far
        self._partial: xxhash.xxh3_64 | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        """Hash the next ``len(data)`` bytes of the stream."""
        view = memoryview(data).cast("B")
        b, n, off = self.block, len(view), 0
        if self._fill:
            assert self._partial is not None
            off = min(b - self._fill, n)
            self._partial.update(view[:off])
            self._fill += off
            if self._fill < b:
                return
            self.sums[self._k] = self._partial.intdigest()
            self._k, self._fill, self._partial = self._k + 1, 0, None
        full = (n - off) // b
        if full:
            # The rows of a 2-D view: a quarter cheaper per block than slicing the memoryview.
            rows = np.frombuffer(view, dtype=np.uint8, count=full * b, offset=off).reshape(full, b)
            self.sums[self._k : self._k + full] = np.fromiter(
                map(_hash_array, rows), np.uint64, full
            )
            self._k += full
            off += full * b
        if off < n:
            self._partial = xxhash.xxh3_64(view[off:])
            self._fill = n - off

    def digests(self) -> np.ndarray:
        """Every block's digest (call once the whole stream was fed)."""
        if self._fill:
            assert self._partial is not None
            self.sums[self._k] = self._partial.intdigest()
            self._k, self._fill, self._partial = self._k + 1, 0, None
        if self._k != len(self.sums):
            raise InvalidArgumentError(f"block hasher fed {self._k} of {len(self.sums)} blocks")
        return self.sums
