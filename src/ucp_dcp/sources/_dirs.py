"""A checkpoint or model directory, local or in object storage: the few questions finding its files
asks.

The Hugging Face source, DCP's format and DeepSpeed's checkpoints (whose
state is in a tag subfolder: :meth:`ModelDir.child`) read their directories
through this view (:class:`LocalDir` for a local directory, :class:`StoreDir` for an
:class:`~ucp_dcp.byteio.objstore.ObjectStore`, listed once), so one code
path serves both.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from ..byteio.objstore import ObjectAccess, ObjectStore
from ..errors import CheckpointFormatError
from ..format.header import RandomAccess

__all__ = ["ModelDir", "LocalDir", "StoreDir", "plain_file_name"]


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
    def read(self, name: str) -> bytes:
        """The whole of file ``name`` (a small one: an index, DCP's ``.metadata``)."""

    @abstractmethod
    def access(self, name: str) -> RandomAccess | None:
        """``name`` as random access for header parsing; None: open :meth:`path_of` as a local
        file."""

    @abstractmethod
    def child(self, name: str) -> ModelDir:
        """The view of subfolder ``name`` (a plain name, checked by :func:`plain_file_name`)."""

    @abstractmethod
    def is_dir(self) -> bool:
        """Whether the directory exists (in a store: whether any object is under its prefix)."""


class LocalDir(ModelDir):
    """A local directory."""

    def __init__(self, path: str) -> None:
        self.where = path

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

    def read(self, name: str) -> bytes:
        """The file's bytes; an unreadable file is a :class:`CheckpointFormatError` naming it."""
        path = self.path_of(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise CheckpointFormatError(f"{path}: cannot read ({e.strerror or e})") from None

    def access(self, name: str) -> None:
        """None: header parsing opens the file itself."""
        return None

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

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.where = store.url
        self._sizes: dict[str, int] | None = None

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

    def read(self, name: str) -> bytes:
        """The whole object (errors are :class:`~ucp_dcp.errors.StorageError` naming its URL)."""
        return self.store.read(name)

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
                s.url_of(plain_file_name(name, self.where)), s.storage_options, retry=s.retry
            )
        )

    def is_dir(self) -> bool:
        """Whether the listing holds any object (a prefix exists only through its objects)."""
        return bool(self._listing())
