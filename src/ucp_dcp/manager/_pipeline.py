"""The background half of a save: write, hash, replicate, commit, drain, retain.

:meth:`SavePipeline.run` runs one :class:`SaveJob` on every rank, in save
order, on the background process group:

1. ``dcp.save`` of the staged copy into a staging directory of the fastest
   tier that is due; a whole-file xxh3-128 digest of every data file and the
   index, gathered into one :class:`~ucp_dcp.manager.tiers.CommitMarker`.
2. Local tier: replication of each node's files to a partner node, then the
   commit (marker last, atomic rename).
3. Persistent tier: written directly when it is a local path and no local
   copy exists, otherwise uploaded from the local copy (or a scratch
   directory); then its commit.
4. Retention deletes steps outside the policy (:func:`.config.steps_to_delete`); its errors
   are logged, never raised (the step is committed).

Any error stops the save on every rank (:meth:`Group.agree`) and removes
this save's staging leftovers; nothing committed before is touched.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..byteio.integrity import file_digest
from ..dcp import UCPSavePlanner, UCPStorageWriter
from ..dcp.slowest import SlowestRecord
from ..errors import CheckpointSaveError
from ..format import INDEX_FILE, data_file_name
from ._collective import GroupWorker, describe
from .config import steps_to_delete
from .peer import exchange_files
from .records import SaveRecord
from .snapshot import StagedState
from .tiers import CommitMarker, FileDigest, Tier

__all__ = ["SaveJob", "SavePipeline"]

log = logging.getLogger("ucp_dcp.manager.manager")


@dataclass(frozen=True)
class SaveJob:
    """One save handed to the background: the staged state and what to do with it."""

    step: int
    staged: StagedState
    tiers: tuple[str, ...]
    """The tiers due at this step, fastest first."""
    nonfinite: dict[str, list[int]]
    """Tensor name -> ranks whose shard holds NaN/Inf (recorded in the marker)."""
    extra: dict[str, Any]
    token: str
    """Names this save's staging locations; the same on every rank."""
    blocking_s: float


