"""How ``ucp-dcp`` speaks: its name, exit statuses, one-line errors, library messages in its flags.

A library error or warning that a keyword argument would fix records it
(:class:`~ucp_dcp.errors.UCPError`'s ``option`` and ``hint``); :data:`FLAGS`
says which flag of the command that is, and :func:`in_cli_words` rewrites the
message to name it.
"""

from __future__ import annotations

import sys

PROG = "ucp-dcp"
EXIT_OK = 0
EXIT_FAILED = 1  # verify found problems / diff found differences
EXIT_ERROR = 2  # the command could not do its job

STORAGE_OPTIONS_ENV = "UCP_DCP_STORAGE_OPTIONS"

FLAGS = {
    "dcp_values": "--dcp-values",
    "overwrite": "--overwrite",
    "prefix": "--prefix",
    "config": "--config",
    "verify": "--no-verify",
    "storage_options": "--storage-options",
}
"""The flag of each keyword argument a library message may name (``option`` of an error)."""


def _error_line(reason: str) -> None:
    one_line = "; ".join(part.strip() for part in str(reason).splitlines() if part.strip())
    print(f"{PROG}: error: {one_line}", file=sys.stderr)


def in_cli_words(e: BaseException | Warning) -> str:
    """The message of a library error or warning, naming this command's flag where it names a
    keyword argument (its ``option`` and ``hint``; see :data:`FLAGS`)."""
    text = str(e)
    option, hint = getattr(e, "option", None), getattr(e, "hint", None)
    flag = FLAGS.get(option) if isinstance(option, str) else None
    if flag is None or not hint or hint not in text:
        return text
    value = getattr(e, "option_value", None)
    return text.replace(
        hint, flag if value is None or isinstance(value, bool) else f"{flag} {value}"
    )
