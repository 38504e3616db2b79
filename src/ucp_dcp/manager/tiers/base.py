"""The seam between the manager and storage: :class:`Tier`, a place holding committed steps.

Every step directory is a :class:`~ucp_dcp.byteio.location.ModelDir` (a
:class:`~ucp_dcp.byteio.location.LocalDir` or a
:class:`~ucp_dcp.byteio.location.StoreDir`): listing, fetching and putting files
are written here once over it, and the public methods that write
(:meth:`Tier.put_file`, :meth:`Tier.put_bytes`, :meth:`Tier.commit`) check
their arguments here, once for every kind of tier. A kind says where its
directories are (``_dir``, ``_step_dir``, ``_staging_step``) and how it
commits (``_commit``).
"""

from __future__ import annotations

import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import partial
from typing import Any

from ...byteio.durable import fsync_path, replace_via_temp
from ...byteio.location import ModelDir
from ...errors import CheckpointFormatError, InvalidArgumentError
from .marker import MARKER_FILE, CommitMarker, check_copy, check_name, check_step

__all__ = ["Tier", "step_dir_name", "check_token"]

TOKEN_PATTERN = r"[A-Za-z0-9_-]{1,64}"
"""A staging token (:func:`check_token`), as it appears in the tiers' directory names."""


def check_token(token: Any) -> str:
    """``token`` itself if it is 1-64 characters of ``[A-Za-z0-9_-]``;
    :class:`~ucp_dcp.errors.InvalidArgumentError` (a ``ValueError``) otherwise."""
    if not isinstance(token, str) or not re.fullmatch(TOKEN_PATTERN, token):
        raise InvalidArgumentError(f"token must be 1-64 characters of [A-Za-z0-9_-], got {token!r}")
    return token


def step_dir_name(step: int) -> str:
    """Directory name of committed ``step`` in a :class:`~ucp_dcp.manager.tiers.LocalTier`:
    ``step-%012d``."""
    return f"step-{check_step(step):012d}"


