"""Every public name has one stable import path: the top-level ``ucp_dcp`` package.

The docs and README import from ``ucp_dcp`` only; a name they use must be
there, listed in ``__all__``, whatever module defines it.
"""

from __future__ import annotations

import re
from pathlib import Path

import ucp_dcp

ROOT = Path(__file__).resolve().parent.parent

# What a user builds a save or load from, in the order the README introduces it.
DOCUMENTED = [
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "UCPStorageWriter",
    "UCPStorageReader",
    "RankLocal",
    "CheckpointManager",
    "Checkpoint",
    "load_state_dict",
    "load_into_module",
    "LayoutSpec",
    "FlatShard",
    "fsdp1_state_dict",
    # the layout rules
    "Rename",
    "Reindex",
    "Fused",
    "Shard",
    "VocabPad",
    "Replicated",
    "Averaged",
    "Stacked",
    "Unstacked",
    # the common error base
    "UCPError",
]


def _names_the_docs_import() -> set[str]:
    """Names in ``from ucp_dcp import ...`` lines of README.md and docs/*.md."""
    names: set[str] = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"^\s*from ucp_dcp import ([\w, ]+)", path.read_text(), re.M):
            names.update(n.strip() for n in m.group(1).split(",") if n.strip())
    return names


def test_documented_names_import_from_the_top_level() -> None:
    missing = [n for n in DOCUMENTED if n not in ucp_dcp.__all__ or not hasattr(ucp_dcp, n)]
    assert missing == []


def test_names_the_docs_import_are_public() -> None:
    names = _names_the_docs_import()
    assert {"UCPSavePlanner", "LayoutSpec", "Fused"} <= names  # the scan found the examples
    assert sorted(names - set(ucp_dcp.__all__)) == []


def test_all_names_exist() -> None:
    assert [n for n in ucp_dcp.__all__ if not hasattr(ucp_dcp, n)] == []
    assert len(set(ucp_dcp.__all__)) == len(ucp_dcp.__all__)


def test_layout_rules_are_the_adapter_classes() -> None:
    from ucp_dcp.adapters import rules
    from ucp_dcp.adapters.layout_spec import LayoutSpec

    assert ucp_dcp.LayoutSpec is LayoutSpec
    names = ("Rename", "Reindex", "Fused", "Shard", "VocabPad", "Replicated", "Averaged")
    for name in names + ("Stacked", "Unstacked"):
        assert getattr(ucp_dcp, name) is getattr(rules, name)


def test_every_error_is_a_ucp_error_with_a_builtin_base() -> None:
    """``except UCPError`` catches each; ``except ValueError`` (or the like) still does too."""
    from ucp_dcp import errors

    builtin = (ValueError, TypeError, KeyError, RuntimeError, OSError, LookupError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        if name == "unwrap":  # the one function: the library's error inside DCP's wrapper
            continue
        if name == "UCPWarning":  # a warning, not an error: a UserWarning with the option data
            assert issubclass(cls, UserWarning), name
            continue
        assert issubclass(cls, errors.UCPError), name
        if cls not in (errors.UCPError, errors.CLIError):
            assert issubclass(cls, builtin), name


def test_every_error_class_is_listed_in_errors_all() -> None:
    """The loop above sees every error: each exception class errors.py defines (bar private
    helpers) is in ``errors.__all__`` (``PlacementError`` once was not)."""
    import inspect

    from ucp_dcp import errors

    defined = {
        n
        for n, c in vars(errors).items()
        if inspect.isclass(c)
        and issubclass(c, BaseException)
        and c.__module__ == errors.__name__
        and not n.startswith("_")
    }
    assert sorted(defined - set(errors.__all__)) == []


def test_no_public_name_is_defined_in_a_private_module() -> None:
    """Each name of ``ucp_dcp.__all__`` that a module defines comes from a public one (no
    ``_``-prefixed part in its dotted path), so its documentation has a public home."""
    private = []
    for name in ucp_dcp.__all__:
        obj = getattr(ucp_dcp, name)
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and mod.startswith("ucp_dcp"):
            if any(part.startswith("_") for part in mod.split(".")[1:]):
                private.append(f"{name} ({mod})")
    assert private == []


def test_every_warning_the_library_gives_is_a_ucp_warning() -> None:
    """``warnings.filterwarnings(..., category=ucp_dcp.UCPWarning)`` sees every warning of the
    library: each ``warnings.warn`` in ``src/`` is handed a ``UCPWarning(...)`` (three were plain
    ``UserWarning`` text once)."""
    import ast

    plain = []
    for path in sorted((ROOT / "src" / "ucp_dcp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "warn" or not isinstance(node.func.value, ast.Name):
                continue
            if node.func.value.id != "warnings":
                continue
            first = node.args[0] if node.args else None
            # UCPWarning(...) or UCPWarning(...).with_option(...)
            while isinstance(first, ast.Call) and isinstance(first.func, ast.Attribute):
                first = first.func.value
            made = isinstance(first, ast.Call) and isinstance(first.func, ast.Name)
            if not (made and first.func.id == "UCPWarning"):  # type: ignore[union-attr]
                plain.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not plain, plain
