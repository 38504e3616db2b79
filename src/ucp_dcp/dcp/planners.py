"""DCP planners: what each rank saves (:class:`UCPSavePlanner`) and reads back
(:class:`UCPLoadPlanner`).

The planners live in :mod:`ucp_dcp.dcp.save_planner` and
:mod:`ucp_dcp.dcp.load_planner`, their algorithms in the ``_save_*``,
``_load_*``, ``_mesh_groups`` and ``_rank_values`` modules of this package
and the records they pass through DCP in :mod:`ucp_dcp.dcp._plan_records`.
This module keeps the names importable from where they always were.
"""

from ..errors import CheckpointKeyError
from .load_planner import UCPLoadPlanner
from .save_planner import UCPSavePlanner

__all__ = ["UCPSavePlanner", "UCPLoadPlanner", "CheckpointKeyError"]
