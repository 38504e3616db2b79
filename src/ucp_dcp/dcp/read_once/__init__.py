"""Read-once loads: each needed byte read from storage by one rank of the job and sent to
the ranks that need it, over the load's process group (the design and its measurements:
docs/read-once.md).

The subpackage, in reading order:

- :mod:`~ucp_dcp.dcp.read_once.ranges`: the arithmetic on byte ranges the plan is built from
  (segments of the needs, water-filling).
- :mod:`~ucp_dcp.dcp.read_once.plan`: which rank reads each needed page (one that needs it,
  balanced) and what it sends to whom: pure arithmetic on byte ranges as integer arrays.
- :mod:`~ucp_dcp.dcp.read_once.rounds`: the plan in compact form (ranks with identical needs as
  one group) and its rounds within a budget (each byte read once).
- :mod:`~ucp_dcp.dcp.read_once.exchange`: one rank's part: reading, moving
  (``all_to_all_single``), checking received pieces block by block, putting them in place.
- :mod:`~ucp_dcp.dcp.read_once.first_requests`: each data file's first request (its header)
  made by one rank and shared.
- :mod:`~ucp_dcp.dcp.read_once.transport`: what the collectives run on.
- this module: whether a load exchanges (the policy, :func:`decide`) and each rank's rounds,
  agreed by the whole group (:func:`coordinate`: the needs' digests gathered by every rank, each
  distinct needs once by the first rank, which plans, decides, and scatters each rank its part,
  :func:`messages`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch.distributed as dist

from ...byteio.objstore import is_url
from ...errors import InvalidArgumentError, ReadOnceError
from ...format.schema import check_field_types
from .exchange import ExchangeTotals, LocalNeeds, RankRounds, first_failure
from .rounds import GroupReadPlan, NeedGroups, needs_digest, plan_group_reads

__all__ = [
    "READ_ONCE_MODES",
    "ExchangeTotals",
    "ReadOnceCosts",
    "ReadOnceDecision",
    "check_read_once",
    "checkpoint_identity",
    "coordinate",
    "RankPart",
    "SharedPart",
    "decide",
    "messages",
    "rank_shares",
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
    storage's and interconnect's figures to ``ReadOptions(read_once_costs=...)``)."""

    storage_bytes_per_s: float = 1e9
    """Read bandwidth of the shared storage for the whole job (all ranks together)."""
    network_bytes_per_s: float = 5e9
    """Bandwidth between ranks, per rank (what one rank can receive)."""
    round_seconds: float = 2e-3
    """Fixed cost of one exchange round (one ``all_to_all_single``)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("storage_bytes_per_s", "network_bytes_per_s"):
            v = getattr(self, name)
            if not 0 < v < math.inf:  # the costs divide by the rates; a NaN is refused too
                raise InvalidArgumentError(f"ReadOnceCosts({name}={v}): needs a finite rate > 0")
        if not 0 <= self.round_seconds < math.inf:
            raise InvalidArgumentError(
                f"ReadOnceCosts(round_seconds={self.round_seconds}): needs a finite time >= 0"
            )

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
    ``direct_s`` / ``exchange_s``: its estimates (0 where not weighed);
    ``groups``: the distinct needs among the ranks (ranks needing the same
    bytes form one group of the plan: 1 for a fully replicated target).
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
    groups: int = 0


def decide(
    mode: bool | str,
    shared: bool,
    storage: str,
    plan: GroupReadPlan | None,
    costs: ReadOnceCosts | None = None,
    budget: int = 64 << 20,
) -> ReadOnceDecision:
    """Whether a load with ``plan`` exchanges: ``True`` always, ``False`` never (no collective at
    all), ``"auto"`` where the storage is ``shared`` by the job (:func:`shared_storage`: on a
    local disk the ranks of a machine share its page cache, which already reads each page once),
    the ranks' summed needs exceed the unique bytes by more than :data:`OVERLAP_TO_EXCHANGE`
    (replicas, pieces narrower than a checksum block) and ``costs`` (default
    :class:`ReadOnceCosts`) estimate the exchange faster, for rounds of ``budget`` bytes."""
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
    received = plan.bytes_received_per_rank
    most = int(received.max()) if len(received) else 0
    per_rank = plan.bytes_read_per_rank
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
    checkpoint: tuple[str, bytes] = ("", b""),
) -> tuple[ReadOnceDecision, RankRounds | None]:
    """This rank's rounds (None: read directly), agreed with every rank of ``group``.

    Collective: call it on every rank of a load that may exchange (``read_once`` True, or
    ``"auto"`` on ``shared`` storage, :func:`shared_storage`), with this rank's needs, or with
    the ``failure`` that kept it from knowing them; then every rank raises (a
    :class:`~ucp_dcp.errors.ReadOnceError` naming the rank). ``checkpoint``: the path this rank
    loads and what identifies its checkpoint (:func:`checkpoint_identity`); ranks that load
    different checkpoints cannot exchange their bytes: every rank raises, naming both.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    mine: object = failure if failure is not None else (needs.needs() if needs else {})
    # Ranks with identical needs (replicas) send them once: every rank learns the needs'
    # digests, and only the lowest rank of each digest (and any rank that failed) sends more.
    digest = needs_digest(mine) if isinstance(mine, dict) else b""
    sent: list[tuple[bytes, str, bytes]] = [(b"", "", b"")] * world
    dist.all_gather_object(sent, (digest, *checkpoint), group=group)
    digests = [d for d, _, _ in sent]
    other = _other_checkpoint(sent)
    if other is not None:  # every rank saw it: all leave here
        raise failure if failure is not None else other
    body = mine if failure is not None or digests.index(digests[me]) == me else None
    gathered: list[object] | None = [None] * world if me == 0 else None
    dist.gather_object(body, gathered, group=group, group_dst=0)
    answers: list[object] = [None] * world
    common: list[object] = [None]
    if me == 0:
        assert gathered is not None
        try:
            answers, common[0] = _plan(mode, shared, storage, digests, gathered, budget, costs)
        except Exception as e:  # noqa: BLE001  (every rank waits for an answer: send the error)
            answers = [e] * world
    out: list[object] = [None]
    dist.scatter_object_list(out, answers if me == 0 else None, group=group, group_src=0)
    got = out[0]
    if failure is not None:
        raise failure
    if isinstance(got, BaseException):
        raise got
    assert isinstance(got, tuple)
    decision, part = got
    if part is None:
        return decision, None
    # What every rank needs alike (the windows, the groups, the rows to large groups) goes out
    # once, not in every rank's share: a replicated target's rows are not copied per rank.
    dist.broadcast_object_list(common, group=group, group_src=0)
    assert isinstance(common[0], SharedPart) and isinstance(part, RankPart)
    return decision, common[0].rounds(part, me)


