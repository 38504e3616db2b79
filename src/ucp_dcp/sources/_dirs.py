"""A checkpoint or model directory, local or in object storage: the few questions finding its files
asks.

:func:`~ucp_dcp.sources.open_source` opens every location as one of these
views (:func:`open_location`: :class:`LocalDir` for a local directory,
:class:`StoreDir` for an :class:`~ucp_dcp.byteio.objstore.ObjectStore`,
listed once) and every registered format detects and opens itself from it
(DeepSpeed's state is in a tag subfolder: :meth:`ModelDir.child`), so one
code path serves both.
"""

from __future__ import annotations

import builtins
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from ..byteio.objstore import ObjectAccess, ObjectStore, RequestPolicy, is_url, local_path
from ..errors import CheckpointFormatError, NotACheckpointError
from ..format.header import RandomAccess

__all__ = ["ModelDir", "LocalDir", "StoreDir", "plain_file_name", "open_location", "view_of"]


def plain_file_name(name: Any, where: str) -> str:
    """``name`` if it names a file directly inside a directory (no path, no ``..``); else an error
    naming ``where``."""
    if (
        not isinstance(name, str)
        or not name
        or os.path.isabs(name)
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or "\0" in name
    ):
        raise CheckpointFormatError(
            f"{where}: file name {name!r} is not a plain file name inside the directory"
        )
    return name


class ModelDir(ABC):
    """The files of one checkpoint or model directory, local or in object storage: what finding its
    files needs.

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

    def holds(self, name: str) -> bool:
        """Whether file ``name`` exists, asked the cheapest way (:meth:`is_file` unless a view
        knows better)."""
        return self.is_file(name)

    @abstractmethod
    def read(self, name: str) -> bytes:
        """The whole of file ``name`` (a small one: an index, DCP's ``.metadata``)."""

    @abstractmethod
    def access(self, name: str) -> RandomAccess | None:
        """``name`` as random access for header parsing; None: a local file, which
        :mod:`ucp_dcp.byteio.files` opens."""

    @abstractmethod
    def subfolders(self) -> builtins.list[str]:
        """Names of the subfolders (hidden ones left out), sorted."""

    @abstractmethod
    def child(self, name: str) -> ModelDir:
        """The view of subfolder ``name`` (a plain name, checked by :func:`plain_file_name`)."""

    @abstractmethod
    def is_dir(self) -> bool:
        """Whether the directory exists (in a store: whether any object is under its prefix)."""


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
        """``os.stat``'s size (None for a missing file)."""
        try:
            return os.stat(self.path_of(name)).st_size
        except FileNotFoundError:
            return None

    def holds(self, name: str) -> bool:
        """Whether :meth:`keep` was handed ``name`` or it is a file (one ``stat``)."""
        return name in self._kept or self.is_file(name)

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
        return LocalDir(os.path.join(self.where, plain_file_name(name, self.where)))

    def is_dir(self) -> bool:
        """``os.path.isdir``."""
        return os.path.isdir(self.where)


class StoreDir(ModelDir):
    """The objects directly under an :class:`~ucp_dcp.byteio.objstore.ObjectStore`'s URL.

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
        """The store's listing (cached)."""
        return list(self._listing())

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
        """The objects under prefix ``name/`` (its own store, same options; listed when first
        asked)."""
        s = self.store
        return StoreDir(
            ObjectStore(
                s.url_of(plain_file_name(name, self.where)),
                s.storage_options,
                requests=s.requests,
            )
        )

    def is_dir(self) -> bool:
        """Whether the listing holds any object (a prefix exists only through its objects)."""
        return bool(self._listing())

    def subfolders(self) -> builtins.list[str]:
        """None: the listing holds objects only (a checkpoint of subfolders is read locally)."""
        return []


def view_of(where: str | os.PathLike[str] | ModelDir) -> ModelDir:
    """``where`` as a directory view: a view as it is; a local path as a :class:`LocalDir` (of the
    file's directory, with the file :attr:`~ModelDir.named`, for a path that is a file)."""
    if isinstance(where, ModelDir):
        return where
    path = local_path(where)
    if os.path.isfile(path):
        d = LocalDir(os.path.dirname(path) or ".", os.path.basename(path))
        d.location = path
        return d
    return LocalDir(path)


_FILE_SUFFIXES = (".safetensors", ".safetensors.index.json")


def open_location(
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> ModelDir:
    """The directory view of ``path``: a local path, or an fsspec URL (``storage_options`` go to
    fsspec).

    A URL whose last part names a ``.safetensors`` file or index is the view
    of its parent with that file :attr:`~ModelDir.named` (as a local path may
    name a file). A local path that does not exist is a
    :class:`~ucp_dcp.errors.NotACheckpointError`; a URL is not asked yet.
    """
    if is_url(path):
        url = os.fspath(path)
        parent, _, last = url.rstrip("/").rpartition("/")
        if "://" in parent and last.endswith(_FILE_SUFFIXES):
            return StoreDir(ObjectStore(parent, storage_options, requests=requests), last)
        return StoreDir(ObjectStore(url, storage_options, requests=requests))
    local = local_path(path)
    if not os.path.exists(local):
        raise NotACheckpointError(f"{local}: not a checkpoint (no such directory)", local)
    return view_of(local)
