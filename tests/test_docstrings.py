"""The package's docstrings stay readable: no ``Args:``/``Attributes:`` entry merged into the
line of another, and every ``::`` example that reads as Python parses (a mechanical reflow once
ran ``import torch.distributed.checkpoint as dcp`` and ``from ucp_dcp import ...`` into one
line, and ``train_step(...)`` into ``mgr.save(...)``)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "ucp_dcp"
# A line of a literal block that reads as Python: an import, an assignment or a call.
_PYTHON = re.compile(r"^\s*(import |from \S+ import |[\w.\[\]\"']+ = |[\w.]+\()")


def _documented() -> list[tuple[str, ast.AST, str]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        nodes = [
            tree,
            *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))),
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
            if doc:
                out.append((str(path.relative_to(SRC)), node, doc))
    return out


def _names(node: ast.AST) -> list[str]:
    """The parameters (or a class's fields and attributes) a docstring's entries may name."""
    if isinstance(node, ast.FunctionDef):
        args = node.args
        return [a.arg for a in args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    if isinstance(node, ast.ClassDef):
        names = [
            n.target.id
            for n in node.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        ]
        for n in ast.walk(node):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            ):
                names.append(n.attr)
            if isinstance(n, ast.FunctionDef) and n.name == "__init__":
                names += [a.arg for a in n.args.args + n.args.kwonlyargs if a.arg != "self"]
        return names
    return []


def test_no_argument_entry_is_merged_into_another() -> None:
    merged = []
    for where, node, doc in _documented():
        names = set(_names(node))
        for line in doc.splitlines():
            found = [n for n in names if re.search(rf"(^|[.)`] ){re.escape(n)}: ", line.strip())]
            if len(found) >= 2:
                merged.append(f"{where}: {getattr(node, 'name', '<module>')}: {line.strip()[:80]}")
    assert merged == []


def test_python_examples_parse() -> None:
    broken = []
    for where, node, doc in _documented():
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if not line.rstrip().endswith("::"):
                continue
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and not nxt.startswith("    "):
                    break
                block.append(nxt)
            code = textwrap.dedent("\n".join(block))
            body = [c for c in code.splitlines() if c.strip()]
            if sum(bool(_PYTHON.match(c)) for c in body) * 2 < len(body):
                continue  # mostly not statements: a file tree, a formula
            try:
                ast.parse(code)
            except SyntaxError as e:
                broken.append(f"{where}: {getattr(node, 'name', '<module>')}: {e.msg}: {e.text}")
    assert broken == []
