"""The checkpoint id of the storage writer and reader: a local path."""

from __future__ import annotations

import os


class _Directory:
    """A checkpoint that is a local directory (``checkpoint_id`` is its path)."""

    path: str

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return self.path

    def _set_path(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
