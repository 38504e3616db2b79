"""The ``ucp-dcp`` command line: inspect, verify, diff and convert checkpoints.

Commands: ``inspect``, ``verify``, ``diff``, ``export-hf``, ``convert`` (and
its aliases ``import-dcp``, ``import-hf``); ``ucp-dcp COMMAND --help``
describes each, docs/handoff.md ("The ``ucp-dcp`` command line") their exit
statuses and ``--storage-options``. Every command reads every checkpoint
format :mod:`ucp_dcp.sources` knows. This module holds the argument parser
(its option tables, argument types and refusals) and one handler per command,
which takes the parsed arguments, prints text or JSON and returns the exit
status; :func:`main` turns every failure into an exit status: 1 when
``verify`` finds a problem (an unreadable index included) or ``diff`` a
difference, 2 for any other failure, reported as one line ``ucp-dcp: error:
<reason>`` on stderr (``--debug`` adds the traceback).

Messages name the command's own flags: a library error or warning that a
keyword argument would fix records it (:class:`~ucp_dcp.errors.UCPError`'s
``option`` and ``hint``); :data:`FLAGS` says which flag that is here, and
:func:`in_cli_words` rewrites the message to name it.

The conversion functions are looked up when their command runs
(:func:`_optional_function`): a missing one fails that command only, in one line.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from ..byteio.progress import ProgressBar, format_bytes
from ..errors import CLIError, InvalidArgumentError, NotACheckpointError, StorageError
from .hf import parse_dtype
from .hf import parse_size as hf_parse_size

__all__ = [
    "main",
    "build_parser",
    "format_inspection",
    "in_cli_words",
    "parse_size",
    "parse_storage_options",
    "FLAGS",
]

PROG = "ucp-dcp"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_ERROR = 2

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


def _error_line(reason: str, kind: str = "error") -> None:
    """``reason`` on stderr as one line ``ucp-dcp: <kind>: ...`` (its lines joined by ``; ``)."""
    one_line = "; ".join(part.strip() for part in str(reason).splitlines() if part.strip())
    print(f"{PROG}: {kind}: {one_line}", file=sys.stderr)


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
        _error_line(in_cli_words(message) if isinstance(message, Warning) else message, "warning")

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


# ====================================================================== the parser

_EPILOG = (
    "exit status: 0 success; 1 verify found problems (a damaged checkpoint) or diff found "
    "differences; 2 any other error, such as a path that does not exist or holds no checkpoint "
    "(one line 'ucp-dcp: error: ...' on stderr). A checkpoint to read may be an fsspec URL "
    "(s3://bucket/ckpt); --storage-options JSON, else the environment variable "
    "UCP_DCP_STORAGE_OPTIONS, gives fsspec its options."
)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, raised rather than printed."""

    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')")


# ====================================================================== argument types


def parse_size(text: str) -> int:
    """Bytes in ``'5GB'`` (decimal, as Hugging Face counts), ``'512MiB'`` (binary) or ``'1000'``:
    :func:`~ucp_dcp.tools.hf.parse_size`, its error as argparse's."""
    try:
        return hf_parse_size(text)
    except InvalidArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rename_rule(text: str) -> tuple[str, str]:
    pattern, sep, repl = text.partition("=")
    if not sep or not pattern:
        raise argparse.ArgumentTypeError(
            f"invalid rename rule {text!r}; write PATTERN=REPL (a regular expression, split at "
            "the first '=')"
        )
    try:
        re.compile(pattern)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"invalid rename pattern {pattern!r}: {e}") from None
    return pattern, repl


def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid tolerance {text!r}; write a number such as 1e-6"
        ) from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"invalid tolerance {text!r}: must be 0 or more")
    return value


def parse_storage_options(text: str, origin: str = "--storage-options") -> dict[str, Any]:
    """The fsspec options in ``text``, which must be a JSON object; ``origin`` names where it came
    from."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CLIError(
            f"{origin}: not valid JSON ({e}); write a JSON object such as "
            '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\''
        ) from None
    if not isinstance(doc, dict):
        # The text itself is not echoed: it may hold credentials.
        raise CLIError(
            f"{origin}: expected a JSON object of fsspec options, got a JSON {type(doc).__name__}"
        )
    return doc


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-options``, else ``$UCP_DCP_STORAGE_OPTIONS``, else None (fsspec's defaults)."""
    if args.storage_options is not None:
        return parse_storage_options(args.storage_options)
    env = os.environ.get(STORAGE_OPTIONS_ENV)
    if env is not None and env.strip():
        return parse_storage_options(env, f"${STORAGE_OPTIONS_ENV}")
    return None


