"""Command-line conventions the scripts share: comma-separated choices, ``--quick`` defaults."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def comma_list(parser: argparse.ArgumentParser, text: str, choices: Sequence[str] | None = None,
               what: str = "value") -> list[str]:
    """The non-empty items of a comma-separated option; ``parser.error`` on one not in ``choices``."""
    items = [x for x in text.split(",") if x]
    for x in items:
        if choices is not None and x not in choices:
            parser.error(f"unknown {what} {x!r}; choose from {', '.join(choices)}")
    return items


def quick_defaults(args: argparse.Namespace, **defaults: tuple[Any, Any]) -> None:
    """Each option in ``defaults`` left None gets its ``(quick, full)`` value, as ``args.quick`` says."""
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
