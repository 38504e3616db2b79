"""The commit marker ``COMMIT.json``: the record that makes a step committed.

A tier writes a step's marker after every other file of the step; a step
directory is committed when its marker parses and names that step.
:class:`CommitMarker` lists every file of the checkpoint with its size and
whole-file xxh3-128 digest (:class:`FileDigest`,
:func:`ucp_dcp.byteio.integrity.file_digest`); constructing one validates
every field, and :meth:`CommitMarker.decode` reads the bytes back strictly.
:func:`check_copy` rechecks a copy of the step against its marker, one line per problem.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ...byteio.integrity import file_digest
from ...byteio.location import LocalDir
from ...errors import CheckpointFormatError, InvalidArgumentError, listed
from ...format.schema import is_int, is_plain_file_name
from ...tools.checkpoint import Checkpoint

__all__ = [
    "MARKER_FILE",
    "MARKER_FORMAT",
    "MARKER_VERSION",
    "FileDigest",
    "CommitMarker",
    "check_name",
    "check_step",
    "check_copy",
]

MARKER_FILE = "COMMIT.json"
MARKER_FORMAT = "ucp_dcp.commit"
MARKER_VERSION = 1

_HEX32_RE = re.compile(r"[0-9a-f]{32}\Z")


def check_name(name: Any, what: str = "file name") -> None:
    """A plain file name: no directory parts, nothing that escapes the step directory
    (:class:`~ucp_dcp.errors.InvalidArgumentError` naming ``what`` otherwise)."""
    if not is_plain_file_name(name):
        raise InvalidArgumentError(
            f"invalid {what} {name!r}: must be a plain file name (no '/', not '', '.' or '..')"
        )


def check_step(step: Any, what: str = "step") -> int:
    """``step`` itself if it is a non-negative int (not a bool);
    :class:`~ucp_dcp.errors.InvalidArgumentError` (a ``ValueError``) naming ``what`` otherwise."""
    if not is_int(step) or step < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative integer, got {step!r}")
    return step


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
        check_name(self.name, "file name (field 'name')")
        if self.name == MARKER_FILE:
            raise InvalidArgumentError(
                f"field 'name' must not be the commit marker {MARKER_FILE!r}"
            )
        if not is_int(self.size) or self.size < 0:
            raise InvalidArgumentError(
                f"field 'size' of {self.name!r} must be a non-negative integer, got {self.size!r}"
            )
        if not isinstance(self.xxh3, str) or not _HEX32_RE.match(self.xxh3):
            raise InvalidArgumentError(
                f"field 'xxh3' of {self.name!r} must be 32 lowercase hex digits (xxh3-128), got "
                f"{self.xxh3!r}"
            )
        if not is_int(self.rank) or self.rank < -1:
            raise InvalidArgumentError(
                f"field 'rank' of {self.name!r} must be an integer >= -1, got {self.rank!r}"
            )

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
    (:class:`~ucp_dcp.errors.InvalidArgumentError`, a ``ValueError``);
    :meth:`from_json` reports the same problems as :class:`CheckpointFormatError`.
    """

    step: int
    world_size: int
    created: float
    files: tuple[FileDigest, ...]
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_step(self.step, "field 'step'")
        if not is_int(self.world_size) or self.world_size < 1:
            raise InvalidArgumentError(
                f"field 'world_size' must be a positive integer, got {self.world_size!r}"
            )
        created = self.created
        if (
            isinstance(created, bool)
            or not isinstance(created, (int, float))
            or not math.isfinite(created)
            or created < 0
        ):
            raise InvalidArgumentError(
                f"field 'created' must be a finite non-negative unix time, got {created!r}"
            )
        object.__setattr__(self, "created", float(created))
        if not isinstance(self.files, (tuple, list)) or not all(
            isinstance(f, FileDigest) for f in self.files
        ):
            raise InvalidArgumentError(
                f"field 'files' must be a sequence of FileDigest, got {self.files!r}"
            )
        files = tuple(self.files)
        seen: set[str] = set()
        for f in files:
            if f.name in seen:
                raise InvalidArgumentError(f"field 'files' lists {f.name!r} twice")
            seen.add(f.name)
            if f.rank >= self.world_size:
                raise InvalidArgumentError(
                    f"file {f.name!r}: rank {f.rank} is not below world_size {self.world_size}"
                )
        object.__setattr__(self, "files", files)
        if not isinstance(self.nonfinite, dict):
            raise InvalidArgumentError(
                f"field 'nonfinite' must be an object, got {self.nonfinite!r}"
            )
        nonfinite: dict[str, list[int]] = {}
        for k, ranks in self.nonfinite.items():
            if not isinstance(k, str):
                raise InvalidArgumentError(
                    f"field 'nonfinite': tensor names must be strings, got {k!r}"
                )
            if not isinstance(ranks, (list, tuple)) or not all(
                is_int(r) and 0 <= r < self.world_size for r in ranks
            ):
                raise InvalidArgumentError(
                    f"field 'nonfinite'[{k!r}] must be a list of ranks in [0, {self.world_size}), "
                    f"got {ranks!r}"
                )
            nonfinite[k] = list(ranks)
        object.__setattr__(self, "nonfinite", nonfinite)
        if not isinstance(self.extra, dict) or not all(isinstance(k, str) for k in self.extra):
            raise InvalidArgumentError(
                f"field 'extra' must be an object with string keys, got {self.extra!r}"
            )
        try:
            json.dumps(self.extra, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"field 'extra' must be JSON-able (no NaN/Inf): {e}"
            ) from None

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
    def from_json(doc: Any, where: str) -> CommitMarker:
        """Parse and strictly validate a marker document.

        Raises :class:`CheckpointFormatError` naming ``where`` and the bad
        field: a wrong format name or version, a missing or unknown field, a
        field of the wrong type or range, a file listed twice.
        """
        if not isinstance(doc, dict):
            raise CheckpointFormatError(
                f"{where}: commit marker must be a JSON object, got {type(doc).__name__}"
            )
        if doc.get("format") != MARKER_FORMAT:
            raise CheckpointFormatError(
                f"{where}: field 'format' must be {MARKER_FORMAT!r}, got {doc.get('format')!r} "
                "(not a ucp_dcp commit marker)"
            )
        if doc.get("version") != MARKER_VERSION or isinstance(doc.get("version"), bool):
            raise CheckpointFormatError(
                f"{where}: field 'version' must be {MARKER_VERSION} (this ucp_dcp reads commit "
                "markers of version "
                f"{MARKER_VERSION}), got {doc.get('version')!r}"
            )
        expected = {"format", "version", *(f.name for f in fields(CommitMarker))}
        missing = sorted(expected - doc.keys())
        if missing:
            raise CheckpointFormatError(
                f"{where}: commit marker lacks field(s) {', '.join(map(repr, missing))}"
            )
        unknown = sorted(doc.keys() - expected)
        if unknown:
            raise CheckpointFormatError(
                f"{where}: commit marker has unknown field(s) {', '.join(map(repr, unknown))}"
            )
        raw_files = doc["files"]
        if not isinstance(raw_files, list):
            raise CheckpointFormatError(f"{where}: field 'files' must be a list, got {raw_files!r}")
        files = []
        fkeys = {f.name for f in fields(FileDigest)}
        for i, fd in enumerate(raw_files):
            if not isinstance(fd, dict) or fd.keys() != fkeys:
                raise CheckpointFormatError(
                    f"{where}: files[{i}] must be an object with exactly the fields name, size, "
                    f"xxh3, rank; got {fd!r}"
                )
            try:
                files.append(FileDigest(fd["name"], fd["size"], fd["xxh3"], fd["rank"]))
            except ValueError as e:
                raise CheckpointFormatError(f"{where}: files[{i}]: {e}") from None
        try:
            return CommitMarker(
                doc["step"],
                doc["world_size"],
                doc["created"],
                tuple(files),
                doc["nonfinite"],
                doc["extra"],
            )
        except ValueError as e:
            raise CheckpointFormatError(f"{where}: {e}") from None

    @staticmethod
    def decode(data: bytes, where: str, *, step: int | None = None) -> CommitMarker:
        """Parse the bytes of a ``COMMIT.json`` (:class:`CheckpointFormatError` if truncated or
        corrupt, or, with ``step``, if it names another step: a step directory's marker must
        name that directory's step)."""
        try:
            doc = json.loads(data)
        # ValueError also covers an integer of more digits than Python converts; RecursionError,
        # arrays nested deeper than the parser recurses.
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointFormatError(
                f"{where}: truncated or corrupt commit marker ({str(e)[:200]})"
            ) from None
        m = CommitMarker.from_json(doc, where)
        if step is not None and m.step != step:
            raise CheckpointFormatError(f"{where}: the marker names step {m.step}, expected {step}")
        return m

    @property
    def names(self) -> list[str]:
        """The names of the files listed, in order."""
        return [f.name for f in self.files]

    @property
    def sizes(self) -> dict[str, int]:
        """Name -> recorded size of every file listed, in order."""
        return {f.name: f.size for f in self.files}

    def check_sizes(
        self,
        present: Mapping[str, int],
        held: Collection[str] | None = None,
        *,
        where: Callable[[str], str],
        holder: str,
    ) -> None:
        """:class:`CheckpointFormatError` for the first file listed that ``present`` (name -> size,
        what ``holder`` holds) lacks or holds at another size, each message starting with
        ``where(name)``; a file not in ``held`` may be absent (None: every one is expected)."""
        for f in self.files:
            size = present.get(f.name)
            if size is None and held is not None and f.name not in held:
                continue
            if size is None:
                raise CheckpointFormatError(
                    f"{where(f.name)}: the commit marker of step {self.step} lists it "
                    f"({f.size} bytes) but {holder} lacks it"
                )
            if size != f.size:
                raise CheckpointFormatError(
                    f"{where(f.name)}: the commit marker of step {self.step} says {f.size} bytes, "
                    f"{holder} holds {size}: it is incomplete or was replaced"
                )

    def digest(self, name: str) -> FileDigest:
        """The record of file ``name``; :class:`CheckpointFormatError` if the marker does not list
        it."""
        for f in self.files:
            if f.name == name:
                return f
        raise CheckpointFormatError(
            f"commit marker of step {self.step} lists no file {name!r} (it lists "
            f"{len(self.files)} files: {listed([f.name for f in self.files], 8)})"
        )


