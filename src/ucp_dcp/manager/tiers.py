"""Storage tiers: places that hold committed checkpoint steps.

A *tier* holds the steps of a run, each a directory with a universal
checkpoint (``ucp_index.json`` plus data files) and a commit marker
``COMMIT.json`` written last. A step is *committed* when its marker parses
and names the step; nothing else is ever listed. Two kinds:

:class:`LocalTier`
    A local (or shared, POSIX) file system directory: node-local disk,
    ``/dev/shm``, NFS/Lustre/GPFS. Saves are staged in a hidden directory and
    made visible with ``rename``; every step of :meth:`LocalTier.commit` and
    :meth:`LocalTier.delete` is crash safe (see the comments there)::

        root/step-000000000100/            committed step 100
        root/.tmp-step-000000000200-<tok>/ a save of step 200 in progress
        root/.old-step-N-<tok>/            a replaced step N being removed
        root/.del-step-N-<rand>/           a deleted step being removed

:class:`FsspecTier`
    An fsspec URL (``s3://bucket/prefix``, ``gs://``, ``memory://``...).
    Object stores have no atomic rename: every save writes its own directory
    ``root/step-N-<tok>/`` and uploads the marker last; a PUT of one object is
    atomic, so the marker's presence is the commit. When two committed
    directories hold the same step (a re-save, before the older one is
    removed) the newer marker (``created``) wins.

:func:`open_tier` picks the kind from the root. :class:`CommitMarker` is the
marker's record (whole-file digests are xxh3-128:
:func:`ucp_dcp.byteio.integrity.file_digest`).

``cleanup()`` removes the leftovers of saves and deletes that did not finish:
call it when no save into the tier is in progress (at start-up, before the
first save), since an in-progress staging directory looks like a leftover.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import tempfile
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable


from ..byteio.durable import fsync_path, write_bytes_durable
from ..errors import CheckpointFormatError

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

MARKER_FILE = "COMMIT.json"
MARKER_FORMAT = "ucp_dcp.commit"
MARKER_VERSION = 1

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
_HEX32_RE = re.compile(r"[0-9a-f]{32}\Z")
_STEP_RE = re.compile(r"step-(\d{12,})\Z")  # LocalTier committed dirs
_STEP_TOKEN_RE = re.compile(r"step-(\d{12,})-([A-Za-z0-9_-]{1,64})\Z")  # FsspecTier dirs
_TMP_RE = re.compile(r"\.tmp-step-(\d{12,})-([A-Za-z0-9_-]{1,64})\Z")
_OLD_RE = re.compile(r"\.old-step-(\d{12,})-([A-Za-z0-9_-]{1,64})\Z")
_DEL_RE = re.compile(r"\.del-step-(\d{12,})-([A-Za-z0-9_-]{1,64})\Z")
_COPY_CHUNK = 16 * 1024 * 1024


# ---------------------------------------------------------------- records


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_name(name: Any, what: str) -> None:
    """A plain file name: no directory parts, nothing that escapes the step directory."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
    ):
        raise ValueError(f"{what} must be a plain file name (no '/', not '.' or '..'), got {name!r}")


def _check_step(step: Any) -> int:
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return step


def _check_token(token: Any) -> str:
    if not isinstance(token, str) or not _TOKEN_RE.match(token):
        raise ValueError(f"token must be 1-64 characters of [A-Za-z0-9_-], got {token!r}")
    return token


@dataclass(frozen=True)
class FileDigest:
    """One file of a committed checkpoint: its name, size and whole-file xxh3-128 digest.

    ``name`` is relative to the step directory (a plain file name); ``rank``
    is the rank that wrote it, -1 for the index.
    """

    name: str
    size: int
    xxh3: str
    rank: int

    def __post_init__(self) -> None:
        _check_name(self.name, "field 'name'")
        if self.name == MARKER_FILE:
            raise ValueError(f"field 'name' must not be the commit marker {MARKER_FILE!r}")
        if not _is_int(self.size) or self.size < 0:
            raise ValueError(f"field 'size' of {self.name!r} must be a non-negative integer, got {self.size!r}")
        if not isinstance(self.xxh3, str) or not _HEX32_RE.match(self.xxh3):
            raise ValueError(
                f"field 'xxh3' of {self.name!r} must be 32 lowercase hex digits (xxh3-128), got {self.xxh3!r}"
            )
        if not _is_int(self.rank) or self.rank < -1:
            raise ValueError(f"field 'rank' of {self.name!r} must be an integer >= -1, got {self.rank!r}")

    def to_json(self) -> dict[str, Any]:
        """JSON form used inside the marker."""
        return {"name": self.name, "size": self.size, "xxh3": self.xxh3, "rank": self.rank}


