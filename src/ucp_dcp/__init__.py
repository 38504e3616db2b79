"""ucp_dcp: universal checkpoints for torch.distributed.checkpoint.

Save a training state under one parallel layout, load it into any other
layout and world size, reading only the bytes each rank needs::

    import torch.distributed.checkpoint as dcp
    from ucp_dcp import UCPSavePlanner, UCPLoadPlanner, UCPStorageWriter, UCPStorageReader

    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
"""

from .adapters.flat import FlatParam, FlatShard, flat_partition, pack_flat
from .adapters.fsdp1 import fsdp1_apply_loaded, fsdp1_state_dict
from .adapters.layout_spec import LayoutSpec
from .adapters.rules import (
    Averaged,
    Fused,
    Reindex,
    Rename,
    Replicated,
    Shard,
    Stacked,
    Unstacked,
    VocabPad,
)
from .byteio.progress import ProgressConfig
from .byteio.requests import RequestPolicy
from .core.pieces import Piece, TensorPieces
from .core.values import RankLocal
from .dcp import UCPLoadPlanner, UCPSavePlanner
from .dcp.options import LoadReport, ReadOptions
from .dcp.read_once import ReadOnceCosts
from .dcp.reader import UCPStorageReader
from .dcp.slowest import SlowestRecord
from .dcp.writer import UCPStorageWriter
from .errors import (
    CheckpointFormatError,
    CheckpointKeyError,
    CheckpointRestoreError,
    CheckpointSaveError,
    ChecksumError,
    LayoutRuleError,
    NoCheckpointError,
    NonFiniteError,
    PlacementError,
    StorageError,
    UCPError,
    UCPWarning,
    UnsupportedValueError,
)
from .format import FORMAT_VERSION
from .manager.manager import CheckpointConfig, CheckpointManager, ReshardEvent
from .sources.native import load_index, rebuild_index
from .tools.checkpoint import Checkpoint, ModuleLoadResult, load_into_module, load_state_dict
from .tools.convert import convert
from .tools.hf import export_hf, import_hf
from .tools.inspection import inspect_checkpoint

__all__ = [
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "UCPStorageWriter",
    "UCPStorageReader",
    "ReadOptions",
    "LoadReport",
    "ReadOnceCosts",
    "RequestPolicy",
    "ProgressConfig",
    "SlowestRecord",
    "RankLocal",
    "Checkpoint",
    "load_state_dict",
    "export_hf",
    "import_hf",
    "convert",
    "inspect_checkpoint",
    "load_into_module",
    "ModuleLoadResult",
    "UCPError",
    "UCPWarning",
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
    "PlacementError",
    "StorageError",
    "Piece",
    "TensorPieces",
    "FlatParam",
    "FlatShard",
    "pack_flat",
    "flat_partition",
    "fsdp1_state_dict",
    "fsdp1_apply_loaded",
    "LayoutSpec",
    "Rename",
    "Reindex",
    "Fused",
    "Shard",
    "VocabPad",
    "Replicated",
    "Averaged",
    "Stacked",
    "Unstacked",
    "LayoutRuleError",
]

__version__ = "0.1.0"
