"""Compact save planning: describe a mesh's tensors once, not once per rank.

Every rank of a device mesh holds the same regular DTensors with the same placements, and its
chunk follows from its mesh coordinate. So :class:`~ucp_dcp.UCPSavePlanner` groups them by mesh
(:class:`MeshGroup`): the mesh's first rank sends the group's description, every rank its
checksum. Which replica writes a replicated chunk (:meth:`MeshGroup.replica_choice`), each
rank's writes (:func:`group_items`) and the coordinator's index (:func:`compact_records`)
follow from the description alone, so no per-item decision travels either way. Why, and what
it saves at 16384 ranks: docs/scale.md, "Save plans per device mesh".
"""

from __future__ import annotations

import functools
import json
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, SupportsIndex, TypeVar, overload

import numpy as np
import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..core.sharding import Box, arith_box
from ..core.values import dtype_from_name
from ..errors import CheckpointFormatError
from ..format import FileRecord, Layout, RunList, TensorRecord, decode_runs, encode_runs

__all__ = [
    "TensorSpec",
    "MeshGroup",
    "Owners",
    "cached_group",
    "described_group",
    "group_items",
    "shard_item",
    "owned_metadata",
    "compact_records",
    "LazyChunks",
    "balance",
]

_H = TypeVar("_H", bound=Hashable)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a mesh group: name, dtype name, global shape, layout."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    layout: Layout

    @property
    def nbytes(self) -> int:
        """Size of the whole tensor in bytes."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True, eq=False)
class MeshGroup:
    """The regular DTensors one device mesh holds, as every rank of it sees them.

    ``ranks`` lists the global rank at every mesh position (row-major), so
    the coordinator can tell which rank writes each chunk.
    """

    mesh: tuple[int, ...]
    ranks: tuple[int, ...]
    tensors: tuple[TensorSpec, ...]  # sorted by name

    # ------------------------------------------------------------ wire form
    def to_json(self) -> dict[str, Any]:
        """JSON-safe description (what the mesh's first rank sends)."""
        return {
            "mesh": list(self.mesh),
            "ranks": encode_runs(self.ranks),
            "tensors": [[t.fqn, t.dtype, list(t.shape), t.layout.to_json()] for t in self.tensors],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> MeshGroup:
        """Inverse of :meth:`to_json`."""
        return MeshGroup(
            tuple(d["mesh"]),
            tuple(decode_runs(d["ranks"], "mesh group")),
            tuple(
                TensorSpec(f, dt, tuple(sh), Layout.from_json(lj, f))
                for f, dt, sh, lj in d["tensors"]
            ),
        )

    @functools.cached_property
    def signature(self) -> str:
        """Checksum of the description: what every other rank of the mesh sends."""
        return xxhash.xxh3_128_hexdigest(json.dumps(self.to_json(), separators=(",", ":")).encode())

    def spec(self, fqn: str) -> TensorSpec:
        """The spec of tensor ``fqn`` of this group."""
        return self._by_name[fqn]

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorSpec]:
        return {t.fqn: t for t in self.tensors}

    @property
    def first_rank(self) -> int:
        """The rank that describes the group (mesh position 0)."""
        return self.ranks[0]

    # ------------------------------------------------------------ writers
    @functools.cached_property
    def replica_choice(self) -> dict[str, int]:
        """Per tensor, which replica (index over its replicated mesh dims) writes it.

        :func:`balance` over the replicas of the same replicated dims, each charged
        its chunk's bytes: the writes of a replicated layout (HSDP, TP-replicated
        norms) spread over the replicas. Deterministic in the description, so
        every rank computes the same answer.
        """
        # A replica is a (replicated dims, index) slot: tensors replicated over the same dims
        # share their slots, and so their load.
        slots: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
        replicas = {}
        for t in self.tensors:
            rdims = _replicated_dims(t.layout)
            if rdims not in slots:
                slots[rdims] = [(rdims, i) for i in range(math.prod(self.mesh[m] for m in rdims))]
            replicas[t.fqn] = slots[rdims]
        load: dict[tuple[tuple[int, ...], int], int] = defaultdict(int)
        choice: dict[str, int] = {}
        for fqn, k in balance({t.fqn: t.nbytes for t in self.tensors}, replicas, load):
            choice[fqn] = k
            if len(replicas[fqn]) > 1:
                t = self.spec(fqn)
                load[replicas[fqn][k]] += t.nbytes // max(1, t.layout.grid(t.shape).n_chunks)
        return choice

    def writes(self, spec: TensorSpec, coord: Sequence[int]) -> bool:
        """Whether the rank at mesh coordinate ``coord`` writes its chunk of ``spec``."""
        k = 0
        for m in _replicated_dims(spec.layout):
            k = k * self.mesh[m] + coord[m]
        return k == self.replica_choice[spec.fqn]

    def writer_ranks(self, spec: TensorSpec) -> np.ndarray:
        """Global rank that writes each chunk of ``spec``, in chunk order."""
        grid = spec.layout.grid(spec.shape)
        assert grid.mesh_lin is not None, "mesh groups hold only layouts with an arithmetic grid"
        mesh = self.mesh
        strides = [math.prod(mesh[m + 1 :]) for m in range(len(mesh))]
        shard_dims = [m for m, p in enumerate(spec.layout.placements) if p != "R"]
        pos = np.zeros(grid.n_chunks, dtype=np.int64)
        rest = grid.mesh_lin.copy()
        for m in reversed(shard_dims):
            pos += (rest % mesh[m]) * strides[m]
            rest //= mesh[m]
        k = self.replica_choice[spec.fqn]
        for m in reversed(_replicated_dims(spec.layout)):
            pos += (k % mesh[m]) * strides[m]
            k //= mesh[m]
        return self._ranks_array[pos]

    @functools.cached_property
    def _ranks_array(self) -> np.ndarray:
        return np.asarray(self.ranks, dtype=np.int64)


def _replicated_dims(layout: Layout) -> tuple[int, ...]:
    return tuple(m for m, p in enumerate(layout.placements) if p == "R")


def balance(
    sizes: Mapping[str, int], options: Mapping[str, Sequence[_H]], load: Mapping[_H, int]
) -> Iterator[tuple[str, int]]:
    """Greedy balancing, the rule of every writer choice of a save: each name of ``sizes``,
    largest first (ties by name), with the index in ``options[name]`` of the least-``load``ed
    option (the first on a tie).

    The caller adds what it placed to ``load`` before taking the next. The answer depends on
    these arguments alone, so every rank that computes it from the same ones gets the same.
    """
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        opts = options[name]
        yield name, min(range(len(opts)), key=lambda i: load[opts[i]])


# ---------------------------------------------------------------------- each rank's writes

# Plan caches (per process): mesh groups by signature, so their grids and
# replica choices are computed once, and derived write items per rank.
_GROUPS: dict[str, MeshGroup] = {}
_GROUP_ITEMS: dict[tuple[str, int, tuple[int, ...], frozenset[str]], list[WriteItem]] = {}


def cached_group(group: MeshGroup) -> MeshGroup:
    """The cached group with ``group``'s signature (``group`` itself the first time)."""
    cached = _GROUPS.get(group.signature)
    if cached is None:
        if len(_GROUPS) >= 64:
            _GROUPS.pop(next(iter(_GROUPS)))
        _GROUPS[group.signature] = cached = group
    return cached


def described_group(signature: str, description: dict[str, Any]) -> MeshGroup:
    """The group a rank described: the cached one with its checksum, else ``description``
    parsed (and cached)."""
    return _GROUPS.get(signature) or cached_group(MeshGroup.from_json(description))


def group_items(
    group: MeshGroup, rank: int, coord: Sequence[int], skip: frozenset[str]
) -> list[WriteItem]:
    """Write items of the chunks the rank at mesh coordinate ``coord`` writes for ``group``.

    Cached per (group, rank, coordinate, skip): a training loop saving the
    same model again derives nothing twice (items name tensors by key; the
    data is looked up at write time).
    """
    key = (group.signature, rank, tuple(coord), skip)
    items = _GROUP_ITEMS.get(key)
    if items is None:
        items = []
        for t in group.tensors:
            if t.fqn not in skip and group.writes(t, coord):
                box = arith_box(t.shape, group.mesh, t.layout.parsed_placements(), coord)
                assert box is not None  # mesh groups hold arithmetic layouts only
                if box.numel:
                    items.append(shard_item(t.fqn, box, dtype_from_name(t.dtype), t.shape))
        if len(_GROUP_ITEMS) >= 16:
            _GROUP_ITEMS.pop(next(iter(_GROUP_ITEMS)))
        _GROUP_ITEMS[key] = items
    return items


def shard_item(fqn: str, box: Box, dtype: torch.dtype, shape: Sequence[int]) -> WriteItem:
    """DCP's write item for box ``box`` of tensor ``fqn`` (what ``_create_write_items``
    makes for a DTensor shard, without DTensor's per-call arithmetic)."""
    offsets, sizes = torch.Size(box.offsets), torch.Size(box.sizes)
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


# ---------------------------------------------------------------------- the coordinator's index

Owners = dict[str, tuple[MeshGroup, TensorSpec]]
"""For every mesh-planned tensor, the group that writes it and its spec there."""


def owned_metadata(owners: Owners) -> dict[str, TensorStorageMetadata]:
    """DCP's metadata of the mesh-planned tensors; their chunk lists are built only if read."""
    return {
        fqn: TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(t.dtype)),
            torch.Size(t.shape),
            LazyChunks(functools.partial(t.layout.chunks, t.shape)),
        )
        for fqn, (_, t) in owners.items()
    }


