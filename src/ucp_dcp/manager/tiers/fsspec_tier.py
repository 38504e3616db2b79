"""A tier at an fsspec URL: ``s3://bucket/prefix``, ``gs://``, ``memory://``...

Object stores have no atomic rename: every save writes its own directory
``root/step-N-<tok>/`` and uploads the marker last; a PUT of one object is
atomic, so the marker's presence is the commit. When two committed
directories hold the same step (a re-save, before the older one is removed)
the newer marker (``created``) wins.

The tier works with directory names (``step-N-<tok>``) on its one
:class:`~ucp_dcp.byteio.objstore.ObjectStore`, each a
:class:`~ucp_dcp.byteio.location.StoreDir`; every request goes through that store, under the
manager's :class:`~ucp_dcp.byteio.requests.RequestPolicy` (see docs/manager.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from ...byteio.location import StoreDir
from ...byteio.objstore import ObjectStore, protocols
from ...byteio.requests import RequestPolicy
from ...errors import CheckpointFormatError, InvalidArgumentError, StorageError
from .base import TOKEN_PATTERN, Tier, check_token, step_dir_name
from .marker import MARKER_FILE, CommitMarker, check_name, check_step

__all__ = ["FsspecTier", "StepCopy"]

_STEP_TOKEN_RE = re.compile(rf"step-(\d{{12,}})-{TOKEN_PATTERN}\Z")


_OBJECT_STORES = {
    "s3",
    "s3a",
    "gs",
    "gcs",
    "az",
    "abfs",
    "abfss",
    "adl",
    "oci",
    "oss",
    "r2",
    "tos",
    "cos",
}


class StepCopy(NamedTuple):
    """One committed copy of a step in an :class:`FsspecTier` (see :meth:`FsspecTier.copy_of`)."""

    marker: CommitMarker
    url: str
    sizes: dict[str, int]
    """Name -> size of each file in the copy, the marker excluded."""


class FsspecTier(Tier):
    """A tier at an fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``memory://...``.

    Staging and committed location of a save are the same directory (see the module docstring).
    ``storage_options`` go to fsspec (credentials, ``endpoint_url``...); ``requests`` is the
    policy every request of the tier runs under.
    """

    def __init__(
        self,
        root: str,
        *,
        name: str,
        storage_options: dict[str, Any] | None = None,
        requests: RequestPolicy | None = None,
    ) -> None:
        """Open the tier at URL ``root``; ``name`` is used in messages."""
        self.name = name
        self.local = False
        self.store = ObjectStore(str(root), storage_options, requests=requests)
        """The tier's objects: its URL, fsspec options and file system, and every request."""
        self.url = self.store.url

    # -- directories, by name

    def _dir(self, name: str) -> StoreDir:
        """Step directory ``name`` as a location on the tier's store."""
        return StoreDir(self.store.child(name))

    def _dirs(self) -> dict[int, list[str]]:
        """Step directory names under the root, by step (uncommitted ones included)."""
        out: dict[int, list[str]] = {}
        for n in self.store.list_folders():
            m = _STEP_TOKEN_RE.match(n)
            if m is not None and n.startswith(step_dir_name(int(m.group(1))) + "-"):
                out.setdefault(int(m.group(1)), []).append(n)
        return out

    def _load_marker(self, dirname: str, step: int) -> CommitMarker | None:
        """The dir's marker; None if it has none; CheckpointFormatError if corrupt or of another
        step."""
        d = self._dir(dirname)
        where = f"{self._where(step, MARKER_FILE)} ({d.path_of(MARKER_FILE)})"
        try:
            if not d.holds(MARKER_FILE):  # one GET, whose bytes read() returns
                return None
        except StorageError as e:
            if isinstance(e.__cause__, (IsADirectoryError, NotADirectoryError)):
                raise CheckpointFormatError(f"{where}: not a file ({e.__cause__})") from None
            raise
        return CommitMarker.decode(d.read(MARKER_FILE), where, step=step)

    def _committed(self, step: int, dirs: list[str]) -> list[tuple[CommitMarker, str]]:
        """Committed dirs of ``step``, newest first; junk ignored."""
        out = []
        for d in dirs:
            try:
                m = self._load_marker(d, step)
            except CheckpointFormatError:
                continue
            if m is not None:
                out.append((m, d))
        out.sort(key=lambda md: (md[0].created, md[1]), reverse=True)
        return out

    def _current(self, step: int) -> tuple[CommitMarker, str]:
        """Marker and dir name of the newest committed copy of ``step``."""
        check_step(step)
        dirs = self._dirs().get(step, [])
        committed = self._committed(step, dirs)
        if committed:
            return committed[0]
        for d in sorted(dirs):
            self._load_marker(d, step)  # raises the corrupt marker's error
        raise CheckpointFormatError(
            f"{self._where(step)}: no such committed step (expected a directory "
            f"{self.store.url_of(step_dir_name(step))}-<token>/ holding {MARKER_FILE}"
            f"{'; found only uncommitted ' + ', '.join(sorted(dirs)) if dirs else ''})"
        )

    # -- reading

    def markers(self) -> dict[int, CommitMarker]:
        """The newest committed marker of every step: one listing, one GET per step directory
        (see :meth:`Tier.markers`)."""
        out = {}
        for step, dirs in self._dirs().items():
            committed = self._committed(step, dirs)
            if committed:
                out[step] = committed[0][0]
        return out

    def copy_of(self, step: int) -> StepCopy:
        """The newest committed copy of ``step`` as one look finds it: marker, URL and file sizes
        (two listings and one GET; :class:`CheckpointFormatError` if there is none).

        Reading the copy's files at its URL (:meth:`read_at`) reads that copy
        even if the step is saved again meanwhile.
        """
        marker, d = self._current(step)
        return StepCopy(marker, self.store.url_of(d), self._step_files(self._dir(d)))

    def read_at(self, copy: StepCopy, name: str) -> bytes:
        """The content of file ``name`` of ``copy`` (one GET)."""
        check_name(name)
        d = self._dir(self.store.name_of(copy.url))
        if not d.holds(name):
            raise CheckpointFormatError(
                f"{self._where(copy.marker.step, name)}: missing (expected an object "
                f"{d.path_of(name)})"
            )
        return d.read(name)

    def marker(self, step: int) -> CommitMarker:
        """The marker of the newest committed copy of ``step``."""
        return self._current(step)[0]

    def step_path(self, step: int) -> str:
        """URL of the newest committed copy of ``step`` (:class:`CheckpointFormatError` if none)."""
        return self.store.url_of(self._current(step)[1])

    def _step_dir(self, step: int) -> StoreDir:
        """The newest committed copy of ``step``."""
        return self._dir(self._current(step)[1])

    # -- writing

    @staticmethod
    def _staging_name(step: int, token: str) -> str:
        return f"{step_dir_name(step)}-{check_token(token)}"

    def staging_path(self, step: int, token: str) -> str:
        """URL ``root/step-%012d-<token>``: staging and, once committed, the step's location."""
        return self.store.url_of(self._staging_name(step, token))

    def begin(self, step: int, token: str) -> str:
        """Remove leftover content under the staging URL and return it."""
        name = self._staging_name(step, token)
        if self.store.exists(name):
            self._rm_dir(name)
        if self._has_dirs():
            # File systems with real directories (sftp, hdfs, smb...) need
            # it; object stores have none (and s3fs/gcsfs makedirs would
            # create a missing bucket).
            path = self.store.path(name)
            self.store.call(
                "creating the directory",
                name,
                lambda: self.store.fs.makedirs(path, exist_ok=True),
            )
        return self.store.url_of(name)

    def _has_dirs(self) -> bool:
        """Whether the store has directories of its own (not an object store's prefixes)."""
        return not _OBJECT_STORES.intersection(protocols(self.store.fs))

    def _staging_step(self, staging: str) -> tuple[int, str]:
        """The step of staging URL ``staging`` and its directory name."""
        path = self.store.fs._strip_protocol(staging).rstrip("/")
        parent, _, base = path.rpartition("/")
        m = _STEP_TOKEN_RE.match(base)
        if m is None or parent != self.store.root:
            raise InvalidArgumentError(
                f"{self._where()}: {staging} is not a staging location of this tier "
                f"(expected {self.url}/step-NNNNNNNNNNNN-<token>, as returned by begin())"
            )
        return int(m.group(1)), base

    def _commit(
        self, step: int, name: str, marker: CommitMarker, staged: Mapping[str, int]
    ) -> None:
        """Upload the marker last (one atomic PUT commits), then remove older copies of the step."""
        d = self._dir(name)
        # The commit point: until this PUT completes the directory is not
        # listed; after it, it is (and, being newest, wins over older copies).
        d.write_atomic(MARKER_FILE, marker.encode())
        # Only now remove earlier commits of the same step (whatever their
        # `created`, so the new one wins even under clock skew). A crash here
        # leaves two committed copies; the newest wins and cleanup() removes
        # the others. Uncommitted dirs are left to cleanup().
        for _, old in self._committed(step, [o for o in self._dirs().get(step, []) if o != name]):
            self._rm_dir(old)

    def _rm_dir(self, name: str) -> None:
        """Remove a step directory: marker first (so it is unlisted at once), then the rest."""
        step_dir = self._dir(name)
        step_dir.remove([MARKER_FILE])
        step_dir.remove(step_dir.list())  # listed after the marker went
        if self._has_dirs():  # the directory itself (and a memory store's pseudo-directory)
            path = self.store.path(name)

            def rm() -> None:
                try:
                    self.store.fs.rm(path, recursive=True)
                except FileNotFoundError:
                    pass

            self.store.call("removing the directory", name, rm)

    def delete(self, step: int) -> None:
        """Remove every copy of ``step``: markers first, then the data."""
        dirs = self._dirs().get(check_step(step), [])
        if not dirs:
            raise CheckpointFormatError(
                f"{self._where(step)}: cannot delete: no such step "
                f"(expected {self.store.url_of(step_dir_name(step))}-<token>/)"
            )
        # All markers first: once the first is gone an older copy could win,
        # so none may remain before data goes. A crash part way leaves
        # unmarked dirs (never listed; cleanup() removes them).
        for d in dirs:
            self._dir(d).remove([MARKER_FILE])
        for d in dirs:
            self._rm_dir(d)

    def cleanup(self) -> list[str]:
        """Remove step dirs without a marker and older copies of re-saved steps.

        Dirs whose marker is corrupt are kept (for inspection) but never
        listed.
        """
        done: list[str] = []
        for step, dirs in sorted(self._dirs().items()):
            committed = self._committed(step, dirs)
            for _, d in committed[1:]:
                self._rm_dir(d)
                done.append(f"removed {self.store.url_of(d)} (older copy of step {step})")
            for d in dirs:
                if any(d == c for _, c in committed):
                    continue
                if not self._dir(d).exists(MARKER_FILE):
                    self._rm_dir(d)
                    done.append(f"removed {self.store.url_of(d)} (unfinished save or delete)")
        return done