def checkpoint_identity(files: Sequence[tuple[str, int]]) -> bytes:
    """What tells a checkpoint from another without reading its data: its files' names (relative
    to the checkpoint) and sizes, digested. Copies of one checkpoint at different paths (each
    node's local copy) agree."""
    h = hashlib.blake2b(digest_size=16)
    for name, size in files:
        h.update(f"{name}\0{size}\0".encode())
    return h.digest()


def _other_checkpoint(sent: Sequence[tuple[bytes, str, bytes]]) -> ReadOnceError | None:
    """The error for the first rank that loads another checkpoint than the first rank that said
    which it loads (a rank that failed says nothing); None when they all load one."""
    told = [(r, path, ident) for r, (_, path, ident) in enumerate(sent) if ident]
    if not told:
        return None
    r0, path0, ident0 = told[0]
    for r, path, ident in told[1:]:
        if ident != ident0:
            return ReadOnceError(
                f"rank {r} loads another checkpoint than rank {r0}: {path} holds other files than "
                f"{path0}; a read-once load exchanges the bytes of one checkpoint between its "
                "ranks (load each checkpoint with read_once=False, or the same one everywhere)"
            )
    return None


@dataclass(frozen=True)
class RankPart:
    """What the coordinator sends one rank alone: the rows it sends, and the rows it receives
    unless they are its group's in the :class:`SharedPart` (see :class:`RankRounds`)."""

    sends: np.ndarray
    recvs: np.ndarray | None

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        return self.sends.nbytes + (0 if self.recvs is None else self.recvs.nbytes)


