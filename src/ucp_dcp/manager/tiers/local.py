"""A tier in a local or shared POSIX directory: node-local disk, ``/dev/shm``, NFS/Lustre/GPFS.

Saves are staged in a hidden directory and made visible with ``rename``;
every step of :meth:`LocalTier.commit` and :meth:`LocalTier.delete` is crash
safe (see the comments there)::

    root/step-000000000100/            committed step 100
    root/.tmp-step-000000000200-<tok>/ a save of step 200 in progress
    root/.old-step-N-<tok>/            a replaced step N being removed
    root/.del-step-N-<rand>/           a deleted step being removed
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Mapping

from ...byteio.durable import fsync_file, fsync_path, swap_paths
from ...byteio.location import LocalDir
from ...errors import CheckpointFormatError, InvalidArgumentError, StorageError
from .base import TOKEN_PATTERN, Tier, check_token, step_dir_name
from .marker import MARKER_FILE, CommitMarker

__all__ = ["LocalTier"]

_STEP_RE = re.compile(r"step-(\d{12,})\Z")
_HIDDEN_RE = re.compile(rf"\.(tmp|old|del)-step-(\d{{12,}})-{TOKEN_PATTERN}\Z")
"""A staging directory (``tmp``), a replaced step's copy (``old``) or a deleted one (``del``)."""


def _remove_dir(path: str) -> None:
    """Remove a step-like directory: its marker first (fsync'd), then the rest.

    A directory this leaves half removed after a crash has no marker, so it
    can never pass for a committed step (nor be restored by cleanup).
    """
    if os.path.islink(path):
        os.unlink(path)
        return
    marker = os.path.join(path, MARKER_FILE)
    try:
        os.unlink(marker)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        os.unlink(path)
        return
    else:
        fsync_path(path)
    shutil.rmtree(path)


