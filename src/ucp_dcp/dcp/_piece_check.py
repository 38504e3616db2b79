"""Read-once loads, the checks: received pieces against their chunks' block checksums.

A piece the exchange (:mod:`ucp_dcp.dcp._exchange`) receives is hashed block
by block where it was received, before any of it is copied into place; a
block split between pieces is held until it is complete. A mismatch raises
the :class:`~ucp_dcp.ChecksumError` of the block verifier, naming the file,
the tensor, the block and the rank that read it.
"""

from __future__ import annotations

import numpy as np

from ..byteio.blockverify import BlockVerifier, ChunkCheck
from ..format import Location
from ._landing import LocalNeeds, Region

__all__ = ["PieceChecker"]


class PieceChecker:
    """Checks received pieces against the block checksums of this rank's chunks.

    A block a piece holds whole is hashed where it was received; a block
    split between pieces (a balancing cut inside a small chunk) is gathered
    in ``pending`` until complete. :meth:`verified` returns the parts of a
    piece that may be copied into place now.
    """

    def __init__(self, needs: LocalNeeds, verifier: BlockVerifier) -> None:
        self.verifier = verifier
        chunks: dict[tuple[int, int], Region] = {}
        for r in needs.regions:
            if r.sums is not None:
                chunks.setdefault((r.part.location.file, r.part.location.start), r)
        keys = sorted(chunks)
        self._chunks = [chunks[k] for k in keys]
        self._file = np.array([k[0] for k in keys], np.int64)
        self._start = np.array([k[1] for k in keys], np.int64)
        self._end = np.array([k[1] + chunks[k].part.location.nbytes for k in keys], np.int64)
        self.pending: dict[tuple[int, int], tuple[bytearray, int]] = {}

    def verified(
        self, file: int, start: int, data: np.ndarray, sender: int
    ) -> list[tuple[int, np.ndarray]]:
        """Check every block of this rank's chunks that the piece completes; the parts of the
        piece ready to copy, as ``(file offset, bytes)``."""
        end = start + len(data)
        lo = int(np.searchsorted(self._file, file, "left"))
        hi = int(np.searchsorted(self._file, file, "right"))
        i = lo + int(np.searchsorted(self._end[lo:hi], start, "right"))
        j = lo + int(np.searchsorted(self._start[lo:hi], end, "left"))
        ready: list[tuple[int, np.ndarray]] = []
        cursor = start  # the bytes before it are handed out or held
        for k in range(i, j):
            r = self._chunks[k]
            loc, sums = r.part.location, r.sums
            assert sums is not None
            bs = sums.block
            a, b = max(start, loc.start), min(end, loc.start + loc.nbytes)
            if cursor < a:  # bytes of no checked chunk of this rank's
                ready.append((cursor, data[cursor - start : a - start]))
            rel_a, rel_b = a - loc.start, b - loc.start
            first = -(-rel_a // bs)  # the first block that starts in the piece
            last = rel_b // bs if rel_b < loc.nbytes else -(-rel_b // bs)  # past its last whole one
            check = ChunkCheck(
                self.verifier, sums, f"{r.name} (read by rank {sender})", r.chunk_offsets
            )
            if first < last:
                at, stop = first * bs, min(last * bs, loc.nbytes)
                mem = data[loc.start + at - start : loc.start + stop - start]
                self.verifier.check_span(
                    check, loc, mem, at, np.arange(first, last, dtype=np.int64)
                )
                ready.append((loc.start + at, mem))
            else:
                first = last = rel_a // bs  # no whole block: the piece lies inside one
            for ea, eb in ((rel_a, min(first * bs, rel_b)), (max(last * bs, rel_a), rel_b)):
                if ea < eb:  # part of an edge block: held until the block is complete
                    held = self._hold(
                        check, loc, ea, data[loc.start + ea - start : loc.start + eb - start]
                    )
                    if held is not None:
                        ready.append(held)
            cursor = b
        if cursor < end:
            ready.append((cursor, data[cursor - start :]))
        return ready

    def _hold(
        self, check: ChunkCheck, loc: Location, rel: int, part: np.ndarray
    ) -> tuple[int, np.ndarray] | None:
        """Keep ``part`` (bytes from ``rel`` of the chunk, inside one block); once its block is
        complete, check it and return it as ``(file offset, bytes)``."""
        bs = check.sums.block
        k = rel // bs
        width = min(bs, loc.nbytes - k * bs)
        key = (loc.file, loc.start + k * bs)
        buf, got = self.pending.pop(key, (bytearray(width), 0))
        buf[rel - k * bs : rel - k * bs + len(part)] = part.data
        got += len(part)
        if got < width:
            self.pending[key] = (buf, got)
            return None
        block = np.frombuffer(buf, dtype=np.uint8)
        self.verifier.check_span(check, loc, block, k * bs, np.array([k], np.int64))
        return loc.start + k * bs, block
