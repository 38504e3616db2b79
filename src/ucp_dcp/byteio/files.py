"""Local data files opened for reading: the descriptor, random access and the header.

:mod:`ucp_dcp.format` parses headers from bytes (a :class:`~ucp_dcp.format.header.RandomAccess`);
this module opens the local file they come from.
"""

from __future__ import annotations

import os

from ..errors import CheckpointFormatError
from ..format.header import FileHeader, RandomAccess, SafetensorsHeader, parse_header
from ..format.header import parse_safetensors as _parse_safetensors

__all__ = ["open_data_file", "FileAccess", "read_header", "read_safetensors"]


def open_data_file(path: str, *, random: bool = True) -> int:
    """Open data file ``path`` for random reads (no read-ahead), or with ``random=False`` for a
    stream (the kernel's default read-ahead); a missing or unreadable file is a
    :class:`CheckpointFormatError` naming it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointFormatError(f"data file {path} is missing") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot open ({e.strerror or e})") from None
    if random and hasattr(os, "posix_fadvise"):
        # Without this the header read leaves read-ahead marks in the page
        # cache, and a later exact read of a marked page makes the kernel
        # stream in the rest of the file: other ranks' bytes.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


class FileAccess:
    """:class:`~ucp_dcp.format.header.RandomAccess` over a local file, opened by
    :func:`open_data_file` and closed by :meth:`close` (or the ``with`` block)."""

    def __init__(self, path: str) -> None:
        self.fd = open_data_file(path)
        self.size = os.fstat(self.fd).st_size

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes at ``offset``."""
        return os.pread(self.fd, n, offset)

    def close(self) -> None:
        """Close the descriptor."""
        os.close(self.fd)

    def __enter__(self) -> FileAccess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_safetensors(path: str, access: RandomAccess | None = None) -> SafetensorsHeader:
    """The checked header of safetensors file ``path``: read through ``access``, or from the local
    file (:func:`~ucp_dcp.format.header.parse_safetensors`)."""
    if access is not None:
        return _parse_safetensors(path, access)
    with FileAccess(path) as f:
        return _parse_safetensors(path, f)


def read_header(path: str, *, access: RandomAccess | None = None) -> FileHeader:
    """The checked header of native data file ``path``: read through ``access``, or from the local
    file (:func:`~ucp_dcp.format.header.parse_header`)."""
    if access is not None:
        return parse_header(path, access)
    with FileAccess(path) as f:
        return parse_header(path, f)
