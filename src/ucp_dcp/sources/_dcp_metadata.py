"""DCP's ``.metadata`` file: its name and a restricted unpickler for it.

``.metadata`` is a pickle of :class:`~torch.distributed.checkpoint.metadata.Metadata`.
:func:`read_dcp_metadata` loads it constructing only DCP's own metadata
records, the plan records Megatron-core attaches to it (``all_local_plans``:
``SavePlan``, ``WriteItem``, ``TensorWriteData``, ``WriteItemType``),
``torch.Size``, dtypes, layouts and paths. Any other class is refused before
it is imported, naming it.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointFormatError
from ._dirs import LocalDir, ModelDir

__all__ = ["DCP_METADATA_FILE", "read_dcp_metadata"]

DCP_METADATA_FILE = ".metadata"


_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_PLAN = "torch.distributed.checkpoint.planner"
_ALLOWED_GLOBALS = {
    (_DCP_MD, "Metadata"),
    (_DCP_MD, "TensorStorageMetadata"),
    (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"),
    (_DCP_MD, "TensorProperties"),
    (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    (_DCP_MD, "MetadataIndex"),
    (_DCP_MD, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # Megatron-core's torch_dist strategy attaches every rank's local save
    # plan to the metadata (``all_local_plans``): DCP's own plan records.
    *(
        (_DCP_PLAN, cls)
        for cls in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData", "WriteItemType")
    ),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("collections", "OrderedDict"),
    *(
        (mod, cls)
        for mod in ("pathlib", "pathlib._local")
        for cls in ("PosixPath", "PurePosixPath")
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata`` and nothing else.

    ``find_class`` is the only way a pickle reaches code; it hands out DCP's
    metadata and plan records, ``torch.Size``, torch dtypes / layouts /
    memory formats and path objects, and refuses anything else before
    importing it.
    """

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and not name.startswith("_"):
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise CheckpointFormatError(
            f"{self.where}: refusing to unpickle {module}.{name} from .metadata: only DCP's own "
            "metadata "
            "and plan records (and torch.Size, dtypes, layouts) are loaded; this file is damaged, "
            "hostile, or was "
            "written by a planner that stores its own classes in the metadata"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"{self.where}: refusing persistent id {pid!r} in .metadata")


def read_dcp_metadata(directory: str | os.PathLike[str] | ModelDir) -> Metadata:
    """Load DCP's ``.metadata`` of ``directory`` (a local path, or a directory view) with the
    restricted unpickler.

    The file is read as bytes (from object storage: one request) and only
    then unpickled. Raises :class:`CheckpointFormatError` naming the file
    when it is missing, not a DCP metadata pickle, or refers to any class
    outside the allow-list.
    """
    d = directory if isinstance(directory, ModelDir) else LocalDir(os.fspath(directory))
    path = d.path_of(DCP_METADATA_FILE)
    if not d.is_file(DCP_METADATA_FILE):
        raise CheckpointFormatError(f"{d.where}: not a DCP checkpoint (no {DCP_METADATA_FILE})")
    raw = d.read(DCP_METADATA_FILE)
    try:
        md = _MetadataUnpickler(io.BytesIO(raw), path).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # truncated / garbage pickles raise all sorts
        raise CheckpointFormatError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(
            f"{path}: DCP metadata without state_dict_metadata/storage_data"
        )
    return md
