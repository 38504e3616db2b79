"""CheckpointManager: async, atomic, verified, multi-tier checkpoints for a training loop.

::

    mgr = CheckpointManager("/shared/ckpt", local="/local_nvme/ckpt", local_interval=100,
                            persistent_interval=1000)
    start = mgr.load(state) + 1 if mgr.steps() else 0
    for step in range(start, steps):
        train_step(...)
        mgr.save(step, state)   # returns once the state is staged in host memory
    mgr.wait()

Every checkpoint is a universal checkpoint (``UCPStorageWriter``), so
``load`` reshards into whatever layout and world size the state has now.

How a save goes (one background thread per process, saves run in order):

1. ``save`` (blocking part): optional NaN/Inf check, wait for a free slot
   (at most ``max_in_flight`` saves in flight), copy every tensor into
   reusable host buffers (:class:`~ucp_dcp.manager.snapshot.Snapshotter`). From here
   on training may change the state in place.
2. Background: ``dcp.save`` of the staged copy into a staging directory of
   the fastest tier that is due, on its own gloo process group (so it never
   interleaves with the training loop's collectives); a whole-file xxh3-128
   digest per data file and the index; replication of each node's files to
   a partner node (local tier); a commit marker written last and an atomic
   rename (:mod:`ucp_dcp.manager.tiers`). Then the local copy drains to the
   persistent tier (upload, marker last), and retention deletes old steps.
3. Errors of any rank stop the save on every rank and surface at the next
   ``save`` or ``wait``; nothing committed before is touched.

Restore tries candidates newest first, for each step the fastest tier
first; a missing or corrupt copy falls back to the next tier's copy of the
same step, then to older steps, and says so (log and ``last_restore``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from . import goodput
from ..tools.checkpoint import Checkpoint
from ..format import INDEX_FILE
from ..byteio.integrity import bytes_digest, file_digest
from .peer import clean_partials, exchange_files
from ..dcp.planners import UCPLoadPlanner, UCPSavePlanner
from .snapshot import NonFiniteError, Snapshotter, StagedState, find_nonfinite
from ..dcp import UCPStorageReader, UCPStorageWriter
from .tiers import CommitMarker, FileDigest, LocalTier, Tier, open_tier
from ..errors import CheckpointRestoreError, CheckpointSaveError, NoCheckpointError
from ..errors import CheckpointFormatError

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointRestoreError",
    "NoCheckpointError",
    "ReshardEvent",
    "SaveRecord",
    "RestoreRecord",
]

log = logging.getLogger("ucp_dcp.manager.manager")
T = TypeVar("T")


@dataclass
class CheckpointConfig:
    """Settings of a :class:`CheckpointManager`; every field can also be passed as a keyword."""

    local: str | None = None
    """Fast tier: a node-local directory (NVMe, ``/dev/shm``). ``{node}`` in the
    path is replaced by the node index (lets tests simulate nodes on one machine).
    None: no local tier, saves go straight to the persistent tier."""

    local_interval: int = 1
    """Save to the local tier every this many steps (a step divisible by it)."""

    persistent_interval: int = 1
    """Save to the persistent tier (``root``) every this many steps. With a local
    tier, a persistent save drains the local copy in the background."""

    keep_last: int = 3
    """Persistent tier: keep the newest this many committed steps (at least 1)."""

    keep_every: int | None = None
    """Persistent tier: also keep every step divisible by this, forever."""

    local_keep_last: int = 2
    """Local tier: keep the newest this many committed steps (at least 1)."""

    max_in_flight: int = 1
    """Saves staged or writing at once; ``save`` blocks (backpressure) beyond it.
    Each in-flight save holds one host copy of the state."""

    async_save: bool = True
    """Write in the background. False: ``save`` returns after the commit."""

    verify_on_load: bool = True
    """Check every chunk ``load`` reads against its xxh3 checksum (cost: see
    benchmarks/README.md), and the index against the commit marker."""

    nonfinite: Literal["off", "error", "flag"] = "off"
    """NaN/Inf guard: "error" refuses the save (naming the tensors), "flag"
    saves and records them in the commit marker, "off" does not look."""

    load_flagged: bool = False
    """Whether ``load()`` without a step may pick a step flagged non-finite."""

    ranks_per_node: int | None = None
    """Ranks sharing one node-local directory; default ``$LOCAL_WORLD_SIZE``, else
    the world size (one node)."""

    peer_replication: bool = True
    """Local tier with several nodes: also copy each node's files to the next
    node over torch.distributed, so losing one node's disk loses nothing."""

    storage_options: dict[str, Any] | None = None
    """fsspec options for a URL ``root`` (e.g. S3 endpoint and credentials)."""

    io_threads: int = 4
    """Threads reading during ``load``."""


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


