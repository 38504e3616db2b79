"""Where a checkpoint is written: one storage object, a local directory or an object store.

``UCPStorageWriter`` holds one :class:`CheckpointStorage` (as DCP's
``FsspecWriter`` holds ``fs``) and never asks which kind it is:

* :class:`LocalStorage`: a directory; each data file written by
  :class:`~ucp_dcp.byteio.datafile.DataFileWriter` (``pwrite`` threads,
  fsync), the index by an atomic rename (:func:`~ucp_dcp.byteio.durable.atomic_write`);
* :class:`ObjectStorage`: an :class:`~ucp_dcp.byteio.objstore.ObjectStore`;
  each data file streamed (a multipart upload on S3, restarted on a
  transient failure), the index in one PUT, which is atomic.

Either way a checkpoint is committed by :func:`commit_index`: the index is
written last, whole, and only then are the data files of older saves removed
(:func:`remove_old_data_files`, the one cleanup), so until the index is
replaced the previous checkpoint stays loadable.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..errors import CheckpointWriteError
from ..format import INDEX_FILE, Index, PlannedEntry, index_bytes
from .datafile import DataFileWriter, stream_data_file
from .durable import atomic_write
from .objstore import ObjectStore, RequestPolicy, discard, is_url, local_path
from .progress import Progress

__all__ = [
    "CheckpointStorage",
    "DataFileSpec",
    "LocalStorage",
    "ObjectStorage",
    "WrittenFile",
    "storage_at",
    "write_index",
    "commit_index",
    "remove_old_data_files",
    "write_error",
]


class WrittenFile(NamedTuple):
    """A data file as written: its entries (with checksums), their absolute offsets, its size."""

    entries: list[PlannedEntry]
    starts: list[int]
    size: int


@dataclass(frozen=True)
class DataFileSpec:
    """Who writes a data file, for which save, and how (``sync`` and ``threads`` matter to local
    files only; ``progress``, if given, is fed the bytes of each piece written)."""

    rank: int
    world_size: int
    save_id: str
    align: int
    sync: bool = True
    threads: int = 1
    progress: Progress | None = None


class _Counted:
    """A streamed write that feeds ``progress`` the bytes of every write."""

    def __init__(self, out: Any, progress: Progress) -> None:
        self.out = out
        self.progress = progress

    def write(self, data: Any) -> int:
        """Append ``data`` to the stream, then count it."""
        n: int = self.out.write(data)
        self.progress.add(memoryview(data).nbytes)
        return n


class CheckpointStorage(Protocol):
    """The few things writing a checkpoint asks of where it goes."""

    where: str
    """The directory or URL, as messages show it."""

    def path_of(self, name: str) -> str:
        """The path or URL of file ``name``."""
        ...

    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists."""
        ...

    def make(self) -> None:
        """Create the directory if needed (a store needs nothing)."""
        ...

    def write_data_file(
        self,
        name: str,
        entries: list[PlannedEntry],
        data: Iterable[tuple[Any, bool]],
        spec: DataFileSpec,
    ) -> WrittenFile:
        """Write data file ``name``: entry ``i``'s bytes are the ``i``-th of ``data``, given as
        ``(bytes or uint8 view, stable)`` (``stable``: unchanged until the call returns, so it may
        be written from in place). A failure leaves no file and raises naming it and ``rank``."""
        ...

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write file ``name`` whole: readers see the old one or all of the new one."""
        ...

    def list(self) -> list[str]:
        """Names of the files in the directory."""
        ...

    def remove(self, names: Sequence[str]) -> None:
        """Delete files ``names`` (missing ones are not an error)."""
        ...


class LocalStorage:
    """A checkpoint directory on a local (or mounted) file system."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.where = local_path(path)

    def path_of(self, name: str) -> str:
        """``os.path.join`` of the directory and ``name``."""
        return os.path.join(self.where, name)

    def exists(self, name: str) -> bool:
        """``os.path.exists``."""
        return os.path.exists(self.path_of(name))

    def make(self) -> None:
        """``os.makedirs``."""
        os.makedirs(self.where, exist_ok=True)

    def write_data_file(
        self,
        name: str,
        entries: list[PlannedEntry],
        data: Iterable[tuple[Any, bool]],
        spec: DataFileSpec,
    ) -> WrittenFile:
        """One :class:`~ucp_dcp.byteio.datafile.DataFileWriter`; ``data`` is consumed as it
        writes. An ``OSError`` becomes :class:`~ucp_dcp.errors.CheckpointWriteError` (same errno)
        naming the file and the rank."""
        path = self.path_of(name)
        out = DataFileWriter(
            path,
            entries,
            rank=spec.rank,
            world_size=spec.world_size,
            save_id=spec.save_id,
            align=spec.align,
            sync=spec.sync,
            threads=spec.threads,
        )
        try:
            with out:
                for i, (piece, stable) in enumerate(data):
                    out.write(i, piece, stable=stable)
                    if spec.progress is not None:  # written, or queued behind a few pieces
                        spec.progress.add(memoryview(piece).nbytes)
        except OSError as e:
            gone = "; its partial file was removed" if out.created else ""
            raise write_error(
                e,
                f"rank {spec.rank} could not write checkpoint data file {path}: {e.strerror or e}"
                f"{gone}. The save is not committed and a previous checkpoint is untouched: free "
                "space (or save elsewhere) and save again",
            ) from e
        return WrittenFile(out.entries, out.starts, out.size)

    def write_atomic(self, name: str, data: bytes) -> None:
        """:func:`~ucp_dcp.byteio.durable.atomic_write`: fsync'd, renamed into place."""
        atomic_write(self.path_of(name), data)

    def list(self) -> list[str]:
        """``os.listdir``."""
        return os.listdir(self.where)

    def remove(self, names: Sequence[str]) -> None:
        """``os.remove`` each."""
        for name in names:
            try:
                os.remove(self.path_of(name))
            except FileNotFoundError:
                pass


