"""Constants and names of the native format: file names, entry names, dtype codes.

One table maps torch dtypes to safetensors dtype codes, for the writer, the
header parser and the Hugging Face source and export alike.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

FORMAT_NAME = "ucp_dcp"
FORMAT_VERSION = 1
INDEX_FILE = "ucp_index.json"
ALIGN = 4096
# A safetensors header is JSON describing the entries; anything beyond this
# is a corrupt or hostile file, not a checkpoint (safetensors uses 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_MESH_DEVICES = 1 << 24
"""Most devices a recorded layout's mesh may have (more than any job runs on)."""
MAX_ENUMERATED_COORDS = 1 << 16
"""Most mesh coordinates of an irregular recorded layout, whose chunks are found one coordinate at a
time."""
VALUE_PREFIX = "__ucp_value__/"
RANK_LOCAL_PREFIX = "__ucp_rank_local__/"
PAD_PREFIX = "__ucp_pad__."
BLOCK_SUMS_ENTRY = "__ucp_block_sums__"
"""The U64 entry of a data file holding the xxh3-64 of every block of its tensor chunks."""
BLOCK_BYTES = 4096
"""Bytes per checksummed block of a tensor chunk: one page, so checking a read costs no extra
I/O."""
FILE_SUFFIXES = (".safetensors", ".safetensors.index.json")
"""The endings of a location that names one file directly: a safetensors file or a Hugging Face
index, read as the view of its directory with that file named."""
LAYOUT_KEY = "__ucp_layout__"
"""Top-level state-dict key under which ``LayoutSpec.apply(record=True)`` stores the spec."""


_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


_FROM_ST = {code: dtype for dtype, code in _ST_DTYPES.items()}


def dtype_from_st(code: str) -> torch.dtype | None:
    """The torch dtype of safetensors dtype code ``code`` (``"BF16"``), or None when torch has
    none."""
    return _FROM_ST.get(code)


def st_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors dtype code of ``dtype``, or None (stored as raw U8 bytes)."""
    return _ST_DTYPES.get(dtype)


DTYPE_ALIASES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}
"""The dtype names every entry point that takes a ``dtype`` accepts besides a ``torch.dtype``
(case and a ``torch.`` prefix aside)."""


def dtype_named(name: str) -> torch.dtype | None:
    """The dtype :data:`DTYPE_ALIASES` names ``name`` (None for another name)."""
    return DTYPE_ALIASES.get(name.strip().lower().removeprefix("torch."))


def chunk_entry_name(fqn: str, offsets: Sequence[int]) -> str:
    """Data-file entry name of a tensor chunk: ``fqn`` plus its global offsets."""
    return f"{fqn}@{','.join(map(str, offsets))}" if offsets else f"{fqn}@"


def value_entry_name(fqn: str) -> str:
    """Data-file entry name of a non-tensor value."""
    return VALUE_PREFIX + fqn


def rank_local_entry_name(fqn: str) -> str:
    """Data-file entry name of a rank-local value (each rank has its own file)."""
    return RANK_LOCAL_PREFIX + fqn


def rank_local_key(rank: int, fqn: str) -> str:
    """DCP storage key of ``rank``'s copy of rank-local value ``fqn``."""
    return f"{RANK_LOCAL_PREFIX}{rank}/{fqn}"


def split_rank_local_key(key: str) -> tuple[int, str] | None:
    """``(rank, fqn)`` of a key made by :func:`rank_local_key`, else None."""
    if not key.startswith(RANK_LOCAL_PREFIX):
        return None
    rank, _, fqn = key[len(RANK_LOCAL_PREFIX) :].partition("/")
    return int(rank), fqn


def data_file_name(rank: int, save_id: str) -> str:
    """File name of the data file written by ``rank`` in save ``save_id``.

    The save id keeps a new save from writing over the files of a committed
    checkpoint in the same directory: the old index stays valid until the new
    one replaces it.
    """
    return f"rank{rank:05d}-{save_id}.safetensors"


# convert writes a rank's further files as ``<save id>-<n>``.
_DATA_FILE = re.compile(r"rank\d{5}-([0-9A-Za-z]+)(?:-\d+)?\.safetensors")


def save_id_of(file_name: str) -> str | None:
    """The save id in a data file name made by :func:`data_file_name` (None for any other name:
    the only files a save may remove are those it names)."""
    m = _DATA_FILE.fullmatch(file_name.rpartition("/")[2])
    return m.group(1) if m else None