@dataclass(frozen=True)
class RestoreRecord:
    """How the last ``load`` went: the step, the tier, and every failed attempt before it."""

    step: int
    tier: str
    seconds: float
    failed_attempts: tuple[str, ...]
    verified_bytes: int


@dataclass
class _Job:
    step: int
    staged: StagedState
    tiers: tuple[str, ...]
    nonfinite: dict[str, list[int]]
    extra: dict[str, Any]
    token: str
    blocking_s: float = 0.0


@dataclass
class _Candidate:
    step: int
    tier: str
    marker: CommitMarker
    nodes_with_step: list[int] = field(default_factory=list)


class CheckpointManager:
    """Drives async, atomic, verified, multi-tier checkpoints of a training state.

    Args:
        root: persistent tier: a directory (shared file system) or an fsspec
            URL such as ``s3://bucket/run``.
        config: a :class:`CheckpointConfig`; keywords override its fields.
        on_reshard: callbacks called with a :class:`ReshardEvent` when a
            restored step was saved by another world size (rescale batch size
            and learning rate, reshard rank-local state).

    Works with or without an initialised process group. With one, every rank
    must construct the manager, and call ``save`` and ``load`` at the same
    steps (they are collective).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        config: CheckpointConfig | None = None,
        *,
        on_reshard: Sequence[Callable[[ReshardEvent], None]] = (),
        **overrides: Any,
    ) -> None:
        cfg = dataclasses.replace(config or CheckpointConfig(), **overrides)
        _validate(cfg)
        self.config = cfg
        self._dist = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self._dist else 0
        self.world_size = dist.get_world_size() if self._dist else 1
        rpn = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.ranks_per_node = max(1, min(rpn, self.world_size))
        self.node = self.rank // self.ranks_per_node
        self.num_nodes = -(-self.world_size // self.ranks_per_node)
        self.is_leader = self.rank % self.ranks_per_node == 0
        # Two gloo groups of our own: the foreground one (save's checks, load)
        # runs in the training thread, the background one in the writer
        # thread. Sharing a group between threads would let their collectives
        # interleave differently on different ranks.
        self._fg = dist.new_group(backend="gloo") if self._dist else None
        self._bg = dist.new_group(backend="gloo") if self._dist else None
        self._session = self._bcast(self._fg, uuid.uuid4().hex[:6])
        self._seq = 0
        self.persistent: Tier = open_tier(root, name="persistent", storage_options=cfg.storage_options)
        self.local: LocalTier | None = (
            LocalTier(cfg.local.format(node=self.node), name="local") if cfg.local else None
        )
        self._on_reshard = list(on_reshard)
        self._snap = Snapshotter(max_buffers=cfg.max_in_flight)
        self._slots = threading.Semaphore(cfg.max_in_flight)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucp-ckpt")
        self._futures: list[concurrent.futures.Future[SaveRecord]] = []
        self._lock = threading.Lock()
        self.records: list[SaveRecord] = []
        self.last_restore: RestoreRecord | None = None
        self._closed = False
        self._agree(self._fg, "start-up cleanup", self._startup_cleanup, step=-1)

    # ------------------------------------------------------------------ public
    def save(self, step: int, state: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None) -> bool:
        """Save ``state`` as ``step`` to every tier due at this step; collective.

        Returns once the state is copied to host memory (True), or at once when
        no tier is due (False). Raises the error of an earlier background save,
        or :class:`~ucp_dcp.manager.snapshot.NonFiniteError` (``nonfinite="error"``).
        """
        self._check_open()
        self._raise_finished_errors()
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        due = self._due(step)
        if not due:
            return False
        t0 = time.perf_counter()
        nonfinite: dict[str, list[int]] = {}
        if self.config.nonfinite != "off":
            for rank, names in enumerate(self._gather(self._fg, find_nonfinite(state))):
                for n in names:
                    nonfinite.setdefault(n, []).append(rank)
            if nonfinite and self.config.nonfinite == "error":
                listed = ", ".join(f"{n} (rank {', '.join(map(str, r))})" for n, r in sorted(nonfinite.items()))
                raise NonFiniteError(
                    f"refusing to save step {step}: NaN/Inf in {len(nonfinite)} tensor(s): {listed}. "
                    "The last good checkpoint is kept; pass nonfinite='flag' to save anyway"
                )
        self._slots.acquire()  # backpressure: wait until an in-flight save finishes
        try:
            staged = self._snap.stage(state)
        except BaseException:
            self._slots.release()
            raise
        self._seq += 1
        job = _Job(step, staged, due, nonfinite, dict(extra or {}), f"{self._session}{self._seq:05d}")
        job.blocking_s = time.perf_counter() - t0
        if not self.config.async_save:
            self._record(self._run(job))
            return True
        with self._lock:
            self._futures.append(self._pool.submit(self._run, job))
        return True

    def wait(self) -> None:
        """Block until every in-flight save is committed; raise the first error of any of them."""
        with self._lock:
            futures, self._futures = self._futures, []
        first: BaseException | None = None
        for f in futures:
            try:
                self._record(f.result())
            except BaseException as e:  # keep waiting for the rest: none may be left running
                first = first or e
        if first is not None:
            raise first

    def steps(self) -> list[int]:
        """Committed steps in any tier (this node's local tier and the persistent tier), ascending."""
        found = set(self.persistent.steps())
        if self.local is not None:
            found.update(self.local.steps())
        return sorted(found)

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int:
        """Load ``step`` (default: the newest valid one) into ``state`` in place; collective.

        Resharding happens as needed. A copy that is missing, incomplete or
        fails its checksums is skipped for the next tier's copy of the same
        step, then older steps; each fallback is logged and kept in
        :attr:`last_restore`. Returns the step loaded.
        """
        self._check_open()
        self.wait()
        t0 = time.perf_counter()
        candidates = self._candidates(step)
        if not candidates:
            where = self.persistent.url + (f" and {self.local.url}" if self.local else "")
            what = f"step {step}" if step is not None else "no committed step"
            raise NoCheckpointError(f"nothing to restore: {what} found in {where}")
        attempts: list[str] = []
        for cand in candidates:
            try:
                path, done = self._prepare(cand)
                try:
                    verified = self._load_from(path, state, cand)
                finally:
                    done()
            except (Exception, CheckpointException) as e:
                msg = f"step {cand.step} from the {cand.tier} tier failed: {_short(e)}"
                attempts.append(msg)
                if self.rank == 0:
                    log.warning("%s; falling back", msg)
                continue
            self.last_restore = RestoreRecord(cand.step, cand.tier, time.perf_counter() - t0, tuple(attempts), verified)
            if attempts and self.rank == 0:
                log.warning("restored step %d from the %s tier after %d failed attempt(s)", cand.step, cand.tier,
                            len(attempts))
            if cand.marker.world_size != self.world_size:
                event = ReshardEvent(cand.step, cand.marker.world_size, self.world_size, cand.tier)
                for cb in self._on_reshard:
                    cb(event)
            return cand.step
        raise CheckpointRestoreError("no copy of any candidate step could be restored:", attempts)

    def add_reshard_callback(self, fn: Callable[[ReshardEvent], None]) -> None:
        """Call ``fn`` after a restore from a step saved by another world size."""
        self._on_reshard.append(fn)

    def verify(self, step: int, *, tier: str | None = None) -> list[str]:
        """Recheck every file of ``step`` this process can see; one line per problem ([] = intact).

        Whole-file xxh3-128 digests against the commit marker (catches any
        flipped byte, header and padding included), then, for a damaged data
        file, every chunk checksum to name the tensors hit. Not collective: a
        node-local tier is checked for this node's files only.
        """
        problems: list[str] = []
        tiers = [t for t in self._tiers() if tier is None or t.name == tier]
        found = False
        for t in tiers:
            if step not in t.steps():
                continue
            found = True
            problems += self._verify_tier(t, step)
        if not found:
            problems.append(f"step {step}: not committed in {', '.join(t.name for t in tiers) or 'any tier'}")
        return problems

    def stats(self) -> list[SaveRecord]:
        """Per-save measurements of the saves committed so far."""
        return list(self.records)

    def goodput(self, mtbf_s: float, *, restart_s: float = 0.0) -> goodput.GoodputEstimate:
        """Daly's optimal checkpoint interval and the expected goodput for the measured save cost."""
        recs = self.records
        return goodput.estimate(
            [r.blocking_s for r in recs], [r.write_s for r in recs], [r.nbytes for r in recs],
            mtbf_s=mtbf_s, restart_s=restart_s,
        )

    def close(self) -> None:
        """Wait for in-flight saves, then release threads and host buffers."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._snap.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ collectives
    def _gather(self, group: Any, obj: T) -> list[T]:
        if not self._dist:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def _bcast(self, group: Any, obj: T, src: int = 0) -> T:
        if not self._dist:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]  # type: ignore[return-value]

    def _agree(self, group: Any, what: str, fn: Callable[[], T], *, step: int, restoring: bool = False) -> T:
        """Run ``fn`` on every rank; if it failed anywhere, raise on every rank (no rank is left waiting)."""
        err: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            err = e
        errors = [m for m in self._gather(group, None if err is None else f"rank {self.rank}: {_short(err)}") if m]
        if errors:
            if restoring:
                raise CheckpointRestoreError(f"step {step}: {what}: " + "; ".join(errors)) from err
            raise CheckpointSaveError(step, f"{what}: " + "; ".join(errors)) from err
        return result

    # ------------------------------------------------------------------ saving
    def _due(self, step: int) -> tuple[str, ...]:
        due = []
        if self.local is not None and step % self.config.local_interval == 0:
            due.append("local")
        if step % self.config.persistent_interval == 0:
            due.append("persistent")
        return tuple(due)

    def _run(self, job: _Job) -> SaveRecord:
        """Background: write, replicate, commit, drain, retain. Runs on every rank in save order."""
        try:
            job.staged.wait_ready()
            t0 = time.perf_counter()
            state, step = job.staged.state, job.step
            committed: list[str] = []
            src: str | None = None  # a local directory holding this rank's files of the step
            scratch: str | None = None
            if "local" in job.tiers:
                assert self.local is not None
                staging = self.local.staging_path(step, job.token)
                marker = self._write(job, state, self.local, staging, per_node=True)
                if self.config.peer_replication and self.num_nodes > 1:
                    self._agree(self._bg, "peer replication", lambda: self._replicate(staging, marker), step=step)
                self._agree(
                    self._bg, "local commit",
                    lambda: self.local.commit(staging, marker) if self.is_leader else None,  # type: ignore[union-attr]
                    step=step,
                )
                committed.append("local")
                src = self.local.step_path(step)
            if "persistent" in job.tiers:
                if src is None and self.persistent.local:
                    staging = self.persistent.staging_path(step, job.token)
                    marker = self._write(job, state, self.persistent, staging, per_node=False)
                else:
                    if src is None:  # a remote tier and no local one: write to a scratch dir, then upload
                        scratch = src = tempfile.mkdtemp(prefix=f"ucp-scratch-{step}-")
                        marker = self._write(job, state, None, scratch, per_node=False)
                    marker = self._upload(job, src, marker)
                    staging = self.persistent.staging_path(step, job.token)
                self._agree(
                    self._bg, "persistent commit",
                    lambda: self.persistent.commit(staging, marker) if self.rank == 0 else None,
                    step=step,
                )
                committed.append("persistent")
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            self._retain(step)
            nbytes = sum(d.size for d in marker.files if d.rank == self.rank)
            return SaveRecord(step, job.blocking_s, time.perf_counter() - t0, nbytes, tuple(committed))
        except BaseException:
            self._abort(job)
            raise
        finally:
            self._snap.release(job.staged)
            self._slots.release()

    def _write(self, job: _Job, state: Any, tier: Tier | None, path: str, *, per_node: bool) -> CommitMarker:
        """dcp.save the staged state into ``path``; return the commit marker (digests of every file)."""
        step = job.step
        creator = self.is_leader if per_node else self.rank == 0
        if tier is not None:
            self._agree(self._bg, "creating the staging directory",
                        lambda: tier.begin(step, job.token) if creator else None, step=step)
        try:
            dcp.save(dict(state), storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner(),
                     process_group=self._bg)
        except CheckpointException as e:
            raise CheckpointSaveError(step, _short(e)) from e

        def digest_mine() -> list[FileDigest]:
            prefix = f"rank{self.rank:05d}-"
            mine = sorted(n for n in os.listdir(path) if n.startswith(prefix) and n.endswith(".safetensors"))
            out = [FileDigest(n, *file_digest(os.path.join(path, n)), self.rank) for n in mine]
            if self.rank == 0:
                with open(os.path.join(path, INDEX_FILE), "rb") as f:
                    data = f.read()
                out.append(FileDigest(INDEX_FILE, len(data), bytes_digest(data), -1))
            return out

        digests = self._agree(self._bg, "hashing the written files", digest_mine, step=step)
        files = sorted((d for ds in self._gather(self._bg, digests) for d in ds), key=lambda d: d.name)
        marker = CommitMarker(step, self.world_size, time.time(), tuple(files), job.nonfinite, job.extra)
        marker = self._bcast(self._bg, marker)  # one creation time on every rank
        if per_node and self.num_nodes > 1:
            # Every node's directory gets the index, so that it is a complete
            # description of the checkpoint wherever the data files end up.
            index = self._bcast(self._bg, _read(os.path.join(path, INDEX_FILE)) if self.rank == 0 else None)

            def put_index() -> None:
                if self.is_leader and self.rank != 0:
                    assert tier is not None
                    tier.put_bytes(path, INDEX_FILE, index)

            self._agree(self._bg, "replicating the index", put_index, step=step)
        return marker

    def _replicate(self, staging: str, marker: CommitMarker) -> None:
        """Copy the previous node's data files into this node's staging directory."""
        partner = (self.node - 1) % self.num_nodes
        wanted = []
        if self.is_leader:
            wanted = [d.name for d in marker.files if d.rank >= 0 and d.rank // self.ranks_per_node == partner]
        own = [d.name for d in marker.files if d.rank == self.rank]
        exchange_files(self._bg, staging, own, staging, wanted)

    def _upload(self, job: _Job, src: str, marker: CommitMarker) -> CommitMarker:
        """Copy this rank's files of the step from local ``src`` into the persistent tier's staging."""
        step = job.step
        self._agree(self._bg, "creating the persistent staging location",
                    lambda: self.persistent.begin(step, job.token) if self.rank == 0 else None, step=step)
        staging = self.persistent.staging_path(step, job.token)

        def put_mine() -> None:
            for d in marker.files:
                if d.rank == self.rank or (d.rank == -1 and self.rank == 0):
                    self.persistent.put_file(staging, os.path.join(src, d.name), d.name)

        self._agree(self._bg, f"uploading to {self.persistent.url}", put_mine, step=step)
        return marker

    def _retain(self, step: int) -> None:
        """Delete steps outside the retention policy; the newest committed step always stays."""
        cfg = self.config
        plans: list[tuple[Tier, int, int | None]] = []
        if self.rank == 0:
            plans.append((self.persistent, cfg.keep_last, cfg.keep_every))
        if self.local is not None and self.is_leader:
            plans.append((self.local, cfg.local_keep_last, None))
        for tier, keep_last, keep_every in plans:
            try:
                committed = tier.steps()
                keep = set(committed[-keep_last:]) | {step}
                if keep_every:
                    keep |= {s for s in committed if s % keep_every == 0}
                for s in committed:
                    if s not in keep:
                        tier.delete(s)
            except Exception as e:  # retention must never fail a committed save
                log.warning("retention in the %s tier (%s) failed: %s", tier.name, tier.url, e)

    def _abort(self, job: _Job) -> None:
        """Best effort: remove this save's staging leftovers (start-up cleanup catches the rest)."""
        for tier, mine in ((self.local, self.is_leader), (self.persistent, self.rank == 0)):
            if tier is None or not mine:
                continue
            try:
                if tier.local:
                    shutil.rmtree(tier.staging_path(job.step, job.token), ignore_errors=True)
                else:
                    tier.cleanup()
            except Exception as e:
                log.warning("could not clean up the failed save of step %d in %s: %s", job.step, tier.url, e)

    def _record(self, rec: SaveRecord) -> None:
        self.records.append(rec)

    def _raise_finished_errors(self) -> None:
        with self._lock:
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        first: BaseException | None = None
        for f in done:
            try:
                self._record(f.result())
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    # --------------------------------------------------------------- restoring
    def _tiers(self) -> list[Tier]:
        return ([self.local] if self.local is not None else []) + [self.persistent]

    def _candidates(self, step: int | None) -> list[_Candidate]:
        """(step, tier) pairs to try, newest step first, fastest tier first; the same list on every rank."""
        out: list[_Candidate] = []
        if self.local is not None:
            mine: dict[int, CommitMarker] = {}
            if self.is_leader:
                for s in self.local.steps():
                    try:
                        mine[s] = self.local.marker(s)
                    except CheckpointFormatError:
                        continue
            per_rank = self._gather(self._fg, mine)
            steps: dict[int, _Candidate] = {}
            for rank, markers in enumerate(per_rank):
                for s, m in markers.items():
                    c = steps.setdefault(s, _Candidate(s, "local", m))
                    c.nodes_with_step.append(rank // self.ranks_per_node)
            out += steps.values()
        remote: dict[int, CommitMarker] = {}
        if self.rank == 0:
            for s in self.persistent.steps():
                try:
                    remote[s] = self.persistent.marker(s)
                except CheckpointFormatError:
                    continue
        out += [_Candidate(s, "persistent", m) for s, m in self._bcast(self._fg, remote).items()]
        if step is not None:
            out = [c for c in out if c.step == step]
        elif not self.config.load_flagged:
            out = [c for c in out if not c.marker.nonfinite]
        order = {"local": 0, "persistent": 1}
        return sorted(out, key=lambda c: (-c.step, order[c.tier]))

    def _prepare(self, cand: _Candidate) -> tuple[str, Callable[[], None]]:
        """Make ``cand`` loadable from a local directory on every node; return it and a clean-up."""
        step, marker = cand.step, cand.marker
        if cand.tier == "local":
            assert self.local is not None
            tier = self.local
            have_step = self.node in cand.nodes_with_step
            token = f"r{self._session}{self._seq:05d}"

            def missing() -> list[str]:
                if not self.is_leader:
                    return []
                present = tier.files(step) if have_step else {}
                return [d.name for d in marker.files if present.get(d.name) != d.size]

            wanted = self._agree(self._fg, f"listing local files of step {step}", missing, step=step, restoring=True)
            if any(self._gather(self._fg, bool(wanted))):
                # Some node lost files (or never had them): fetch them from the
                # nodes that hold copies, then commit the repaired directory.
                dest = tier.step_path(step) if have_step else tier.staging_path(step, token)
                self._agree(self._fg, f"creating a local directory for step {step}",
                            lambda: tier.begin(step, token) if self.is_leader and not have_step else None,
                            step=step, restoring=True)
                avail = []
                if have_step:
                    avail = [n for n, size in tier.files(step).items() if marker_size(marker, n) == size]
                exchange_files(self._fg, tier.step_path(step) if have_step else None, avail, dest, wanted)
                self._agree(
                    self._fg, f"committing repaired step {step} locally",
                    lambda: tier.commit(dest, marker) if self.is_leader and not have_step else None,
                    step=step, restoring=True,
                )
            path = tier.step_path(step)
            self._check_index(path, marker, "local")
            return path, lambda: None
        if self.persistent.local:
            path = self.persistent.step_path(step)
            self._check_index(path, marker, "persistent")
            return path, lambda: None
        # A remote tier: download into the local tier (committing it there, so the
        # next restore is local), or into a temporary directory.
        if self.local is not None:
            tier = self.local
            token = f"f{self._session}{self._seq:05d}"
            dest = tier.staging_path(step, token)

            def fetch() -> None:
                if self.is_leader:
                    tier.begin(step, token)
                    self.persistent.fetch(step, [d.name for d in marker.files], dest)
                    tier.commit(dest, marker)

            self._agree(self._fg, f"fetching step {step} from {self.persistent.url}", fetch, step=step, restoring=True)
            path = tier.step_path(step)
            self._check_index(path, marker, "persistent")
            return path, lambda: None
        tmp = tempfile.mkdtemp(prefix=f"ucp-restore-{step}-")
        self._agree(self._fg, f"fetching step {step} from {self.persistent.url}",
                    lambda: self.persistent.fetch(step, [d.name for d in marker.files], tmp), step=step,
                    restoring=True)
        self._check_index(tmp, marker, "persistent")
        return tmp, lambda: shutil.rmtree(tmp, ignore_errors=True)

    def _check_index(self, path: str, marker: CommitMarker, tier: str) -> None:
        """The index must match the marker's digest (a flipped byte there could misdirect every read)."""

        def check() -> None:
            want = marker.digest(INDEX_FILE)
            data = _read(os.path.join(path, INDEX_FILE))
            got = bytes_digest(data)
            if len(data) != want.size or got != want.xxh3:
                raise CheckpointFormatError(
                    f"{os.path.join(path, INDEX_FILE)}: the index of step {marker.step} in the {tier} tier does "
                    f"not match its commit marker ({len(data)} bytes, xxh3-128 {got}; recorded {want.size} bytes, "
                    f"{want.xxh3}): it is corrupt"
                )

        self._agree(self._fg, "checking the index", check, step=marker.step, restoring=True)

    def _load_from(self, path: str, state: Mapping[str, Any], cand: _Candidate) -> int:
        reader = UCPStorageReader(path, verify=self.config.verify_on_load, io_threads=self.config.io_threads)
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner(), process_group=self._fg)  # type: ignore[arg-type]
        return int(getattr(reader, "verified_bytes", 0))

    def _verify_tier(self, tier: Tier, step: int) -> list[str]:
        where = f"step {step} in the {tier.name} tier ({tier.url})"
        try:
            marker = tier.marker(step)
        except CheckpointFormatError as e:
            return [f"{where}: {e}"]
        tmp: str | None = None
        try:
            if tier.local:
                path = tier.step_path(step)
                present = tier.files(step)
            else:
                tmp = tempfile.mkdtemp(prefix=f"ucp-verify-{step}-")
                path = tmp
                tier.fetch(step, [d.name for d in marker.files], tmp)
                present = {n: os.path.getsize(os.path.join(tmp, n)) for n in os.listdir(tmp)}
            problems: list[str] = []
            damaged = False
            for d in marker.files:
                own = d.rank == -1 or tier is self.persistent or d.rank // self.ranks_per_node == self.node
                who = "the index" if d.rank == -1 else f"written by rank {d.rank}"
                if d.name not in present:
                    if own:
                        problems.append(f"{where}: {d.name} ({who}) is missing")
                    continue
                size, digest = file_digest(os.path.join(path, d.name))
                if size != d.size or digest != d.xxh3:
                    damaged = True
                    problems.append(
                        f"{where}: {d.name} ({who}) is corrupt: {size} bytes with xxh3-128 {digest}, "
                        f"the commit recorded {d.size} bytes with {d.xxh3}"
                    )
            if damaged and all(d.name in present for d in marker.files):
                try:
                    with Checkpoint(path) as ck:
                        problems += [f"{where}: {p}" for p in ck.verify()]
                except Exception as e:  # a damaged index: the digest line above already says so
                    problems.append(f"{where}: cannot check chunks: {_short(e)}")
            return problems
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    # ------------------------------------------------------------------ misc
    def _startup_cleanup(self) -> None:
        if self.rank == 0:
            for line in self.persistent.cleanup():
                log.info("%s", line)
        if self.local is not None and self.is_leader:
            for line in self.local.cleanup():
                log.info("%s", line)
            for s in self.local.steps():
                clean_partials(self.local.step_path(s))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this CheckpointManager is closed")


def marker_size(marker: CommitMarker, name: str) -> int | None:
    """The size ``marker`` records for file ``name`` (None if it has no such file)."""
    for d in marker.files:
        if d.name == name:
            return d.size
    return None


def _validate(cfg: CheckpointConfig) -> None:
    for k in ("local_interval", "persistent_interval", "keep_last", "local_keep_last", "max_in_flight", "io_threads"):
        v = getattr(cfg, k)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"CheckpointConfig.{k} must be an int >= 1, got {v!r} (keep_last=0 would delete "
                             "the only good checkpoint)" if "keep" in k else f"CheckpointConfig.{k} must be an "
                             f"int >= 1, got {v!r}")
    if cfg.keep_every is not None and (not isinstance(cfg.keep_every, int) or cfg.keep_every < 1):
        raise ValueError(f"CheckpointConfig.keep_every must be None or an int >= 1, got {cfg.keep_every!r}")
    if cfg.nonfinite not in ("off", "error", "flag"):
        raise ValueError(f"CheckpointConfig.nonfinite must be 'off', 'error' or 'flag', got {cfg.nonfinite!r}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _short(e: BaseException) -> str:
    """One line for an error, including DCP's per-rank failures."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, err in sorted(e.failures.items()):
            inner = err[0] if isinstance(err, tuple) else err
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts) or str(e)
    return f"{type(e).__name__}: {e}"
