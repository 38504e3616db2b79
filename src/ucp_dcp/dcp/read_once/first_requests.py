"""Read-once loads, the metadata half: each data file's first request made by one rank.

The ranks say which files they read (one ``all_gather_object`` of runs of file numbers); file
``f`` is fetched by the ``f mod n``-th of its ``n`` readers and one ``all_to_all_single`` hands
the bytes to the others. Every rank computes the same assignment from the same gather, and the
length of every first request follows from the index, so the message sizes need no exchange of
their own. Messages are framed as the exchange's (a status word first,
:func:`~ucp_dcp.dcp.read_once.exchange.framed`), so a failed fetch fails every rank. Why:
docs/read-once.md, "The data files' first requests, shared". The bytes are checked as any header
is, where they are parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...core.spans import merge_ranges
from ...errors import ReadOnceError
from ...sources import NativeSource
from .exchange import first_failure, framed, mark_failed, message_sizes, raise_gathered
from .transport import Wire

__all__ = ["share_first_requests"]


def share_first_requests(
    src: NativeSource,
    wanted: Sequence[int],
    failure: BaseException | None,
    on: Wire,
) -> None:
    """Have the first request of each file of ``wanted`` made by one rank of the load's group and
    handed to ``src``, a native checkpoint in object storage
    (:meth:`~ucp_dcp.sources.NativeSource.hold_first_requests`), over the group and memory ``on``
    names (:func:`~ucp_dcp.dcp.read_once.transport.wire_for`).

    Collective: every rank of the group calls it, with the ``failure`` that kept it from knowing
    what it reads if one did. Raises on every rank if any rank failed.
    """
    group = on.group
    me, world = dist.get_rank(group), dist.get_world_size(group)
    files = np.array(sorted(set(wanted)), dtype=np.int64)
    mine: object = failure if failure is not None else merge_ranges(files, files + 1)
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    refused = failure if failure is not None else first_failure(gathered)
    if refused is not None:  # every rank raises: its own error, else the first failed rank's
        raise refused
    readers = _readers(gathered)
    reads = np.flatnonzero(readers == me).tolist()
    size = src.first_request_bytes
    wants = [_wants(gathered[p], reads) if p != me else [] for p in range(world)]
    send_sizes = message_sizes(sum(size(f) for f in fs) for fs in wants)
    send = np.zeros(sum(send_sizes), dtype=np.uint8)
    error: BaseException | None = None
    got: Mapping[int, bytes] = {}
    try:
        got = src.fetch_first_requests(reads)
        for fs, (_, payload) in zip(wants, framed(send, send_sizes)):
            payload[:] = np.frombuffer(b"".join(got[f] for f in fs), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001  (raised after the collective: the others wait on it)
        error = e
        mark_failed(send, send_sizes)
    expect: list[list[int]] = [[] for _ in range(world)]
    for f in files.tolist():  # sorted: each reader sends its files in order
        if readers[f] != me:
            expect[readers[f]].append(f)
    recv_sizes = message_sizes(sum(size(f) for f in fs) for fs in expect)
    wire = on.device
    recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=wire)
    dist.all_to_all_single(
        recv, torch.from_numpy(send).to(wire), recv_sizes, send_sizes, group=group
    )
    data = recv.cpu().numpy()
    held: dict[int, bytes] = {f: got[f] for f in files.tolist() if f in got}
    failed: int | None = None
    for p, (fs, (status, payload)) in enumerate(zip(expect, framed(data, recv_sizes))):
        if status.any():
            failed = p if failed is None else failed
        w = 0
        for f in fs:
            held[f] = payload[w : w + size(f)].tobytes()
            w += size(f)
    if failed is not None:  # every rank saw it (each sends every rank a status): say what failed
        raise_gathered(error, group)
        raise ReadOnceError(f"rank {failed} could not fetch a data file's first request")
    src.hold_first_requests(held)


def _readers(runs: list[object]) -> np.ndarray:
    """Who fetches each file (by file number; -1 for files no rank reads): the ``f mod n``-th,
    in rank order, of its ``n`` readers. Numpy over each rank's runs: linear in the files the
    ranks read, whatever the number of ranks."""
    spans = [(r, a, b) for r, g in enumerate(runs) if isinstance(g, tuple) for a, b in zip(*g)]
    end = max((int(b) for _, _, b in spans), default=0)
    count = np.zeros(end, dtype=np.int64)
    for _, a, b in spans:
        count[a:b] += 1
    pick = np.arange(end) % np.maximum(count, 1)  # which of its readers, in rank order
    seen = np.zeros(end, dtype=np.int64)
    reader = np.full(end, -1, dtype=np.int64)
    for r, a, b in spans:  # in rank order
        hit = seen[a:b] == pick[a:b]
        reader[a:b][hit] = r
        seen[a:b] += 1
    return reader


def _wants(runs: object, files: list[int]) -> list[int]:
    """Those of ``files`` (sorted) that a rank's runs of file numbers hold."""
    assert isinstance(runs, tuple)
    a, b = runs
    i = np.searchsorted(a, files, side="right") - 1
    return [f for f, k in zip(files, i.tolist()) if k >= 0 and f < b[k]]
