"""Storage tiers: places that hold committed checkpoint steps.

A *tier* holds the steps of a run, each a directory with a universal
checkpoint (``ucp_index.json`` plus data files) and a commit marker
``COMMIT.json`` written last. A step is *committed* when its marker parses
and names the step; nothing else is ever listed.

Modules:

* :mod:`.marker`: :class:`CommitMarker`, :class:`FileDigest`, the commit record;
* :mod:`.base`: :class:`Tier`, the interface; argument checks shared by every kind;
* :mod:`.local`: :class:`LocalTier`, a POSIX directory, commit by ``rename``;
* :mod:`.fsspec_tier`: :class:`FsspecTier`, an fsspec URL, commit by the marker's PUT (every
  request through an :class:`~ucp_dcp.byteio.objstore.ObjectStore`, under a
  :class:`~ucp_dcp.byteio.requests.RequestPolicy`).

:func:`open_tier` picks the kind from the root.

``cleanup()`` removes the leftovers of saves and deletes that did not finish:
call it when no save into the tier is in progress (at start-up, before the
first save), since an in-progress staging directory looks like a leftover.
"""

from __future__ import annotations

import os
from typing import Any

from ...byteio.requests import RequestPolicy
from .base import Tier, step_dir_name
from .fsspec_tier import FsspecTier
from .local import LocalTier
from .marker import MARKER_FILE, MARKER_FORMAT, MARKER_VERSION, CommitMarker, FileDigest

__all__ = [
    "MARKER_FILE",
    "MARKER_FORMAT",
    "MARKER_VERSION",
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
    if not isinstance(root, str):
        return LocalTier(os.fspath(root), name=name)
    if root.startswith("file://"):
        return LocalTier(root[len("file://") :] or "/", name=name)
    if root.startswith("local://"):
        return LocalTier(root[len("local://") :] or "/", name=name)
    if "://" in root or "::" in root:
        return FsspecTier(root, name=name, storage_options=storage_options, requests=requests)
    return LocalTier(root, name=name)
