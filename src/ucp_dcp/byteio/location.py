"""Where a checkpoint or a model lives, a local directory or the objects under an fsspec URL, as
one type, :class:`ModelDir` (:class:`LocalDir`, :class:`StoreDir`), which the writer, every source
and the manager's tiers use without asking which (as DCP's ``FsspecWriter`` holds ``fs``).

:func:`open_location` opens a path or URL for reading (every registered format then detects and
opens itself from the view); :func:`location_at` is where a save writes, and :func:`commit_index`
commits it: the index last, whole, and only then the data files of older saves removed, so the
previous checkpoint stays loadable until then (docs/format.md, "Commits").
"""

from __future__ import annotations

import builtins
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import (
    CheckpointFormatError,
    CheckpointWriteError,
    InvalidArgumentTypeError,
    NotACheckpointError,
)
from ..format import INDEX_FILE, Index, PlannedEntry, index_bytes
from ..format.header import RandomAccess
from ..format.names import FILE_SUFFIXES, save_id_of
from ..format.schema import check_relative_name
from .datafile import DataFileWriter, stream_data_file
from .durable import atomic_write, copy_durable, fsync_file, write_remedy
from .objrange import ObjectAccess
from .objstore import ObjectStore, is_url, local_path
from .progress import Progress
from .requests import RequestPolicy

