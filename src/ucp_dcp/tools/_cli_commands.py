"""The ``ucp-dcp`` subcommands: what each one does with its parsed arguments, and what it prints.

One handler per command (``inspect``, ``verify``, ``diff``, ``export-hf``,
``convert`` and its aliases), each taking the :class:`argparse.Namespace`
and returning the exit status, with the text and JSON output they print.
The conversion modules (:mod:`ucp_dcp.tools.hf`, :mod:`ucp_dcp.tools.convert`)
are imported only by the commands that need them.

It also says how ``ucp-dcp`` speaks (the command's name, exit statuses, one-line errors, library
messages in its flags' words): a library error or warning that a keyword argument would fix
records it (:class:`~ucp_dcp.errors.UCPError`'s ``option`` and ``hint``); :data:`FLAGS` says
which flag of the command that is, and :func:`in_cli_words` rewrites the message to name it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, TextIO

from ..byteio.progress import ProgressBar, format_bytes
from ..errors import CLIError, NotACheckpointError

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


_HF_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _require_checkpoint(path: str, storage_options: dict[str, Any] | None) -> None:
    """A path or URL with nothing at it: one line "not a checkpoint (...)", naming it (every command
    says it alike)."""
    from ..byteio.objstore import is_url
    from ..sources import checkpoint_exists

    if not checkpoint_exists(path, storage_options):
        what = "nothing is stored at this URL" if is_url(path) else "the path does not exist"
        raise CLIError(f"{path}: not a checkpoint ({what})")


def _location_options(args: argparse.Namespace, *paths: str) -> dict[str, Any]:
    """Check that something is at every checkpoint in ``paths`` (local or URL); the keyword
    arguments that reach them: ``{"storage_options": ...}`` when options were given, else
    nothing (the functions called keep their defaults)."""
    so = args.storage
    for path in paths:
        _require_checkpoint(path, so)
    return {} if so is None else {"storage_options": so}


# ====================================================================== output helpers


def _print_json(doc: Any, out: TextIO | None = None) -> None:
    json.dump(doc, out or sys.stdout, indent=2)
    (out or sys.stdout).write("\n")


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
    from ..dcp.options import ReadOptions
    from .inspection import inspect_checkpoint

    where = _location_options(args, args.path)
    info = inspect_checkpoint(
        args.path,
        describe=in_cli_words,
        dcp_values=args.dcp_values,
        options=ReadOptions(verify=not args.no_verify),
        **where,
    )
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
    where = _location_options(args, args.path)
    try:
        ck = Checkpoint(args.path, dcp_values=args.dcp_values, **where)
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
    from ..dcp.options import ReadOptions
    from .inspection import diff_checkpoints

    where = _location_options(args, args.a, args.b)
    with _progress(args, "comparing") as bar:
        report = diff_checkpoints(
            args.a,
            args.b,
            on_progress=bar,
            dcp_values=args.dcp_values,
            options=ReadOptions(verify=not args.no_verify),
            **where,
        )
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


def _optional_module(name: str, command: str) -> ModuleType:
    """Import module ``name`` on demand; a missing module or dependency is a one-line error."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name:
            raise CLIError(
                f"{command} is not available: this installation of ucp_dcp has no module {e.name}"
            ) from None
        raise CLIError(
            f"{command} needs the Python package {e.name!r}, which is not installed"
        ) from None


def _function(module: ModuleType, attr: str, command: str) -> Callable[..., Any]:
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CLIError(f"{command} is not available: {module.__name__} has no function {attr}()")
    return fn


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from ..dcp.options import ReadOptions

    export_hf = _function(
        _optional_module("ucp_dcp.tools.hf", "export-hf"), "export_hf", "export-hf"
    )
    kwargs: dict[str, Any] = _url_options(args)
    if args.dtype is not None:
        import torch

        kwargs["dtype"] = getattr(torch, _HF_DTYPES[args.dtype])
    if args.max_shard_size is not None:
        kwargs["max_shard_size"] = args.max_shard_size
    if args.prefix is not None:
        kwargs["prefix"] = args.prefix
    if args.rename:
        kwargs["rename"] = list(args.rename)
    if args.config is not None:
        kwargs["config"] = args.config
    if args.dcp_values is not None:
        kwargs["dcp_values"] = args.dcp_values
    if args.no_verify:
        kwargs["options"] = ReadOptions(verify=False)
    with _progress(args, "exporting") as bar:
        written = export_hf(args.src, args.dst, on_progress=bar, **kwargs)
    count = f": {_plural(len(written), 'file')}" if isinstance(written, list) else ""
    print(f"exported {args.src} to {args.dst} (Hugging Face safetensors){count}")
    return EXIT_OK


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..dcp.options import ReadOptions

    convert = _function(
        _optional_module("ucp_dcp.tools.convert", args.command), "convert", args.command
    )
    kwargs: dict[str, Any] = {"overwrite": args.overwrite, **_url_options(args)}
    if args.prefix is not None:
        kwargs["prefix"] = args.prefix
    if args.no_verify:
        kwargs["options"] = ReadOptions(verify=False)
    if args.dcp_values is not None:
        kwargs["dcp_values"] = args.dcp_values
    with _progress(args, "converting") as bar:
        convert(args.src, args.dst, on_progress=bar, **kwargs)
    print(f"converted {args.src} into ucp_dcp checkpoint {args.dst}")
    return EXIT_OK


def _url_options(args: argparse.Namespace) -> dict[str, Any]:
    """For a conversion: refuse a URL output, check a URL source has something stored, pass the
    storage options."""
    from ..byteio.objstore import is_url

    if is_url(args.dst):
        raise CLIError(
            f"{args.dst}: {args.command} writes a local directory, not object storage; write it "
            "locally and copy it there"
        )
    return _location_options(args, args.src)


def _cmd_import_hf(args: argparse.Namespace) -> int:
    import_hf = _function(
        _optional_module("ucp_dcp.tools.hf", "import-hf"), "import_hf", "import-hf"
    )
    kwargs: dict[str, Any] = {} if args.prefix is None else {"prefix": args.prefix}
    _require_checkpoint(args.src, None)
    with _progress(args, "importing") as bar:
        import_hf(args.src, args.dst, on_progress=bar, **kwargs)
    print(f"imported {args.src} into ucp_dcp checkpoint {args.dst}")
    return EXIT_OK
