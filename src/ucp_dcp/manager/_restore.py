"""Restore with fallback: which copies to try, in what order, and making each one loadable.

:func:`order_candidates` is the choice, a pure function. :class:`Restorer` gathers the markers
(the same list on every rank) and tries each candidate until one loads, falling back past a
copy that is missing, incomplete or fails its checksums: a local copy some node lacks is
repaired from the nodes that hold it, an object-store copy is loaded from there directly
(:meth:`Restorer.refill` then copies it into the local tier), any other persistent copy is read
where it lies or downloaded first. See docs/manager.md ("Tiers").

Small reads go through the manager's group, not whole-file fetches (:mod:`._small_reads`).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..byteio.integrity import bytes_digest
from ..byteio.objstore import is_url
from ..dcp import (
    LoadReport,
    PlannedRead,
    ReadOptions,
    UCPLoadPlanner,
    UCPStorageReader,
    collector_paused,
)
from ..errors import CheckpointFormatError, CheckpointRestoreError, NoCheckpointError
from ..format import INDEX_FILE
from ._collective import GroupWorker, describe
from ._small_reads import SmallReads, fill, put_back, serve, small_keys, without
from .peer import exchange_files
from .records import RestoreRecord
from .tiers import CommitMarker, FsspecTier, Tier
from .tiers.marker import check_copy

__all__ = ["Candidate", "order_candidates", "Restorer"]

log = logging.getLogger("ucp_dcp.manager.manager")

_TIER_ORDER = {"local": 0, "persistent": 1}

OBJECT_REQUEST_BYTES = 64 << 20
"""Largest ranged request of a restore straight from an object store (the reader's default is 16
MiB): a request costs a round trip, and on some servers more (moto's S3 reads the whole object
for every ranged GET). The reader keeps at most two windows' bytes in memory, one being placed,
the next being fetched: of one request each (128 MiB)."""


@dataclass(frozen=True)
class Candidate:
    """A committed copy of a step to try: its tier (``"local"`` or ``"persistent"``) and marker."""

    step: int
    tier: str
    marker: CommitMarker
    nodes_with_step: tuple[int, ...] = ()
    """Local candidates: the nodes whose directory holds the step."""


def order_candidates(
    local: Sequence[Mapping[int, CommitMarker]] | None,
    persistent: Mapping[int, CommitMarker],
    *,
    ranks_per_node: int,
    step: int | None,
    load_flagged: bool,
) -> list[Candidate]:
    """The copies to try, newest step first, local before persistent.

    ``local``: per rank (in rank order), the local markers it read (node
    leaders only; None: no local tier); a local candidate's marker is that of
    the lowest rank holding the step. ``persistent``: the persistent tier's
    markers. With ``step`` only that step; without, steps flagged non-finite
    only if ``load_flagged``.
    """
    out: list[Candidate] = []
    if local is not None:
        markers: dict[int, CommitMarker] = {}
        nodes: dict[int, list[int]] = {}
        for rank, mine in enumerate(local):
            for s, m in mine.items():
                markers.setdefault(s, m)
                nodes.setdefault(s, []).append(rank // ranks_per_node)
        out += [Candidate(s, "local", m, tuple(nodes[s])) for s, m in markers.items()]
    out += [Candidate(s, "persistent", m) for s, m in persistent.items()]
    if step is not None:
        out = [c for c in out if c.step == step]
    elif not load_flagged:
        out = [c for c in out if not c.marker.nonfinite]
    return sorted(out, key=lambda c: (-c.step, _TIER_ORDER[c.tier]))


@dataclass(frozen=True)
class _Loadable:
    """A candidate made loadable on this rank: where to read it and how, and the clean-up after."""

    path: str
    """A local directory or a URL."""
    index: bytes
    """Its index, read and checked against the marker: the load parses these bytes (no second
    read)."""
    storage_options: dict[str, Any] | None = None
    """For a URL: fsspec's options."""
    done: Callable[[], None] = lambda: None
    """Run after the load, whatever its outcome."""
    small: SmallReads | None = None
    """Keys read through the group from the nodes that hold their files (the same on every
    rank; None: none, on any rank)."""


