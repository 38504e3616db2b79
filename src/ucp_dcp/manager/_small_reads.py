"""Small reads of a restore served through the manager's group instead of whole-file fetches.

A node-local repair fetches per file, and one tiny read can cost a whole file: the few bytes of
AdamW's ``step`` counters every rank reads (saved by one rank; in checkpoints saved before rank 0
wrote small replicated tensors, spread over every rank's file). So a key whose reads are small
and whose target is a plain tensor or a value in a dict is read by a rank whose node holds its
file and handed to the ranks that need it in one ``all_gather_object``. The restorer
(:mod:`~ucp_dcp.manager._restore`) decides and runs this; here are its parts: which keys
(:func:`small_keys`), the state without them for ``dcp.load`` (:func:`without`,
:func:`put_back`), who reads each (:meth:`SmallReads.provider`, :func:`serve`) and putting what
arrives in place (:func:`fill`). See docs/manager.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import flatten_state_dict
from ..core.values import RankLocal, copy_containers, set_in_place
from ..dcp import PlannedRead, ReadOptions
from ..tools.checkpoint import Checkpoint
from ._collective import NodeLayout

__all__ = ["SMALL_READ_BYTES", "SmallReads", "fill", "put_back", "serve", "small_keys", "without"]

SMALL_READ_BYTES = 64 << 10
"""A key whose planned reads add up to at most this many bytes may be read through the group."""


@dataclass(frozen=True)
class SmallReads:
    """The keys each rank of the restore of ``step`` gets through the group (flattened key ->
    the files its reads are in), rank by rank, and the files each node's local tier holds
    (node by node)."""

    step: int
    keys: Sequence[Mapping[str, tuple[str, ...]]]
    held: Sequence[frozenset[str]]

    def provider(self, files: tuple[str, ...], layout: NodeLayout) -> int | None:
        """The lowest rank whose node holds every one of ``files`` (None: no node does)."""
        return next(
            (r for r in range(layout.world_size) if set(files) <= self.held[layout.node_of(r)]),
            None,
        )


def _eligible(value: Any, path: tuple[Any, ...], state: Mapping[str, Any]) -> bool:
    """Whether a target leaf is filled from a whole value, which one rank can read and send: a
    plain tensor (its planned reads are the whole tensor), or a non-tensor leaf of a dict (DCP
    puts values in place by their path). A shard (a DTensor) reads part of a tensor whose rest
    may be in files no node lends: its file is fetched."""
    if isinstance(value, torch.Tensor):
        return type(value) in (torch.Tensor, torch.nn.Parameter)
    if isinstance(value, RankLocal):
        return False  # one value per saving rank, gathered by the planner
    cur: Any = state  # ``path`` is the leaf's flatten_state_dict path in this very state
    for p in path[:-1]:
        cur = cur[p]
    return isinstance(cur, dict)


def small_keys(
    state: Mapping[str, Any], reads: Sequence[PlannedRead]
) -> dict[str, tuple[str, ...]]:
    """The keys of ``state`` whose ``reads`` (this rank's planned reads) are small and whose
    targets are eligible: key -> the files its reads are in."""
    flat, paths = flatten_state_dict(dict(state))
    sizes: dict[str, int] = {}
    files: dict[str, set[str]] = {}
    renamed: set[str] = set()  # keys read from a tensor or value of another name
    for r in reads:
        sizes[r.key] = sizes.get(r.key, 0) + r.nbytes
        files.setdefault(r.key, set()).add(r.file)
        if r.stored != r.key:
            renamed.add(r.key)
    return {
        k: tuple(sorted(files[k]))
        for k, n in sizes.items()
        if n <= SMALL_READ_BYTES
        and k in flat
        and k not in renamed
        and _eligible(flat[k], paths[k], state)
    }


def without(state: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """``state`` with its containers copied (leaves shared) and the leaves at ``keys`` left out:
    what ``dcp.load`` fills in place; :func:`put_back` returns its values."""
    _, paths = flatten_state_dict(dict(state))
    out = copy_containers(state)
    for k in keys:
        cur = out
        for p in paths[k][:-1]:
            cur = cur[p]
        del cur[paths[k][-1]]
    return out


def put_back(state: Any, loaded: Mapping[str, Any]) -> None:
    """Copy the non-tensor values ``dcp.load`` put in ``loaded`` (a :func:`without` copy of
    ``state``) into ``state``: tensors were filled in place."""
    flat, paths = flatten_state_dict(dict(loaded))
    for k, v in flat.items():
        if not isinstance(v, torch.Tensor):
            set_in_place(state, paths[k], v)


def serve(
    small: SmallReads, layout: NodeLayout, local_dir: str, options: ReadOptions
) -> dict[str, Any]:
    """The values of the keys this rank (of ``layout``) provides (those whose files its node
    holds, for which it is the lowest such rank), read from ``local_dir``: full tensors, or
    decoded values."""
    wanted: dict[str, tuple[str, ...]] = {}
    for keys in small.keys:
        wanted.update(keys)
    mine = [
        k for k, files in sorted(wanted.items()) if small.provider(files, layout) == layout.rank
    ]
    out: dict[str, Any] = {}
    if mine:
        with Checkpoint(local_dir, options=options) as ck:
            tensors = set(ck.tensor_names())
            for k in mine:
                out[k] = ck.read_tensor(k) if k in tensors else ck.read_value(k)
    return out


def fill(state: Any, keys: Mapping[str, tuple[str, ...]], got: Mapping[str, Any]) -> None:
    """Put the values ``got`` (key -> full tensor or value) of ``keys`` into ``state``: a plain
    tensor whole (cast to its dtype), a value at its path."""
    flat, paths = flatten_state_dict(dict(state))
    for k in keys:
        target, value = flat[k], got[k]
        if isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(value)
        else:
            set_in_place(state, paths[k], value)
