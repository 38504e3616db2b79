"""DCP integration: the save and load planners and the storage writer and reader.

``UCPSavePlanner`` + ``UCPStorageWriter`` write a universal checkpoint from
any layout; ``UCPLoadPlanner`` + ``UCPStorageReader`` load any source into
any layout with exact offset reads.
"""

from .load_planner import UCPLoadPlanner
from .options import LoadReport, ReadOptions
from .reader import PlannedRead, UCPStorageReader, collector_paused
from .save_planner import UCPSavePlanner
from .writer import UCPStorageWriter

__all__ = [
    "UCPSavePlanner",
    "UCPLoadPlanner",
    "UCPStorageWriter",
    "UCPStorageReader",
    "ReadOptions",
    "LoadReport",
    "PlannedRead",
    "collector_paused",
]