def _listed(tier: Tier) -> dict[int, CommitMarker] | str:
    """``tier``'s markers, or why they could not be listed (to be sent to the other ranks)."""
    try:
        return tier.markers()
    except Exception as e:
        return f"listing the {tier.name} tier: {describe(e)}"


class Restorer(GroupWorker):
    """Loads the newest restorable copy into a state; collective over the foreground group."""

    def restore(
        self, state: Mapping[str, Any], step: int | None, token: str
    ) -> tuple[Candidate, RestoreRecord]:
        """Load ``step`` (None: the newest valid one) into ``state``; return the copy used and how
        it went.

        ``token`` (the same on every rank) names any directory this creates.
        :class:`NoCheckpointError` if there is no candidate,
        :class:`CheckpointRestoreError` (listing every attempt) if none loads.
        """
        t0 = time.perf_counter()
        candidates = self.candidates(step)
        if not candidates:
            where = self.persistent.url + (f" and {self.local.url}" if self.local else "")
            what = f"step {step}" if step is not None else "no committed step"
            raise NoCheckpointError(f"nothing to restore: {what} found in {where}")
        attempts: list[str] = []
        for cand in candidates:
            try:
                ready = self._prepare(cand, token, state)
                try:
                    done = self._load_from(ready, state)
                finally:
                    ready.done()
            except (Exception, CheckpointException) as e:
                msg = f"step {cand.step} from the {cand.tier} tier failed: {describe(e)}"
                attempts.append(msg)
                if self.layout.rank == 0:
                    log.warning("%s; falling back", msg)
                continue
            if attempts and self.layout.rank == 0:
                log.warning(
                    "restored step %d from the %s tier after %d failed attempt(s)",
                    cand.step,
                    cand.tier,
                    len(attempts),
                )
            return cand, RestoreRecord(
                cand.step,
                cand.tier,
                time.perf_counter() - t0,
                tuple(attempts),
                done.verified_bytes,
                done.bytes_requested,
                done.read_once,
                done.slowest,
                done.placement,
            )
        raise CheckpointRestoreError("no copy of any candidate step could be restored:", attempts)

    def candidates(self, step: int | None) -> list[Candidate]:
        """:func:`order_candidates` of the markers every node's local tier and the persistent tier
        hold."""
        # One rank lists each tier for the others: its failure is sent, not raised, so that no
        # rank is left waiting in the collective. A node-local tier is a cache (the node's disk
        # may be gone): unlistable, it holds nothing, and the persistent copies are restored.
        local = None
        if self.local is not None:
            mine = _listed(self.local) if self.layout.is_leader else {}
            if isinstance(mine, str):
                log.warning("node %d: %s; restoring from the other copies", self.layout.node, mine)
                mine = {}
            local = self.group.gather(mine)
        persistent = self.group.bcast(_listed(self.persistent) if self.layout.rank == 0 else {})
        if isinstance(persistent, str):
            raise CheckpointRestoreError(f"rank 0: {persistent}")
        return order_candidates(
            local,
            persistent,
            ranks_per_node=self.layout.ranks_per_node,
            step=step,
            load_flagged=self.config.load_flagged,
        )

    def direct(self, cand: Candidate) -> bool:
        """Whether ``cand`` is loaded straight from its object store (no whole-step download
        first)."""
        return (
            cand.tier == "persistent"
            and self.config.direct_restore
            and isinstance(self.persistent, FsspecTier)
            and is_url(self.persistent.url)
        )

    def _prepare(self, cand: Candidate, token: str, state: Mapping[str, Any]) -> _Loadable:
        """Make ``cand`` loadable on every rank: its location, the storage options to read it with,
        its checked index, a clean-up (``state``: what the load reads into, which decides the
        files a node-local copy must have)."""
        if self.direct(cand):
            assert isinstance(self.persistent, FsspecTier)
            url, index = self._check_remote(cand)
            return _Loadable(url, index, self.persistent.store.storage_options)
        if cand.tier == "local":
            path, index, small = self._repair_local(cand, f"r{token}", state)
            return _Loadable(path, index, small=small)
        elif self.persistent.local:
            path = self.persistent.step_path(cand.step)
        elif self.local is not None:  # every node copies it into its local tier first
            self._agree(
                f"fetching step {cand.step} from {self.persistent.url}",
                lambda: self._copy_to_local(cand, f"f{token}") if self.layout.is_leader else None,
                cand,
            )
            path = self.local.step_path(cand.step)  # the next restore of it is local
        else:
            tmp = tempfile.mkdtemp(prefix=f"ucp-restore-{cand.step}-")
            done = functools.partial(shutil.rmtree, tmp, ignore_errors=True)
            try:  # a failed fetch or index falls back to an older step: its copy goes now
                self._agree(
                    f"fetching step {cand.step} from {self.persistent.url}",
                    lambda: self.persistent.fetch(cand.step, cand.marker.names, tmp),
                    cand,
                )
                return _Loadable(tmp, self._check_index(tmp, cand), done=done)
            except BaseException:
                done()
                raise
        return _Loadable(path, self._check_index(path, cand))

    def _check_remote(self, cand: Candidate) -> tuple[str, bytes]:
        """The URL of ``cand``'s persistent copy and its index's bytes, after checking it against
        its marker (rank 0 looks, all agree).

        Every file the marker lists must be there with its recorded size, and
        the index must match its recorded digest (a flipped byte there could
        misdirect every read); the data is checked by the load itself, chunk by
        chunk or block by block, as it arrives. The checked index goes to every
        rank with the URL, and the load reads it from there: one request, and
        the bytes loaded are the bytes checked.
        """
        step, marker, tier = cand.step, cand.marker, self.persistent
        assert isinstance(tier, FsspecTier)

        def check() -> tuple[str, bytes] | None:
            if self.layout.rank != 0:
                return None
            copy = tier.copy_of(step)  # one look: the URL, sizes and index read are of one copy
            url = copy.url
            marker.check_sizes(copy.sizes, where=lambda name: f"{url}/{name}", holder="the store")
            index = tier.read_at(copy, INDEX_FILE)
            self._check_index_bytes(index, f"{url}/{INDEX_FILE}", cand)
            return url, index

        checked = self._agree(
            f"checking step {step} in {tier.url} against its commit marker", check, cand
        )
        return self.group.bcast(checked)

    def refill(self, cand: Candidate, token: str) -> None:
        """:meth:`_copy_to_local` after a direct restore, in the manager's background thread (in
        order with saves, so retention never runs beside it); never raises: the step was restored,
        and a failed refill only costs the next restore's speed."""
        if self.local is None or not self.layout.is_leader:
            return
        t0 = time.perf_counter()
        try:
            self._copy_to_local(cand, token)
        except Exception as e:
            log.warning(
                "node %d: refilling the local tier %s with step %d failed: %s",
                self.layout.node,
                self.local.url,
                cand.step,
                describe(e),
            )
            return
        log.info(
            "node %d: refilled the local tier with step %d in %.1f s",
            self.layout.node,
            cand.step,
            time.perf_counter() - t0,
        )

    def _copy_to_local(self, cand: Candidate, token: str) -> None:
        """Download every file of ``cand``'s persistent copy into a staging directory of this
        node's local tier, check them against the marker's whole-file digests and commit them
        by the tier's atomic rename (node leaders; not collective). A failure at any point
        leaves no committed step: the staging directory is removed (or left for start-up
        cleanup)."""
        tier, step = self.local, cand.step
        assert tier is not None
        dest = tier.begin(step, token)
        try:
            self.persistent.fetch(step, cand.marker.names, dest)
            where = f"step {step} from {self.persistent.url}"
            problems = check_copy(cand.marker, dest, held=None, where=where)
            if problems:
                raise CheckpointFormatError("; ".join(problems))
            tier.commit(dest, cand.marker)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def _repair_local(
        self, cand: Candidate, token: str, state: Mapping[str, Any]
    ) -> tuple[str, bytes, SmallReads | None]:
        """The local copy of ``cand``, its checked index and the keys read through the group,
        after each node fetched, from the nodes that hold them, the files it lacks of those
        its ranks' load of ``state`` reads (and, restarted at the saved world size, of its
        share of the ring: :meth:`NodeLayout.held_files`); a small key whose file is on
        another node is read there and sent (see the module docstring), not fetched as a file."""
        step, marker, tier, lay = cand.step, cand.marker, self.local, self.layout
        assert tier is not None
        have_step = lay.node in cand.nodes_with_step
        dest = tier.step_path(step) if have_step else tier.staging_path(step, token)
        self._agree(
            f"creating a local directory for step {step}",
            lambda: tier.begin(step, token) if lay.is_leader and not have_step else None,
            cand,
        )

        def present() -> dict[str, int]:
            """This node's files of the step that are whole (their recorded size)."""
            if not lay.is_leader or not have_step:
                return {}
            recorded = marker.sizes
            return {n: size for n, size in tier.files(step).items() if recorded.get(n) == size}

        def fetch(wanted: list[str], what: str) -> None:
            """``wanted`` (node leaders) from the nodes that hold them, into ``dest``."""
            held = self._agree(f"listing local files of step {step}", present, cand)
            wanted = [n for n in wanted if n not in held]
            if any(self.group.gather(bool(wanted))):
                src = tier.step_path(step) if have_step else None
                self._agree(
                    f"fetching {what} of step {step} from other nodes",
                    lambda: exchange_files(self.group.pg, src, sorted(held), dest, wanted),
                    cand,
                )

        # The index first: every node plans its ranks' reads from it.
        fetch([INDEX_FILE] if lay.is_leader else [], "the index")
        index = self._check_index(dest, cand)

        def mine() -> tuple[list[PlannedRead], dict[str, tuple[str, ...]]]:
            reader = UCPStorageReader(dest)
            reader.provide_files({INDEX_FILE: index})
            reads = reader.planned_reads(dict(state))
            return reads, small_keys(state, reads)

        plans = self.group.gather(self._agree(f"planning the reads of step {step}", mine, cand))
        held = self._node_files(self.group.gather(sorted(present())))
        # A small key is read through the group where its files are all on another node (one
        # that holds them all) and not all on this rank's node; every other read, from a file
        # this node fetches.
        small: list[dict[str, tuple[str, ...]]] = []
        for rank, (_, keys) in enumerate(plans):
            own = held[lay.node_of(rank)]
            small.append(
                {
                    k: files
                    for k, files in keys.items()
                    if not set(files) <= own and any(set(files) <= h for h in held)
                }
            )
        wanted: set[str] = set()
        if lay.is_leader:
            for rank, (reads, _) in enumerate(plans):
                if lay.node_of(rank) == lay.node:
                    wanted.update(r.file for r in reads if r.key not in small[rank])
            if marker.world_size == lay.world_size:  # the same ring: keep this node's share
                wanted.update(lay.held_files(marker, peer=self.config.peer_replication))
        wanted.discard(INDEX_FILE)  # fetched and checked above: the load parses those bytes
        fetch(sorted(wanted), "the files its ranks read")
        committing = lay.is_leader and not have_step
        self._agree(  # on every rank: an agreement is collective
            f"committing step {step} locally",
            lambda: tier.commit(dest, marker, held=os.listdir(dest)) if committing else None,
            cand,
        )
        reads_through = None
        if any(small):
            after = self._node_files(self.group.gather(sorted(present())))
            reads_through = SmallReads(step, small, after)
        return tier.step_path(step), index, reads_through

    def _node_files(self, listed: list[list[str]]) -> list[frozenset[str]]:
        """Per node, the files its leader listed (``listed``: every rank's list, in rank
        order; only leaders list)."""
        lay = self.layout
        return [frozenset(listed[n * lay.ranks_per_node]) for n in range(lay.num_nodes)]

    def _check_index(self, path: str, cand: Candidate) -> bytes:
        """The index's bytes, which must match the marker's digest (a flipped byte there could
        misdirect every read); the load parses these same bytes (read once, no window between
        the check and the read)."""

        def check() -> bytes:
            data = Path(path, INDEX_FILE).read_bytes()
            self._check_index_bytes(data, os.path.join(path, INDEX_FILE), cand)
            return data

        return self._agree("checking the index", check, cand)

    @staticmethod
    def _check_index_bytes(data: bytes, where: str, cand: Candidate) -> None:
        marker = cand.marker
        want = marker.digest(INDEX_FILE)
        got = bytes_digest(data)
        if len(data) != want.size or got != want.xxh3:
            raise CheckpointFormatError(
                f"{where}: the index of step {marker.step} in the {cand.tier} tier "
                f"does not match its commit marker ({len(data)} bytes, xxh3-128 {got}; recorded "
                f"{want.size} "
                f"bytes, {want.xxh3}): it is corrupt"
            )

    def _load_from(self, ready: _Loadable, state: Mapping[str, Any]) -> LoadReport:
        """Load ``ready`` (a directory, or a URL read with its storage options; the index it
        holds already checked); return the reader's report of the load."""
        options = self._read_options(ready.path)
        reader = UCPStorageReader(
            ready.path,
            options=options,
            storage_options=ready.storage_options,
            # The group dcp.load runs on below: a read-once exchange (the reader's default
            # "auto": a copy in an object store, replicas needing the same bytes) runs on it too.
            process_group=self.group.pg,
        )
        reader.provide_files({INDEX_FILE: ready.index})
        # Python's cyclic collector paused for the whole load, not only while the reader reads
        # (reader.read_data): parsing the index and planning allocate tens of thousands of
        # objects, enough to set off full collections, each walking the training process's whole
        # heap. Measured (one process, 2 shared cores, cold local restores of a 261 MiB state,
        # about 0.19 s each without one): a full collection took 0.10-0.13 s and fell in 15 of 64
        # restores, in index parsing or planning; with the pause, in none of 64. What a load
        # allocates is freed when it returns; any cycle (an error's traceback) is collected once
        # the collector runs again.
        small, lay = ready.small, self.layout
        target = without(state, list(small.keys[lay.rank])) if small is not None else state
        with collector_paused():
            dcp.load(
                target, storage_reader=reader, planner=UCPLoadPlanner(), process_group=self.group.pg
            )
        if small is not None:
            put_back(state, target)
            self._through_group(small, ready.path, state)
        return reader.last_load

    def _read_options(self, path: str) -> ReadOptions:
        """``config.read`` for a load of ``path``: its requests ``config.requests`` unless it names
        its own, its largest request :data:`OBJECT_REQUEST_BYTES` from an object store unless it
        sets another."""
        read = self.config.read
        changes: dict[str, Any] = {}
        if read.requests is None:
            changes["requests"] = self.config.requests
        if is_url(path) and read.max_request_bytes == ReadOptions.max_request_bytes:
            changes["max_request_bytes"] = OBJECT_REQUEST_BYTES
        return replace(read, **changes) if changes else read

    def _through_group(self, small: SmallReads, path: str, state: Mapping[str, Any]) -> None:
        """Fill this rank's small keys: each read by the lowest rank whose node holds its files
        (from ``path``, that rank's local copy), all of them gathered to every rank."""
        lay = self.layout

        def read() -> dict[str, Any]:
            return serve(small, lay, path, self._read_options(path))

        got: dict[str, Any] = {}
        parts = self.group.agree("reading small keys", read, step=small.step, restoring=True)
        for part in self.group.gather(parts):
            got.update(part)
        fill(state, small.keys[lay.rank], got)

    def _agree(self, what: str, fn: Callable[[], Any], cand: Candidate) -> Any:
        return self.group.agree(what, fn, step=cand.step, restoring=True)
