"""A Hugging Face safetensors model (``save_pretrained``: ``model.safetensors``, or shards
listed by ``model.safetensors.index.json``) as a source, local or in object storage.

Every tensor is one chunk (the whole tensor) at its byte range in its file, under the file's
name with ``SourceOptions.prefix`` in front. Safetensors records no checksums; the headers are
checked against the files' sizes. See docs/sources.md ("A Hugging Face safetensors model").

The file names (:data:`HF_WEIGHTS_NAME`, :data:`HF_INDEX_NAME`, the config files
:data:`HF_CONFIG_FILES`) are shared with export (:mod:`ucp_dcp.tools.hf`).
"""

from __future__ import annotations

import errno
import re

from ..byteio.location import ModelDir
from ..byteio.objrange import ObjectAccess
from ..byteio.rangeio import read_safetensors
from ..core.sharding import Box
from ..errors import CheckpointFormatError, InvalidArgumentTypeError, StorageError, listed
from ..format import (
    ChunkRecord,
    FileRecord,
    Index,
    Location,
    TensorRecord,
    dtype_from_st,
)
from ..format.names import FILE_SUFFIXES
from ..format.schema import check_relative_name, parse_json
from .base import Source, SourceOptions, register

__all__ = [
    "HFSource",
    "HF_WEIGHTS_NAME",
    "HF_INDEX_NAME",
    "HF_CONFIG_FILES",
    "find_hf_files",
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
            else f" and no .safetensors files ({listed(listing) or 'it is empty'})"
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
        check_relative_name(name, f"{path}: weight_map[{key!r}]", "file name")
        if name not in files:
            files.append(name)
    for name in files:
        if not d.is_file(name):
            raise CheckpointFormatError(f"{path}: lists {name}, which is missing from {d.where}")
    return files, wm


@register
class HFSource(Source):
    """A Hugging Face safetensors model directory, or one ``.safetensors`` file or index."""

    format = "hf"
    title = "Hugging Face"
    looks_for = f"{HF_WEIGHTS_NAME} / {HF_INDEX_NAME} / one .safetensors file"
    detect_order = 50
    opens_files = True

    def __init__(self, d: ModelDir, prefix: str = "") -> None:
        """The model in directory view ``d`` (local or in a store; or the one ``.safetensors`` file
        or index it :attr:`~ucp_dcp.byteio.location.ModelDir.named`; :meth:`open` takes a path)."""
        path = d.location
        if not isinstance(prefix, str):
            raise InvalidArgumentTypeError(
                f"HFSource({path!r}): prefix must be a string, got {prefix!r}"
            )
        names, weight_map = find_hf_files(d, d.named)
        directory = d.where
        files: list[FileRecord] = []
        tensors: dict[str, TensorRecord] = {}
        where: dict[str, str] = {}
        for fi, fname in enumerate(names):
            st = read_safetensors(d.path_of(fname), d.access(fname))
            files.append(FileRecord(fname, 0, st.size))
            for e in st.entries.values():
                dtype = dtype_from_st(e.st_dtype)
                if dtype is None:
                    raise CheckpointFormatError(
                        f"{st.path}: tensor {e.name!r} has dtype {e.st_dtype!r}, which torch "
                        "cannot hold"
                    )
                # parse_safetensors checked the byte count against dtype and shape.
                key = prefix + e.name
                if key in tensors:
                    raise CheckpointFormatError(
                        f"{directory}: tensor {e.name!r} is in both {where[key]} and {fname}"
                    )
                if weight_map is not None and weight_map.get(e.name, fname) != fname:
                    raise CheckpointFormatError(
                        f"{directory}: the index puts {e.name!r} in {weight_map[e.name]}, but it "
                        f"is in {fname}"
                    )
                box = Box.whole(e.shape)
                loc = Location(fi, e.start, e.nbytes, "")
                tensors[key] = TensorRecord(
                    dtype, e.shape, None, False, chunks=[ChunkRecord(box, loc)]
                )
                where[key] = fname
        if weight_map is not None:
            missing = sorted(k for k, v in weight_map.items() if prefix + k not in tensors)
            if missing:
                raise CheckpointFormatError(
                    f"{directory}: the index lists {len(missing)} tensor(s) missing from their "
                    "files, e.g. "
                    f"{missing[0]!r} in {weight_map[missing[0]]}"
                )
        if not tensors:
            raise CheckpointFormatError(f"{path}: holds no tensors")
        super().__init__(path, Index(1, files, tensors, {}, {}), [d.path_of(f.name) for f in files])
        self.store = d.store

    @classmethod
    def detect_dir(cls, d: ModelDir) -> bool:
        """``model.safetensors``, a ``*.safetensors.index.json``, or one such file named
        directly (by names alone)."""
        if d.named is not None:
            return d.named.endswith(FILE_SUFFIXES)
        if d.is_file(HF_WEIGHTS_NAME) or d.is_file(HF_INDEX_NAME):
            return True
        names = d.list()
        if any(n.endswith(".safetensors.index.json") for n in names):
            return True
        st = [n for n in names if n.endswith(".safetensors")]
        return len(st) == 1 and not _NATIVE_DATA_FILE.fullmatch(st[0])

    @classmethod
    def open_dir(cls, d: ModelDir, options: SourceOptions) -> HFSource:
        """Parse every file's header (nothing else is read; in a store, with ranged requests)."""
        return cls(d, options.prefix)

    def check_files(self) -> list[str]:
        """Every file's header parses and its size is what it was when opened."""
        problems = []
        for path, f in zip(self.paths, self.index.files):
            try:
                # On a store, ObjectAccess asks for the object's size now (not the one recorded at
                # open).
                access = ObjectAccess(self.store, f.name) if self.store is not None else None
                size = read_safetensors(path, access).size
                if size != f.size:
                    problems.append(f"{path}: {size} bytes on disk, {f.size} when opened")
            except CheckpointFormatError as e:
                problems.append(str(e))
            except StorageError as e:
                if (
                    e.errno != errno.ENOENT
                ):  # a store that cannot be reached is no finding about the files
                    raise
                problems.append(str(e))
        return problems