def compact_records(
    owners: dict[str, MeshGroup],
    positions: dict[int, int],
    files: Sequence[FileRecord],
    counts: dict[int, int],
) -> dict[str, TensorRecord]:
    """Index records of the mesh groups' tensors, from the writer rule alone.

    ``owners`` names the group that writes each tensor; ``positions`` maps global ranks to positions
    in the save's process group (``FileRecord.rank``); ``counts`` is how many mesh-planned chunks
    each position reported writing, checked against what the plan says. Vectorised: linear in the
    number of chunks, a few numpy operations per tensor.
    """
    if not owners:
        return {}
    n = max(positions.values()) + 1
    pos_of_rank = np.full(max(positions) + 1, -1, dtype=np.int64)
    for r, p in positions.items():
        pos_of_rank[r] = p
    file_of_pos = np.full(n, -1, dtype=np.int64)
    for i, f in enumerate(files):
        file_of_pos[f.rank] = i
    expected = np.zeros(n, dtype=np.int64)
    out: dict[str, TensorRecord] = {}
    for fqn, g in owners.items():
        t = g.spec(fqn)
        ranks = g.writer_ranks(t)
        pos = pos_of_rank[ranks]
        fidx = np.where(pos >= 0, file_of_pos[pos], -1)
        if (fidx < 0).any():
            k = int(np.flatnonzero(fidx < 0)[0])
            raise CheckpointFormatError(
                f"tensor {t.fqn!r}: rank {int(ranks[k])} was to write chunk {k} at "
                f"{list(t.layout.grid(t.shape).box(k).offsets)} but reported no data file"
            )
        expected += np.bincount(pos, minlength=n)
        out[t.fqn] = TensorRecord(
            dtype_from_name(t.dtype), t.shape, t.layout, True, RunList(encode_runs(fidx))
        )
    got = np.zeros(n, dtype=np.int64)
    for p, c in counts.items():
        got[p] = c
    bad = np.flatnonzero(got != expected)
    if len(bad):
        p = int(bad[0])
        raise CheckpointFormatError(
            f"the rank at position {p} of the save wrote {int(got[p])} chunk(s) of mesh-planned "
            "tensors but the "
            f"plan gives it {int(expected[p])}: ranks disagree about the mesh layout; nothing was "
            "committed"
        )
    return out


