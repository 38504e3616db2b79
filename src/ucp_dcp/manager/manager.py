"""CheckpointManager: async, atomic, verified, multi-tier checkpoints for a training loop.

Every checkpoint is a universal checkpoint (``UCPStorageWriter``), so ``load`` reshards into
whatever layout and world size the state has now. This module is the public face: it checks
arguments and owns the threads, buffers and process groups; the background half of a save is
:mod:`._pipeline`'s, restore with fallback :mod:`._restore`'s. The example is
:class:`CheckpointManager`'s; docs/manager.md describes the behaviour and docs/architecture.md
what each module of the package does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch.distributed as dist

from ..byteio.location import path_arg
from ..byteio.requests import rank_and_world
from ..errors import (
    CheckpointRestoreError,
    CheckpointSaveError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidStateError,
    NoCheckpointError,
    UCPError,
)
from ._collective import Group, NodeLayout
from ._pipeline import SaveJob, SavePipeline
from ._restore import Restorer
from .config import CheckpointConfig, GoodputEstimate, estimate, tiers_due
from .peer import clean_partials
from .records import ReshardEvent, RestoreRecord, SaveRecord
from .snapshot import NonFiniteError, Snapshotter, find_nonfinite
from .tiers import LocalTier, Tier, open_tier
from .tiers.marker import check_step

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


class CheckpointManager:
    """Drives async, atomic, verified, multi-tier checkpoints of a training state.

    ::

        mgr = CheckpointManager("/shared/ckpt", local="/local_nvme/ckpt", local_interval=100,
                                persistent_interval=1000)
        start = mgr.load(state) + 1 if mgr.steps() else 0
        for step in range(start, steps):
            train_step(...)
            mgr.save(step, state)   # returns once the state is staged in host memory
        mgr.wait()

    Args:
        root: persistent tier: a directory (shared file system) or an fsspec
            URL such as ``s3://bucket/run``.
        config: a :class:`CheckpointConfig`; keywords override its fields
            (``help(CheckpointConfig)`` lists them all).
        on_reshard: callbacks called with a :class:`ReshardEvent` when a
            restored step was saved by another world size (rescale batch size
            and learning rate, reshard rank-local state).

    Works with or without an initialised process group. With one, every rank
    must construct the manager, and call ``save`` and ``load`` at the same
    steps (they are collective). Saves are written in the background in
    order; an error of any rank surfaces at the next ``save`` or ``wait``.
    See docs/manager.md.

    Attributes:
        config: the effective :class:`CheckpointConfig`.
        persistent: the persistent :class:`~ucp_dcp.manager.tiers.Tier`.
        local: this node's :class:`~ucp_dcp.manager.tiers.LocalTier`, or None.
        last_restore: a :class:`RestoreRecord` of the last :meth:`load`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        config: CheckpointConfig | None = None,
        *,
        on_reshard: Sequence[Callable[[ReshardEvent], None]] = (),
        **overrides: Any,
    ) -> None:
        if config is not None and not isinstance(config, CheckpointConfig):
            raise InvalidArgumentTypeError(
                f"CheckpointManager: config must be a CheckpointConfig, got {type(config).__name__}"
            )
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(CheckpointConfig)})
        if unknown:
            raise InvalidArgumentTypeError(
                f"CheckpointManager: unknown option(s) {unknown}; CheckpointConfig's fields are "
                "the options"
            )
        callbacks = list(on_reshard) if isinstance(on_reshard, Iterable) else None
        if callbacks is None or not all(callable(f) for f in callbacks):
            raise InvalidArgumentTypeError(
                "CheckpointManager: on_reshard must be a sequence of callables"
            )
        root = path_arg(root, "CheckpointManager: root")
        cfg = dataclasses.replace(config or CheckpointConfig(), **overrides)
        cfg.validate()
        self.config = cfg
        distributed = dist.is_available() and dist.is_initialized()
        self._layout = NodeLayout.detect(*rank_and_world(), cfg.ranks_per_node)
        self._snap = Snapshotter(max_buffers=cfg.max_in_flight)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ucp-ckpt"
        )
        # Two gloo groups of our own, one per thread that runs collectives (see ._collective),
        # destroyed by close() (or here, if the manager cannot start).
        self._fg = Group(self._layout, distributed)
        self._bg = Group(self._layout, distributed)
        try:
            self._session = self._fg.bcast(uuid.uuid4().hex[:6])
            self._seq = 0
            self.persistent: Tier = open_tier(
                root, name="persistent", storage_options=cfg.storage_options, requests=cfg.requests
            )
            self.local: LocalTier | None = (
                LocalTier(os.fspath(cfg.local).format(node=self.node), name="local")
                if cfg.local
                else None
            )
            self._on_reshard = callbacks
            self._slots = threading.Semaphore(cfg.max_in_flight)
            self._pipeline = SavePipeline(cfg, self._layout, self._bg, self.local, self.persistent)
            self._restorer = Restorer(cfg, self._layout, self._fg, self.local, self.persistent)
            # Saves (a SaveRecord each) and local-tier refills after a restore (None), in
            # submission order.
            self._futures: list[concurrent.futures.Future[SaveRecord | None]] = []
            self._lock = threading.Lock()
            self._records: list[SaveRecord] = []
            self.last_restore: RestoreRecord | None = None
            self._closed = False
            self._fg.agree("start-up cleanup", self._startup_cleanup, step=-1)
        except BaseException:
            self._closed = True
            self._release()
            raise

    @property
    def node(self) -> int:
        """The node this rank is on: the ranks sharing one local directory (``ranks_per_node``)."""
        return self._layout.node

    # ------------------------------------------------------------------ saving
    def save(
        self, step: int, state: Mapping[str, Any], *, extra: Mapping[str, Any] | None = None
    ) -> bool:
        """Save ``state`` as ``step`` to every tier due at this step; collective.

        Returns once the state is copied to host memory (True), or at once when
        no tier is due (False). ``extra`` (JSON-able) is stored in the commit
        marker. A step already committed is replaced: the new copy is swapped in when it
        commits, and until then the old one loads. Raises the error of an earlier background
        save, or :class:`~ucp_dcp.manager.snapshot.NonFiniteError` (``nonfinite="error"``).
        """
        self._check_open()
        self._raise_finished_errors()
        check_step(step, "CheckpointManager.save: step")
        _check_state(state, "CheckpointManager.save")
        if extra is not None and not isinstance(extra, Mapping):
            raise InvalidArgumentTypeError(
                "CheckpointManager.save: extra must be a mapping or None, got "
                f"{type(extra).__name__}"
            )
        extras = dict(extra or {})
        try:  # it goes into the commit marker (strict JSON): refused now, not once the save has run
            json.dumps(extras, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"CheckpointManager.save: extra is not JSON ({e})") from None
        cfg = self.config
        due = tiers_due(
            step,
            local_interval=cfg.local_interval if self.local is not None else None,
            persistent_interval=cfg.persistent_interval,
        )
        if not due:
            return False
        t0 = time.perf_counter()
        nonfinite = self._check_nonfinite(step, state)
        self._slots.acquire()  # backpressure: wait until an in-flight save finishes
        try:
            staged = self._snap.stage(state)
        except BaseException as e:
            self._slots.release()
            if isinstance(e, UCPError) or not isinstance(e, RuntimeError):
                raise
            # torch's own failure while copying (host memory for the copy, a device error):
            # named as this step's save failing, as every other save error is.
            raise CheckpointSaveError(step, f"staging the state's copy failed: {e}") from e
        self._seq += 1
        job = SaveJob(step, staged, due, nonfinite, extras, self._token(), time.perf_counter() - t0)
        if not cfg.async_save:
            self.wait()  # a local-tier refill may still run: saves never run beside it
            self._records.append(self._save_in_background(job))
            return True
        with self._lock:
            self._futures.append(self._pool.submit(self._save_in_background, job))
        return True

    def wait(self) -> None:
        """Block until every in-flight save is committed (and any local-tier refill is done); raise
        the first save error of any of them."""
        with self._lock:
            futures, self._futures = self._futures, []
        self._collect(futures)

    # --------------------------------------------------------------- restoring
    def steps(self) -> list[int]:
        """Committed steps in any tier (this node's local tier and the persistent tier),
        ascending."""
        return sorted({s for t in self._tiers() for s in t.steps()})

    def load(self, state: Mapping[str, Any], step: int | None = None) -> int:
        """Load ``step`` (default: the newest valid one) into ``state`` in place; collective.

        Resharding happens as needed. A copy that is missing, incomplete or
        fails its checksums is skipped for the next tier's copy of the same
        step, then older steps; each fallback is logged and kept in
        :attr:`last_restore`. Returns the step loaded. Raises
        :class:`NoCheckpointError` when nothing is committed,
        :class:`CheckpointRestoreError` when no copy loads.
        """
        self._check_open()
        if step is not None:
            check_step(step, "CheckpointManager.load: step")
        _check_state(state, "CheckpointManager.load")
        self.wait()
        token = self._token()
        cand, self.last_restore = self._restorer.restore(state, step, token)
        if self.local is not None and self._restorer.direct(cand):
            # Loaded straight from the object store: copy it into the local tier
            # behind the training loop, in order with later saves.
            with self._lock:
                self._futures.append(self._pool.submit(self._restorer.refill, cand, f"f{token}"))
        world_size = self._layout.world_size
        if cand.marker.world_size != world_size:
            event = ReshardEvent(cand.step, cand.marker.world_size, world_size, cand.tier)
            for cb in self._on_reshard:
                cb(event)
        return cand.step

    def verify(self, step: int, *, tier: str | None = None) -> list[str]:
        """Recheck every file of ``step`` this process can see against the digests of its commit
        marker (:func:`~ucp_dcp.manager.tiers.marker.check_copy`); one line per problem, naming
        the file and, for a damaged data file, the tensors hit ([] = intact).

        Not collective: a node-local tier is checked for this node's files only. ``tier``
        (``"local"`` or ``"persistent"``): check that tier only.
        """
        if tier not in (None, "local", "persistent"):
            raise InvalidArgumentError(f"tier must be 'local', 'persistent' or None, got {tier!r}")
        problems: list[str] = []
        tiers = [t for t in self._tiers() if tier is None or t.name == tier]
        if not tiers:
            return [f"step {step}: this manager has no {tier} tier (made without local=)"]
        found = False
        for t in tiers:
            if step not in t.steps():
                continue
            found = True
            # A node-local tier holds this node's share of the files (and its partner's).
            held = partial(self._layout.held_files, peer=self.config.peer_replication)
            problems += t.verify(step, held=held if t is self.local else None)
        if not found:
            problems.append(f"step {step}: not committed in {', '.join(t.name for t in tiers)}")
        return problems

    # ------------------------------------------------------------- measuring
    def stats(self) -> list[SaveRecord]:
        """Per-save measurements of the saves committed so far."""
        return list(self._records)

    def goodput(self, mtbf_s: float, *, restart_s: float = 0.0) -> GoodputEstimate:
        """Daly's optimal checkpoint interval and the expected goodput for the measured save
        cost."""
        recs = self._records
        return estimate(
            [r.blocking_s for r in recs],
            [r.write_s for r in recs],
            [r.nbytes for r in recs],
            mtbf_s=mtbf_s,
            restart_s=restart_s,
        )

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Wait for in-flight saves, then release threads, host buffers and the manager's two
        process groups (local: call it on every rank, as the ``with`` block does)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._release()

    def _release(self) -> None:
        self._pool.shutdown(wait=True)
        self._snap.close()
        self._bg.close()
        self._fg.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- internals
    def _check_nonfinite(self, step: int, state: Mapping[str, Any]) -> dict[str, list[int]]:
        """Tensor name -> ranks holding NaN/Inf in it (nothing when the guard is off); raises for
        "error"."""
        nonfinite: dict[str, list[int]] = {}
        if self.config.nonfinite == "off":
            return nonfinite
        for rank, names in enumerate(self._fg.gather(find_nonfinite(state))):
            for n in names:
                nonfinite.setdefault(n, []).append(rank)
        if nonfinite and self.config.nonfinite == "error":
            listed = ", ".join(
                f"{n} (rank {', '.join(map(str, r))})" for n, r in sorted(nonfinite.items())
            )
            raise NonFiniteError(
                f"refusing to save step {step}: NaN/Inf in {len(nonfinite)} tensor(s): {listed}. "
                "The last good checkpoint is kept; pass nonfinite='flag' to save anyway"
            )
        return nonfinite

    def _token(self) -> str:
        """Names this save's (or restore's) directories; the same on every rank."""
        return f"{self._session}{self._seq:05d}"

    def _save_in_background(self, job: SaveJob) -> SaveRecord:
        try:
            return self._pipeline.run(job)
        finally:
            self._snap.release(job.staged)
            self._slots.release()

    def _raise_finished_errors(self) -> None:
        with self._lock:
            done = [f for f in self._futures if f.done()]
            self._futures = [f for f in self._futures if not f.done()]
        self._collect(done)

    def _collect(self, futures: Iterable[concurrent.futures.Future[SaveRecord | None]]) -> None:
        """Record each save's result; raise the first error once all are finished (none may be left
        running)."""
        first: BaseException | None = None
        for f in futures:
            try:
                rec = f.result()
                if rec is not None:  # None: a refill
                    self._records.append(rec)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _tiers(self) -> list[Tier]:
        return ([self.local] if self.local is not None else []) + [self.persistent]

    def _startup_cleanup(self) -> None:
        for tier in self._tiers():
            if self._pipeline.acts_for(tier):
                for line in tier.cleanup():
                    log.info("%s", line)
        if self.local is not None and self._layout.is_leader:
            for s in self.local.steps():
                clean_partials(self.local.step_path(s))

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidStateError(
                "this CheckpointManager is closed (close() was called); create a new one"
            )


def _check_state(state: object, who: str) -> None:
    """The state dict ``who`` saves or loads must be a mapping (checked before any collective)."""
    if not isinstance(state, Mapping):
        raise InvalidArgumentTypeError(
            f"{who}: state must be a mapping, got {type(state).__name__}"
        )