class SavePipeline(GroupWorker):
    """Runs :class:`SaveJob`\\ s on the background group; every rank runs the same jobs in the same
    order."""

    def run(self, job: SaveJob) -> SaveRecord:
        """Write, replicate, commit, drain, retain; on any error clean up and raise."""
        try:
            job.staged.wait_ready()
            t0 = time.perf_counter()
            marker, committed, slowest = self._write_and_commit(job)
            self._retain(job.step)
            nbytes = sum(d.size for d in marker.files if d.rank == self.layout.rank)
            return SaveRecord(
                job.step,
                job.blocking_s,
                time.perf_counter() - t0,
                nbytes,
                tuple(committed),
                slowest,
            )
        except BaseException:
            self._abort(job)
            raise

    def _write_and_commit(
        self, job: SaveJob
    ) -> tuple[CommitMarker, list[str], SlowestRecord | None]:
        step, agree, lay = job.step, self.group.agree, self.layout
        committed: list[str] = []
        src: str | None = None  # a local directory holding this rank's files of the step
        slowest: SlowestRecord | None = None  # the dcp.save's slowest rank
        scratch: str | None = None
        if "local" in job.tiers:
            local = self.local
            assert local is not None
            staging = self._begin(job, local)
            marker, slowest = self._write(job, staging)
            if lay.num_nodes > 1:
                self._put_index(step, local, staging)
                if self.config.peer_replication:
                    agree("peer replication", lambda: self._replicate(staging, marker), step=step)
            held = lay.held_files(marker, peer=self.config.peer_replication)
            agree(
                "local commit",
                lambda: local.commit(staging, marker, held=held) if self.acts_for(local) else None,
                step=step,
            )
            committed.append("local")
            src = local.step_path(step)
        if "persistent" in job.tiers:
            persistent = self.persistent
            if src is None and persistent.local:
                staging = self._begin(job, persistent)
                marker, slowest = self._write(job, staging)
            else:
                if src is None:
                    # A remote tier and no local one: write to a scratch dir, then upload.
                    scratch = src = tempfile.mkdtemp(prefix=f"ucp-scratch-{step}-")
                    marker, slowest = self._write(job, scratch)
                staging = self._upload(job, src, marker)
            agree(
                "persistent commit",
                lambda: persistent.commit(staging, marker) if self.acts_for(persistent) else None,
                step=step,
            )
            committed.append("persistent")
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        return marker, committed, slowest

    def _begin(self, job: SaveJob, tier: Tier) -> str:
        """Create ``tier``'s staging location of ``job`` (the rank that acts for the tier does);
        return it."""
        self.group.agree(
            f"creating the staging location in {tier.url}",
            lambda: tier.begin(job.step, job.token) if self.acts_for(tier) else None,
            step=job.step,
        )
        return tier.staging_path(job.step, job.token)

    def _write(self, job: SaveJob, path: str) -> tuple[CommitMarker, SlowestRecord | None]:
        """dcp.save the staged state into local directory ``path``; return the commit marker
        (digests of every file) and the save's slowest rank."""
        step, lay, group = job.step, self.layout, self.group
        writer = UCPStorageWriter(path, placement_digests=self.config.placement_digests)
        try:
            dcp.save(
                dict(job.staged.state),
                storage_writer=writer,
                planner=UCPSavePlanner(),
                process_group=group.pg,
            )
        except CheckpointException as e:
            raise CheckpointSaveError(step, describe(e)) from e

        def digest_mine() -> list[FileDigest]:
            # This rank's one data file, if it had anything to write (the staging is fresh), and
            # rank 0's index.
            name = data_file_name(lay.rank, writer.save_id)
            mine = [(name, lay.rank)] if os.path.exists(os.path.join(path, name)) else []
            mine += [(INDEX_FILE, -1)] if lay.rank == 0 else []
            return [FileDigest(n, *file_digest(os.path.join(path, n)), r) for n, r in mine]

        digests = group.agree("hashing the written files", digest_mine, step=step)
        files = sorted((d for ds in group.gather(digests) for d in ds), key=lambda d: d.name)
        marker = CommitMarker(
            step, lay.world_size, time.time(), tuple(files), job.nonfinite, job.extra
        )
        # One creation time on every rank; the save's slowest rank, which only its coordinator
        # (rank 0) learnt, comes along.
        return group.bcast((marker, writer.slowest))

    def _put_index(self, step: int, tier: Tier, staging: str) -> None:
        """Copy rank 0's index into every node's ``staging`` of node-local ``tier``, so that each
        is a complete description of the checkpoint wherever the data files end up."""
        lay = self.layout
        index = self.group.bcast(Path(staging, INDEX_FILE).read_bytes() if lay.rank == 0 else None)

        def put_index() -> None:
            if lay.is_leader and lay.rank != 0:
                assert index is not None  # rank 0's bytes
                tier.put_bytes(staging, INDEX_FILE, index)

        self.group.agree("replicating the index", put_index, step=step)

    def _replicate(self, staging: str, marker: CommitMarker) -> None:
        """Copy the partner node's data files (:attr:`NodeLayout.partner`) into this node's
        staging directory."""
        lay = self.layout
        wanted = []
        if lay.is_leader:
            wanted = [
                d.name for d in marker.files if d.rank >= 0 and lay.node_of(d.rank) == lay.partner
            ]
        own = [d.name for d in marker.files if d.rank == lay.rank]
        exchange_files(self.group.pg, staging, own, staging, wanted)

    def _upload(self, job: SaveJob, src: str, marker: CommitMarker) -> str:
        """Copy this rank's files of the step from local ``src`` into the persistent tier's staging;
        return it."""
        step, rank = job.step, self.layout.rank
        staging = self._begin(job, self.persistent)

        def put_mine() -> None:
            for d in marker.files:
                if d.rank == rank or (d.rank == -1 and rank == 0):
                    self.persistent.put_file(staging, os.path.join(src, d.name), d.name)

        self.group.agree(f"uploading to {self.persistent.url}", put_mine, step=step)
        return staging

    def _retain(self, step: int) -> None:
        """Delete steps outside the retention policy; the newest committed step always stays."""
        cfg = self.config
        plans: list[tuple[Tier | None, int, int | None]] = [
            (self.persistent, cfg.keep_last, cfg.keep_every),
            (self.local, cfg.local_keep_last, None),
        ]
        for tier, keep_last, keep_every in plans:
            if tier is None or not self.acts_for(tier):
                continue
            try:
                markers = tier.markers()
                finite = [s for s, m in markers.items() if not m.nonfinite]
                for s in steps_to_delete(
                    sorted(markers),
                    step,
                    keep_last=keep_last,
                    keep_every=keep_every,
                    last_good=max(finite, default=None),
                ):
                    tier.delete(s)
            except Exception as e:  # retention must never fail a committed save
                log.warning("retention in the %s tier (%s) failed: %s", tier.name, tier.url, e)

    def _abort(self, job: SaveJob) -> None:
        """Best effort: remove this save's staging leftovers (start-up cleanup catches the rest)."""
        for tier in (self.local, self.persistent):
            if tier is None or not self.acts_for(tier):
                continue
            try:
                if tier.local:
                    shutil.rmtree(tier.staging_path(job.step, job.token), ignore_errors=True)
                else:
                    tier.cleanup()
            except Exception as e:
                log.warning(
                    "could not clean up the failed save of step %d in %s: %s", job.step, tier.url, e
                )
