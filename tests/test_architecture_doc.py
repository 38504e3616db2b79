"""docs/architecture.md cannot drift from the package: every module of ``src/ucp_dcp`` is in its
tree exactly once, under its package, and every error class of ``errors.py`` in its table of
errors exactly once."""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "architecture.md").read_text()
SRC = ROOT / "src" / "ucp_dcp"


def _listed_modules() -> Counter[str]:
    """The modules the page's package tree lists, as paths relative to ``src/ucp_dcp``."""
    out: Counter[str] = Counter()
    stack: list[tuple[int, str]] = []  # (indent, package path)
    in_tree = False
    for line in DOC.splitlines():
        if line.startswith("```"):
            in_tree = not in_tree
            stack = []
            continue
        if not in_tree:
            continue
        m = re.match(r"^(\s*)([\w]+)/(\s|$)", line)
        f = re.match(r"^(\s*)([\w]+\.py)(\s|$)", line)
        if m:
            indent = len(m.group(1))
            stack = [(i, p) for i, p in stack if i < indent]
            stack.append((indent, m.group(2)))
        elif f:
            indent = len(f.group(1))
            parents = [p for i, p in stack if i < indent]
            out[
                "/".join([*parents[1:], f.group(2)])
                if parents[:1] == ["ucp_dcp"]
                else "/".join([*parents, f.group(2)])
            ] += 1
    return out


def test_every_module_is_listed_once() -> None:
    modules = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py")}
    listed = _listed_modules()
    assert sorted(modules - set(listed)) == [], "modules missing from docs/architecture.md"
    assert sorted(set(listed) - modules) == [], (
        "docs/architecture.md lists modules that do not exist"
    )
    assert sorted(n for n, k in listed.items() if k > 1) == [], "modules listed twice"


def test_every_error_class_is_in_the_table_once() -> None:
    tree = ast.parse((SRC / "errors.py").read_text())
    classes = {
        n.name
        for n in tree.body
        if isinstance(n, ast.ClassDef)
        and not n.name.startswith("_")
        and n.name.endswith(("Error", "Warning"))
    }
    rows = Counter(re.findall(r"^\| `(\w+)` \|", DOC, flags=re.M))
    assert sorted(classes - set(rows)) == [], "error classes missing from the table"
    assert sorted(set(rows) - classes) == [], "the table names classes errors.py does not define"
    assert sorted(n for n, k in rows.items() if k > 1) == [], "error classes listed twice"