class Tier(ABC):
    """A place holding committed steps (see :mod:`ucp_dcp.manager.tiers`).

    ``name`` is the user-chosen name used in messages, ``url`` the root path
    or URL, ``local`` is True when step and staging locations are local
    paths that ``dcp.save``/``dcp.load`` can use directly.
    """

    name: str
    url: str
    local: bool

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={self.url!r})"

    def _where(self, step: int | None = None, file: str | None = None) -> str:
        s = f"tier {self.name!r} ({self.url})"
        if step is not None:
            s += f", step {step}"
        if file is not None:
            s += f", file {file!r}"
        return s

    # ------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """Committed steps, ascending: a step directory whose marker parses and names that step.

        Never raises for junk: other names, uncommitted directories and
        unparsable markers are ignored.
        """
        return sorted(self.markers())

    @abstractmethod
    def markers(self) -> dict[int, CommitMarker]:
        """The marker of every committed step (what :meth:`steps` lists), from one listing, each
        read once.

        Never raises for junk, like :meth:`steps`; a marker that turns
        unreadable between the listing and its read is left out.
        """

    @abstractmethod
    def marker(self, step: int) -> CommitMarker:
        """The marker of committed ``step``; :class:`CheckpointFormatError` naming the tier and step
        if missing or corrupt."""

    @abstractmethod
    def step_path(self, step: int) -> str:
        """Location of committed ``step`` (local path or URL)."""

    def files(self, step: int) -> dict[str, int]:
        """Names and sizes of the files present in committed ``step`` (the marker excluded)."""
        return self._step_files(self._step_dir(step))

    def fetch(self, step: int, names: Iterable[str], dest_dir: str) -> None:
        """Copy (download) the named files of committed ``step`` into local directory ``dest_dir``
        (nothing to copy where ``dest_dir`` is the step's own directory).

        Every file is looked for first (:class:`CheckpointFormatError` naming a missing one,
        nothing copied). Each is written under a temporary name, fsync'd and renamed, so a crash
        never leaves a partial file under the final name.
        """
        names = list(names)
        for name in names:
            check_name(name)
        dest_dir = os.fspath(dest_dir)
        d = self._step_dir(step)
        sizes = d.sizes() if names else {}
        for name in names:
            if name not in sizes:
                raise CheckpointFormatError(
                    f"{self._where(step, name)}: missing (expected it at {d.path_of(name)})"
                )
        os.makedirs(dest_dir, exist_ok=True)
        if not names or (d.store is None and os.path.samefile(d.where, dest_dir)):
            return
        for name in names:
            replace_via_temp(
                os.path.join(dest_dir, name), partial(d.download, name, size=sizes[name])
            )
        fsync_path(dest_dir)

    def read_bytes(self, step: int, name: str) -> bytes:
        """The content of file ``name`` of committed ``step`` (generic: fetch into a temp dir)."""
        with tempfile.TemporaryDirectory(prefix="ucp-tier-") as d:
            self.fetch(step, [name], d)
            with open(os.path.join(d, name), "rb") as f:
                return f.read()

    def verify(
        self, step: int, *, held: Callable[[CommitMarker], Collection[str]] | None = None
    ) -> list[str]:
        """Problems of the copy of ``step`` here ([] = intact): :func:`~.marker.check_copy` of the
        step's files against its marker, read in place on a local tier, downloaded into a
        temporary directory otherwise.

        ``held`` gives the files this copy is expected to hold, from the marker (a node's share of
        a node-local tier); None: all of them.
        """
        where = f"step {step} in the {self.name} tier ({self.url})"
        try:
            marker = self.marker(step)
        except CheckpointFormatError as e:
            return [f"{where}: {e}"]
        expected = None if held is None else set(held(marker))
        if self.local:
            return check_copy(marker, self.step_path(step), held=expected, where=where)
        with tempfile.TemporaryDirectory(
            prefix=f"ucp-verify-{step}-", ignore_cleanup_errors=True
        ) as tmp:
            self.fetch(step, marker.names, tmp)
            return check_copy(marker, tmp, held=expected, where=where)

    # ------------------------------------------------------------ writing

    @abstractmethod
    def begin(self, step: int, token: str) -> str:
        """Create a fresh staging location for a save of ``step`` and return it.

        A local path for local tiers, a URL otherwise. ``token`` is a short
        unique id (1-64 of ``[A-Za-z0-9_-]``) chosen by the caller, the same
        on all ranks; call ``begin`` once per location (then barrier), since
        leftover staging content of the same name is removed first.
        """

    @abstractmethod
    def staging_path(self, step: int, token: str) -> str:
        """Where :meth:`begin` puts the staging location (creates nothing; callable on any rank)."""

    def put_file(self, staging: str, local_path: str, name: str) -> None:
        """Copy (upload) local file ``local_path`` into ``staging`` as ``name``, durably."""
        self._check_payload_name(name, "put_file")
        self._dir(self._staging_step(staging)[1]).upload(name, os.fspath(local_path))

    def put_bytes(self, staging: str, name: str, data: bytes) -> None:
        """Write ``data`` into ``staging`` as file ``name``, durably."""
        self._check_payload_name(name, "put_bytes")
        self._dir(self._staging_step(staging)[1]).write_atomic(name, bytes(data))

    def commit(
        self, staging: str, marker: CommitMarker, *, held: Collection[str] | None = None
    ) -> None:
        """Make step ``marker.step`` visible atomically, replacing an earlier commit of the same
        step.

        Every file the marker lists (``held``: those of its files this copy holds, a node's
        share of a node-local tier) must be in ``staging`` with the listed
        size (:class:`CheckpointFormatError` otherwise, and nothing becomes
        visible).
        """
        step, path = self._staging_step(staging)
        if marker.step != step:
            raise InvalidArgumentError(
                f"{self._where(step)}: marker is for step {marker.step} but staging {staging} is "
                f"for step {step}"
            )
        self._commit(step, path, marker, self._check_staged(step, path, marker, held))

    @abstractmethod
    def delete(self, step: int) -> None:
        """Remove ``step`` so that it is never listed half-deleted.

        :class:`CheckpointFormatError` if the tier holds nothing of ``step``.
        """

    @abstractmethod
    def cleanup(self) -> list[str]:
        """Remove leftovers of unfinished saves and deletes (restoring a replaced step where
        needed).

        Returns what was done, one line each. Call only while no save into
        this tier is in progress (at start-up, before the first save): an
        in-progress staging directory looks like a leftover.
        """

    # ------------------------------------------------ for the kinds of tier

    @abstractmethod
    def _staging_step(self, staging: str) -> tuple[int, str]:
        """The step and the normalised location of ``staging``;
        :class:`~ucp_dcp.errors.InvalidArgumentError` (a ``ValueError``) if it is not a staging
        location here."""

    @abstractmethod
    def _dir(self, location: str) -> ModelDir:
        """The directory at ``location`` (a step or staging directory, as :meth:`_staging_step`
        returns it)."""

    @abstractmethod
    def _step_dir(self, step: int) -> ModelDir:
        """The directory of committed ``step``; :class:`CheckpointFormatError` naming the tier and
        step if there is none."""

    @abstractmethod
    def _commit(
        self, step: int, staging: str, marker: CommitMarker, staged: Mapping[str, int]
    ) -> None:
        """:meth:`commit` of ``marker`` (of ``step``) from checked ``staging``, which holds the
        files ``staged`` (name -> size)."""

    @staticmethod
    def _step_files(d: ModelDir) -> dict[str, int]:
        """Names and sizes of the files in step directory ``d``, the marker excluded (one
        listing)."""
        sizes = d.sizes()
        sizes.pop(MARKER_FILE, None)
        return sizes

    def _check_payload_name(self, name: str, method: str) -> None:
        check_name(name)
        if name == MARKER_FILE:
            raise InvalidArgumentError(
                f"{self._where()}: {MARKER_FILE} is written by commit(), not {method}()"
            )

    def _check_staged(
        self, step: int, staging: str, marker: CommitMarker, held: Collection[str] | None
    ) -> dict[str, int]:
        """The files in ``staging`` (name -> size, one listing), once every file ``marker`` lists
        (of ``held``, where given) is there with its recorded size; so is any other file of the
        marker that is there."""
        d = self._dir(staging)
        sizes = self._step_files(d)
        marker.check_sizes(
            sizes,
            None if held is None else frozenset(held),
            where=lambda name: f"{self._where(step, name)}: cannot commit",
            holder=f"staging {d.where}",
        )
        return sizes
