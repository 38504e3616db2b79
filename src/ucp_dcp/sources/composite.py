"""A directory whose subfolders are checkpoints, read as one (accelerate's layout).

``accelerate``'s FSDP sharded saves put the model and the optimizer in
separate DCP checkpoints next to each other (``pytorch_model_fsdp_0/`` with
keys ``model.*``, ``optimizer_0/`` with keys ``optimizer.*``). Opening the
parent directory gives one source holding every key of every subfolder, so
one ``dcp.load`` fills model and optimizer state. Keys must not repeat
across subfolders.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch

from ..byteio.blocksums import BlockSums
from ..byteio.location import ModelDir
from ..byteio.rangeio import MAX_REQUEST_BYTES, ByteSource, Extents, MappedSpan, ReadStats
from ..byteio.requests import RequestPolicy
from ..byteio.segments import Segment
from ..errors import CheckpointFormatError
from ..format import FileRecord, Index, Location, TensorRecord, split_rank_local_key
from .base import Source, SourceOptions, register, source_types

__all__ = ["CompositeSource"]

_R = TypeVar("_R")  # a record type of Index: TensorRecord, Location, per-rank Locations


def _child_sources(d: ModelDir) -> list[tuple[str, ModelDir, type[Source]]]:
    """``(subfolder, its view, source class)`` of every immediate subfolder some other format
    recognises."""
    if not d.is_dir():
        return []
    found = []
    for name in d.subfolders():
        sub = d.child(name)
        cls = next((c for c in source_types() if c is not CompositeSource and c.detect(sub)), None)
        if cls is not None:
            found.append((name, sub, cls))
    return found


class _JoinedReader(ByteSource):
    """The children's readers as one: file ``f`` of the composite is file ``f - base`` of the
    child whose files start at ``base``. Each child reads its own way (its object store, its
    computed file), and every read is counted in this reader's :attr:`stats`."""

    def __init__(self, readers: list[ByteSource], counts: list[int]) -> None:
        self._readers = readers
        self._bases = list(itertools.accumulate(counts, initial=0))[:-1]
        self.gap_bytes = min(r.gap_bytes for r in readers)
        self.maps_files = any(r.maps_files for r in readers)
        self.stats = ReadStats()
        for r, base in zip(readers, self._bases):
            r.stats.into = (self.stats, base)

    def _part(self, file: int) -> int:
        return bisect.bisect_right(self._bases, file) - 1

    def read(self, segments: Sequence[Segment]) -> None:
        """Each child reads its segments, renumbered to its files; children at once (each read
        blocks until done, and a batch spanning two subfolders should take the longer, not the
        sum)."""
        parts: dict[int, list[Segment]] = {}
        for s in segments:
            i = self._part(s.file)
            parts.setdefault(i, []).append(s._replace(file=s.file - self._bases[i]) if i else s)
        if len(parts) <= 1:
            for i, segs in parts.items():
                self._readers[i].read(segs)
            return
        # A pool per call, not per reader: nothing to leak in a process that drops readers.
        with ThreadPoolExecutor(len(parts), thread_name_prefix="ucp-joined") as pool:
            for f in [pool.submit(self._readers[i].read, segs) for i, segs in parts.items()]:
                f.result()  # the first failure raises, naming its file

    def plan_access(
        self, extents: Extents, mode: str = "auto", shared: Extents | None = None
    ) -> dict[int, str]:
        """Each child's choice for its files, renumbered."""
        chosen: dict[int, str] = {}
        for i, (r, base) in enumerate(zip(self._readers, self._bases)):
            mine = r.plan_access(
                self._own(extents, i), mode, None if shared is None else self._own(shared, i)
            )
            chosen.update({f + base: how for f, how in mine.items()})
        return chosen

    def _own(self, extents: Extents, i: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Child ``i``'s part of ``extents``, renumbered to its files."""
        return {f - self._bases[i]: e for f, e in extents.items() if self._part(f) == i}

    def read_mapped(self, file: int, spans: Sequence[MappedSpan]) -> bool:
        """As the child holding ``file`` maps it."""
        i = self._part(file)
        return self._readers[i].read_mapped(file - self._bases[i], spans)

    def close(self) -> None:
        """Close every child's reader."""
        for r in self._readers:
            r.close()


@register
class CompositeSource(Source):
    """The union of the checkpoints in a directory's subfolders (see the module docstring).

    Records are the children's; file numbers are renumbered into one list
    (child ``k``'s files follow child ``k-1``'s), and every byte location
    comes from the child that holds the key.
    """

    format = "subfolders"
    title = "accelerate"
    looks_for = "subfolders that are checkpoints"
    detect_order = 100

    def __init__(self, path: str, children: dict[str, Source]) -> None:
        files: list[FileRecord] = []
        paths: list[str] = []
        tensors: dict[str, TensorRecord] = {}
        values: dict[str, Location] = {}
        rank_local: dict[str, dict[int, Location]] = {}
        self._owner: dict[str, tuple[Source, int]] = {}
        origin: dict[str, str] = {}

        def claim(
            kind: str,
            name: str,
            child: Source,
            base: int,
            mine: dict[str, _R],
            theirs: dict[str, _R],
        ) -> None:
            for key, rec in theirs.items():
                if key in origin:
                    raise CheckpointFormatError(
                        f"{path}: {kind} {key!r} is in both {origin[key]}/ and {name}/; "
                        "open the subfolder you want instead"
                    )
                origin[key] = name
                self._owner[key] = (child, base)
                mine[key] = rec

        for name, child in children.items():
            base = len(paths)
            files += child.index.files
            paths += child.paths
            claim("tensor", name, child, base, tensors, child.index.tensors)
            claim("value", name, child, base, values, child.index.values)
            claim("rank-local value", name, child, base, rank_local, child.index.rank_local)
        world = max(c.index.world_size for c in children.values())
        super().__init__(path, Index(world, files, tensors, values, rank_local), paths)
        self.children = children
        self.checksums = all(c.checksums for c in children.values())

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """A directory that is no checkpoint itself but has subfolders that are."""
        return bool(_child_sources(d))

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> CompositeSource:
        """Open every subfolder that is a checkpoint."""
        return cls(d.where, {name: c.open(sub, options) for name, sub, c in _child_sources(d)})

    def open_reader(
        self,
        *,
        threads: int,
        gap_bytes: int | None = None,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        requests: RequestPolicy | None = None,
        verify: bool = True,
    ) -> ByteSource:
        """Each child's reader (its own storage, its own computed file), joined."""
        readers = [
            c.open_reader(
                threads=threads,
                gap_bytes=gap_bytes,
                max_request_bytes=max_request_bytes,
                requests=requests,
                verify=verify,
            )
            for c in self.children.values()
        ]
        if len(readers) == 1:  # accelerate's usual case: the numbering is the child's
            return readers[0]
        return _JoinedReader(readers, [len(c.paths) for c in self.children.values()])

    def materialize(self, reader: ByteSource, fqn: str, idx: int) -> torch.Tensor:
        """As the child that holds ``fqn`` builds it, from its own files."""
        child = self._child(fqn)[0]
        if isinstance(reader, _JoinedReader):  # by position: a child of no files shares a base
            reader = reader._readers[list(self.children.values()).index(child)]
        return child.materialize(reader, fqn, idx)

    def _child(self, key: str) -> tuple[Source, int]:
        rl = split_rank_local_key(key)
        try:
            return self._owner[rl[1] if rl else key]
        except KeyError:
            raise CheckpointFormatError(f"{self.path}: no saved tensor or value {key!r}") from None

    @staticmethod
    def _shifted(loc: Location, base: int) -> Location:
        return dataclasses.replace(loc, file=loc.file + base)

    def chunk_index(self, fqn: str, offsets: tuple[int, ...], hint: int | None) -> int:
        """As the child that holds ``fqn`` says."""
        return self._child(fqn)[0].chunk_index(fqn, offsets, hint)

    def locate(self, fqn: str, idx: int) -> Location:
        """The child's location, renumbered."""
        child, base = self._child(fqn)
        return self._shifted(child.locate(fqn, idx), base)

    def block_sums(self, fqn: str, idx: int, location: Location) -> BlockSums | None:
        """The child's block checksums."""
        child, base = self._child(fqn)
        return child.block_sums(fqn, idx, self._shifted(location, -base))

    def prepare(
        self, chunks: Sequence[tuple[str, int]], values: Sequence[str], threads: int = 4
    ) -> None:
        """Each child prepares its own keys."""
        for child in self.children.values():
            child.prepare(
                [c for c in chunks if self._child(c[0])[0] is child],
                [v for v in values if self._child(v)[0] is child],
                threads,
            )

    def chunk_origin(self, fqn: str, idx: int) -> tuple[int, int]:
        """The child's origin, renumbered."""
        child, base = self._child(fqn)
        file, start = child.chunk_origin(fqn, idx)
        return file + base, start

    def value_location(self, key: str) -> Location:
        """The child's location, renumbered."""
        child, base = self._child(key)
        return self._shifted(child.value_location(key), base)

    def decode_value(self, key: str, raw: bytes) -> bytes:
        """As the child that holds ``key`` decodes it."""
        return self._child(key)[0].decode_value(key, raw)

    def checksummed_records(self) -> list[tuple[str, Location]]:
        """Every child's, renumbered."""
        out = []
        base = 0
        for c in self.children.values():
            out += [(what, self._shifted(loc, base)) for what, loc in c.checksummed_records()]
            base += len(c.paths)
        return out

    def check_files(self) -> list[str]:
        """Every child's problems."""
        return [p for c in self.children.values() for p in c.check_files()]

    def close(self) -> None:
        """Close every child."""
        for c in self.children.values():
            c.close()
