"""Hugging Face model directories, local or in object storage: file names, and which files hold the
weights.

The directory view (:class:`ModelDir`, :class:`LocalDir`, :class:`StoreDir`)
lives in :mod:`._dirs`; it is re-exported here.

Shared by the Hugging Face source (:mod:`ucp_dcp.sources.hf`) and export
(:mod:`ucp_dcp.tools.hf`).
"""

from __future__ import annotations

import os
import re

from ..errors import CheckpointFormatError
from ..format.schema import parse_json
from ._dirs import LocalDir, ModelDir, StoreDir, plain_file_name

__all__ = [
    "HF_WEIGHTS_NAME",
    "HF_INDEX_NAME",
    "HF_CONFIG_FILES",
    "ModelDir",
    "LocalDir",
    "StoreDir",
    "find_hf_files",
    "local_model_dir",
    "looks_like_hf",
    "plain_file_name",
]

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
# Files copied next to the weights when ``config=`` names a Hugging Face model
# directory: what from_pretrained / AutoTokenizer read besides the weights.
HF_CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)

# Native data files are safetensors too: never mistake a directory of them
# (say, one whose index was lost) for a Hugging Face model.
_NATIVE_DATA_FILE = re.compile(r"rank\d{5}-.*\.safetensors")


def looks_like_hf(path: str | ModelDir) -> bool:
    """Whether ``path`` (a local path, or a directory view) is a Hugging Face safetensors model (by
    names alone)."""
    if isinstance(path, str):
        if os.path.isfile(path):
            return path.endswith(".safetensors") or path.endswith(".safetensors.index.json")
        if not os.path.isdir(path):
            return False
        path = LocalDir(path)
    d = path
    if d.is_file(HF_WEIGHTS_NAME) or d.is_file(HF_INDEX_NAME):
        return True
    names = d.list()
    if any(n.endswith(".safetensors.index.json") for n in names):
        return True
    st = [n for n in names if n.endswith(".safetensors")]
    return len(st) == 1 and not _NATIVE_DATA_FILE.fullmatch(st[0])


def local_model_dir(src: str) -> tuple[LocalDir, str | None]:
    """``(directory, file named directly or None)`` of local path ``src``: a directory, or one file
    in one."""
    if not os.path.exists(src):
        raise CheckpointFormatError(f"{src}: no such Hugging Face model directory or file")
    if os.path.isfile(src):
        return LocalDir(os.path.dirname(src) or "."), os.path.basename(src)
    return LocalDir(src), None


def find_hf_files(d: ModelDir, named: str | None = None) -> tuple[list[str], dict[str, str] | None]:
    """(safetensors file names, weight_map or None) of the Hugging Face model in directory ``d``.

    ``named`` is one ``.safetensors`` file or index named directly. Else the
    directory holds ``model.safetensors`` (which wins, as it does for
    ``from_pretrained``), or a sharded ``model.safetensors.index.json``, or
    the only ``*.safetensors.index.json`` / ``*.safetensors`` there.
    """
    if named is not None:
        if named.endswith(".index.json"):
            return _from_index(d, named)
        return [named], None
    if d.is_file(HF_WEIGHTS_NAME):
        # from_pretrained's choice too, even with an index next to it (export_hf writes one).
        return [HF_WEIGHTS_NAME], None
    if d.is_file(HF_INDEX_NAME):
        return _from_index(d, HF_INDEX_NAME)
    listing = sorted(d.list())
    indexes = [n for n in listing if n.endswith(".safetensors.index.json")]
    if len(indexes) == 1:
        return _from_index(d, indexes[0])
    files = [n for n in listing if n.endswith(".safetensors")]
    if len(files) == 1 and not indexes:
        return files, None
    raise CheckpointFormatError(
        f"{d.where}: not a Hugging Face safetensors model directory: no {HF_WEIGHTS_NAME} or "
        f"{HF_INDEX_NAME}"
        + (
            f" (it holds {', '.join(indexes + files)}: name the file to import)"
            if indexes or files
            else f" and no .safetensors files ({', '.join(listing[:10]) or 'it is empty'})"
        )
    )


def _from_index(d: ModelDir, index_name: str) -> tuple[list[str], dict[str, str]]:
    path = d.path_of(index_name)
    raw = d.read(index_name)
    doc = parse_json(raw, f"{path}: not valid JSON")
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
    ):
        raise CheckpointFormatError(f'{path}: no "weight_map" object of tensor name -> file name')
    if not wm:
        raise CheckpointFormatError(f"{path}: the weight_map is empty")
    files: list[str] = []
    for key, name in wm.items():
        plain_file_name(name, f"{path}: weight_map[{key!r}]")
        if name not in files:
            files.append(name)
    for name in files:
        if not d.is_file(name):
            raise CheckpointFormatError(f"{path}: lists {name}, which is missing from {d.where}")
    return files, wm