# ====================================================================== parser


def _common_options(defaults: bool) -> _Parser:
    """--quiet/--progress/--debug, accepted before and after the command name.

    Only the top-level parser sets defaults: a subcommand's default would
    overwrite a value given before the command name.
    """
    p = _Parser(add_help=False)  # a parent: only its arguments are used
    kw: dict[str, Any] = {"action": "store_true"}
    if not defaults:
        kw["default"] = argparse.SUPPRESS
    p.add_argument("-q", "--quiet", help="no progress bar", **kw)
    p.add_argument(
        "--progress", help="draw the progress bar even when stderr is not a terminal", **kw
    )
    p.add_argument("--debug", help="print the traceback of an error", **kw)
    return p


_DCP_VALUES_READ = (
    "load the pickled values of a DCP checkpoint with torch.load(weights_only=True) (refused by "
    "default)"
)
_DCP_VALUES_CONVERT = (
    "how the pickled values of a DCP checkpoint are loaded: with torch.load(weights_only=True), "
    "the one choice and convert's default"
)
_READING_OPTIONS = ("dcp_values", "no_verify", "storage_options")


def _reading_options(
    p: argparse.ArgumentParser,
    *,
    dcp_values: str | None = _DCP_VALUES_READ,
    no_verify: bool = True,
    top: bool = False,
) -> None:
    """The options of a command that reads checkpoints: --storage-options, and --dcp-values (with
    help text ``dcp_values``) and --no-verify where the command uses them.

    The top-level parser (``top``) takes all three before the command name, with the defaults;
    a subcommand's own leave the value given before its name alone, and record which of them
    the command takes (:func:`_refuse_unused`).
    """
    default: Any = argparse.SUPPRESS
    where = " (given before COMMAND: for the commands that take it)" if top else ""
    if top:
        p.set_defaults(dcp_values=None, no_verify=False, storage_options=None, takes=())
        default = None
    else:
        p.set_defaults(
            takes=("storage_options",)
            + (("dcp_values",) if dcp_values else ())
            + (("no_verify",) if no_verify else ())
        )
    if dcp_values:
        p.add_argument(
            "--dcp-values", choices=["weights_only"], default=default, help=dcp_values + where
        )
    if no_verify:
        p.add_argument(
            "--no-verify",
            action="store_true",
            default=False if top else argparse.SUPPRESS,
            help="do not check the tensor data read against the checksums recorded at save "
            "(checked by default)" + where,
        )
    p.add_argument(
        "--storage-options",
        metavar="JSON",
        default=default,
        help="fsspec options for checkpoints given as URLs (s3://bucket/ckpt), as a JSON object, "
        'e.g. \'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'; default: the '
        f"environment variable {STORAGE_OPTIONS_ENV}, else fsspec's defaults" + where,
    )


def _refuse_unused(args: argparse.Namespace) -> None:
    """An option given before the command name that the command does not take: one line."""
    given = [o for o in _READING_OPTIONS if getattr(args, o) not in (None, False)]
    unused = ["--" + o.replace("_", "-") for o in given if o not in args.takes]
    if unused:
        _unknown_arguments(args.command, unused)


