"""The native format: a ``ucp_index.json`` plus safetensors data files with per-entry checksums."""

from __future__ import annotations

import os
import threading

from ..errors import CheckpointFormatError
from ..format import INDEX_FILE, FileHeader, Location, chunk_entry_name, load_index, read_header
from .base import Source, SourceOptions, register

__all__ = ["NativeSource"]


@register
class NativeSource(Source):
    """A universal checkpoint written by :class:`~ucp_dcp.UCPStorageWriter`.

    Explicit index entries carry their location; compact ones name only the
    file, and the byte range comes from that file's header, read once per
    file and only for the files this process actually reads from.
    """

    format = "ucp_dcp"
    checksums = True

    def __init__(self, path: str) -> None:
        index = load_index(path)
        super().__init__(path, index, [os.path.join(path, f.name) for f in index.files])
        self._headers: dict[int, FileHeader] = {}
        self._lock = threading.Lock()

    @classmethod
    def detect(cls, path: str) -> bool:
        """A directory holding ``ucp_index.json``."""
        return os.path.isfile(os.path.join(path, INDEX_FILE))

    @classmethod
    def open(cls, path: str, options: SourceOptions) -> "NativeSource":
        """Read and validate the index (no data file is opened yet)."""
        return cls(path)

    def header(self, file: int) -> FileHeader:
        """Parsed header of data file ``file``; checks its size against the index."""
        h = self._headers.get(file)
        if h is None:
            with self._lock:
                h = self._headers.get(file)
                if h is None:
                    h = read_header(self.paths[file])
                    rec = self.index.files[file]
                    if h.size != rec.size:
                        raise CheckpointFormatError(
                            f"{self.paths[file]}: {h.size} bytes on disk but the index recorded {rec.size}: "
                            "the file was truncated or replaced after the checkpoint was committed"
                        )
                    self._headers[file] = h
        return h

    def locate(self, fqn: str, idx: int) -> Location:
        """From the index (explicit chunk lists) or from the data file's header (compact ones)."""
        rec = self.index.tensors[fqn]
        if not rec.compact:
            return super().locate(fqn, idx)
        box = self.box(fqn, idx)
        file = rec.files[idx]
        h = self.header(file)
        name = chunk_entry_name(fqn, box.offsets)
        try:
            start, nbytes = h.ranges[name]
            meta = h.meta[name]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.paths[file]}: the index says it holds chunk {name!r} of {fqn!r}, but it does not"
            ) from None
        want = box.numel * rec.dtype.itemsize
        if nbytes != want or meta.fqn != fqn:
            raise CheckpointFormatError(
                f"{self.paths[file]}: entry {name!r} has {nbytes} bytes, expected {want} for chunk "
                f"{list(box.sizes)} of {fqn!r}"
            )
        return Location(file, start, nbytes, meta.xxh3)

    def check_files(self) -> list[str]:
        """Every data file's header parses and its size is the one the index recorded."""
        problems = []
        for i, f in enumerate(self.index.files):
            try:
                h = read_header(self.paths[i])
                if h.size != f.size:
                    problems.append(f"{f.name}: {h.size} bytes on disk, the index recorded {f.size}")
            except CheckpointFormatError as e:
                problems.append(str(e))
        return problems