@dataclass(frozen=True)
class CommitMarker:
    """The commit marker ``COMMIT.json`` of a step, written after every other file.

    ``files`` lists every file of the checkpoint (index included) with its
    size and digest; ``nonfinite`` maps a tensor name to the ranks whose shard
    held NaN/Inf (when saves only flag them), normally empty; ``extra`` is
    JSON-able user metadata. Constructing one validates every field
    (``ValueError``); :meth:`from_json` reports the same problems as
    :class:`CheckpointFormatError`.
    """

    step: int
    world_size: int
    created: float
    files: tuple[FileDigest, ...]
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _is_int(self.step) or self.step < 0:
            raise ValueError(f"field 'step' must be a non-negative integer, got {self.step!r}")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"field 'world_size' must be a positive integer, got {self.world_size!r}")
        created = self.created
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created) or created < 0:
            raise ValueError(f"field 'created' must be a finite non-negative unix time, got {created!r}")
        object.__setattr__(self, "created", float(created))
        if not isinstance(self.files, (tuple, list)) or not all(isinstance(f, FileDigest) for f in self.files):
            raise ValueError(f"field 'files' must be a sequence of FileDigest, got {self.files!r}")
        files = tuple(self.files)
        seen: set[str] = set()
        for f in files:
            if f.name in seen:
                raise ValueError(f"field 'files' lists {f.name!r} twice")
            seen.add(f.name)
            if f.rank >= self.world_size:
                raise ValueError(f"file {f.name!r}: rank {f.rank} is not below world_size {self.world_size}")
        object.__setattr__(self, "files", files)
        if not isinstance(self.nonfinite, dict):
            raise ValueError(f"field 'nonfinite' must be an object, got {self.nonfinite!r}")
        nonfinite: dict[str, list[int]] = {}
        for k, ranks in self.nonfinite.items():
            if not isinstance(k, str):
                raise ValueError(f"field 'nonfinite': tensor names must be strings, got {k!r}")
            if not isinstance(ranks, (list, tuple)) or not all(
                _is_int(r) and 0 <= r < self.world_size for r in ranks
            ):
                raise ValueError(
                    f"field 'nonfinite'[{k!r}] must be a list of ranks in [0, {self.world_size}), got {ranks!r}"
                )
            nonfinite[k] = list(ranks)
        object.__setattr__(self, "nonfinite", nonfinite)
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise ValueError(f"field 'extra' must be an object with string keys, got {self.extra!r}")
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"field 'extra' must be JSON-able (no NaN/Inf): {e}") from None

    def to_json(self) -> dict[str, Any]:
        """The marker document (``json.dumps`` of it is what ``COMMIT.json`` holds)."""
        return {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "created": self.created,
            "files": [f.to_json() for f in self.files],
            "nonfinite": {k: list(v) for k, v in self.nonfinite.items()},
            "extra": self.extra,
        }

    def encode(self) -> bytes:
        """The bytes of ``COMMIT.json``: compact UTF-8 JSON, no NaN/Inf."""
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode("utf-8")

    @staticmethod
    def from_json(doc: Any, where: str) -> "CommitMarker":
        """Parse and strictly validate a marker document.

        Raises :class:`CheckpointFormatError` naming ``where`` and the bad
        field: a wrong format name or version, a missing or unknown field, a
        field of the wrong type or range, a file listed twice.
        """
        if not isinstance(doc, dict):
            raise CheckpointFormatError(f"{where}: commit marker must be a JSON object, got {type(doc).__name__}")
        if doc.get("format") != MARKER_FORMAT:
            raise CheckpointFormatError(
                f"{where}: field 'format' must be {MARKER_FORMAT!r}, got {doc.get('format')!r} (not a ucp_dcp commit marker)"
            )
        if doc.get("version") != MARKER_VERSION or isinstance(doc.get("version"), bool):
            raise CheckpointFormatError(
                f"{where}: field 'version' must be {MARKER_VERSION} (this ucp_dcp reads commit markers of version "
                f"{MARKER_VERSION}), got {doc.get('version')!r}"
            )
        expected = {"format", "version", "step", "world_size", "created", "files", "nonfinite", "extra"}
        missing = sorted(expected - doc.keys())
        if missing:
            raise CheckpointFormatError(f"{where}: commit marker lacks field(s) {', '.join(map(repr, missing))}")
        unknown = sorted(doc.keys() - expected)
        if unknown:
            raise CheckpointFormatError(f"{where}: commit marker has unknown field(s) {', '.join(map(repr, unknown))}")
        raw_files = doc["files"]
        if not isinstance(raw_files, list):
            raise CheckpointFormatError(f"{where}: field 'files' must be a list, got {raw_files!r}")
        files = []
        fkeys = {"name", "size", "xxh3", "rank"}
        for i, fd in enumerate(raw_files):
            if not isinstance(fd, dict) or fd.keys() != fkeys:
                raise CheckpointFormatError(
                    f"{where}: files[{i}] must be an object with exactly the fields name, size, xxh3, rank; got {fd!r}"
                )
            try:
                files.append(FileDigest(fd["name"], fd["size"], fd["xxh3"], fd["rank"]))
            except ValueError as e:
                raise CheckpointFormatError(f"{where}: files[{i}]: {e}") from None
        try:
            return CommitMarker(
                doc["step"], doc["world_size"], doc["created"], tuple(files), doc["nonfinite"], doc["extra"]
            )
        except ValueError as e:
            raise CheckpointFormatError(f"{where}: {e}") from None

    @staticmethod
    def decode(data: bytes, where: str) -> "CommitMarker":
        """Parse the bytes of a ``COMMIT.json`` (:class:`CheckpointFormatError` if truncated or corrupt)."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointFormatError(f"{where}: truncated or corrupt commit marker ({e})") from None
        return CommitMarker.from_json(doc, where)

    def digest(self, name: str) -> FileDigest:
        """The record of file ``name``; :class:`CheckpointFormatError` if the marker does not list it."""
        for f in self.files:
            if f.name == name:
                return f
        raise CheckpointFormatError(
            f"commit marker of step {self.step} lists no file {name!r} (it lists {len(self.files)} files: "
            f"{', '.join(f.name for f in self.files[:8])}{', ...' if len(self.files) > 8 else ''})"
        )


def step_dir_name(step: int) -> str:
    """Directory name of committed ``step`` in a :class:`LocalTier`: ``step-%012d``."""
    return "step-%012d" % _check_step(step)


# ---------------------------------------------------------------- the seam


class Tier(ABC):
    """A place holding committed steps (see the module docstring).

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

    @abstractmethod
    def steps(self) -> list[int]:
        """Committed steps, ascending: a step directory whose marker parses and names that step.

        Never raises for junk: other names, uncommitted directories and
        unparsable markers are ignored.
        """

    @abstractmethod
    def marker(self, step: int) -> CommitMarker:
        """The marker of committed ``step``; :class:`CheckpointFormatError` naming the tier and step if missing or corrupt."""

    @abstractmethod
    def step_path(self, step: int) -> str:
        """Location of committed ``step`` (local path or URL)."""

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

    @abstractmethod
    def put_file(self, staging: str, local_path: str, name: str) -> None:
        """Copy (upload) local file ``local_path`` into ``staging`` as ``name``, durably."""

    @abstractmethod
    def put_bytes(self, staging: str, name: str, data: bytes) -> None:
        """Write ``data`` into ``staging`` as file ``name``, durably."""

    @abstractmethod
    def commit(self, staging: str, marker: CommitMarker) -> None:
        """Make step ``marker.step`` visible atomically, replacing an earlier commit of the same step.

        Every file the marker lists must be in ``staging`` with the listed
        size (:class:`CheckpointFormatError` otherwise, and nothing becomes
        visible).
        """

    @abstractmethod
    def delete(self, step: int) -> None:
        """Remove ``step`` so that it is never listed half-deleted.

        :class:`CheckpointFormatError` if the tier holds nothing of ``step``.
        """

    @abstractmethod
    def cleanup(self) -> list[str]:
        """Remove leftovers of unfinished saves and deletes (restoring a replaced step where needed).

        Returns what was done, one line each. Call only while no save into
        this tier is in progress.
        """

    @abstractmethod
    def files(self, step: int) -> dict[str, int]:
        """Names and sizes of the files present in committed ``step`` (the marker excluded)."""

    @abstractmethod
    def fetch(self, step: int, names: Iterable[str], dest_dir: str) -> None:
        """Copy (download) the named files of committed ``step`` into local directory ``dest_dir``.

        Each file is written under a temporary name, fsync'd and renamed, so
        a crash never leaves a partial file under the final name.
        """

    def read_bytes(self, step: int, name: str) -> bytes:
        """The content of file ``name`` of committed ``step`` (generic: fetch into a temp dir)."""
        with tempfile.TemporaryDirectory(prefix="ucp-tier-") as d:
            self.fetch(step, [name], d)
            with open(os.path.join(d, name), "rb") as f:
                return f.read()


