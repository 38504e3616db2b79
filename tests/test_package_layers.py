"""The package tree shows the layers, and imports go one way.

Read from the source files (no import): every module-level ``import`` of
one ucp_dcp module by another must go from a higher layer to a lower one
(or stay within a subpackage), so there are no import cycles and a
newcomer can read the package bottom-up.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "src" / "ucp_dcp"

# Lowest first. ``errors`` and ``_compat`` import nothing of the package,
# ``byteio.durable`` only ``errors``; any layer may use them.
LAYERS = ["core", "format", "byteio", "sources", "dcp", "adapters", "tools", "manager"]
LEAVES = {"errors", "_compat", "byteio.durable"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(path: Path, everywhere: bool = False) -> set[str]:
    """Package-relative names of the ucp_dcp modules ``path`` imports at module level
    (``everywhere``: also inside functions and ``if TYPE_CHECKING:`` blocks)."""
    me = _module_name(path)
    pkg_parts = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if everywhere else tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.startswith("ucp_dcp"):
                mod = node.module[len("ucp_dcp"):].lstrip(".")
            else:
                continue
            for alias in node.names:  # ``from . import x`` may name a module
                sub = f"{mod}.{alias.name}" if mod else alias.name
                found.add(sub if (PKG / sub.replace(".", "/")).with_suffix(".py").exists() else mod)
    return {m for m in found if m}


def _layer(mod: str) -> int | None:
    if mod in LEAVES or mod.split(".")[0] in LEAVES:
        return None
    top = mod.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else None


def test_every_subpackage_is_a_layer() -> None:
    subpackages = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert subpackages == set(LAYERS)


def test_imports_go_down_the_layers() -> None:
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        me = _module_name(path)
        mine = _layer(me)
        if mine is None:
            continue
        for dep in _imports(path):
            theirs = _layer(dep)
            if theirs is not None and theirs > mine:
                wrong.append(f"{me} ({LAYERS[mine]}) imports {dep} ({LAYERS[theirs]})")
    assert wrong == []


def test_leaves_import_only_errors() -> None:
    """The leaves any layer may use stay leaves: ``errors`` and ``_compat`` import nothing of the
    package, ``byteio.durable`` nothing but ``errors``."""
    allowed = {"errors": set(), "_compat": set(), "byteio.durable": {"errors"}}
    extra = {m: _imports(PKG / f"{m.replace('.', '/')}.py") - ok for m, ok in allowed.items()}
    assert extra == {m: set() for m in allowed}


def test_no_import_cycles() -> None:
    """None at all: not through imports inside functions, nor through ``if TYPE_CHECKING:``
    (a circle there is still two modules that cannot be read one after the other)."""
    # An edge into a package means its __init__, a module of its own here.
    graph = {_module_name(p): _imports(p, everywhere=True) for p in PKG.rglob("*.py")}
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d not in graph or d == m:
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d):], d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, [*stack, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_private_torch_apis_come_through_compat() -> None:
    """Only ``_compat.py`` imports private torch names, so a torch upgrade touches one file."""
    offenders = []
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                private = any(p.startswith("_") for p in node.module.split(".")) or any(
                    a.name.startswith("_") for a in node.names
                )
                if private:
                    offenders.append(f"{path.relative_to(PKG)}:{node.lineno} from {node.module}")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(PKG)}:{node.lineno} import {a.name}" for a in node.names
                              if a.name.split(".")[0] == "torch" and any(p.startswith("_") for p in a.name.split("."))]
    assert offenders == []


# Modules that open, list or remove files; ``format/`` is data and parsing only.
FILE_MODULES = {"os", "io", "shutil", "tempfile", "pathlib", "mmap", "fcntl", "glob"}


def test_format_opens_no_files() -> None:
    """``format/`` parses and serialises bytes; reading and writing files is ``byteio/``'s (and
    ``sources/``'s) job, so format/ imports no file-system module and calls no ``open``."""
    offenders = []
    for path in sorted((PKG / "format").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno} open(...)")
                continue
            else:
                continue
            offenders += [f"{path.relative_to(PKG)}:{node.lineno} import {n}" for n in names
                          if n.split(".")[0] in FILE_MODULES]
    assert offenders == []