def build_parser() -> argparse.ArgumentParser:
    """The ``ucp-dcp`` argument parser (one subcommand per task)."""
    from .. import __version__

    parser = _Parser(
        prog=PROG,
        parents=[_common_options(True)],
        epilog=_EPILOG,
        description="Inspect, verify, compare and convert ucp_dcp universal checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _reading_options(parser, top=True)  # before the command name, for the commands that take them
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_common_options(False)]

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=common, help=help, description=help, epilog=_EPILOG)
        p.set_defaults(handler=handler)
        return p

    for name, handler, text in (
        (
            "inspect",
            _cmd_inspect,
            "Summarise a checkpoint: format, step, world size, files, and every tensor's "
            "dtype, shape, sharding and size. Reads only the index.",
        ),
        (
            "verify",
            _cmd_verify,
            "Re-read every data file and check every checksum; print one line per "
            "problem (naming the file and the tensor or value) and exit 1 if there is any.",
        ),
    ):
        p = command(name, handler, text)
        # verify checks everything: --no-verify would contradict it.
        _reading_options(p, no_verify=name != "verify")
        p.add_argument(
            "path",
            metavar="PATH",
            help="checkpoint (any format ucp_dcp reads), or the fsspec URL "
            "of a ucp_dcp checkpoint (s3://bucket/ckpt)",
        )
        p.add_argument("--json", action="store_true", help="print machine-readable JSON only")

    p = command(
        "diff",
        _cmd_diff,
        "Compare two checkpoints: entries only in one, shape/dtype differences, "
        "per-tensor max abs difference (NaN-aware), differing values. Exit 1 if they differ.",
    )
    _reading_options(p)
    p.add_argument("a", metavar="A", help="first checkpoint (any format, or a URL)")
    p.add_argument("b", metavar="B", help="second checkpoint (any format, or a URL)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON only")
    p.add_argument(
        "--atol",
        type=_tolerance,
        default=0.0,
        metavar="X",
        help="tensors whose elements differ by at most X count as equal (default 0: exact)",
    )

    p = command(
        "export-hf",
        _cmd_export_hf,
        "Write a checkpoint's model weights as a Hugging Face "
        "safetensors checkpoint (sharded, with model.safetensors.index.json).",
    )
    _reading_options(p)
    p.add_argument("src", metavar="SRC", help="checkpoint (any format ucp_dcp reads, or a URL)")
    p.add_argument("dst", metavar="DST", help="output directory (local)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help="cast floating-point tensors to this dtype",
    )
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        metavar="SIZE",
        help="largest output file, e.g. 5GB (decimal) or 4GiB (binary)",
    )
    p.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="export only the tensors whose names start with PREFIX, "
        "with PREFIX removed (default: 'model.')",
    )
    p.add_argument(
        "--rename",
        type=_rename_rule,
        action="append",
        metavar="PATTERN=REPL",
        help="rename tensors with re.sub(PATTERN, REPL, name); repeatable, applied in order",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="also write config.json: from a config.json file, or from a "
        "Hugging Face model directory (its tokenizer and generation config are copied too)",
    )

    p = command(
        "convert",
        _cmd_convert,
        "Write any checkpoint this tool reads (ucp_dcp, DCP's FileSystemWriter "
        "format, Megatron torch_dist, accelerate subfolders, a Hugging Face model) as a ucp_dcp "
        "checkpoint with checksums, keeping its sharding. The pickled values of a DCP "
        "checkpoint are loaded with torch.load(weights_only=True) (--dcp-values weights_only, "
        "the default here). Loading never needs this.",
    )
    _reading_options(p, dcp_values=_DCP_VALUES_CONVERT)
    p.add_argument(
        "src",
        metavar="SRC",
        help="source checkpoint (directory or file), or the fsspec URL of a ucp_dcp checkpoint",
    )
    p.add_argument("dst", metavar="DST", help="output ucp_dcp checkpoint directory (local)")
    p.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="put PREFIX in front of a Hugging Face model's tensor names",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace a ucp_dcp checkpoint already in DST"
    )

    p = command(
        "import-hf",
        _cmd_import_hf,
        "Like convert, for a Hugging Face model (names get 'model.' by "
        "default; DST must be new or empty). Kept as an alias.",
    )
    p.add_argument("src", metavar="SRC", help="Hugging Face model directory")
    p.add_argument("dst", metavar="DST", help="output ucp_dcp checkpoint directory")
    p.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="put PREFIX in front of every tensor name (default: 'model.')",
    )

    p = command(
        "import-dcp",
        _cmd_convert,
        "Alias of convert for a checkpoint saved with DCP's default "
        "FileSystemWriter (.metadata + .distcp files).",
    )
    _reading_options(p, dcp_values=_DCP_VALUES_CONVERT)
    p.add_argument("src", metavar="SRC", help="DCP checkpoint directory")
    p.add_argument("dst", metavar="DST", help="output ucp_dcp checkpoint directory")
    p.add_argument(
        "--overwrite", action="store_true", help="replace a ucp_dcp checkpoint already in DST"
    )
    p.set_defaults(prefix=None)
    return parser


def _unknown_arguments(command: str, extra: list[str]) -> NoReturn:
    """Arguments the command does not take: name them and the command (one line)."""
    options = [a for a in extra if a.startswith("-")]
    what = (
        f"{command} does not take the option{'s' if len(options) > 1 else ''} {', '.join(options)}"
        if options
        else f"unrecognized arguments: {' '.join(extra)}"
    )
    raise CLIError(f"{what} (see '{PROG} {command} --help')")


# ====================================================================== checkpoint locations


