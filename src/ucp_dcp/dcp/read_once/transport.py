"""Read-once loads: what their collectives run on.

A :class:`Wire`, chosen by :func:`choose_transport` from the group's backend alone, carries the
messages of the exchange, the first requests and the placement check. They are host memory: on
the load's group where its backend handles CPU tensors (gloo, mpi, or ``"cpu:gloo,cuda:nccl"``),
otherwise (a group that is NCCL alone) on a gloo group made once from the same ranks and reused
(:func:`gloo_group`). Device memory, on the NCCL group itself, only where the caller opts in
(``ReadOptions(device_transport=True)``, not yet verified on multi-GPU): copied there and back,
the checks and copies into place run on the host.
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "Transport",
    "Wire",
    "choose_transport",
    "gloo_group",
    "group_backend",
    "wire_device",
    "wire_for",
]


class Transport(str, enum.Enum):
    """How a load's read-once messages (and the placement check's sums) travel
    (:func:`choose_transport`); its value is what :attr:`~ucp_dcp.LoadReport.transport` shows."""

    GROUP = "group"
    """Host memory, on the load's group itself: its backend handles CPU tensors (gloo, mpi, or
    one per device type with a CPU one: ``"cpu:gloo,cuda:nccl"``)."""
    GLOO = "gloo"
    """Host memory, on a gloo group made once from the load's group's ranks and reused
    (:func:`gloo_group`): the group is NCCL alone, or a backend not known to handle CPU tensors."""
    DEVICE = "device"
    """Device memory, on the NCCL group itself: only where the caller opts in
    (``ReadOptions(device_transport=True)``); not yet verified on multi-GPU."""
    NONE = "none"
    """No exchange: the group does not handle CPU tensors and this torch has no gloo."""

    def __str__(self) -> str:
        return self.value


# Backends that move CPU tensors: a group of one of them (for its CPU tensors) is used as it is.
_HOST_BACKENDS = frozenset({"gloo", "mpi"})


def choose_transport(backend: str, allow_device: bool = False, gloo: bool = True) -> Transport:
    """The transport for a group whose backend is ``backend`` (as ``dist.get_backend`` names
    it: ``"gloo"``, ``"nccl"``, or one per device type, ``"cpu:gloo,cuda:nccl"``).

    The group itself where it moves CPU tensors; else device memory where the caller opts in
    (``allow_device``) and the group's CUDA backend is NCCL; else a gloo group made from the same
    ranks where this torch has gloo (``gloo``), else none. Never device memory by default.
    """
    names = backend.lower()
    if ":" in names:
        per = dict(p.split(":", 1) for p in names.split(",") if ":" in p)
        cpu, cuda = per.get("cpu"), per.get("cuda")
    else:
        cpu = cuda = names
    if cpu in _HOST_BACKENDS:
        return Transport.GROUP
    if allow_device and cuda == "nccl":
        return Transport.DEVICE
    return Transport.GLOO if gloo else Transport.NONE


def wire_device(transport: Transport) -> torch.device:
    """Where the messages must be for ``transport``: the current CUDA device for
    :attr:`Transport.DEVICE` (opted in), else host memory."""
    if transport is Transport.DEVICE:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Wire:
    """What a read-once collective runs on: its ``transport`` and the ``group`` the messages
    travel on (None: the default group), whose group ranks are the load's group's."""

    transport: Transport
    group: Any

    @property
    def device(self) -> torch.device:
        """Where the messages must be (:func:`wire_device`)."""
        return wire_device(self.transport)


def group_backend(group: dist.ProcessGroup | None) -> str:
    """``group``'s backend as ``dist.get_backend`` names it (the seam the tests stand a gloo
    group in for an NCCL one through)."""
    return str(dist.get_backend(group))


# A load's group -> the gloo group made from its ranks: made once per process group, reused by
# every later load and peer copy on it, and dropped with the group.
_MADE: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def gloo_group(group: dist.ProcessGroup | None) -> Any:
    """A gloo group of ``group``'s ranks, in its rank order (group rank ``r`` of both is the same
    process): made the first time, reused after.

    Making it is collective (``dist.new_group``): the first call must come at the same point on
    every rank of ``group``, after the same groups were made on each. For the default group (or
    any group of the whole world) every rank of the job calls it; for a subgroup only its own
    ranks do (``use_local_synchronization``), so ranks outside it need not take part.
    """
    key = group if group is not None else dist.group.WORLD
    assert key is not None  # the default group: initialised wherever a load runs collectives
    made = _MADE.get(key)
    if made is not None:
        try:
            dist.get_rank(made)  # still registered: not destroyed with its world
            return made
        except (ValueError, RuntimeError):
            pass
    size = dist.get_world_size(key)
    ranks = [dist.get_global_rank(key, r) for r in range(size)]
    whole = size == dist.get_world_size()
    made = dist.new_group(
        ranks=ranks, backend="gloo", sort_ranks=False, use_local_synchronization=not whole
    )
    _MADE[key] = made
    return made


def wire_for(group: dist.ProcessGroup | None, allow_device: bool = False) -> Wire:
    """The :class:`Wire` for read-once collectives on ``group`` (:func:`choose_transport` of its
    backend); ``allow_device``: the caller opted in to device memory on an NCCL group.

    Collective where it makes a gloo group (:func:`gloo_group`, the first time for a group that
    is NCCL alone): every rank of ``group`` calls it at the same point.
    """
    transport = choose_transport(group_backend(group), allow_device, dist.is_gloo_available())
    if transport is Transport.GLOO:
        return Wire(transport, gloo_group(group))
    return Wire(transport, group)