# ---------------------------------------------------------------- local helpers


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_durable(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` (created or truncated) and fsync it."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, _COPY_CHUNK)
        fout.flush()
        os.fsync(fout.fileno())


def _tmp_name(name: str) -> str:
    return f".{name}.{uuid.uuid4().hex[:12]}.part"


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None  # None: not looked up yet; False: unavailable


def _exchange(a: str, b: str) -> bool:
    """Atomically swap paths ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``).

    False when the platform or file system cannot (then nothing happened).
    """
    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b} failed: {os.strerror(err)}")


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
        """Open (creating if needed) the tier rooted at directory ``root``; ``name`` is used in messages."""
        self.name = name
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self.local = True
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"{self._where()}: cannot create the tier directory: {e.strerror}") from e
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"{self._where()}: expected a directory, found a file")

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
                    f"{self._where(step)}: no such step (expected a committed step directory {dirpath})"
                ) from None
            raise CheckpointFormatError(
                f"{where}: missing: the step directory exists but was never committed, "
                "so it is not a complete checkpoint"
            ) from None
        except OSError as e:
            raise CheckpointFormatError(f"{where}: cannot read the commit marker: {e}") from None
        m = CommitMarker.decode(data, where)
        if m.step != step:
            raise CheckpointFormatError(f"{where}: the marker names step {m.step}, expected {step}")
        return m

    def _committed(self, dirpath: str, step: int) -> CommitMarker | None:
        try:
            return self._read_marker(dirpath, step)
        except (CheckpointFormatError, OSError):
            return None

    def _listdir(self) -> list[str]:
        try:
            return sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []

    def steps(self) -> list[int]:
        """Committed steps, ascending (see :meth:`Tier.steps`)."""
        out = []
        for n in self._listdir():
            m = _STEP_RE.match(n)
            if m is None or step_dir_name(int(m.group(1))) != n:
                continue
            step = int(m.group(1))
            if self._committed(os.path.join(self.root, n), step) is not None:
                out.append(step)
        return sorted(out)

    def marker(self, step: int) -> CommitMarker:
        """The marker of committed ``step`` (:class:`CheckpointFormatError` if missing or corrupt)."""
        return self._read_marker(self.step_path(step), step)

    def step_path(self, step: int) -> str:
        """``root/step-%012d`` (the path; whether it is committed is for :meth:`steps` to say)."""
        return os.path.join(self.root, step_dir_name(step))

    def files(self, step: int) -> dict[str, int]:
        """Names and sizes of the regular files in committed ``step``, the marker excluded."""
        path = self.step_path(step)
        self._read_marker(path, step)
        out = {}
        with os.scandir(path) as it:
            for e in it:
                if e.name != MARKER_FILE and e.is_file(follow_symlinks=False):
                    out[e.name] = e.stat(follow_symlinks=False).st_size
        return out

    def fetch(self, step: int, names: Iterable[str], dest_dir: str) -> None:
        """Copy named files of committed ``step`` into ``dest_dir`` (temp name, fsync, rename)."""
        src_dir = self.step_path(step)
        dest_dir = os.fspath(dest_dir)
        os.makedirs(dest_dir, exist_ok=True)
        same_dir = os.path.exists(src_dir) and os.path.samefile(src_dir, dest_dir)
        copied = False
        for name in names:
            _check_name(name, "file name")
            src = os.path.join(src_dir, name)
            if not os.path.isfile(src):
                raise CheckpointFormatError(
                    f"{self._where(step, name)}: missing (expected a file at {src}"
                    f"{'' if os.path.isdir(src_dir) else '; the step directory does not exist'})"
                )
            if same_dir:
                continue
            tmp = os.path.join(dest_dir, _tmp_name(name))
            try:
                _copy_durable(src, tmp)
                os.replace(tmp, os.path.join(dest_dir, name))
            except BaseException:
                _unlink_quiet(tmp)
                raise
            copied = True
        if copied:
            fsync_path(dest_dir)

    def read_bytes(self, step: int, name: str) -> bytes:
        """The content of file ``name`` of committed ``step``."""
        _check_name(name, "file name")
        path = os.path.join(self.step_path(step), name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self._where(step, name)}: missing (expected a file at {path})") from None

    # -- writing

    def staging_path(self, step: int, token: str) -> str:
        """``root/.tmp-step-%012d-<token>``."""
        return os.path.join(self.root, f".tmp-{step_dir_name(step)}-{_check_token(token)}")

    def begin(self, step: int, token: str) -> str:
        """Create an empty staging directory (removing a leftover of the same name) and return its path."""
        path = self.staging_path(step, token)
        if os.path.lexists(path):
            _remove_dir(path)
        os.makedirs(path)
        return path

    def _staging_step(self, staging: str) -> tuple[int, str]:
        staging = os.path.abspath(os.fspath(staging))
        m = _TMP_RE.match(os.path.basename(staging))
        if m is None or os.path.dirname(staging) != self.root:
            raise ValueError(
                f"{self._where()}: {staging} is not a staging directory of this tier "
                f"(expected {self.root}/.tmp-step-NNNNNNNNNNNN-<token>, as returned by begin())"
            )
        if not os.path.isdir(staging):
            raise FileNotFoundError(f"{self._where()}: staging directory {staging} does not exist (call begin() first)")
        return int(m.group(1)), staging

    def put_file(self, staging: str, local_path: str, name: str) -> None:
        """Copy ``local_path`` into ``staging`` as ``name`` and fsync it (only fsync if it already is that file)."""
        _check_name(name, "file name")
        if name == MARKER_FILE:
            raise ValueError(f"{self._where()}: {MARKER_FILE} is written by commit(), not put_file()")
        _, staging = self._staging_step(staging)
        dst = os.path.join(staging, name)
        if os.path.exists(dst) and os.path.samefile(local_path, dst):
            _fsync_file(dst)  # dcp.save wrote it in place
            return
        _copy_durable(os.fspath(local_path), dst)

    def put_bytes(self, staging: str, name: str, data: bytes) -> None:
        """Write ``data`` into ``staging`` as ``name`` and fsync it."""
        _check_name(name, "file name")
        if name == MARKER_FILE:
            raise ValueError(f"{self._where()}: {MARKER_FILE} is written by commit(), not put_bytes()")
        _, staging = self._staging_step(staging)
        write_bytes_durable(os.path.join(staging, name), data)

    def commit(self, staging: str, marker: CommitMarker) -> None:
        """Make ``staging`` the committed ``step-N`` (see the class docstring for the layout).

        Crash safety: at every point below, each step committed before is
        still listed and loadable, or (only step N itself, in the fallback
        without an atomic swap) restored by :meth:`cleanup`.
        """
        step, staging = self._staging_step(staging)
        if marker.step != step:
            raise ValueError(f"{self._where(step)}: marker is for step {marker.step} but staging {staging} is for step {step}")
        # Every listed file present with its size, and durable: dcp.save may
        # have written them without fsync. Nothing visible has changed yet.
        for f in marker.files:
            p = os.path.join(staging, f.name)
            try:
                size = os.stat(p).st_size
            except FileNotFoundError:
                raise CheckpointFormatError(
                    f"{self._where(step, f.name)}: cannot commit: the marker lists it but staging {staging} lacks it"
                ) from None
            if size != f.size:
                raise CheckpointFormatError(
                    f"{self._where(step, f.name)}: cannot commit: the marker says {f.size} bytes, staging holds {size}"
                )
            _fsync_file(p)
        # 1. Marker into staging: temp file + fsync + rename. A crash here
        #    leaves a .tmp- dir, never listed (steps() only reads step-*);
        #    cleanup() removes it. No committed step was touched.
        tmp = os.path.join(staging, _tmp_name(MARKER_FILE))
        write_bytes_durable(tmp, marker.encode())
        os.replace(tmp, os.path.join(staging, MARKER_FILE))
        # 2. fsync the staging dir: the marker's and the data files' directory
        #    entries are durable before the directory can become visible, so a
        #    power loss cannot leave a visible step-N missing files.
        fsync_path(staging)
        final = self.step_path(step)
        if os.path.lexists(final):
            # 3a. Re-save of step N: swap atomically where the OS can. A crash
            #     before the swap: old step-N intact. After it: step-N is the
            #     new committed dir, the old one sits under the .tmp- name and
            #     cleanup() removes it.
            if _exchange(staging, final):
                fsync_path(self.root)  # the swap is durable before the old copy goes
                _remove_dir(staging)
                return
            # 3b. Fallback: two renames. Crash after the first one: step-N is
            #     missing, .old-step-N-<token> holds the complete old step
            #     (with its marker) and cleanup() renames it back, since
            #     step-N is missing. Other steps are never touched.
            old = os.path.join(self.root, f".old-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}")
            os.rename(final, old)
            # 4. Crash after this rename but before the root fsync: either
            #    rename may be lost on power failure, leaving one of the
            #    states above or the new step-N; all are handled.
            os.rename(staging, final)
            # 5. fsync root: both renames are durable before the old copy is
            #    removed; without it a power loss could bring back a state
            #    with step-N missing and a half-removed .old dir.
            fsync_path(self.root)
            # 6. Remove the old copy, marker first: a crash mid-way leaves a
            #    .old dir without marker, which cleanup() removes and never
            #    restores; step-N is committed anyway.
            _remove_dir(old)
        else:
            # 3. New step: one rename makes it visible (atomic). A crash
            #    before: .tmp- leftover; after: committed step N.
            os.rename(staging, final)
            # 4. fsync root: the new step survives power loss once commit returns.
            fsync_path(self.root)

    def delete(self, step: int) -> None:
        """Rename ``step-N`` to ``.del-step-N-<random>``, fsync the root, then remove it."""
        final = self.step_path(step)
        if not os.path.lexists(final):
            raise CheckpointFormatError(f"{self._where(step)}: cannot delete: no such step (expected {final})")
        gone = os.path.join(self.root, f".del-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}")
        # One rename hides the step at once: never listed half deleted. A
        # crash before: the step is intact; after: a .del- leftover that
        # cleanup() removes. Other steps are not touched.
        os.rename(final, gone)
        fsync_path(self.root)  # the deletion is durable before any byte goes
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
            path = os.path.join(self.root, n)
            if _TMP_RE.match(n) or _DEL_RE.match(n):
                # Never listed, never restored: a save that did not commit (or
                # whose swapped-out old copy was not removed), or a delete.
                _remove_dir(path)
                done.append(f"removed {path} ({'unfinished save' if n.startswith('.tmp-') else 'unfinished delete'})")
            elif m := _OLD_RE.match(n):
                step = int(m.group(1))
                olds.setdefault(step, []).append((path, self._committed(path, step)))
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
                    aside = os.path.join(self.root, f".del-{step_dir_name(step)}-{uuid.uuid4().hex[:12]}")
                    os.rename(final, aside)
                    fsync_path(self.root)
                    _remove_dir(aside)
                    done.append(f"removed uncommitted {final} (no valid {MARKER_FILE})")
                os.rename(restore, final)
                fsync_path(self.root)
                done.append(f"restored step {step}: renamed {restore} back to {final} (a re-save of it did not finish)")
            for p, _ in cands:
                if p != restore:
                    _remove_dir(p)
                    done.append(f"removed {p} (replaced copy of step {step})")
        return done


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------- fsspec


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "r2", "tos", "cos"}


def _protocols(fs: Any) -> set[str]:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


class FsspecTier(Tier):
    """A tier at an fsspec URL: ``s3://bucket/prefix``, ``gs://...``, ``memory://...``.

    Each save writes its own directory ``root/step-%012d-<token>/`` (staging
    and committed location are the same); the marker, uploaded last, commits
    it. ``storage_options`` go to fsspec (credentials, ``endpoint_url``...).
    """

    def __init__(self, root: str, *, name: str, storage_options: dict[str, Any] | None = None) -> None:
        """Open the tier at URL ``root``; ``name`` is used in messages."""
        import fsspec

        self.name = name
        self.url = str(root).rstrip("/")
        self.local = False
        self.fs, path = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self._root = path.rstrip("/")

    # -- paths

    def _path(self, *parts: str) -> str:
        return "/".join((self._root,) + parts)

    def _to_url(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _refresh(self, path: str | None = None) -> None:
        # s3fs & co cache listings; another process may have written since.
        self.fs.invalidate_cache(path)

    def _dirs(self) -> dict[int, list[str]]:
        """Step directory names under the root, by step (uncommitted ones included)."""
        self._refresh(self._root)
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return {}
        out: dict[int, list[str]] = {}
        for e in entries:
            n = e.rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_TOKEN_RE.match(n)
            if m is not None and n.startswith(step_dir_name(int(m.group(1))) + "-"):
                out.setdefault(int(m.group(1)), []).append(n)
        return out

    def _load_marker(self, dirname: str, step: int) -> CommitMarker | None:
        """The dir's marker; None if it has none; CheckpointFormatError if corrupt or of another step."""
        path = self._path(dirname, MARKER_FILE)
        where = f"{self._where(step, MARKER_FILE)} ({self._to_url(path)})"
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        except (IsADirectoryError, NotADirectoryError) as e:
            raise CheckpointFormatError(f"{where}: not a file ({e})") from None
        m = CommitMarker.decode(data, where)
        if m.step != step:
            raise CheckpointFormatError(f"{where}: the marker names step {m.step}, expected {step}")
        return m

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
        _check_step(step)
        dirs = self._dirs().get(step, [])
        committed = self._committed(step, dirs)
        if committed:
            return committed[0]
        for d in sorted(dirs):
            self._load_marker(d, step)  # raises the corrupt marker's error
        raise CheckpointFormatError(
            f"{self._where(step)}: no such committed step (expected a directory "
            f"{self._to_url(self._path(step_dir_name(step)))}-<token>/ holding {MARKER_FILE}"
            f"{'; found only uncommitted ' + ', '.join(sorted(dirs)) if dirs else ''})"
        )

    # -- reading

    def steps(self) -> list[int]:
        """Committed steps, ascending (see :meth:`Tier.steps`)."""
        return sorted(step for step, dirs in self._dirs().items() if self._committed(step, dirs))

    def marker(self, step: int) -> CommitMarker:
        """The marker of the newest committed copy of ``step``."""
        return self._current(step)[0]

    def step_path(self, step: int) -> str:
        """URL of the newest committed copy of ``step`` (:class:`CheckpointFormatError` if none)."""
        return self._to_url(self._path(self._current(step)[1]))

    def files(self, step: int) -> dict[str, int]:
        """Names and sizes of the files in committed ``step``, the marker excluded."""
        d = self._path(self._current(step)[1])
        self._refresh(d)
        out = {}
        for e in self.fs.ls(d, detail=True):
            n = e["name"].rstrip("/").rsplit("/", 1)[-1]
            if e.get("type") == "file" and n != MARKER_FILE:
                out[n] = int(e["size"])
        return out

    def fetch(self, step: int, names: Iterable[str], dest_dir: str) -> None:
        """Download named files of committed ``step`` into ``dest_dir`` (temp name, fsync, rename)."""
        d = self._path(self._current(step)[1])
        dest_dir = os.fspath(dest_dir)
        os.makedirs(dest_dir, exist_ok=True)
        fetched = False
        for name in names:
            _check_name(name, "file name")
            src = f"{d}/{name}"
            tmp = os.path.join(dest_dir, _tmp_name(name))
            try:
                self.fs.get_file(src, tmp)
                _fsync_file(tmp)
                os.replace(tmp, os.path.join(dest_dir, name))
            except FileNotFoundError:
                _unlink_quiet(tmp)
                raise CheckpointFormatError(
                    f"{self._where(step, name)}: missing (expected an object {self._to_url(src)})"
                ) from None
            except BaseException:
                _unlink_quiet(tmp)
                raise
            fetched = True
        if fetched:
            fsync_path(dest_dir)

    def read_bytes(self, step: int, name: str) -> bytes:
        """The content of file ``name`` of committed ``step``."""
        _check_name(name, "file name")
        src = f"{self._path(self._current(step)[1])}/{name}"
        try:
            return self.fs.cat_file(src)
        except FileNotFoundError:
            raise CheckpointFormatError(f"{self._where(step, name)}: missing (expected an object {self._to_url(src)})") from None

    # -- writing

    def staging_path(self, step: int, token: str) -> str:
        """URL ``root/step-%012d-<token>``: staging and, once committed, the step's location."""
        return self._to_url(self._path(f"{step_dir_name(step)}-{_check_token(token)}"))

    def begin(self, step: int, token: str) -> str:
        """Remove leftover content under the staging URL and return it."""
        url = self.staging_path(step, token)
        path = self.fs._strip_protocol(url)
        self._refresh(path)
        if self.fs.exists(path):
            self._rm_dir(path)
        if not _OBJECT_STORES.intersection(_protocols(self.fs)):
            # File systems with real directories (sftp, hdfs, smb...) need
            # it; object stores have none (and s3fs/gcsfs makedirs would
            # create a missing bucket).
            self.fs.makedirs(path, exist_ok=True)
        return url

    def _staging_step(self, staging: str) -> tuple[int, str]:
        path = self.fs._strip_protocol(staging).rstrip("/")
        parent, _, base = path.rpartition("/")
        m = _STEP_TOKEN_RE.match(base)
        if m is None or parent != self._root:
            raise ValueError(
                f"{self._where()}: {staging} is not a staging location of this tier "
                f"(expected {self.url}/step-NNNNNNNNNNNN-<token>, as returned by begin())"
            )
        return int(m.group(1)), path

    def put_file(self, staging: str, local_path: str, name: str) -> None:
        """Upload local file ``local_path`` into ``staging`` as ``name``."""
        _check_name(name, "file name")
        if name == MARKER_FILE:
            raise ValueError(f"{self._where()}: {MARKER_FILE} is written by commit(), not put_file()")
        _, path = self._staging_step(staging)
        self.fs.put_file(os.fspath(local_path), f"{path}/{name}")

    def put_bytes(self, staging: str, name: str, data: bytes) -> None:
        """Upload ``data`` into ``staging`` as ``name``."""
        _check_name(name, "file name")
        if name == MARKER_FILE:
            raise ValueError(f"{self._where()}: {MARKER_FILE} is written by commit(), not put_bytes()")
        _, path = self._staging_step(staging)
        self.fs.pipe_file(f"{path}/{name}", bytes(data))

    def commit(self, staging: str, marker: CommitMarker) -> None:
        """Upload the marker last (one atomic PUT commits), then remove older copies of the step."""
        step, path = self._staging_step(staging)
        if marker.step != step:
            raise ValueError(f"{self._where(step)}: marker is for step {marker.step} but staging {staging} is for step {step}")
        self._refresh(path)
        try:
            present = {
                e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
                for e in self.fs.ls(path, detail=True)
                if e.get("type") == "file"
            }
        except FileNotFoundError:
            present = {}
        for f in marker.files:
            if f.name not in present:
                raise CheckpointFormatError(
                    f"{self._where(step, f.name)}: cannot commit: the marker lists it but staging {staging} lacks it"
                )
            if present[f.name] != f.size:
                raise CheckpointFormatError(
                    f"{self._where(step, f.name)}: cannot commit: the marker says {f.size} bytes, "
                    f"staging holds {present[f.name]}"
                )
        # The commit point: until this PUT completes the directory is not
        # listed; after it, it is (and, being newest, wins over older copies).
        self.fs.pipe_file(f"{path}/{MARKER_FILE}", marker.encode())
        self._refresh(path)
        # Only now remove earlier commits of the same step (whatever their
        # `created`, so the new one wins even under clock skew). A crash here
        # leaves two committed copies; the newest wins and cleanup() removes
        # the others. Uncommitted dirs are left to cleanup().
        mine = path.rsplit("/", 1)[-1]
        for _, d in self._committed(step, [d for d in self._dirs().get(step, []) if d != mine]):
            self._rm_dir(self._path(d))

    def _rm_dir(self, path: str) -> None:
        """Remove a step directory: marker first (so it is unlisted at once), then the rest."""
        try:
            self.fs.rm_file(f"{path}/{MARKER_FILE}")
        except FileNotFoundError:
            pass
        self._refresh(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self._refresh(path)

    def delete(self, step: int) -> None:
        """Remove every copy of ``step``: markers first, then the data."""
        dirs = self._dirs().get(_check_step(step), [])
        if not dirs:
            raise CheckpointFormatError(
                f"{self._where(step)}: cannot delete: no such step "
                f"(expected {self._to_url(self._path(step_dir_name(step)))}-<token>/)"
            )
        # All markers first: once the first is gone an older copy could win,
        # so none may remain before data goes. A crash part way leaves
        # unmarked dirs (never listed; cleanup() removes them).
        for d in dirs:
            try:
                self.fs.rm_file(self._path(d, MARKER_FILE))
            except FileNotFoundError:
                pass
        for d in dirs:
            self._rm_dir(self._path(d))

    def cleanup(self) -> list[str]:
        """Remove step dirs without a marker and older copies of re-saved steps.

        Dirs whose marker is corrupt are kept (for inspection) but never
        listed.
        """
        done: list[str] = []
        for step, dirs in sorted(self._dirs().items()):
            committed = self._committed(step, dirs)
            for _, d in committed[1:]:
                self._rm_dir(self._path(d))
                done.append(f"removed {self._to_url(self._path(d))} (older copy of step {step})")
            for d in dirs:
                if any(d == c for _, c in committed):
                    continue
                try:
                    has_marker = self.fs.exists(self._path(d, MARKER_FILE))
                except FileNotFoundError:
                    has_marker = False
                if not has_marker:
                    self._rm_dir(self._path(d))
                    done.append(f"removed {self._to_url(self._path(d))} (unfinished save or delete)")
        return done


# ---------------------------------------------------------------- factory


def open_tier(root: str | os.PathLike[str], *, name: str, storage_options: dict[str, Any] | None = None) -> Tier:
    """A :class:`LocalTier` for plain paths and ``file://`` URLs, an :class:`FsspecTier` for other URLs.

    ``storage_options`` go to fsspec; they are ignored for local tiers.
    """
    if not isinstance(root, str):
        return LocalTier(os.fspath(root), name=name)
    if root.startswith("file://"):
        return LocalTier(root[len("file://") :] or "/", name=name)
    if root.startswith("local://"):
        return LocalTier(root[len("local://") :] or "/", name=name)
    if "://" in root or "::" in root:
        return FsspecTier(root, name=name, storage_options=storage_options)
    return LocalTier(root, name=name)

