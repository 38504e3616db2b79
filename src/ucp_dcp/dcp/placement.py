"""A load proves itself: every loaded tensor's placement digest, checked against the saved one.

Each rank adds up the placement-digest shares (:mod:`ucp_dcp.core.placement_digest`) of the
boxes its state dict holds, at the global positions their own layout gives them, never the load
plan's; one all-reduce sums the ranks' shares, and a tensor held ``n`` times in the job must
hash to ``n`` times its digest. What it proves, and why replicas are counted, not skipped:
docs/resharding.md, "Loads that prove their placement".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .._compat import (
    ShardedTensor,
    compute_local_shape_and_global_offset,
    dtensor_local,
    flatten_sharded_tensors,
    flatten_state_dict,
    is_checkpointable,
)
from ..byteio.requests import rank_and_world
from ..core.pieces import TensorPieces
from ..core.placement_digest import MASK64, box_share, digest_hex
from ..errors import PlacementError, listed
from ..format import TensorRecord
from .read_once.transport import wire_for

__all__ = [
    "PlacementReport",
    "LocalShare",
    "local_shares",
    "check_placement",
    "flat_state",
    "no_digests_error",
    "PlacementCheck",
    "checked_placement",
]

_SLOTS = 4  # per tensor: share's low 32 bits, its high 32 bits, elements counted, casts
_LO = (1 << 32) - 1


@dataclass(frozen=True)
class PlacementReport:
    """What a placement check found (every tensor listed here was loaded by some rank).

    Attributes:
        checked: tensors whose every loaded copy matches the saved digest.
        copies: tensor -> how many times the job holds it (1 for a sharded tensor loaded
            once; the number of replicas otherwise).
        cast: tensors loaded into another dtype than saved: not checked (the bits differ).
        no_digest: tensors the checkpoint records no digest for: not checked.
    """

    checked: tuple[str, ...] = ()
    copies: dict[str, int] = field(default_factory=dict)
    cast: tuple[str, ...] = ()
    no_digest: tuple[str, ...] = ()


@dataclass
class LocalShare:
    """One rank's part of a tensor: the share of the boxes it holds, their element count, and
    whether it holds the tensor in another dtype than saved (then the share is 0)."""

    share: int = 0
    count: int = 0
    cast: bool = False


def flat_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A nested state dict flattened with DCP's rules (as the planners flatten it)."""
    flat, _ = flatten_state_dict(flatten_sharded_tensors(dict(state)))
    return flat


