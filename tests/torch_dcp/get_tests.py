#!/usr/bin/env python
"""Copy PyTorch's DCP test files into tests/torch_dcp/upstream/ for run.py.

PyTorch's tests are not committed to this repository. Point this script at a
PyTorch source tree (a checkout of the tag that matches the installed torch,
``v2.13.0``, is best), or at a git repository and a revision::

    python tests/torch_dcp/get_tests.py --from ~/src/pytorch
    python tests/torch_dcp/get_tests.py --git ~/src/pytorch --rev v2.13.0
    python tests/torch_dcp/get_tests.py --from ~/src/pytorch --all   # every test file
    python tests/torch_dcp/get_tests.py --check                      # compare with MANIFEST.json

By default it copies the files listed in ``MANIFEST.json`` (those the
recorded results came from) and reports each one whose hash differs from the
manifest's: another version of a test file may pass or skip other tests, so
``run.py`` then records new results. ``--all`` copies every ``test_*.py`` of
``test/distributed/checkpoint/`` (and their folders' helpers) instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
UPSTREAM = HERE / "upstream"
MANIFEST = HERE / "MANIFEST.json"
SUBDIR = "test/distributed/checkpoint"


def manifest() -> dict:
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(rel: str, data: bytes) -> None:
    dest = UPSTREAM / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    # Packages, so that spawned ranks import the test module by a package
    # name and pass through tests/torch_dcp/__init__.py (the substitution).
    d = dest.parent
    while True:
        (d / "__init__.py").touch()
        if d == UPSTREAM:
            break
        d = d.parent


def _listing_from_tree(root: Path) -> list[str]:
    base = root / SUBDIR
    return sorted(str(p.relative_to(base)) for p in base.rglob("*.py") if p.name != "__init__.py")


def _listing_from_git(repo: Path, rev: str) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-tree", "-r", "--name-only", rev, "--", SUBDIR + "/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()
    return sorted(p[len(SUBDIR) + 1:] for p in out if p.endswith(".py") and not p.endswith("__init__.py"))


def _read(rel: str, tree: Path | None, git: tuple[Path, str] | None) -> bytes:
    if tree is not None:
        return (tree / SUBDIR / rel).read_bytes()
    repo, rev = git  # type: ignore[misc]
    return subprocess.run(
        ["git", "-C", str(repo), "show", f"{rev}:{SUBDIR}/{rel}"], check=True, capture_output=True
    ).stdout


def check() -> int:
    bad = 0
    for f in manifest()["files"]:
        p = UPSTREAM / f["path"]
        if not p.exists():
            print(f"missing   {f['path']}")
            bad += 1
        elif _sha(p.read_bytes()) != f["sha256"]:
            print(f"differs   {f['path']} (manifest: pytorch@{f['commit'][:12]})")
            bad += 1
        else:
            print(f"ok        {f['path']}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="tree", type=Path, help="a PyTorch source tree")
    src.add_argument("--git", type=Path, help="a PyTorch git repository (with --rev)")
    src.add_argument("--check", action="store_true", help="compare upstream/ with MANIFEST.json")
    ap.add_argument("--rev", default="v2.13.0", help="revision for --git (default v2.13.0)")
    ap.add_argument("--all", action="store_true", help="copy every test file, not only the manifest's")
    args = ap.parse_args(argv)

    if args.check:
        return check()
    git = (args.git, args.rev) if args.git else None
    if args.tree is not None and not (args.tree / SUBDIR).is_dir():
        sys.exit(f"{args.tree} has no {SUBDIR}/")
    if args.all:
        rels = _listing_from_tree(args.tree) if args.tree is not None else _listing_from_git(*git)  # type: ignore[misc]
        expected = {f["path"]: f["sha256"] for f in manifest()["files"]}
    else:
        expected = {f["path"]: f["sha256"] for f in manifest()["files"]}
        rels = sorted(expected)
    differ = 0
    for rel in rels:
        data = _read(rel, args.tree, git)
        _write(rel, data)
        note = ""
        if rel in expected and _sha(data) != expected[rel]:
            note = "  (differs from MANIFEST.json: results may differ from the recorded ones)"
            differ += 1
        print(f"copied {rel}{note}")
    UPSTREAM.mkdir(exist_ok=True)
    (UPSTREAM / "__init__.py").touch()
    print(f"{len(rels)} files in {UPSTREAM.relative_to(HERE.parents[1])}; {differ} differ from the manifest")
    return 0


if __name__ == "__main__":
    sys.exit(main())