@dataclass(frozen=True)
class SharedPart:
    """What the coordinator sends every rank alike: the rounds' count, every reader's window,
    every rank's group, and the rows received by each large group (one copy however many ranks
    it has)."""

    count: int
    windows: np.ndarray
    group_of: np.ndarray
    group_recvs: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        rows = sum(a.nbytes for a in self.group_recvs.values())
        return self.windows.nbytes + self.group_of.nbytes + rows

    def rounds(self, part: RankPart, me: int) -> RankRounds:
        """Rank ``me``'s rounds from its own part and this."""
        recvs = part.recvs
        if recvs is None:
            recvs = self.group_recvs[int(self.group_of[me])]
        return RankRounds(self.count, part.sends, recvs, self.windows, self.group_of)


def _plan(
    mode: bool | str,
    shared: bool,
    storage: str,
    digests: Sequence[bytes],
    gathered: Sequence[object],
    budget: int,
    costs: ReadOnceCosts | None,
) -> tuple[list[object], SharedPart | None]:
    """On the coordinator: each rank's ``(decision, part or None)``, or the error every rank
    raises (a rank that failed raises its own); and what goes to every rank alike when
    exchanging."""
    world = len(gathered)
    failed = first_failure(gathered)
    if failed is not None:
        return [failed] * world, None
    bodies = {r: g for r, g in enumerate(gathered) if isinstance(g, dict)}
    plan = plan_group_reads(NeedGroups.from_digests(digests, bodies))
    decision = dataclasses.replace(
        decide(mode, shared, storage, plan, costs, budget), groups=len(plan.groups.extents)
    )
    if not decision.exchange:
        return [(decision, None)] * world, None
    parts, common = messages(plan, budget)
    decision = dataclasses.replace(decision, rounds=common.count, budget=budget)
    return [(decision, part) for part in parts], common


def messages(plan: GroupReadPlan, budget: int) -> tuple[list[RankPart], SharedPart]:
    """What the coordinator sends for an exchange of ``plan`` in rounds of ``budget``: each
    rank's own :class:`RankPart` and the :class:`SharedPart` every rank gets alike. A group of
    at least sqrt(ranks) ranks has the rows it receives in the shared part (there are at most
    sqrt(ranks) such groups), a smaller one in each of its ranks' parts."""
    count, windows, sends, recvs = rank_shares(plan, budget)
    world, group_of, sizes = plan.world_size, plan.groups.group_of, plan.groups.sizes
    large = {g: recvs[g] for g in np.flatnonzero(sizes * sizes >= world).tolist()}
    parts = [
        RankPart(sends[r], None if int(group_of[r]) in large else recvs[int(group_of[r])])
        for r in range(world)
    ]
    return parts, SharedPart(count, windows, group_of, large)


def rank_shares(
    plan: GroupReadPlan, budget: int
) -> tuple[int, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """The number of rounds, every reader's window, and the rows of :class:`RankRounds`: what
    each rank sends, ``(group, file, start, length, at)``, and what each group receives,
    ``(reader, file, start, length, at)`` (O(rows + ranks), whatever the rounds)."""
    world, ngroups = plan.world_size, len(plan.groups.extents)
    windows = plan.windows(budget)
    count = plan.round_count(windows)
    t = plan.transfers
    rows = np.stack([t.group, t.file, t.start, t.length, t.at], axis=1)
    sends = [rows[plan.send_offsets[r] : plan.send_offsets[r + 1]] for r in range(world)]
    back = np.stack([t.reader, t.file, t.start, t.length, t.at], axis=1)[plan.recv_index]
    recvs = [back[plan.recv_offsets[g] : plan.recv_offsets[g + 1]] for g in range(ngroups)]
    return count, windows, sends, recvs
