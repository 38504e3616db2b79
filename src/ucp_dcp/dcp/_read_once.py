"""Read-once loads, the deciding half: whether to exchange, and each rank's rounds.

``UCPStorageReader(read_once=...)`` hands :func:`coordinate` this rank's
regions that can be filled in place. Every rank says which byte ranges of
the files it needs (rounded out to whole checksum blocks,
:meth:`~ucp_dcp.dcp._exchange.LocalNeeds.needs`) in one gather to the
group's first rank, which makes the job's plan
(:func:`~ucp_dcp.core.readplan.plan_job_reads`: every needed byte read by
one rank, preferring a rank that needs it, balanced), decides with the
policy whether exchanging pays, cuts the transfers into rounds of at most
``budget`` bytes sent and received per rank
(:mod:`~ucp_dcp.core.exchange_rounds`, each rank's reads for itself
included: each byte read once, in the round all its receivers get it), and
scatters each rank its transfers and the windows that cut them into rounds
its rounds. :func:`~ucp_dcp.dcp._exchange.run_exchange` then runs them.

The policy (:func:`decide`): ``True`` always exchanges, ``False`` never
(no collective at all), ``"auto"`` exchanges where the storage is shared by
the job (an object store, a network file system) and the ranks' needs
overlap (replicas, or pieces narrower than a checksum block), that is where
the bytes the ranks would pull exceed the unique bytes by more than 5%. Two
ranks on one machine reading one local disk share its page cache, which
already reads each page once, so there ``"auto"`` reads directly without
asking the other ranks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from ..byteio.objstore import is_url
from ..core.exchange_rounds import exchange_windows, stream_positions, with_own_reads
from ..core.readplan import JobReadPlan, plan_job_reads
from ..errors import InvalidArgumentError, ReadOnceError
from ._exchange import RankRounds
from ._landing import LocalNeeds

__all__ = [
    "READ_ONCE_MODES",
    "ReadOnceCosts",
    "ReadOnceDecision",
    "check_read_once",
    "coordinate",
    "decide",
    "shared_storage",
]

READ_ONCE_MODES = (True, False, "auto")

OVERLAP_TO_EXCHANGE = 1.05
"""``"auto"`` exchanges where the bytes the ranks need, summed, exceed the unique bytes by more."""

# File systems whose storage a job's ranks share over the network (their page caches are not
# shared): what "auto" counts as shared storage besides object stores.
_SHARED_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cifs",
        "smb3",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.juicefs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.goofys",
        "fuse.mountpoint-s3",
        "wekafs",
        "orangefs",
        "9p",
        "virtiofs",
    }
)


def check_read_once(value: object) -> bool | str:
    """``value`` if it is one of :data:`READ_ONCE_MODES`, else :class:`InvalidArgumentError`."""
    if isinstance(value, bool) or value == "auto":
        return value
    raise InvalidArgumentError(f"read_once must be True, False or 'auto', got {value!r}")


def shared_storage(path: str) -> tuple[bool, str]:
    """Whether the job's ranks share the storage of ``path`` over the network, and what it is
    (``"object store"``, or the file system type from ``/proc/mounts``)."""
    if is_url(path):
        return True, "object store"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return False, "unknown"
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    for mount, fstype in mounts:
        mount = mount.replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(best):
            best, kind = mount, fstype
    return kind in _SHARED_FS, kind


@dataclass(frozen=True)
class ReadOnceCosts:
    """The cost model ``"auto"`` weighs an exchange with (configured, not measured: pass your
    storage's and interconnect's figures to ``UCPStorageReader(read_once_costs=...)``)."""

    storage_bytes_per_s: float = 1e9
    """Read bandwidth of the shared storage for the whole job (all ranks together)."""
    network_bytes_per_s: float = 5e9
    """Bandwidth between ranks, per rank (what one rank can receive)."""
    round_seconds: float = 2e-3
    """Fixed cost of one exchange round (one ``all_to_all_single``)."""

    def direct_seconds(self, needed_bytes: int) -> float:
        """Every rank reads what it needs: the job pulls ``needed_bytes`` through the storage."""
        return needed_bytes / self.storage_bytes_per_s

    def exchange_seconds(self, unique_bytes: int, most_received: int, rounds: int) -> float:
        """Each byte read once, then moved: reads and transfers overlap round by round, so the
        slower of the two, plus the rounds' fixed costs."""
        return (
            max(unique_bytes / self.storage_bytes_per_s, most_received / self.network_bytes_per_s)
            + rounds * self.round_seconds
        )


