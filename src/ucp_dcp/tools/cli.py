"""The ``ucp-dcp`` command line: inspect, verify, diff and convert checkpoints.

Every command reads every checkpoint format :mod:`ucp_dcp.sources` knows.

Exit status: 0 on success; 1 when ``verify`` finds a problem (a damaged
checkpoint, an unreadable index included) or ``diff`` finds a difference; 2
for any other failure (bad arguments, a path that does not exist or holds no
checkpoint, a failed conversion), reported as one line ``ucp-dcp: error:
<reason>`` on stderr; 130 when interrupted. ``--debug`` adds the traceback.

Messages name the command's own flags: a library error or warning that a
keyword argument would fix records it (:class:`~ucp_dcp.errors.UCPError`'s
``option`` and ``hint``), and :data:`FLAGS` says which flag that is here.

Commands: ``inspect``, ``verify``, ``diff``, ``export-hf``, ``convert`` (and
its aliases ``import-dcp``, ``import-hf``); ``ucp-dcp COMMAND --help``
describes each.

A checkpoint to read (``inspect``, ``verify``, ``diff``, the source of
``export-hf`` and ``convert``) may be the fsspec URL of a universal
checkpoint in object storage (``s3://bucket/run/step-100``, ``gs://``,
``memory://``...); outputs stay local. ``--storage-options JSON`` (a JSON
object, given to fsspec as it is: credentials, ``{"client_kwargs":
{"endpoint_url": ...}}``) applies to every URL of the command; without it
the environment variable ``UCP_DCP_STORAGE_OPTIONS`` is read, and without
either fsspec's own defaults apply (environment credentials).

The conversion modules (:mod:`ucp_dcp.tools.hf`, :mod:`ucp_dcp.tools.convert`)
are imported only by the commands that need them.

The parser and its option tables live in :mod:`ucp_dcp.tools._cli_args`, the
commands and their output in :mod:`ucp_dcp.tools._cli_commands`, the
command's name, exit statuses and flag words in :mod:`ucp_dcp.tools._cli_words`;
this module runs them and turns every failure into an exit status.
"""

from __future__ import annotations

import io
import os
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from ..errors import CLIError, StorageError
from ._cli_args import (
    _refuse_unused,
    _storage_options,
    _unknown_arguments,
    build_parser,
    parse_size,
    parse_storage_options,
)
from ._cli_commands import format_inspection
from ._cli_words import (
    EXIT_ERROR,
    EXIT_OK,
    FLAGS,
    PROG,
    STORAGE_OPTIONS_ENV,
    _error_line,
    in_cli_words,
)

__all__ = [
    "main",
    "build_parser",
    "format_inspection",
    "in_cli_words",
    "parse_size",
    "parse_storage_options",
    "FLAGS",
]


_CREDENTIALS_HINT = (
    "; give the store's credentials with --storage-options JSON (e.g. "
    '\'{"key": "...", "secret": "..."}\' for s3://) or the environment variable '
    f"{STORAGE_OPTIONS_ENV}"
)


def _reason(e: BaseException) -> str:
    """What went wrong, in words, for the one-line error."""
    if isinstance(e, StorageError) and _about_credentials(e):
        return in_cli_words(e) + _CREDENTIALS_HINT
    if isinstance(e, OSError) and e.filename is not None:
        where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
        return f"{where}: {(e.strerror or str(e)).lower()}"
    if isinstance(e, (CLIError, ValueError, OSError, EOFError, KeyError, ImportError)):
        return in_cli_words(e) or type(e).__name__
    return f"unexpected {type(e).__name__}: {e} (rerun with --debug for the traceback)"


def _about_credentials(e: BaseException) -> bool:
    """Whether the store refused for want of credentials: access denied, or the client found
    none (its error, the cause of ``e``, is named ``...Credentials...``)."""
    causes = [e, e.__cause__, e.__context__]
    if any(isinstance(c, PermissionError) for c in causes):
        return True
    return any(
        "Credentials" in k.__name__ for c in causes if c is not None for k in type(c).__mro__
    )


def _one_line_warnings() -> None:
    """Inside ``warnings.catch_warnings()``: print warnings as ``ucp-dcp: warning: ...`` lines.

    torch's notice that ``dcp.save`` runs without a process group is dropped:
    this tool always runs in one process.
    """
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        said = in_cli_words(message) if isinstance(message, Warning) else message
        text = "; ".join(line.strip() for line in said.splitlines() if line.strip())
        print(f"{PROG}: warning: {text}", file=sys.stderr)

    warnings.showwarning = show


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # no real file descriptor (tests)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ucp-dcp`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:
            _unknown_arguments(args.command, extra)
        _refuse_unused(args)
    except CLIError as e:
        _error_line(str(e))
        return EXIT_ERROR
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    try:
        with warnings.catch_warnings():
            _one_line_warnings()
            args.storage = _storage_options(args)  # a bad JSON fails every command alike
            return args.handler(args)
    except KeyboardInterrupt:
        _error_line("interrupted")
        return 130
    except (
        BrokenPipeError
    ):  # e.g. `ucp-dcp inspect PATH | head`: the reader left, nothing to report
        _silence_stdout()
        return EXIT_ERROR
    except Exception as e:  # every failure becomes one line; --debug shows where it came from
        if args.debug:
            traceback.print_exc()
        _error_line(_reason(e))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
