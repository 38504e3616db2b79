"""Durable writes: every byte written, fsync'd, and made visible by one atomic rename.

The data-file writer, the index, the manager's tiers and the Hugging Face
export all write through these helpers, so "written" means the same thing
everywhere: no short write is ignored, a file is fsync'd before it is
renamed into place, and the directory is fsync'd after the rename.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointExistsError, CheckpointWriteError

__all__ = [
    "write_all",
    "start_writeback",
    "write_bytes_durable",
    "fsync_file",
    "copy_durable",
    "replace_via_temp",
    "atomic_write",
    "fsync_path",
    "swap_paths",
    "remove_quietly",
    "building_dir",
    "write_remedy",
]

_COPY_CHUNK = 16 * 1024 * 1024

# Every positional data write goes through this name (looked up at call
# time), so tests can inject failures such as ENOSPC by monkeypatching it.
_pwrite = os.pwrite


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int | None = None) -> None:
    """Write all of ``data`` to ``fd``: at ``offset`` (``pwrite``), or at the file position."""
    view = (
        memoryview(data).cast("B")
        if not isinstance(data, memoryview) or data.format != "B"
        else data
    )
    while view:
        n = _pwrite(fd, view, offset) if offset is not None else os.write(fd, view)
        if n <= 0:  # never for a regular file, but a zero would spin forever
            raise CheckpointWriteError(errno.EIO, f"write made no progress at offset {offset}")
        view = view[n:]
        if offset is not None:
            offset += n


def _libc(name: str, argtypes: list[Any]) -> Any:
    """The C library's function ``name`` returning an int (its calls release the GIL and keep
    ``errno``), or False where it is missing."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return False
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # None: not looked up yet; False: unavailable


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to storage now; best
    effort.

    Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: it waits for nothing
    and guarantees nothing (only ``fsync`` does), but the storage starts on
    bytes as soon as they are in the page cache instead of when the final
    ``fsync`` asks for all of them at once, so writing and the device's work
    overlap. A no-op where the call is missing or refused.
    """
    global _sync_file_range
    if _sync_file_range is None:
        _sync_file_range = _libc(
            "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        )
    if _sync_file_range is not False and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # errors surface at fsync


def write_bytes_durable(path: str, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to a new file ``path`` and fsync it.

    An existing file is refused (``O_EXCL``): it is for temp names that must
    be fresh. The caller renames into place and fsyncs the directory.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """fsync the file at ``path`` (written by someone else, e.g. ``dcp.save``); errors are
    raised."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_durable(src: str, dst: str) -> None:
    """Copy file ``src`` to ``dst`` (created or truncated) and fsync it."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, _COPY_CHUNK)
        fout.flush()
        os.fsync(fout.fileno())


def replace_via_temp(path: str, fill: Callable[[str], None]) -> None:
    """Build ``path`` under a fresh hidden sibling name, then rename it into place.

    ``fill(tmp)`` writes the temp file and leaves it durable (e.g.
    :func:`write_bytes_durable`, :func:`copy_durable`). Readers of ``path``
    never see a partial file; on any failure the temp file is removed. The
    caller fsyncs the directory (once, after many files).
    """
    tmp = os.path.join(
        os.path.dirname(path) or ".", f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp"
    )
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise


def atomic_write(path: str, data: bytes | bytearray | memoryview) -> None:
    """Replace ``path`` with ``data`` atomically: temp file, fsync, rename, fsync the directory.

    Readers see the previous file or the complete new one, never a partial
    file. On any failure the temp file is removed and ``path`` is untouched.
    """
    replace_via_temp(path, lambda tmp: write_bytes_durable(tmp, data))
    fsync_path(os.path.dirname(path) or ".")


def fsync_path(path: str) -> None:
    """fsync a directory (or file) by path, so a rename in it is durable; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None  # None: not looked up yet; False: unavailable


def swap_paths(a: str, b: str) -> bool:
    """Atomically swap paths ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``).

    False when the platform or file system cannot (then nothing happened);
    the caller falls back to two renames.
    """
    global _renameat2
    if _renameat2 is None:
        _renameat2 = _libc(
            "renameat2",
            [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint],
        )
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise CheckpointWriteError(
        err, f"renameat2(RENAME_EXCHANGE) of {a} and {b} failed: {os.strerror(err)}"
    )


def remove_quietly(path: str) -> None:
    """Remove file ``path`` if it exists; best effort (used while another error is reported)."""
    try:
        os.remove(path)
    except OSError:
        pass


@contextlib.contextmanager
def building_dir(dst: str) -> Iterator[str]:
    """A fresh hidden sibling directory of ``dst`` to build it in, for the ``with`` block; moved
    to ``dst`` (absent or empty) in one rename, durably, when the block ends, and removed when
    the block (or the move) fails."""
    parent = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(
        parent, f".{os.path.basename(os.path.abspath(dst))}.tmp-{uuid.uuid4().hex[:8]}"
    )
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(tmp)
    except OSError as e:
        raise CheckpointWriteError(
            e.errno, f"{dst}: cannot make a directory there ({e.strerror or e}): {write_remedy(e)}"
        ) from None
    try:
        yield tmp
        fsync_path(tmp)
        try:
            os.rename(tmp, dst)  # replaces an empty directory atomically on POSIX
        except OSError as e:
            raise CheckpointExistsError(
                f"{dst}: cannot move the finished output into place ({e}); is it still empty?"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(parent)


def write_remedy(e: OSError) -> str:
    """What to do about a failed write, by its errno: the one hint every write error gives."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space (or save elsewhere)"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "the place is not writable: save to one that is"
    if e.errno in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
        return "a file is in the way: remove it or save elsewhere"
    return "fix the cause (or save elsewhere)"
