"""The README and docs/ as a reader meets them: the usage block runs as written, every
relative link and #anchor resolves, and the documented way out of DCP's CheckpointException works."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import ChecksumError, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.errors import StorageError, unwrap

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def usage_block() -> str:
    """The first python block under README's "## Usage"."""
    text = (ROOT / "README.md").read_text()
    usage = text[text.index("\n## Usage\n"):]
    m = re.search(r"^```python\n(.*?)^```", usage, re.S | re.M)
    assert m, "README's Usage section has no python block"
    return m.group(1)


def test_readme_usage_block_runs_as_written(tmp_path: Path) -> None:
    """In a fresh process, in an empty directory, with nothing added: it saves, loads, and reads the
    DCP and Hugging Face variants."""
    script = tmp_path / "usage.py"
    script.write_text(usage_block())
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    assert {"ckpt", "dcp-ckpt", "hf-model"} <= {c.name for c in tmp_path.iterdir()}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lowercase, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slug_rules() -> None:
    assert slug("DCP's `FileSystemWriter` format") == "dcps-filesystemwriter-format"
    assert slug("Commits that don't clobber") == "commits-that-dont-clobber"
    assert slug("Errors inside dcp.save and dcp.load") == "errors-inside-dcpsave-and-dcpload"
    assert slug("`convert`: any source as a native checkpoint") == "convert-any-source-as-a-native-checkpoint"


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_unwrap_gets_the_library_error_out_of_checkpoint_exception(tmp_path: Path) -> None:
    """The docs' example: a damaged checkpoint fails dcp.load with CheckpointException (not an
    Exception); unwrap gives the ChecksumError naming the file."""
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4096.0)}, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    [data] = path.glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    state = {"w": torch.zeros(4096)}
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    assert not isinstance(info.value, Exception)
    err = unwrap(info.value)
    assert isinstance(err, ChecksumError) and err.path == str(data)
    assert unwrap(err) is err
    assert unwrap(ValueError("not ours")) is None
    wrapped = CheckpointException("load", {1: (StorageError("rank 1"), None), 0: (KeyError("x"), None)})
    assert str(unwrap(wrapped)) == "rank 1"  # the lowest rank whose failure is the library's
    try:
        raise RuntimeError("outer") from StorageError("inner")
    except RuntimeError as e:
        assert str(unwrap(e)) == "inner"  # causes are searched too


def test_help_of_the_reader_names_no_private_detail() -> None:
    """help(UCPStorageReader) is for users: no development machine, no private constant."""
    import pydoc

    text = pydoc.render_doc(UCPStorageReader, renderer=pydoc.plaintext)
    for word in ("development", " VM", "_IO_THREADS", "_MiB"):
        assert word not in text, word


def test_every_documented_import_works() -> None:
    """``from ucp_dcp... import ...`` in README.md, docs/ and examples/*.md names what exists."""
    import importlib
    import importlib.util

    pages = [*PAGES, *sorted((ROOT / "examples").glob("*.md"))]
    broken = []
    for page in pages:
        for module, names in re.findall(r"from (ucp_dcp[\w.]*) import ([\w ,]+)", page.read_text()):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                broken.append(f"{page.relative_to(ROOT)}: {module} ({e})")
                continue
            for name in (n.strip() for n in names.split(",")):
                if name and not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                    broken.append(f"{page.relative_to(ROOT)}: {module}.{name}")
    assert not broken, "\n".join(broken)