class ObjectStorage:
    """A checkpoint at an fsspec URL, written through an
    :class:`~ucp_dcp.byteio.objstore.ObjectStore` (its retries and errors)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.where = store.url

    def path_of(self, name: str) -> str:
        """The object's URL."""
        return self.store.url_of(name)

    def exists(self, name: str) -> bool:
        """One request."""
        return self.store.exists(name)

    def make(self) -> None:
        """Nothing: a prefix exists through its objects."""

    def write_data_file(
        self,
        name: str,
        entries: list[PlannedEntry],
        data: Iterable[tuple[Any, bool]],
        spec: DataFileSpec,
    ) -> WrittenFile:
        """Stream the file to the store (``sync`` and ``threads`` are for files); a transient
        failure restarts the upload, so every piece of ``data`` is taken first. An upload that
        fails is aborted, never completed: the object appears whole or not at all."""
        pieces = [piece for piece, _ in data]

        def upload() -> WrittenFile:
            out = self.store.open_write(name)
            try:
                done = stream_data_file(
                    out if spec.progress is None else _Counted(out, spec.progress),
                    entries,
                    pieces,
                    path=self.store.url_of(name),
                    rank=spec.rank,
                    world_size=spec.world_size,
                    save_id=spec.save_id,
                    align=spec.align,
                )
                out.close()  # completes the upload: the object appears whole
                return WrittenFile(*done)
            except BaseException:
                discard(out)  # an upload that failed is aborted, never completed
                raise

        return self.store.call(f"uploading rank {spec.rank}'s data file", name, upload)

    def write_atomic(self, name: str, data: bytes) -> None:
        """One PUT: the object appears whole, replacing the older one, or not at all."""
        self.store.put(name, data)

    def list(self) -> list[str]:
        """One listing."""
        return self.store.list()

    def remove(self, names: Sequence[str]) -> None:
        """One request per object."""
        self.store.remove(names)


def storage_at(
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> CheckpointStorage:
    """The storage of checkpoint ``path``: an :class:`ObjectStorage` for an fsspec URL
    (``storage_options`` go to fsspec, ``requests`` says its deadlines), else a
    :class:`LocalStorage`."""
    if is_url(path):
        return ObjectStorage(ObjectStore(os.fspath(path), storage_options, requests=requests))
    return LocalStorage(path)


def _storage(where: str | os.PathLike[str] | CheckpointStorage) -> CheckpointStorage:
    return storage_at(where) if isinstance(where, (str, os.PathLike)) else where


def write_index(where: str | os.PathLike[str] | CheckpointStorage, index: Index) -> None:
    """Write ``ucp_index.json`` of ``index`` (with its digest) whole into ``where`` (a directory,
    a URL or a storage): readers see the previous index or the complete new one, never a partial
    file, and a failed write leaves no temp file."""
    _storage(where).write_atomic(INDEX_FILE, index_bytes(index))


def remove_old_data_files(storage: CheckpointStorage, keep: Iterable[str]) -> None:
    """Remove the native data files (``rank*.safetensors``) of ``storage`` not in ``keep``: the
    files of older saves and of saves that never committed; nothing else kept there."""
    kept = set(keep)
    storage.remove(
        [
            n
            for n in storage.list()
            if n.startswith("rank") and n.endswith(".safetensors") and n not in kept
        ]
    )


def commit_index(where: str | os.PathLike[str] | CheckpointStorage, index: Index) -> None:
    """Commit a checkpoint: write its index (:func:`write_index`), then remove data files of older
    saves (:func:`remove_old_data_files`).

    Until the index is replaced the previous index (if any) and its data files
    stay loadable; after it, only native data files the new index does not
    name are removed, never anything else kept in the directory.
    """
    storage = _storage(where)
    write_index(storage, index)
    remove_old_data_files(storage, (f.name for f in index.files))


def write_error(e: OSError, message: str) -> CheckpointWriteError:
    """``e`` restated as :class:`~ucp_dcp.errors.CheckpointWriteError` with ``message``, keeping
    its errno (so callers can still test for ``ENOSPC``)."""
    return (
        CheckpointWriteError(e.errno, message)
        if e.errno is not None
        else CheckpointWriteError(message)
    )
