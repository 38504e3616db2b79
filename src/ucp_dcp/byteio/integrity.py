"""Content checksums of whole chunks, values and files (block checksums: :mod:`.blocksums`).

* xxh3-64 per chunk and per value, recorded at save (in the data file's header and the index) and
  checked by :class:`ChunkVerifier` (``ReadOptions(verify=True)``),
  :func:`read_checked_many` (values) and
  :meth:`ucp_dcp.Checkpoint.verify` (everything);
* xxh3-128 of whole files (:func:`file_digest`, :func:`bytes_digest`), for manifests that let a
  copy of a checkpoint be checked file by file.

A mismatch raises :class:`ChecksumError`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import xxhash

from ..errors import ChecksumError, InvalidArgumentError, StorageError
from ..format import Location, split_rank_local_key
from .rangeio import ByteSource, tensor_view
from .segments import Segment

__all__ = [
    "HASH_BLOCK",
    "file_digest",
    "bytes_digest",
    "hash_range",
    "read_checked_many",
    "chunk_what",
    "value_what",
    "chunk_mismatch",
    "ChunkVerifier",
]

# Large enough that the per-call overhead of read + hash vanishes, small
# enough to stay in the CPU caches' neighbourhood and to bound memory.
HASH_BLOCK = 16 << 20


def file_digest(path: str | os.PathLike[str], *, block: int = HASH_BLOCK) -> tuple[int, str]:
    """``(size, xxh3-128 hex)`` of the whole file ``path``, read in blocks of ``block`` bytes.

    One buffer serves every block (``readinto``), so hashing a file of any
    size allocates ``block`` bytes once. I/O errors are re-raised naming
    ``path``.
    """
    if block <= 0:
        raise InvalidArgumentError(f"block must be positive, got {block}")
    path = os.fspath(path)
    h = xxhash.xxh3_128()
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            if hasattr(os, "posix_fadvise"):  # read once, front to back: let the kernel read ahead
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            view = memoryview(bytearray(min(block, max(os.fstat(f.fileno()).st_size, 1))))
            while n := f.readinto(view):
                h.update(view[:n])
                size += n
    except OSError as e:
        # open() names the file already; a failing read does not.
        raise StorageError(
            e.errno, f"cannot read {path} to checksum it: {e.strerror or e}", path
        ) from e
    return size, h.hexdigest()


def bytes_digest(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 hex digest of ``data`` (the same digest :func:`file_digest` gives a file holding
    it)."""
    return xxhash.xxh3_128_hexdigest(data)


def hash_range(reader: ByteSource, location: Location, buf: bytearray | memoryview) -> str:
    """xxh3-64 hex digest of the bytes at ``location``, read through ``reader`` in ``len(buf)``
    blocks.

    ``buf`` is scratch memory reused for every block (and every call), so
    the cost is one read and one hash pass, with no allocation.
    """
    h = xxhash.xxh3_64()
    view = memoryview(buf).cast("B")
    if location.nbytes and not len(view):
        raise InvalidArgumentError("hash_range needs a non-empty buffer")
    pos, end = location.start, location.start + location.nbytes
    while pos < end:
        n = min(len(view), end - pos)
        reader.read([Segment(location.file, pos, view[:n])])
        h.update(view[:n])
        pos += n
    return h.hexdigest()


def read_checked_many(
    reader: ByteSource, reads: Sequence[tuple[Location, str, str, int | None]]
) -> list[bytes]:
    """The bytes at each ``(location, path, what, rank)`` (in file ``path``), checked against
    its checksum, with one ``reader.read`` call: neighbouring locations share a request (on
    object storage one round trip for all the values at the end of a data file, instead of one
    each).

    A location with no checksum (an imported DCP checkpoint) is not checked.
    ``what`` names the entry and ``rank`` the file's writing rank in the
    :class:`ChecksumError` raised on a mismatch.
    """
    bufs = [bytearray(loc.nbytes) for loc, _, _, _ in reads]
    reader.read([Segment(r[0].file, r[0].start, memoryview(b)) for r, b in zip(reads, bufs)])
    for (location, path, what, rank), buf in zip(reads, bufs):
        if location.xxh3:
            digest = xxhash.xxh3_64_hexdigest(buf)
            if digest != location.xxh3:
                raise ChecksumError(path, what, location.xxh3, digest, rank)
    return [bytes(b) for b in bufs]


def chunk_what(fqn: str, offsets: Sequence[int]) -> str:
    """How errors name a chunk: ``"tensor 'layer.w' chunk at [0, 4]"``."""
    return f"tensor {fqn!r} chunk at {list(offsets)}"