class LocalTier(Tier):
    """A tier in a local or shared POSIX directory (created if missing).

    Committed steps are ``root/step-%012d``; :attr:`local` is True, so
    ``dcp.save`` may write straight into :meth:`begin`'s staging directory
    and ``dcp.load`` read :meth:`step_path`.
    """

    def __init__(self, root: str | os.PathLike[str], *, name: str) -> None:
        """Open (creating if needed) the tier rooted at directory ``root``; ``name`` is used in
        messages."""
        self.name = name
        self.url = os.path.abspath(os.fspath(root))
        self.local = True
        try:
            os.makedirs(self.url, exist_ok=True)
        except OSError as e:
            raise StorageError(
                e.errno,
                f"{self._where()}: cannot create the tier directory {self.url}: {e.strerror}",
            ) from e

    # -- reading

    def _read_marker(self, dirpath: str, step: int) -> CommitMarker:
        path = os.path.join(dirpath, MARKER_FILE)
        where = f"{self._where(step, MARKER_FILE)} ({path})"
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            if not os.path.isdir(dirpath):
                raise CheckpointFormatError(
                    f"{self._where(step)}: no such step (expected a committed step directory "
                    f"{dirpath})"
                ) from None
            raise CheckpointFormatError(
                f"{where}: missing: the step directory exists but was never committed, "
                "so it is not a complete checkpoint"
            ) from None
        except OSError as e:
            raise CheckpointFormatError(f"{where}: cannot read the commit marker: {e}") from None
        return CommitMarker.decode(data, where, step=step)

    def _committed(self, dirpath: str, step: int) -> CommitMarker | None:
        try:
            return self._read_marker(dirpath, step)
        except (CheckpointFormatError, OSError):
            return None

    def _listdir(self) -> list[str]:
        try:
            return sorted(os.listdir(self.url))
        except FileNotFoundError:
            return []
        except OSError as e:  # the root replaced by a file, unreadable, a failing disk
            raise StorageError(
                e.errno, f"{self._where()}: cannot list {self.url}: {e.strerror}"
            ) from e

    def markers(self) -> dict[int, CommitMarker]:
        """The marker of every committed step, from one listing (see :meth:`Tier.markers`)."""
        out = {}
        for n in self._listdir():
            m = _STEP_RE.match(n)
            if m is None or step_dir_name(int(m.group(1))) != n:
                continue
            step = int(m.group(1))
            marker = self._committed(os.path.join(self.url, n), step)
            if marker is not None:
                out[step] = marker
        return out

    def marker(self, step: int) -> CommitMarker:
        """The marker of committed ``step`` (:class:`CheckpointFormatError` if missing or
        corrupt)."""
        return self._read_marker(self.step_path(step), step)

    def step_path(self, step: int) -> str:
        """``root/step-%012d`` (the path; whether it is committed is for :meth:`steps` to say)."""
        return os.path.join(self.url, step_dir_name(step))

    def _dir(self, location: str) -> LocalDir:
        """The directory at path ``location``."""
        return LocalDir(location)

    def _step_dir(self, step: int) -> LocalDir:
        """``step``'s directory, once its marker is read."""
        path = self.step_path(step)
        self._read_marker(path, step)
        return LocalDir(path)

    # -- writing

    def staging_path(self, step: int, token: str) -> str:
        """``root/.tmp-step-%012d-<token>``."""
        return os.path.join(self.url, f".tmp-{step_dir_name(step)}-{check_token(token)}")

    def begin(self, step: int, token: str) -> str:
        """Create an empty staging directory (removing a leftover of the same name) and return its
        path."""
        path = self.staging_path(step, token)
        if os.path.lexists(path):
            _remove_dir(path)
        os.makedirs(path)
        return path

    def _staging_step(self, staging: str) -> tuple[int, str]:
        """The step of ``staging`` and its absolute path; it must be a ``begin()`` directory of this
        tier."""
        staging = os.path.abspath(os.fspath(staging))
        m = _HIDDEN_RE.match(os.path.basename(staging))
        if m is None or m.group(1) != "tmp" or os.path.dirname(staging) != self.url:
            raise InvalidArgumentError(
                f"{self._where()}: {staging} is not a staging directory of this tier "
                f"(expected {self.url}/.tmp-step-NNNNNNNNNNNN-<token>, as returned by begin())"
            )
        if not os.path.isdir(staging):
            raise StorageError(
                errno.ENOENT,
                f"{self._where()}: staging directory {staging} does not exist (call begin() first)",
            )
        return int(m.group(2)), staging

    def _commit(
        self, step: int, staging: str, marker: CommitMarker, staged: Mapping[str, int]
    ) -> None:
        """Make ``staging`` the committed ``step-N`` (see the module docstring for the layout).

        Crash safety: at every point below, each step committed before is
        still listed and loadable, or (only step N itself, in the fallback
        without an atomic swap) restored by :meth:`cleanup`.
        """
        # Every listed file present with its size (checked), and durable: dcp.save
        # may have written them without fsync. Nothing visible has changed yet.
        for name in marker.names:
            if name in staged:
                fsync_file(os.path.join(staging, name))
        # 1. Marker into staging: temp file + fsync + rename, then fsync the
        #    staging dir: the marker's and the data files' directory entries
        #    are durable before the directory can become visible, so a power
        #    loss cannot leave a visible step-N missing files. A crash here
        #    leaves a .tmp- dir, never listed (steps() only reads step-*);
        #    cleanup() removes it. No committed step was touched.
        self._dir(staging).write_atomic(MARKER_FILE, marker.encode())
        final = self.step_path(step)
        if os.path.lexists(final):
            # 2a. Re-save of step N: swap atomically where the OS can. A crash
            #     before the swap: old step-N intact. After it: step-N is the
            #     new committed dir, the old one sits under the .tmp- name and
            #     cleanup() removes it.
            if swap_paths(staging, final):
                fsync_path(self.url)  # the swap is durable before the old copy goes
                _remove_dir(staging)
                return
            # 2b. Fallback: two renames. Crash after the first one: step-N is
            #     missing, .old-step-N-<token> holds the complete old step
            #     (with its marker) and cleanup() renames it back, since
            #     step-N is missing. Other steps are never touched.
            old = self._aside("old", step)
            os.rename(final, old)
            # 3. Crash after this rename but before the root fsync: either
            #    rename may be lost on power failure, leaving one of the
            #    states above or the new step-N; all are handled.
            os.rename(staging, final)
            # 4. fsync root: both renames are durable before the old copy is
            #    removed; without it a power loss could bring back a state
            #    with step-N missing and a half-removed .old dir.
            fsync_path(self.url)
            # 5. Remove the old copy, marker first: a crash mid-way leaves a
            #    .old dir without marker, which cleanup() removes and never
            #    restores; step-N is committed anyway.
            _remove_dir(old)
        else:
            # 2. New step: one rename makes it visible (atomic). A crash
            #    before: .tmp- leftover; after: committed step N.
            os.rename(staging, final)
            # 3. fsync root: the new step survives power loss once commit returns.
            fsync_path(self.url)

    def delete(self, step: int) -> None:
        """Rename ``step-N`` to ``.del-step-N-<random>``, fsync the root, then remove it."""
        final = self.step_path(step)
        if not os.path.lexists(final):
            raise CheckpointFormatError(
                f"{self._where(step)}: cannot delete: no such step (expected {final})"
            )
        self._hide_and_remove(final, step)

    def _aside(self, kind: str, step: int) -> str:
        """A fresh ``root/.<kind>-step-N-<random>`` name to move a copy of ``step`` to."""
        return os.path.join(self.url, f".{kind}-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}")

    def _hide_and_remove(self, path: str, step: int) -> None:
        """Rename ``path`` (a directory of ``step``) to a ``.del-`` name, fsync the root, remove
        it."""
        gone = self._aside("del", step)
        # One rename hides the step at once: never listed half deleted. A
        # crash before: the step is intact; after: a .del- leftover that
        # cleanup() removes. Other steps are not touched.
        os.rename(path, gone)
        fsync_path(self.url)  # the deletion is durable before any byte goes
        _remove_dir(gone)

    def cleanup(self) -> list[str]:
        """Remove ``.tmp-*`` and ``.del-*`` leftovers; restore or remove ``.old-step-N-*``.

        An ``.old-step-N`` copy (the previous version of a step being
        replaced) is renamed back when ``step-N`` is missing or uncommitted
        (a crash between the two renames of a re-save); the newest committed
        copy wins, others are removed.
        """
        done: list[str] = []
        names = self._listdir()
        olds: dict[int, list[tuple[str, CommitMarker | None]]] = {}
        for n in names:
            path = os.path.join(self.url, n)
            m = _HIDDEN_RE.match(n)
            if m is None:
                continue
            if m.group(1) == "old":
                step = int(m.group(2))
                olds.setdefault(step, []).append((path, self._committed(path, step)))
            else:
                # Never listed, never restored: a save that did not commit (or
                # whose swapped-out old copy was not removed), or a delete.
                _remove_dir(path)
                what = "unfinished save" if m.group(1) == "tmp" else "unfinished delete"
                done.append(f"removed {path} ({what})")
        for step, cands in sorted(olds.items()):
            final = self.step_path(step)
            restore = None
            if self._committed(final, step) is None:
                committed = [(mk.created, p) for p, mk in cands if mk is not None]
                if committed:
                    restore = max(committed)[1]
            if restore is not None:
                if os.path.lexists(final):
                    # An uncommitted step-N (not ours: our step-N dirs always
                    # hold a marker): move it aside so the rename can happen.
                    self._hide_and_remove(final, step)
                    done.append(f"removed uncommitted {final} (no valid {MARKER_FILE})")
                os.rename(restore, final)
                fsync_path(self.url)
                done.append(
                    f"restored step {step}: renamed {restore} back to {final} (a re-save of it "
                    "did not finish)"
                )
            for p, _ in cands:
                if p != restore:
                    _remove_dir(p)
                    done.append(f"removed {p} (replaced copy of step {step})")
        return done