def _require_checkpoint(path: str, storage_options: dict[str, Any] | None) -> None:
    """A path or URL with nothing at it: one line "not a checkpoint (...)", naming it (every command
    says it alike)."""
    from ..byteio.objstore import is_url
    from ..sources import checkpoint_exists

    if not checkpoint_exists(path, storage_options):
        what = "nothing is stored at this URL" if is_url(path) else "the path does not exist"
        raise CLIError(f"{path}: not a checkpoint ({what})")


def _reading_kwargs(args: argparse.Namespace, *paths: str) -> dict[str, Any]:
    """Check that something is at every checkpoint in ``paths`` (local or URL); the keyword
    arguments of the reading function called that the flags give: ``storage_options``,
    ``options`` (``--no-verify``) and ``dcp_values``, each only when given (the function keeps
    its defaults)."""
    from ..dcp.options import ReadOptions

    so = args.storage
    for path in paths:
        _require_checkpoint(path, so)
    kwargs: dict[str, Any] = {} if so is None else {"storage_options": so}
    if args.no_verify:
        kwargs["options"] = ReadOptions(verify=False)
    if args.dcp_values is not None:
        kwargs["dcp_values"] = args.dcp_values
    return kwargs


# ====================================================================== output helpers


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _progress(args: argparse.Namespace, label: str) -> ProgressBar:
    """A progress bar on stderr: off with --quiet, forced with --progress, else only on a
    terminal."""
    enabled = False if args.quiet else (True if args.progress else None)
    return ProgressBar(label, enabled=enabled)


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows padded into aligned columns (columns in ``right`` right-aligned)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ]
        out.append("  ".join(cells).rstrip())
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_inspection(info: dict[str, Any]) -> str:
    """The text ``ucp-dcp inspect`` prints for a
    :func:`~ucp_dcp.tools.inspection.inspect_checkpoint` summary."""
    step = "-" if info["step_key"] is None else f"{info['step']} ({info['step_key']!r})"
    head = [
        ["checkpoint", info["path"]],
        ["format", info["format"]],
        ["step", step],
        ["world size", str(info["world_size"])],
        ["files", f"{info['files']['count']} ({format_bytes(info['files']['bytes'])})"],
    ]
    lines = _table(head, set())
    if info["tensors"]:
        rows = [["name", "dtype", "shape", "sharding", "size"]]
        rows += [
            [
                t["name"],
                t["dtype"],
                "[" + ",".join(map(str, t["shape"])) + "]",
                t["sharding"],
                format_bytes(t["bytes"]),
            ]
            for t in info["tensors"]
        ]
        lines += ["", *_table(rows, {4})]
    tot = info["totals"]
    lines += [
        "",
        f"totals: {_plural(tot['tensors'], 'tensor')} ({format_bytes(tot['tensor_bytes'])}), "
        f"{_plural(tot['values'], 'value')}, {_plural(tot['rank_local'], 'rank-local value')}",
    ]
    lines += [f"warning: {w}" for w in info["warnings"]]
    return "\n".join(lines)


# ====================================================================== commands


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .inspection import inspect_checkpoint

    info = inspect_checkpoint(args.path, describe=in_cli_words, **_reading_kwargs(args, args.path))
    if args.json:
        _print_json(info)
    else:
        print(format_inspection(info))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..errors import CheckpointFormatError
    from .checkpoint import Checkpoint

    summary: dict[str, Any] = {"path": args.path, "files": 0, "bytes_verified": 0}
    # Nothing to verify: the same "cannot open" as every command (status 2, not 1).
    where = _reading_kwargs(args, args.path)
    try:
        ck = Checkpoint(args.path, **where)
    except NotACheckpointError:  # not a damaged checkpoint: no checkpoint (status 2)
        raise
    except CheckpointFormatError as e:  # an unreadable index is a verification failure
        problems = [str(e)]
    else:
        with ck, _progress(args, "verifying") as bar:
            # One damaged file header is reported again for every tensor it holds: say it once.
            problems = list(dict.fromkeys(ck.verify(on_progress=bar)))
            summary.update(
                format=ck.format,
                checksums=ck.has_checksums,
                files=len(ck.index.files),
                tensors=len(ck.index.tensors),
                values=len(ck.index.values),
                rank_local=len(ck.index.rank_local),
                bytes_verified=ck.bytes_read,
                placement_digests=ck.placement_digests,
            )
    if args.json:
        _print_json({**summary, "ok": not problems, "problems": problems})
    elif not problems:
        print(
            f"OK {args.path}: {_plural(summary['tensors'], 'tensor')}, "
            f"{_plural(summary['values'], 'value')}, "
            f"{_plural(summary['rank_local'], 'rank-local value')} in "
            f"{_plural(summary['files'], 'file')}; "
            f"{format_bytes(summary['bytes_verified'])} checked"
            + (
                ""
                if summary.get("checksums", True)
                else f" (the {summary['format']} format records no checksums: structure and "
                "readability only)"
            )
            + _digests_note(summary["placement_digests"], summary["tensors"])
        )
    else:
        for p in problems:
            print(p)
    if problems:
        _error_line(f"{args.path}: verify found {_plural(len(problems), 'problem')}")
        return EXIT_FAILED
    return EXIT_OK