def check_copy(
    marker: CommitMarker, path: str, *, held: Collection[str] | None, where: str
) -> list[str]:
    """Problems of the copy of ``marker.step`` in local directory ``path`` ([] = intact), each
    line starting with ``where``.

    Whole-file xxh3-128 digests of the files there against the marker (catches any flipped byte,
    header and padding included), then, for a damaged data file, every chunk checksum to name the
    tensors hit. ``held``: the files the copy is expected
    to hold (a node's share of a node-local tier; None: all of them); others it holds are checked
    too.
    """
    problems: list[str] = []
    damaged = False
    present = LocalDir(path).sizes()
    for d in marker.files:
        own = held is None or d.name in held
        who = "the index" if d.rank == -1 else f"written by rank {d.rank}"
        if d.name not in present:
            if own:
                problems.append(f"{where}: {d.name} ({who}) is missing")
            continue
        size, digest = file_digest(os.path.join(path, d.name))
        if (size, digest) != (d.size, d.xxh3):
            damaged = True
            problems.append(
                f"{where}: {d.name} ({who}) is corrupt: {size} bytes with xxh3-128 {digest}, "
                f"the commit recorded {d.size} bytes with {d.xxh3}"
            )
    if damaged and all(d.name in present for d in marker.files):
        try:
            with Checkpoint(path) as ck:
                problems += [f"{where}: {p}" for p in ck.verify()]
        except Exception as e:  # a damaged index: the digest line above already says so
            # One process, no dcp.load: never a CheckpointException with per-rank failures.
            problems.append(f"{where}: cannot check chunks: {type(e).__name__}: {e}")
    return problems
