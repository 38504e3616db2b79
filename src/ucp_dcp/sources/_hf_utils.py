"""Hugging Face model directories: file names, and which files hold the weights.

Shared by the Hugging Face source (:mod:`ucp_dcp.sources.hf`) and export
(:mod:`ucp_dcp.tools.hf`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CheckpointFormatError
from ..format.schema import parse_json

__all__ = ["HF_WEIGHTS_NAME", "HF_INDEX_NAME", "HF_CONFIG_FILES", "find_hf_files", "looks_like_hf", "plain_file_name"]

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


def looks_like_hf(path: str) -> bool:
    """Whether ``path`` is a Hugging Face safetensors model (by names alone)."""
    if os.path.isfile(path):
        return path.endswith(".safetensors") or path.endswith(".safetensors.index.json")
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, HF_WEIGHTS_NAME)) or os.path.isfile(os.path.join(path, HF_INDEX_NAME)):
        return True
    names = os.listdir(path)
    if any(n.endswith(".safetensors.index.json") for n in names):
        return True
    st = [n for n in names if n.endswith(".safetensors")]
    return len(st) == 1 and not _NATIVE_DATA_FILE.fullmatch(st[0])


def find_hf_files(src: str) -> tuple[str, list[str], dict[str, str] | None]:
    """(directory, safetensors file names, weight_map or None) of a Hugging Face model.

    ``src`` is a directory (``model.safetensors``, which wins as it does for
    ``from_pretrained``, or a sharded ``model.safetensors.index.json``, or
    the only ``*.safetensors.index.json`` / ``*.safetensors`` there), or one
    ``.safetensors`` file or index.
    """
    if not os.path.exists(src):
        raise CheckpointFormatError(f"{src}: no such Hugging Face model directory or file")
    if os.path.isfile(src):
        if src.endswith(".index.json"):
            return _from_index(os.path.dirname(src) or ".", src)
        return os.path.dirname(src) or ".", [os.path.basename(src)], None
    idx = os.path.join(src, HF_INDEX_NAME)
    single = os.path.join(src, HF_WEIGHTS_NAME)
    if os.path.isfile(single):
        # from_pretrained's choice too, even with an index next to it (export_hf writes one).
        return src, [HF_WEIGHTS_NAME], None
    if os.path.isfile(idx):
        return _from_index(src, idx)
    listing = sorted(os.listdir(src))
    indexes = [n for n in listing if n.endswith(".safetensors.index.json")]
    if len(indexes) == 1:
        return _from_index(src, os.path.join(src, indexes[0]))
    files = [n for n in listing if n.endswith(".safetensors")]
    if len(files) == 1 and not indexes:
        return src, files, None
    raise CheckpointFormatError(
        f"{src}: not a Hugging Face safetensors model directory: no {HF_WEIGHTS_NAME} or {HF_INDEX_NAME}"
        + (f" (it holds {', '.join(indexes + files)}: name the file to import)" if indexes or files else
           f" and no .safetensors files ({', '.join(listing[:10]) or 'it is empty'})")
    )


def _from_index(directory: str, path: str) -> tuple[str, list[str], dict[str, str]]:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot read ({e.strerror or e})") from None
    doc = parse_json(raw, f"{path}: not valid JSON")
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointFormatError(f"{path}: no \"weight_map\" object of tensor name -> file name")
    if not wm:
        raise CheckpointFormatError(f"{path}: the weight_map is empty")
    files: list[str] = []
    for key, name in wm.items():
        plain_file_name(name, f"{path}: weight_map[{key!r}]")
        if name not in files:
            files.append(name)
    for name in files:
        if not os.path.isfile(os.path.join(directory, name)):
            raise CheckpointFormatError(f"{path}: lists {name}, which is missing from {directory}")
    return directory, files, wm


def plain_file_name(name: Any, where: str) -> str:
    """``name`` if it names a file directly inside a directory (no path, no ``..``); else an error naming ``where``."""
    if (
        not isinstance(name, str)
        or not name
        or os.path.isabs(name)
        or "/" in name
        or "\\" in name
        or name in (".", "..")
        or "\0" in name
    ):
        raise CheckpointFormatError(f"{where}: file name {name!r} is not a plain file name inside the directory")
    return name
