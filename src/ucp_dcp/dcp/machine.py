"""Which ranks of a load share a machine, and which bytes of a file they read between them.

Ranks on one machine share its page cache: a page one of them reads is there for the others. So
a stream's read-ahead into pages another rank of the machine reads is no waste
(:func:`~ucp_dcp.core.spans.file_access`'s ``shared``). A load learns who shares its machine
without a collective of its own: each rank's local plan carries its :class:`Whereabouts` (host
name, global rank) to the coordinator, which hands every rank the ranks of its machine with the
global plan (:func:`ranks_by_machine`, ``LoadRun.machine``). What they read a rank works out
from its own state dict (:func:`machine_shared`), as DCP's planner works out its plan.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from ..byteio.requests import current_rank
from ..sources import Source

__all__ = ["Whereabouts", "ranks_by_machine", "machine_shared"]

# Bounds the chunks machine_shared looks at (a few ms): beyond it, a file's way of reading is
# chosen from this rank's own needs, as where nothing is known of the others'.
_SHARED_CHUNKS_MAX = 1 << 15


@dataclass(frozen=True, slots=True)
class Whereabouts:
    """A rank's machine (host name) and global rank: ``LoadPlan.storage_data`` on its way to the
    coordinator. Machines are told apart by host name only."""

    host: str
    rank: int

    @staticmethod
    def here() -> Whereabouts:
        """This process's."""
        return Whereabouts(socket.gethostname(), current_rank())


def ranks_by_machine(reported: Sequence[object]) -> list[tuple[int, ...]]:
    """Per rank's report (a :class:`Whereabouts`, or anything else where a plan carries none): the
    global ranks on its machine, in order, itself included; ``()`` where it reported nothing."""
    machines: dict[str, list[int]] = {}
    for w in reported:
        if isinstance(w, Whereabouts):
            machines.setdefault(w.host, []).append(w.rank)
    return [tuple(sorted(machines[w.host])) if isinstance(w, Whereabouts) else () for w in reported]


def machine_shared(
    src: Source,
    planner: LoadPlanner,
    items: Sequence[ReadItem],
    files: set[int],
    machine: Sequence[int],
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """The byte ranges of ``files`` that ranks on this machine (``machine``: their global ranks)
    read, as far as this rank can tell without asking them: every saved chunk of a tensor it
    loads (``items``) as a DTensor whose whole device mesh runs on this machine. The mesh's
    ranks hold all of the tensor between them, so each of its chunks is read here, by some rank;
    a stream's read-ahead into it is no waste (see :func:`~ucp_dcp.core.spans.file_access`)."""
    state = getattr(planner, "state_dict", None) or {}
    here = set(machine)
    meshes: dict[int, bool] = {}
    keys: dict[str, None] = {}
    for ri in items:
        fqn = ri.storage_index.fqn
        dest = state.get(ri.dest_index.fqn)
        if fqn in keys or ri.dest_index.fqn != fqn or not isinstance(dest, DTensor):
            continue
        mesh = dest.device_mesh
        whole = meshes.get(id(mesh))
        if whole is None:
            whole = meshes[id(mesh)] = set(mesh.mesh.flatten().tolist()) <= here
        if whole:
            keys[fqn] = None
    starts: dict[int, list[int]] = {}
    lengths: dict[int, list[int]] = {}
    budget = _SHARED_CHUNKS_MAX
    for fqn in keys:
        rec = src.index.tensors[fqn]
        n = rec.chunk_count()
        budget -= n
        if budget < 0:
            break
        for idx in range(n):
            if rec.chunk_file(idx) in files:
                loc = src.locate(fqn, idx)
                starts.setdefault(loc.file, []).append(loc.start)
                lengths.setdefault(loc.file, []).append(loc.nbytes)
    return {
        f: (np.asarray(starts[f], dtype=np.int64), np.asarray(lengths[f], dtype=np.int64))
        for f in starts
    }