class LazyChunks(list[ChunkStorageMetadata]):
    """DCP's chunk list of one tensor, built only if something reads it.

    ``TensorStorageMetadata.chunks`` lists every saved chunk; at 16384 ranks
    x 700 tensors that is millions of objects. ucp_dcp's planners and
    storage never look (they use the grids), so the list stays empty; a
    planner or tool that reads it gets the real list. ``boxes`` must be
    picklable (a ``functools.partial`` of module-level functions and
    records), so that pickling stays lazy too.
    """

    def __init__(self, boxes: Callable[[], list[Box]]) -> None:
        super().__init__()
        self._source: Callable[[], list[Box]] | None = boxes

    def _fill(self) -> None:
        if self._source is not None:
            source, self._source = self._source, None
            super().extend(
                ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)) for b in source()
            )

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        self._fill()
        return super().__iter__()

    @overload
    def __getitem__(self, i: SupportsIndex) -> ChunkStorageMetadata: ...

    @overload
    def __getitem__(self, i: slice) -> list[ChunkStorageMetadata]: ...

    def __getitem__(
        self, i: SupportsIndex | slice
    ) -> ChunkStorageMetadata | list[ChunkStorageMetadata]:
        self._fill()
        return super().__getitem__(i)

    def __eq__(self, other: object) -> bool:
        self._fill()
        return super().__eq__(other)

    def __repr__(self) -> str:
        self._fill()
        return super().__repr__()

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        # DCP broadcasts the save's metadata to every rank: stay lazy on the
        # wire too (the source is a picklable partial), else send the list.
        if self._source is not None:
            return (LazyChunks, (self._source,))
        return (list, (list(super().__iter__()),))