__all__ = [
    "ModelDir",
    "path_arg",
    "LocalDir",
    "StoreDir",
    "open_location",
    "location_at",
    "view_of",
    "DataFileSpec",
    "WrittenFile",
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


class ModelDir(ABC):
    """The files of one checkpoint or model directory, local or in object storage: what finding and
    reading its files needs, and what writing a checkpoint there needs.

    Names are plain file names directly inside the directory.
    """

    where: str
    """The directory as shown in messages (a path or a URL)."""
    named: str | None = None
    """A file in the directory that the location named directly (a single-file format), else
    None."""
    location: str = ""
    """The location as given (the directory, or the file named directly)."""
    store: ObjectStore | None = None
    """The object store the directory is in; None for a local directory."""
    _kept: dict[str, bytes]
    """Bytes of files already read, which :meth:`read` returns once instead of reading again."""

    def keep(self, files: Mapping[str, bytes]) -> None:
        """Hand the view bytes of its files that the caller has already read (name -> bytes):
        :meth:`read` returns them, once, instead of reading the file again, and :meth:`holds`
        knows they exist. The manager hands on the index it has checked against its commit
        marker, so the index a load parses is the one that was checked, read once."""
        self._kept.update(files)

    @abstractmethod
    def path_of(self, name: str) -> str:
        """Path or URL of file ``name``."""

    @abstractmethod
    def list(self) -> list[str]:
        """Names of the files (and, locally, folders) in the directory."""

    @abstractmethod
    def is_file(self, name: str) -> bool:
        """Whether file ``name`` exists."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Size of file ``name`` in bytes; None if there is no such file."""

    @abstractmethod
    def sizes(self) -> dict[str, int]:
        """Name -> size of every file directly in the directory (folders and, locally, links
        left out), from one listing."""

    def holds(self, name: str) -> bool:
        """Whether file ``name`` exists, asked the cheapest way: handed to :meth:`keep`, else
        :meth:`is_file` (locally one ``stat``) unless a view knows better."""
        return name in self._kept or self.is_file(name)

    @abstractmethod
    def read(self, name: str) -> bytes:
        """The whole of file ``name`` (a small one: an index, DCP's ``.metadata``)."""

    @abstractmethod
    def access(self, name: str) -> RandomAccess | None:
        """``name`` as random access for header parsing; None: a local file, which
        :mod:`ucp_dcp.byteio.rangeio` opens."""

    @abstractmethod
    def subfolders(self) -> builtins.list[str]:
        """Names of the subfolders (hidden ones left out), sorted."""

    @abstractmethod
    def child(self, name: str) -> ModelDir:
        """The view of subfolder ``name`` (a plain name, checked by
        :func:`~ucp_dcp.format.schema.check_relative_name`)."""

    @abstractmethod
    def is_dir(self) -> bool:
        """Whether the directory exists (in a store: whether any object is under its prefix)."""

    # ------------------------------------------------------------ writing

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether file ``name`` exists, asked now (never from a listing held)."""

    @abstractmethod
    def make(self) -> None:
        """Create the directory if needed (a store needs nothing)."""

    @abstractmethod
    def write_data_file(
        self,
        name: str,
        entries: builtins.list[PlannedEntry],
        data: Iterable[tuple[Any, bool]],
        spec: DataFileSpec,
    ) -> WrittenFile:
        """Write data file ``name``: entry ``i``'s bytes are the ``i``-th of ``data``, given as
        ``(bytes or uint8 view, stable)`` (``stable``: unchanged until the call returns, so it may
        be written from in place). A failure leaves no file and raises naming it and ``rank``."""

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Write file ``name`` whole: readers see the old one or all of the new one."""

    @abstractmethod
    def remove(self, names: Sequence[str]) -> None:
        """Delete files ``names`` (missing ones are not an error)."""

    @abstractmethod
    def upload(self, name: str, src: str) -> None:
        """Local file ``src`` as file ``name``, durably."""

    @abstractmethod
    def download(self, name: str, dst: str, size: int | None = None) -> None:
        """File ``name`` into local file ``dst`` (created or truncated), fsync'd (``size``: its
        size where the caller knows it, saving a request)."""


class LocalDir(ModelDir):
    """A local directory."""

    def __init__(self, path: str, named: str | None = None) -> None:
        self.where = path
        self.named = named
        self.location = os.path.join(path, named) if named else path
        self._kept: dict[str, bytes] = {}

    def path_of(self, name: str) -> str:
        """``os.path.join`` of the directory and ``name``."""
        return os.path.join(self.where, name)

    def list(self) -> list[str]:
        """``os.listdir``."""
        return os.listdir(self.where)

    def is_file(self, name: str) -> bool:
        """``os.path.isfile``."""
        return os.path.isfile(self.path_of(name))

    def size(self, name: str) -> int | None:
        """``os.stat``'s size (None for a missing file; a :class:`CheckpointFormatError` naming
        a path that cannot be looked at, such as a symlink loop)."""
        try:
            return os.stat(self.path_of(name)).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointFormatError(
                f"{self.path_of(name)}: cannot open ({e.strerror or e})"
            ) from None

    def sizes(self) -> dict[str, int]:
        """One ``os.scandir``: its regular files (not following links)."""
        with os.scandir(self.where) as it:
            return {
                e.name: e.stat(follow_symlinks=False).st_size
                for e in it
                if e.is_file(follow_symlinks=False)
            }

    def read(self, name: str) -> bytes:
        """The file's bytes (those handed to :meth:`keep`, the first time); an unreadable file is
        a :class:`CheckpointFormatError` naming it."""
        kept = self._kept.pop(name, None)
        if kept is not None:
            return kept
        path = self.path_of(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise CheckpointFormatError(f"{path}: cannot read ({e.strerror or e})") from None

    def access(self, name: str) -> None:
        """None: header parsing opens the file itself."""
        return None

    def subfolders(self) -> builtins.list[str]:
        """The subdirectories (symbolic links to directories included)."""
        return sorted(
            n
            for n in os.listdir(self.where)
            if not n.startswith(".") and os.path.isdir(self.path_of(n))
        )

    def child(self, name: str) -> LocalDir:
        """The subdirectory ``name``."""
        return LocalDir(
            os.path.join(self.where, check_relative_name(name, self.where, "folder name"))
        )

    def is_dir(self) -> bool:
        """``os.path.isdir``."""
        return os.path.isdir(self.where)

    def exists(self, name: str) -> bool:
        """``os.path.exists``."""
        return os.path.exists(self.path_of(name))

    def make(self) -> None:
        """``os.makedirs``; a path that is a file, or lies under one, is a
        :class:`CheckpointWriteError` naming it."""
        try:
            os.makedirs(self.where, exist_ok=True)
        except OSError as e:
            raise CheckpointWriteError(
                e.errno,
                f"{self.where}: cannot make the checkpoint directory ({e.strerror or e}): "
                f"{write_remedy(e)}",
            ) from None

    def write_data_file(
        self,
        name: str,
        entries: builtins.list[PlannedEntry],
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
                f"{gone}. The save is not committed and a previous checkpoint is untouched: "
                f"{write_remedy(e)}, and save again",
            ) from e
        return WrittenFile(out.entries, out.starts, out.size)

    def write_atomic(self, name: str, data: bytes) -> None:
        """:func:`~ucp_dcp.byteio.durable.atomic_write`: fsync'd, renamed into place."""
        atomic_write(self.path_of(name), data)

    def remove(self, names: Sequence[str]) -> None:
        """``os.remove`` each."""
        for name in names:
            try:
                os.remove(self.path_of(name))
            except FileNotFoundError:
                pass

    def upload(self, name: str, src: str) -> None:
        """:func:`~ucp_dcp.byteio.durable.copy_durable` of ``src``; only an fsync where ``src`` is
        that file already (written in place)."""
        dst = self.path_of(name)
        if os.path.exists(dst) and os.path.samefile(src, dst):
            fsync_file(dst)
            return
        copy_durable(src, dst)

    def download(self, name: str, dst: str, size: int | None = None) -> None:
        """:func:`~ucp_dcp.byteio.durable.copy_durable` of the file."""
        copy_durable(self.path_of(name), dst)


class StoreDir(ModelDir):
    """The objects directly under an :class:`~ucp_dcp.byteio.objstore.ObjectStore`'s URL (a folder
    of another store's URL is a store of its own, :meth:`ObjectStore.child
    <ucp_dcp.byteio.objstore.ObjectStore.child>`, sharing its requests' bound).

    Listed once (one request) and answered from that listing after, so
    finding the files costs no request per name; a file that disappears
    later fails its read naming it.
    """

    store: ObjectStore

    def __init__(self, store: ObjectStore, named: str | None = None) -> None:
        self.store = store
        self.where = store.url
        self.named = named
        self.location = store.url_of(named or "")
        self._sizes: dict[str, int] | None = None
        # Read by holds() before any listing, or handed over by the caller (keep()): no request.
        self._kept: dict[str, bytes] = {}

    def path_of(self, name: str) -> str:
        """The object's URL."""
        return self.store.url_of(name)

    def _listing(self) -> dict[str, int]:
        if self._sizes is None:
            self._sizes = self.store.list_sizes()
        return self._sizes

    def list(self) -> list[str]:
        """The store's listing (held until this view writes or removes an object)."""
        return list(self._listing())

    def sizes(self) -> dict[str, int]:
        """Name -> size of every object, from the listing (a copy)."""
        return dict(self._listing())

    def is_file(self, name: str) -> bool:
        """Whether the listing holds ``name``."""
        return name in self._listing()

    def size(self, name: str) -> int | None:
        """The size the listing gave (no request)."""
        return self._listing().get(name)

    def holds(self, name: str) -> bool:
        """From the listing if there is one; else one GET, whose bytes :meth:`read` then returns (a
        small file that opening reads anyway: the native index)."""
        if self._sizes is not None:
            return name in self._sizes
        if name not in self._kept:
            raw = self.store.read_if_exists(name)
            if raw is None:
                return False
            self._kept[name] = raw
        return True

    def read(self, name: str) -> bytes:
        """The whole object (errors are :class:`~ucp_dcp.errors.StorageError` naming its URL)."""
        kept = self._kept.pop(name, None)
        return kept if kept is not None else self.store.read(name)

    def access(self, name: str) -> ObjectAccess:
        """Ranged reads of the object (its size from the listing): one request for a header under 64
        KiB."""
        return ObjectAccess(self.store, name, self._listing().get(name))

    def child(self, name: str) -> StoreDir:
        """The objects under prefix ``name/`` (:meth:`ObjectStore.child
        <ucp_dcp.byteio.objstore.ObjectStore.child>`; listed when first asked)."""
        return StoreDir(self.store.child(check_relative_name(name, self.where, "folder name")))

    def is_dir(self) -> bool:
        """Whether the listing holds any object (a prefix exists only through its objects)."""
        return bool(self._listing())

    def subfolders(self) -> builtins.list[str]:
        """None: the listing holds objects only (a checkpoint of subfolders is read locally)."""
        return []

    def exists(self, name: str) -> bool:
        """One request (a HEAD)."""
        return self.store.exists(name)

    def make(self) -> None:
        """Nothing: a prefix exists through its objects."""

    def write_data_file(
        self,
        name: str,
        entries: builtins.list[PlannedEntry],
        data: Iterable[tuple[Any, bool]],
        spec: DataFileSpec,
    ) -> WrittenFile:
        """Stream the file to the store (``sync`` and ``threads`` are for files); a transient
        failure restarts the upload, so every piece of ``data`` is taken first. An upload that
        fails is aborted, never completed: the object appears whole or not at all."""
        pieces = [piece for piece, _ in data]
        self._sizes = None  # the listing held no longer holds

        def fill(out: Any) -> WrittenFile:
            done = stream_data_file(
                out,
                entries,
                pieces,
                path=self.path_of(name),
                rank=spec.rank,
                world_size=spec.world_size,
                save_id=spec.save_id,
                align=spec.align,
                progress=spec.progress,
            )
            return WrittenFile(*done)

        return self.store.write_stream(name, f"uploading rank {spec.rank}'s data file", fill)

    def write_atomic(self, name: str, data: bytes) -> None:
        """One PUT: the object appears whole, replacing the older one, or not at all."""
        self._sizes = None
        self.store.put(name, data)

    def remove(self, names: Sequence[str]) -> None:
        """One request per object."""
        self._sizes = None
        self.store.remove(names)

    def upload(self, name: str, src: str) -> None:
        """Local file ``src`` as object ``name``, streamed (restarted on a transient failure): it
        appears whole or not at all."""
        self._sizes = None
        self.store.upload(name, src)

    def download(self, name: str, dst: str, size: int | None = None) -> None:
        """Object ``name`` into local file ``dst``, fsync'd (``size``: the listing's, saving a
        request)."""
        self.store.download(name, dst, size)
        fsync_file(dst)


def view_of(
    where: str | os.PathLike[str] | ModelDir,
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> ModelDir:
    """``where`` as a directory view for reading: a view as it is; an fsspec URL as a
    :class:`StoreDir` (``storage_options`` go to fsspec); a local path as a :class:`LocalDir`.

    A path that is a file, or a URL whose last part names a ``.safetensors``
    file or index, is the view of its parent with that file
    :attr:`~ModelDir.named`.
    """
    if isinstance(where, ModelDir):
        return where
    if is_url(where):
        url = os.fspath(where)
        parent, _, last = url.rstrip("/").rpartition("/")
        if "://" in parent and last.endswith(FILE_SUFFIXES):
            return StoreDir(ObjectStore(parent, storage_options, requests=requests), last)
        return location_at(url, storage_options, requests)
    path = local_path(where)
    if os.path.isfile(path):
        d = LocalDir(os.path.dirname(path) or ".", os.path.basename(path))
        d.location = path
        return d
    return LocalDir(path)


def open_location(
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> ModelDir:
    """The directory view of ``path`` (:func:`view_of`), a local path or an fsspec URL: a local
    path that does not exist is a :class:`~ucp_dcp.errors.NotACheckpointError`; a URL is not asked
    yet."""
    local = None if is_url(path) else local_path(path)
    if local is not None and not os.path.exists(local):
        raise NotACheckpointError(f"{local}: not a checkpoint (no such directory)", local)
    return view_of(path, storage_options, requests)


def location_at(
    path: str | os.PathLike[str] | ModelDir,
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> ModelDir:
    """Where a save writes checkpoint ``path``: a view as it is; a :class:`StoreDir` for an fsspec
    URL (``storage_options`` go to fsspec, ``requests`` says its deadlines), else a
    :class:`LocalDir` (created by :meth:`ModelDir.make`)."""
    if isinstance(path, ModelDir):
        return path
    if is_url(path):
        return StoreDir(ObjectStore(os.fspath(path), storage_options, requests=requests))
    return LocalDir(local_path(path))


def write_index(where: str | os.PathLike[str] | ModelDir, index: Index) -> None:
    """Write ``ucp_index.json`` of ``index`` (with its digest) whole into ``where`` (a directory,
    a URL or a location): readers see the previous index or the complete new one, never a partial
    file, and a failed write leaves no temp file."""
    location_at(where).write_atomic(INDEX_FILE, index_bytes(index))


def path_arg(path: Any, what: str) -> str:
    """``path`` (a ``str`` or ``os.PathLike`` of one: a local path or a URL) as a string."""
    p = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(p, str):
        raise InvalidArgumentTypeError(
            f"{what} must be a path or URL (str or os.PathLike), got {type(path).__name__}"
        )
    return p


def remove_old_data_files(storage: ModelDir, keep: Iterable[str]) -> None:
    """Remove the native data files (named as :func:`~ucp_dcp.format.data_file_name` names them,
    ``rank00000-<save id>.safetensors``) of ``storage`` not in ``keep``: the files of older saves
    and of saves that never committed; nothing else kept there, not even a user's own
    ``rank_0.safetensors``."""
    kept = set(keep)
    storage.remove([n for n in storage.list() if save_id_of(n) is not None and n not in kept])


def commit_index(where: str | os.PathLike[str] | ModelDir, index: Index) -> None:
    """Commit a checkpoint: write its index (:func:`write_index`), then remove data files of older
    saves (:func:`remove_old_data_files`).

    Until the index is replaced the previous index (if any) and its data files
    stay loadable; after it, only native data files the new index does not
    name are removed, never anything else kept in the directory.
    """
    storage = location_at(where)
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
