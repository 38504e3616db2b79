"""Every exception the library raises on purpose, under one base: :class:`UCPError`.

``except ucp_dcp.UCPError`` catches any of them. Each also keeps the builtin
base it had before the common one existed (``ValueError`` for a damaged
checkpoint, ``KeyError`` for a key mismatch, ``RuntimeError`` for a failed
save or restore, ...), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = [
    "UCPError",
    "CheckpointFormatError",
    "ChecksumError",
    "TruncatedFileError",
    "StorageError",
    "DCPValueError",
    "CheckpointKeyError",
    "UnsupportedValueError",
    "LayoutError",
    "LayoutRuleError",
    "NonFiniteError",
    "CheckpointSaveError",
    "CheckpointRestoreError",
    "NoCheckpointError",
    "PeerTransferError",
    "ReadOnceError",
    "PlacementError",
    "CLIError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidStateError",
    "PathNotFoundError",
    "InconsistentSaveError",
    "UnsupportedModelError",
    "TorchInternalsError",
    "ShapeMismatchError",
    "NotACheckpointError",
    "CheckpointExistsError",
    "CheckpointWriteError",
    "UCPWarning",
    "unwrap",
]

_H = TypeVar("_H", bound="_OptionHint")


class _OptionHint:
    """What an error or warning says to pass, as data, so that each interface can say it in
    its own words.

    Attributes:
        option: the keyword argument that would fix it (e.g. ``"dcp_values"``), or None.
        option_value: the value to pass for it.
        hint: the text of the message that says so in Python (e.g. ``"UCPStorageReader(path,
            dcp_values='weights_only')"``); the ``ucp-dcp`` command line replaces it with its own
            flag (``--dcp-values weights_only``).
    """

    option: str | None = None
    option_value: object = None
    hint: str | None = None

    def with_option(self: _H, option: str, value: object, hint: str) -> _H:
        """Record that passing ``option=value`` fixes this (``hint``: the words in the message
        that say so); returns ``self``."""
        self.option, self.option_value, self.hint = option, value, hint
        return self


class UCPError(_OptionHint, Exception):
    """Base of every error ucp_dcp raises on purpose."""


# ---------------------------------------------------------------- reading checkpoints


class CheckpointFormatError(UCPError, ValueError):
    """The checkpoint on disk is missing, damaged or not of a format this library reads."""


class ChecksumError(CheckpointFormatError):
    """Data on disk does not match the checksum recorded when it was written.

    Attributes:
        path: the data file.
        what: the entry, e.g. ``"tensor 'layer.w' chunk at [0, 4]"`` or ``"value 'step'"``.
        expected: the recorded digest (hex).
        actual: the digest of the data read (hex).
        rank: the rank that wrote the file, when known.
    """

    def __init__(
        self, path: str, what: str, expected: str, actual: str, rank: int | None = None
    ) -> None:
        self.path = path
        self.what = what
        self.expected = expected
        self.actual = actual
        self.rank = rank
        by = f", written by rank {rank}" if rank is not None else ""
        super().__init__(
            f"{path}: checksum mismatch for {what}: the file is corrupt (recorded xxh3 {expected}, "
            f"data hashes to {actual}{by}): restore this checkpoint from another copy or load an "
            "earlier one"
        )

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str, int | None]]:
        # DCP pickles per-rank exceptions to gather them on every rank; the
        # default (cls, args) would call __init__ with the message alone.
        return (ChecksumError, (self.path, self.what, self.expected, self.actual, self.rank))


class TruncatedFileError(CheckpointFormatError, EOFError):
    """A file ends before a byte range the checkpoint records for it (``EOFError`` too)."""


class StorageError(UCPError, OSError):
    """Storage that failed a request for good: object storage that refused or kept failing one
    (names the URL, the key and the error), a local read that failed or passed its deadline, or
    a local checkpoint tier's directory that cannot be created or used (names the tier and path).

    Permanent errors (no such bucket, access denied) are raised at once, transient ones
    (connection resets, 5xx, throttling) once the bounded retries are spent; the errno of the
    OS or store error is kept (a ``FileNotFoundError``'s, a ``PermissionError``'s).
    """

    def __str__(self) -> str:
        # The message alone: it names the URL already, and "[Errno 13]" in front hides it.
        return self.strerror if self.errno is not None and self.strerror else super().__str__()


class DCPValueError(CheckpointFormatError):
    """A non-tensor value of a DCP checkpoint that cannot be loaded as asked."""


class CheckpointKeyError(UCPError, KeyError):
    """Keys, shapes or dtypes of the state dict do not match the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


# ---------------------------------------------------------------- describing a state


class UnsupportedValueError(UCPError, TypeError):
    """A value in the state dict that the checkpoint format cannot store safely, or a tensor
    no load can fill (an expanded view)."""


class LayoutError(UCPError, ValueError):
    """A layout that cannot be described as boxes, or an unknown placement."""


class LayoutRuleError(UCPError, ValueError):
    """A layout rule does not fit the state dict, or the state dict has a tensor no rule
    explains."""


class NonFiniteError(UCPError, ValueError):
    """A state to be saved holds NaN/Inf in floating-point tensors."""


# ---------------------------------------------------------------- the manager


