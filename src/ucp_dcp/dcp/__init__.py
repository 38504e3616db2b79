"""DCP integration: the save and load planners and the storage writer and reader.

``UCPSavePlanner`` + ``UCPStorageWriter`` write a universal checkpoint from
any layout; ``UCPLoadPlanner`` + ``UCPStorageReader`` load any source into
any layout with exact offset reads.
"""

from .planners import UCPLoadPlanner, UCPSavePlanner
from .reader import UCPStorageReader
from .writer import UCPStorageWriter

__all__ = ["UCPSavePlanner", "UCPLoadPlanner", "UCPStorageWriter", "UCPStorageReader"]
