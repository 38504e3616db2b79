"""DCP's ``.metadata`` file: its name and how it is read.

``.metadata`` is a pickle of :class:`~torch.distributed.checkpoint.metadata.Metadata`.
:func:`read_dcp_metadata` loads it with the library's restricted unpickler
(:mod:`._pickle`, purpose ``"dcp_metadata"``), constructing only DCP's own
metadata records, the plan records Megatron-core attaches to it
(``all_local_plans``: ``SavePlan``, ``WriteItem``, ``TensorWriteData``,
``WriteItemType``), ``torch.Size``, dtypes, layouts and paths. Any other
class is refused before it is imported, naming it.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CheckpointFormatError
from ._dirs import LocalDir, ModelDir
from ._pickle import unpickle

__all__ = ["DCP_METADATA_FILE", "read_dcp_metadata"]

DCP_METADATA_FILE = ".metadata"


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
    md = unpickle(d.read(DCP_METADATA_FILE), path, "dcp_metadata")
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointFormatError(
            f"{path}: DCP metadata without state_dict_metadata/storage_data"
        )
    return md