def _digests_note(digests: int, tensors: int) -> str:
    """What ``verify`` says about placement digests (checked against the data when recorded)."""
    if not digests:
        return "; no placement digests (loads cannot use verify_placement)"
    return f"; placement digests of {digests} of {_plural(tensors, 'tensor')} match the data"


def _cmd_diff(args: argparse.Namespace) -> int:
    from .inspection import diff_checkpoints

    where = _reading_kwargs(args, args.a, args.b)
    with _progress(args, "comparing") as bar:
        report = diff_checkpoints(args.a, args.b, on_progress=bar, **where)
    same = report.identical if args.atol == 0 else report.within(args.atol)
    if args.json:
        _print_json(report.to_json(args.atol))
    else:
        lines = report.differences(args.atol)
        for line in lines:
            print(line)
        compared = (
            f"{_plural(len(report.tensors), 'tensor')} and "
            f"{_plural(report.values_compared, 'value')} compared"
        )
        if same:
            print(
                ("identical" if report.identical else f"equal within atol {args.atol:g}")
                + f": {compared}"
            )
        else:
            print(f"{_plural(len(lines), 'difference')}: {compared}")
    return EXIT_OK if same else EXIT_FAILED


def _optional_function(name: str, attr: str, command: str) -> Callable[..., Any]:
    """Function ``attr`` of module ``name``, imported on demand; a missing module, dependency or
    function is a one-line error naming ``command``."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise CLIError(
                f"{command} is not available: this installation of ucp_dcp has no module {e.name}"
            ) from None
        raise CLIError(
            f"{command} needs the Python package {e.name!r}, which is not installed"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CLIError(f"{command} is not available: {module.__name__} has no function {attr}()")
    return fn


def _cmd_export_hf(args: argparse.Namespace) -> int:
    export_hf = _optional_function("ucp_dcp.tools.hf", "export_hf", "export-hf")
    # convert and export_hf refuse a URL output themselves.
    kwargs: dict[str, Any] = _reading_kwargs(args, args.src)
    if args.dtype is not None:
        kwargs["dtype"] = parse_dtype(args.dtype)
    if args.max_shard_size is not None:
        kwargs["max_shard_size"] = args.max_shard_size
    if args.prefix is not None:
        kwargs["prefix"] = args.prefix
    if args.rename:
        kwargs["rename"] = list(args.rename)
    if args.config is not None:
        kwargs["config"] = args.config
    with _progress(args, "exporting") as bar:
        written = export_hf(args.src, args.dst, on_progress=bar, **kwargs)
    count = f": {_plural(len(written), 'file')}" if isinstance(written, list) else ""
    print(f"exported {args.src} to {args.dst} (Hugging Face safetensors){count}")
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    convert = _optional_function("ucp_dcp.tools.convert", "convert", args.command)
    kwargs: dict[str, Any] = {"overwrite": args.overwrite, **_reading_kwargs(args, args.src)}
    if args.prefix is not None:
        kwargs["prefix"] = args.prefix
    with _progress(args, "converting") as bar:
        convert(args.src, args.dst, on_progress=bar, **kwargs)
    print(f"converted {args.src} into ucp_dcp checkpoint {args.dst}")
    return EXIT_OK


def _cmd_import_hf(args: argparse.Namespace) -> int:
    import_hf = _optional_function("ucp_dcp.tools.hf", "import_hf", "import-hf")
    kwargs: dict[str, Any] = {} if args.prefix is None else {"prefix": args.prefix}
    _require_checkpoint(args.src, None)
    with _progress(args, "importing") as bar:
        import_hf(args.src, args.dst, on_progress=bar, **kwargs)
    print(f"imported {args.src} into ucp_dcp checkpoint {args.dst}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
