"""Every error the library raises to a user derives from ``ucp_dcp.errors.UCPError``.

The source of ``src/ucp_dcp`` is read with :mod:`ast` (nothing is imported):
a ``raise`` of a builtin exception class (``raise ValueError(...)``,
``raise OSError``), a builtin exception built anywhere else (``OSError(errno,
msg)`` returned to be raised later), and an exception class defined on a
builtin base alone all fail this test. The library's classes in
``ucp_dcp/errors.py`` keep their builtin bases (``class X(UCPError,
ValueError)``), so callers' ``except ValueError`` still works.

Allowed without listing, because Python or the code's own structure needs them:

- ``KeyError``/``IndexError`` inside ``__getitem__``/``__missing__``,
  ``AttributeError`` inside ``__getattr__``, ``StopIteration`` inside
  ``__next__``: the protocols Python's own ``in``, ``get`` and iteration rely on.
- ``NotImplementedError`` in a method whose body is a docstring and that raise
  alone (a hook subclasses override).
- ``AssertionError``: an internal invariant broken, a bug in the library, never
  a user's mistake.

Everything else allowed is listed in ``ALLOWED`` with the reason.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import ucp_dcp

PACKAGE = Path(ucp_dcp.__file__).parent

BUILTIN_EXCEPTIONS = frozenset(
    name
    for name in dir(builtins)
    if isinstance(getattr(builtins, name), type)
    and issubclass(getattr(builtins, name), BaseException)
)

# Python protocols: the special method and the builtin exceptions its callers expect.
PROTOCOLS = {
    "__getitem__": {"KeyError", "IndexError"},
    "__missing__": {"KeyError"},
    "__getattr__": {"AttributeError"},
    "__next__": {"StopIteration"},
}

ALWAYS = {"AssertionError"}

# (file relative to src/ucp_dcp, enclosing function or class, exception): why it may stay builtin.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("errors.py", "UCPError", "Exception"): "the base of every library error",
    # A file object's seek before the start: zipfile (the only caller) expects OSError from a
    # file too short to be an archive, and turns it into its own BadZipFile.
    ("sources/_torch_archive.py", "seek", "OSError"): "file protocol for zipfile",
    # The request scheduler's own signals between a try and its retry: ObjectStore wraps the
    # last one in a StorageError naming the object, the range, the rank and the time waited.
    ("byteio/requests.py", "DeadlineExceeded", "TimeoutError"): "internal: a try past its deadline",
    ("byteio/scheduler.py", "_Wrong", "Exception"): "internal: an answer the check refused",
    # Raised in an I/O thread once its load failed at a deadline, so it reads nothing more:
    # IOWorkers.wait raises the load's StorageError before any future holding it is looked at.
    ("byteio/workers.py", "Abandoned", "Exception"): "internal: stops an I/O thread of a failed load",
}


def _is_abstract_hook(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    exc = body[0].exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


class _Finder(ast.NodeVisitor):
    def __init__(self, rel: str) -> None:
        self.rel = rel
        self.scope: list[ast.AST] = []
        self.found: list[str] = []

    def _owner(self) -> str:
        for node in reversed(self.scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                return node.name
        return "<module>"

    def _allowed(self, name: str) -> bool:
        if name in ALWAYS:
            return True
        owner = self._owner()
        if name in PROTOCOLS.get(owner, ()):
            return True
        if name == "NotImplementedError":
            fn = next(
                (
                    n
                    for n in reversed(self.scope)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                ),
                None,
            )
            if fn is not None and _is_abstract_hook(fn):
                return True
        return (self.rel, owner, name) in ALLOWED

    def _report(self, node: ast.expr | ast.stmt, name: str, what: str) -> None:
        if not self._allowed(name):
            self.found.append(f"{self.rel}:{node.lineno} in {self._owner()}: {what}")

    def generic_visit(self, node: ast.AST) -> None:
        self.scope.append(node)
        super().generic_visit(node)
        self.scope.pop()

    def visit_Raise(self, node: ast.Raise) -> None:
        if isinstance(node.exc, ast.Name) and node.exc.id in BUILTIN_EXCEPTIONS:
            self._report(node, node.exc.id, f"raise {node.exc.id}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id in BUILTIN_EXCEPTIONS:
            self._report(node, node.func.id, f"{node.func.id}(...)")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        names = [b.id for b in node.bases if isinstance(b, ast.Name)]
        if names and len(names) == len(node.bases) and all(n in BUILTIN_EXCEPTIONS for n in names):
            self.scope.append(node)  # the class is its own owner in ALLOWED
            for n in names:
                self._report(node, n, f"class {node.name}({n}) outside UCPError")
            self.scope.pop()
        self.generic_visit(node)


def builtin_raises(root: Path = PACKAGE) -> list[str]:
    """Every raise (or construction) of a builtin exception under ``root`` that is not
    allowed."""
    found: list[str] = []
    for path in sorted(root.rglob("*.py")):
        finder = _Finder(path.relative_to(root).as_posix())
        finder.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        found += finder.found
    return found


def test_finder_sees_each_form(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "class Bad(ValueError):\n"
        "    pass\n"
        "class Hook:\n"
        "    def run(self):\n"
        '        """Override."""\n'
        "        raise NotImplementedError\n"
        "    def __getitem__(self, k):\n"
        "        raise KeyError(k)\n"
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError(f'bad {x}')\n"
        "    if not x:\n"
        "        raise NotImplementedError('later')\n"
        "    assert_ = AssertionError('fine')\n"
        "    return OSError(5, 'built to be raised later')\n"
        "def g():\n"
        "    raise TypeError\n"
    )
    assert builtin_raises(tmp_path) == [
        "m.py:1 in Bad: class Bad(ValueError) outside UCPError",
        "m.py:11 in f: ValueError(...)",
        "m.py:13 in f: NotImplementedError(...)",
        "m.py:15 in f: OSError(...)",
        "m.py:17 in g: raise TypeError",
    ]


def test_errors_derive_from_ucp_error() -> None:
    found = builtin_raises()
    assert not found, (
        f"{len(found)} builtin exception(s) raised to users; raise a ucp_dcp.errors class "
        "(UCPError with the builtin base kept) or, for a never user-facing raise, add it to "
        "ALLOWED with the reason:\n  " + "\n  ".join(found)
    )