@dataclass(frozen=True)
class ReadOnceDecision:
    """What the read-once policy decided for one load, and from what.

    ``mode``: the reader's ``read_once``; ``exchange``: whether this load
    exchanged; ``reason``: why, in words; ``storage``: what the storage is
    (``"object store"``, a file system type); ``shared``: whether the job
    shares it; ``needed_bytes``: the bytes every rank needs, summed (whole
    checksum blocks); ``unique_bytes``: the bytes at least one rank needs;
    ``rounds``: exchange rounds; ``budget``: bytes sent and received per
    rank and round, at most; ``costs``: the model weighed (``"auto"``),
    ``direct_s`` / ``exchange_s``: its estimates (0 where not weighed).
    """

    mode: bool | str
    exchange: bool
    reason: str
    storage: str = ""
    shared: bool = False
    needed_bytes: int = 0
    unique_bytes: int = 0
    rounds: int = 0
    budget: int = 0
    costs: ReadOnceCosts | None = None
    direct_s: float = 0.0
    exchange_s: float = 0.0


def decide(
    mode: bool | str,
    shared: bool,
    storage: str,
    plan: JobReadPlan | None,
    costs: ReadOnceCosts | None = None,
    budget: int = 64 << 20,
) -> ReadOnceDecision:
    """The policy (see the module): whether a load with ``plan`` exchanges; ``costs`` (default
    :class:`ReadOnceCosts`) weigh it under ``"auto"``, for rounds of ``budget`` bytes."""
    needed = plan.needed_bytes if plan is not None else 0
    unique = plan.unique_bytes if plan is not None else 0
    base = ReadOnceDecision(mode, False, "", storage, shared, needed, unique)
    if mode is False:
        return dataclasses.replace(base, reason="read_once=False")
    if plan is not None and not unique:
        return dataclasses.replace(base, reason="nothing to read in place")
    if mode is True:
        return dataclasses.replace(base, exchange=True, reason="read_once=True")
    if not shared:
        return dataclasses.replace(
            base, reason=f"local storage ({storage}): the ranks of a machine share its page cache"
        )
    if plan is None or needed <= OVERLAP_TO_EXCHANGE * unique:
        return dataclasses.replace(
            base, reason=f"the ranks' needs overlap by {needed / max(unique, 1):.3f}x: no gain"
        )
    costs = costs or ReadOnceCosts()
    t = plan.transfers
    received = np.bincount(t.receiver, weights=t.length, minlength=plan.world_size)
    most = int(received.max()) if len(received) else 0
    per_rank = np.bincount(plan.read_rank, weights=plan.read_length, minlength=plan.world_size)
    rounds = -(-int(max(per_rank.max() if len(per_rank) else 0, most)) // max(budget, 1))
    direct_s = costs.direct_seconds(needed)
    exchange_s = costs.exchange_seconds(unique, most, rounds)
    weighed = dataclasses.replace(base, costs=costs, direct_s=direct_s, exchange_s=exchange_s)
    overlap = f"the ranks' needs overlap by {needed / unique:.2f}x"
    if exchange_s >= direct_s:
        return dataclasses.replace(
            weighed,
            reason=f"shared storage ({storage}), {overlap}, but exchanging would take "
            f"{exchange_s:.3g} s against {direct_s:.3g} s reading directly",
        )
    return dataclasses.replace(
        weighed,
        exchange=True,
        reason=f"shared storage ({storage}), {overlap}: {exchange_s:.3g} s exchanging against "
        f"{direct_s:.3g} s reading directly",
    )


def coordinate(
    mode: bool | str,
    shared: bool,
    storage: str,
    needs: LocalNeeds | None,
    failure: BaseException | None,
    group: dist.ProcessGroup | None,
    budget: int,
    costs: ReadOnceCosts | None = None,
) -> tuple[ReadOnceDecision, RankRounds | None]:
    """This rank's rounds (None: read directly), agreed with every rank of ``group``.

    Collective: call it on every rank of a load that may exchange (``read_once`` True, or
    ``"auto"`` on ``shared`` storage, :func:`shared_storage`), with this rank's needs, or with
    the ``failure`` that kept it from knowing them; then every rank raises (a
    :class:`ReadOnceError` naming the rank).
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    mine: object = failure if failure is not None else (needs.needs() if needs else {})
    gathered: list[object] | None = [None] * world if me == 0 else None
    dist.gather_object(mine, gathered, dst=_global_rank(group, 0), group=group)
    answers: list[object] = [None] * world
    if me == 0:
        assert gathered is not None
        try:
            answers = list(_plan(mode, shared, storage, gathered, budget, costs))
        except Exception as e:  # noqa: BLE001  (every rank waits for an answer: send the error)
            answers = [e] * world
    out: list[object] = [None]
    dist.scatter_object_list(
        out, answers if me == 0 else None, src=_global_rank(group, 0), group=group
    )
    got = out[0]
    if failure is not None:
        raise failure
    if isinstance(got, BaseException):
        raise got
    assert isinstance(got, tuple)
    decision, rounds = got
    return decision, rounds


def _global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _plan(
    mode: bool | str,
    shared: bool,
    storage: str,
    gathered: Sequence[object],
    budget: int,
    costs: ReadOnceCosts | None,
) -> list[object]:
    """On the coordinator: each rank's ``(decision, rounds or None)``, or the error every rank
    raises."""
    world = len(gathered)
    for r, g in enumerate(gathered):
        if isinstance(g, BaseException):
            err = ReadOnceError(
                f"rank {r} could not take part in the read-once load: {type(g).__name__}: {g}"
            )
            return [g if i == r else err for i in range(world)]
    needs = [g if isinstance(g, dict) else {} for g in gathered]
    plan = plan_job_reads(needs)
    decision = decide(mode, shared, storage, plan, costs, budget)
    if not decision.exchange:
        return [(decision, None)] * world
    count, shares = _rank_rounds(with_own_reads(plan, needs), budget)
    decision = dataclasses.replace(decision, rounds=count, budget=budget)
    return [(decision, share) for share in shares]


def _rank_rounds(plan: JobReadPlan, budget: int) -> tuple[int, list[RankRounds]]:
    """The number of rounds and every rank's share of them (``plan`` with each rank's reads for
    itself among its transfers): the transfers it sends and receives with their positions in
    their readers' streams, and every reader's window (O(transfers), whatever the rounds)."""
    world, t = plan.world_size, plan.transfers
    windows = exchange_windows(plan, budget)
    at = stream_positions(plan)
    count = int(((at + t.length - 1) // windows[t.reader]).max()) + 1 if len(t) else 0
    shares = []
    for me, peer in ((t.reader, t.receiver), (t.receiver, t.reader)):
        order = np.lexsort((at, peer, me))
        rows = np.stack([peer, t.file, t.start, t.length, at], axis=1)[order]
        cuts = np.searchsorted(me[order], np.arange(world + 1))
        shares.append([rows[cuts[r] : cuts[r + 1]] for r in range(world)])
    return count, [RankRounds(count, shares[0][r], shares[1][r], windows) for r in range(world)]