def value_what(key: str) -> str:
    """How errors name the value saved under storage key ``key``: ``"value 'step'"``, or
    ``"rank-local value 'rng' of rank 3"`` for a :func:`~ucp_dcp.format.rank_local_key`."""
    rl = split_rank_local_key(key)
    return f"rank-local value {rl[1]!r} of rank {rl[0]}" if rl else f"value {key!r}"


class ChunkVerifier:
    """Checks the chunks a batch of reads touched against their recorded xxh3-64, each once.

    Register every chunk a read touches with :meth:`add` before the reads
    run, then call :meth:`check` once they completed (any number of rounds).
    A chunk registered several times is hashed once, in the cheapest way
    offered:

    * ``whole`` given: a contiguous CPU tensor that holds exactly the
      chunk's bytes once the read is done. Its memory is hashed; nothing is
      read again.
    * otherwise (a partial read, a cast, a device or strided destination):
      the chunk's bytes are read again from the file, in blocks of at most
      ``block`` bytes through one reused buffer, and hashed. Right after the
      load's own read of the chunk those pages are usually in the page cache.

    Locations without a checksum (imported DCP checkpoints) are skipped.
    ``bytes`` counts the bytes hashed, ``seconds`` the time spent reading
    again and hashing. :meth:`check` raises :class:`ChecksumError` on the
    first mismatch.

    Args:
        reader: the reader that serves the load (its files, its statistics).
        paths: path of each file number, for errors.
        ranks: writing rank of each file number (None where unknown), for errors.
        block: largest block read again at once.
    """

    def __init__(
        self,
        reader: ByteSource,
        paths: Sequence[str],
        ranks: Sequence[int | None],
        *,
        block: int = HASH_BLOCK,
    ) -> None:
        self.reader = reader
        self.paths = paths
        self.ranks = ranks
        self.block = max(block, 1)
        self.bytes = 0
        self.seconds = 0.0
        self._done: set[tuple[int, int]] = set()
        self._whole: dict[tuple[int, int], tuple[Location, str, Sequence[int], torch.Tensor]] = {}
        self._reread: dict[tuple[int, int], tuple[Location, str, Sequence[int]]] = {}
        self._buf: bytearray | None = None

    def add(
        self,
        location: Location,
        fqn: str,
        offsets: Sequence[int],
        whole: torch.Tensor | None = None,
    ) -> None:
        """Register chunk ``fqn`` at ``offsets`` stored at ``location``; see the class for
        ``whole``."""
        if not location.xxh3:
            return
        key = (location.file, location.start)
        if key in self._done or key in self._whole:
            return
        if whole is not None:
            self._reread.pop(key, None)  # the destination will do: no second read
            self._whole[key] = (location, fqn, offsets, whole)
        elif key not in self._reread:
            self._reread[key] = (location, fqn, offsets)

    def check(self) -> None:
        """Hash every chunk registered since the last call; the reads of them must have
        completed."""
        if not (self._whole or self._reread):
            return
        t0 = time.perf_counter()
        try:
            while self._whole:
                key, (location, fqn, offsets, t) = self._whole.popitem()
                self._done.add(key)
                self._compare(location, fqn, offsets, xxhash.xxh3_64_hexdigest(tensor_view(t)))
            while self._reread:
                key, (location, fqn, offsets) = self._reread.popitem()
                self._done.add(key)
                if self._buf is None or (
                    len(self._buf) < location.nbytes and len(self._buf) < self.block
                ):
                    self._buf = bytearray(min(self.block, max(location.nbytes, 1)))
                self._compare(location, fqn, offsets, hash_range(self.reader, location, self._buf))
        finally:
            self.seconds += time.perf_counter() - t0

    def _compare(self, location: Location, fqn: str, offsets: Sequence[int], digest: str) -> None:
        self.bytes += location.nbytes
        if digest != location.xxh3:
            raise chunk_mismatch(self.paths, self.ranks, location, fqn, offsets, digest)


def chunk_mismatch(
    paths: Sequence[str],
    ranks: Sequence[int | None],
    location: Location,
    fqn: str,
    offsets: Sequence[int],
    digest: str,
) -> ChecksumError:
    """The error of a whole chunk whose bytes hash to ``digest``, not its recorded xxh3-64: the
    file, the chunk and the rank that wrote it named."""
    return ChecksumError(
        paths[location.file], chunk_what(fqn, offsets), location.xxh3, digest, ranks[location.file]
    )
