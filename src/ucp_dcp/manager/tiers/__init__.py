"""Storage tiers: places that hold committed checkpoint steps.

A tier holds the steps of a run, each a directory with a universal checkpoint (``ucp_index.json``
plus data files) and its commit marker (:mod:`.marker`). :class:`Tier` (:mod:`.base`) is the
interface; :class:`LocalTier` (a POSIX directory) and :class:`FsspecTier` (an fsspec URL) are the
kinds, and :func:`open_tier` picks one from the root.
"""

from __future__ import annotations

import os
from typing import Any

from ...byteio.objstore import is_url, local_path
from ...byteio.requests import RequestPolicy
from .base import Tier, step_dir_name
from .fsspec_tier import FsspecTier
from .local import LocalTier
from .marker import MARKER_FILE, CommitMarker, FileDigest

__all__ = [
    "MARKER_FILE",
    "FileDigest",
    "CommitMarker",
    "step_dir_name",
    "Tier",
    "LocalTier",
    "FsspecTier",
    "open_tier",
]


def open_tier(
    root: str | os.PathLike[str],
    *,
    name: str,
    storage_options: dict[str, Any] | None = None,
    requests: RequestPolicy | None = None,
) -> Tier:
    """A :class:`LocalTier` for plain paths and ``file://`` URLs, an :class:`FsspecTier` for other
    URLs.

    ``storage_options`` go to fsspec and ``requests`` is the policy of the requests; both are
    ignored for local tiers.
    """
    path = local_path(root)
    if path == root and (is_url(root) or "::" in root):  # a URL given as a string
        return FsspecTier(root, name=name, storage_options=storage_options, requests=requests)
    if not path and os.fspath(root):  # "file://" alone: the file system's root
        path = "/"
    return LocalTier(path, name=name)