class CheckpointSaveError(UCPError, RuntimeError):
    """A save failed on some rank; earlier committed steps are untouched."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(f"checkpoint save of step {step} failed: {message}")
        self.step = step


class CheckpointRestoreError(UCPError, RuntimeError):
    """No candidate step could be restored from any tier."""

    def __init__(self, message: str, attempts: Sequence[str] = ()) -> None:
        if attempts:
            message += "\n  " + "\n  ".join(attempts)
        super().__init__(message)
        self.attempts = tuple(attempts)


class NoCheckpointError(CheckpointRestoreError, LookupError):
    """No committed step exists (``load`` on a fresh run)."""


class PeerTransferError(UCPError, RuntimeError):
    """A file needed by some rank is held by no rank (names the files and the
    ranks that want them), or a provider could not deliver a scheduled file."""


class PlacementError(UCPError, RuntimeError):
    """A loaded state does not match the placement digests its checkpoint recorded: some
    element is not where the save found it (names the tensor, the digests and how many copies
    were loaded), or the checkpoint records no digests to check against."""


class ReadOnceError(UCPError, RuntimeError):
    """A read-once load (``ReadOptions(read_once=...)``) could not run its exchange: a
    rank failed before the plan was agreed, or the plan left a needed byte unsent (names the
    rank or the file)."""


# ---------------------------------------------------------------- tools


class CLIError(UCPError):
    """A failure to report as one ``ucp-dcp: error:`` line (usage or environment)."""


# ---------------------------------------------------------------- calling the library


class InvalidArgumentError(UCPError, ValueError):
    """An argument or setting is of the wrong type or out of range: names the parameter, what
    is expected and what was given."""


class InvalidArgumentTypeError(UCPError, TypeError):
    """An argument of a library call of the wrong kind: names the call and what it needs."""


class InvalidStateError(UCPError, RuntimeError):
    """A call the object's state does not allow (it is closed, or every staging buffer is in
    use): names the object and what to do first."""


class PathNotFoundError(UCPError, FileNotFoundError):
    """A path the call was given (a source, a config file) does not exist: names it."""


# ---------------------------------------------------------------- saving and adapters


class InconsistentSaveError(UCPError, ValueError):
    """What the ranks of a save hold does not fit together: one key names different tensors or
    values on different ranks, a replicated tensor differs, pieces do not tile their tensor, or
    the ranks of one device mesh report different DTensors. Names the key and the ranks."""


class UnsupportedModelError(UCPError, ValueError):
    """A model, optimizer or loaded state an adapter (``fsdp1_state_dict``,
    ``fsdp1_apply_loaded``) does not support or that does not match it: names the module,
    parameter or group and what is supported."""


class TorchInternalsError(UCPError, RuntimeError):
    """Private torch state the library reads (FSDP1's ``FlatParameter`` metadata) is not laid
    out as expected: this torch version is not supported."""


# ---------------------------------------------------------------- reading into tensors


class ShapeMismatchError(UCPError, ValueError):
    """A destination tensor's shape differs from the saved tensor's (names the tensor and both
    shapes)."""


# ---------------------------------------------------------------- storage


class NotACheckpointError(CheckpointFormatError):
    """A path that holds no checkpoint of any format the library reads.

    ``path`` is the path or URL; ``formats`` what was looked for, one
    ``"<files> (<format>)"`` per registered format, in detection order.
    """

    def __init__(self, message: str, path: str = "", formats: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.formats = tuple(formats)

    def __reduce__(self) -> tuple[type, tuple[str, str, tuple[str, ...]]]:
        return type(self), (str(self), self.path, self.formats)


class CheckpointExistsError(UCPError, FileExistsError):
    """A save or an index rebuild that would replace a committed checkpoint (or index) it was not
    asked to replace; names the directory."""


class CheckpointWriteError(UCPError, OSError):
    """A checkpoint file that could not be written (no space, an I/O error): names the file or
    directory and the rank, and keeps the errno (``ENOSPC``...)."""


class UCPWarning(_OptionHint, UserWarning):
    """A warning of the library that may name an option to pass (see :class:`UCPError`)."""


def listed(items: Sequence[object], limit: int = 10, sep: str = ", ") -> str:
    """What a message shows of a list: the first ``limit`` of ``items`` joined by ``sep``, then
    how many are left out (``a, b, c ... (7 more)``); one form for every message, never a cut
    that hides that there were more."""
    shown = sep.join(map(str, items[:limit]))
    return shown + (f" ... ({len(items) - limit} more)" if len(items) > limit else "")


def unwrap(exc: BaseException) -> UCPError | None:
    """The library's error behind ``exc``, or None when there is none.

    ``dcp.save`` and ``dcp.load`` catch what the storage layer raises on each
    rank and raise ``torch.distributed.checkpoint.api.CheckpointException``
    instead: a ``BaseException`` (``except Exception`` does not catch it)
    whose ``failures`` maps each failing rank to ``(exception, traceback)``.
    This returns the :class:`UCPError` of the lowest failing rank (or ``exc``
    itself if it is one; the causes of either are searched too)::

        try:
            dcp.load(state, storage_reader=UCPStorageReader(path))
        except CheckpointException as e:
            err = unwrap(e)
            if err is None:
                raise
            raise err from e  # e.g. a ChecksumError naming the file and tensor
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, UCPError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for rank in sorted(failures):  # ranks are ints
                inner = failures[rank]
                inner = inner[0] if isinstance(inner, tuple) and inner else inner
                if isinstance(inner, BaseException):
                    todo.append(inner)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None