def _boxes(key: str, obj: Any) -> Iterator[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(tensor name, data, global offsets) of every box a flattened state-dict entry holds on
    this rank, from the entry's own description of itself.

    Not :func:`~ucp_dcp.dcp.load_planner.local_boxes`, on purpose: the load planner's boxes come
    from ucp_dcp's arithmetic (``arith_box``), and a check that shared it could not catch it.
    """
    if isinstance(obj, TensorPieces):
        for p in obj.pieces:
            yield p.fqn, p.data, p.offsets
    elif isinstance(obj, DTensor):
        if is_checkpointable(obj) or obj.device_mesh.get_coordinate() is None:
            return  # a LocalShardsWrapper (not described by its placements), or not on this rank
        _, offsets = compute_local_shape_and_global_offset(
            obj.shape, obj.device_mesh, obj.placements
        )
        yield key, dtensor_local(obj), tuple(offsets)
    elif isinstance(obj, ShardedTensor):
        for shard in obj.local_shards():
            yield key, shard.tensor, tuple(shard.metadata.shard_offsets)
    elif isinstance(obj, torch.Tensor) and not is_checkpointable(obj):
        yield key, obj, (0,) * obj.dim()


def local_shares(
    state: Mapping[str, Any], records: Mapping[str, TensorRecord]
) -> dict[str, LocalShare]:
    """This rank's share of every tensor of ``records`` that flattened ``state`` holds."""
    out: dict[str, LocalShare] = {}
    for key, obj in state.items():
        for fqn, data, offsets in _boxes(key, obj):
            rec = records.get(fqn)
            if rec is None or not data.numel():
                continue
            mine = out.setdefault(fqn, LocalShare())
            if data.dtype != rec.dtype:
                mine.cast = True
                continue
            mine.share = (mine.share + box_share(data, offsets, rec.shape)) & MASK64
            mine.count += data.numel()
    return out


@dataclass
class PlacementCheck:
    """What :func:`checked_placement` found (``report`` None: off, or the load failed)."""

    report: PlacementReport | None = None


@contextlib.contextmanager
def checked_placement(
    enabled: bool,
    source: Any,
    planner: Any,
    group: dist.ProcessGroup | None,
    where: str,
    allow_device: bool = False,
) -> Iterator[PlacementCheck]:
    """Check the placement of what ``planner``'s (flattened) state dict holds once the ``with``
    block (a load's reads) is done, when ``enabled``, against open ``source``'s records.

    Raises :class:`~ucp_dcp.errors.PlacementError` on entry when the checkpoint has no digests
    (every rank alike, before any read). When the block raises, this rank still joins the
    check's all-reduce, flagged, so that the other ranks skip it rather than wait.
    """
    check = PlacementCheck()
    if not enabled:
        yield check
        return
    assert source is not None
    records: Mapping[str, TensorRecord] = source.index.tensors
    no_digests_error(records, where)
    try:
        yield check
    except BaseException:
        check_placement(records, None, group, where, allow_device)
        raise
    state = getattr(planner, "state_dict", None)
    shares = local_shares(state, records) if isinstance(state, Mapping) else {}
    check.report = check_placement(records, shares, group, where, allow_device)


def no_digests_error(records: Mapping[str, TensorRecord], where: str) -> None:
    """Raise :class:`~ucp_dcp.errors.PlacementError` when no tensor of ``records`` has a
    placement digest (``where`` names the checkpoint)."""
    if not any(r.digest is not None for r in records.values()):
        raise PlacementError(
            f"{where or 'the checkpoint'} records no placement digests (saved without "
            "UCPStorageWriter(placement_digests=True), by an older ucp_dcp, or in another "
            "format): nothing to prove the load's placement against. Save with "
            "placement_digests=True, or load without verify_placement"
        )


def check_placement(
    records: Mapping[str, TensorRecord],
    shares: Mapping[str, LocalShare] | None,
    group: dist.ProcessGroup | None = None,
    where: str = "",
    allow_device: bool = False,
) -> PlacementReport:
    """Add the ranks' shares up (one all-reduce over ``group`` when a process group is
    initialised) and compare every loaded tensor with its recorded digest.

    The all-reduce runs where :func:`~ucp_dcp.dcp.read_once.transport.wire_for` says: host
    memory, or an NCCL group's device memory only with ``allow_device``.

    Every rank of the group must call this. ``shares=None`` says this rank's load failed: the
    check is skipped on every rank (the failing rank raises its own error), so no rank waits.
    Its callers refuse a checkpoint without digests first (:func:`no_digests_error`).

    Raises :class:`~ucp_dcp.errors.PlacementError` on every rank, naming the first tensors
    (sorted) whose loaded elements do not sum to their digest (``where`` names the checkpoint).
    """
    names = sorted(records)
    pos = {n: i for i, n in enumerate(names)}
    vec = torch.zeros(len(names) * _SLOTS + 1, dtype=torch.int64)
    if shares is None:
        vec[-1] = 1
    else:
        for fqn, s in shares.items():
            i = pos[fqn] * _SLOTS
            # Halves of 32 bits: an int64 sum of them cannot overflow below 2^31 ranks.
            vec[i : i + _SLOTS] = torch.tensor([s.share & _LO, s.share >> 32, s.count, int(s.cast)])
    if rank_and_world(group)[1] > 1:
        on = wire_for(group, allow_device)
        wire = vec.to(on.device)
        dist.all_reduce(wire, group=on.group)
        vec = wire.cpu()
    if vec[-1]:
        return PlacementReport()  # some rank's load failed; it raises its own error
    totals = vec[:-1].reshape(-1, _SLOTS).tolist()
    checked, cast, no_digest, wrong = [], [], [], []
    copies: dict[str, int] = {}
    for fqn, (lo, hi, count, casts) in zip(names, totals):
        rec = records[fqn]
        if not count and not casts:
            continue  # no rank loaded it
        if casts:
            cast.append(fqn)
            continue
        if rec.digest is None:
            no_digest.append(fqn)
            continue
        numel = math.prod(rec.shape)
        got = (lo + (hi << 32)) & MASK64
        n, rest = divmod(count, numel)
        if rest or not n:
            wrong.append(
                f"{fqn!r}: the ranks hold {count} of its elements in all, not a whole number of "
                f"copies of its {numel} (elements missing or held twice)"
            )
        elif got != n * int(rec.digest, 16) & MASK64:
            wrong.append(
                f"{fqn!r}: its {n} loaded cop{'y' if n == 1 else 'ies'} hash to "
                f"{digest_hex(got)}, the save recorded {rec.digest}"
                + (f" x {n}" if n > 1 else "")
                + " (elements in the wrong places, or wrong values)"
            )
        else:
            checked.append(fqn)
            copies[fqn] = n
    if wrong:
        raise PlacementError(
            f"{where + ': ' if where else ''}the load did not put every element where the save "
            f"found it, {len(wrong)} tensor(s): " + listed(wrong, 3, "; ")
        )
    return PlacementReport(tuple(checked), copies, tuple(cast), tuple(no_digest))
