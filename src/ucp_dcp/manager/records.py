"""What the manager reports: reshard events, per-save costs, how a restore went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..dcp.placement import PlacementReport
    from ..dcp.read_once import ReadOnceDecision
    from ..dcp.slowest import SlowestRecord

__all__ = ["ReshardEvent", "SaveRecord", "RestoreRecord"]


@dataclass(frozen=True)
class ReshardEvent:
    """Passed to ``on_reshard`` callbacks when the restored step was saved by another world size."""

    step: int
    old_world_size: int
    new_world_size: int
    tier: str


@dataclass(frozen=True)
class SaveRecord:
    """What one save cost: blocking and background seconds, bytes, tiers committed."""

    step: int
    blocking_s: float
    write_s: float
    nbytes: int
    tiers: tuple[str, ...]
    slowest: SlowestRecord | None = None
    """The save's slowest rank: how long its ``dcp.save`` write took and how many bytes (see
    ``UCPStorageWriter.slowest``); the same on every rank."""


@dataclass(frozen=True)
class RestoreRecord:
    """How the last ``load`` went: the step, the tier, and every failed attempt before it."""

    step: int
    tier: str
    seconds: float
    failed_attempts: tuple[str, ...]
    verified_bytes: int
    read_bytes: int = 0
    """Bytes this rank's load requested from the checkpoint's data files (headers and the index not
    counted, nor data that came with a header's request; a whole-step download before the load is
    not counted either)."""
    read_once: ReadOnceDecision | None = None
    """What the load's read-once policy decided and why (see ``ReadOptions(read_once=)``):
    ``read_once.exchange`` says whether each needed byte was read by one rank and sent to the
    others over the manager's group; None where no decision was asked for (one process)."""
    slowest: SlowestRecord | None = None
    """The load's slowest rank, with the file its reads spent the most time on (see
    ``LoadReport.slowest``): the same on every rank where the load ran on several; this
    rank's own in one process."""
    placement: PlacementReport | None = None
    """What the placement check found (``CheckpointConfig.read.verify_placement``; see
    ``LoadReport.placement``): the tensors whose placement was proven, and those it
    could not check (loaded into another dtype, or with no digest); None where not asked for."""
