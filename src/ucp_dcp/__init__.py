"""ucp_dcp: universal checkpoints for torch.distributed.checkpoint.

Save a training state under one parallel layout, load it into any other
layout and world size, reading only the bytes each rank needs::

    import torch.distributed.checkpoint as dcp
    from ucp_dcp import UCPSavePlanner, UCPLoadPlanner, UCPStorageWriter, UCPStorageReader

    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
"""

from .checkpoint import Checkpoint
from .flat import FlatParam, FlatShard, flat_partition, pack_flat
from .format import FORMAT_VERSION, CheckpointFormatError
from .fsdp1 import fsdp1_apply_loaded, fsdp1_state_dict
from .handoff import ModuleLoadResult, load_into_module, load_state_dict
from .index import load_index, rebuild_index
from .integrity import ChecksumError
from .layout_rules import LayoutRuleError, LayoutSpec
from .manager import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointRestoreError,
    CheckpointSaveError,
    NoCheckpointError,
    ReshardEvent,
)
from .pieces import Piece, TensorPieces
from .planners import CheckpointKeyError, UCPLoadPlanner, UCPSavePlanner
from .storage import UCPStorageReader, UCPStorageWriter
from .snapshot import NonFiniteError
from .values import RankLocal, UnsupportedValueError

__all__ = [
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "UCPStorageWriter",
    "UCPStorageReader",
    "RankLocal",
    "Checkpoint",
    "load_state_dict",
    "load_into_module",
    "ModuleLoadResult",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "UnsupportedValueError",
    "load_index",
    "rebuild_index",
    "FORMAT_VERSION",
    "CheckpointManager",
    "CheckpointConfig",
    "ReshardEvent",
    "CheckpointSaveError",
    "CheckpointRestoreError",
    "NoCheckpointError",
    "NonFiniteError",
    "ChecksumError",
    "Piece",
    "TensorPieces",
    "FlatParam",
    "FlatShard",
    "pack_flat",
    "flat_partition",
    "fsdp1_state_dict",
    "fsdp1_apply_loaded",
    "LayoutSpec",
    "LayoutRuleError",
]

__version__ = "0.1.0"
