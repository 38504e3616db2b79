"""Copying whole checkpoint files between ranks over torch.distributed: the peer ring's copies
and a node-local repair's fetches (docs/manager.md, "Tiers").

Files move by plain ``torch.distributed`` point-to-point operations (gloo, CPU ``uint8``
tensors) on a process group the caller gives: no transport of its own. A group that is NCCL
alone is never used for the files: they go over a gloo group made once from its ranks and
reused, the read-once exchange's rule (:func:`~ucp_dcp.dcp.read_once.transport.wire_for`,
without device memory).

:func:`exchange_files` is one collective: after one ``all_gather_object`` of what each rank
offers and wants, every rank derives the same schedule, refuses the whole exchange if some
wanted file is held by nobody (on every rank, before anything moves, so no rank waits on a peer
that is already gone), and runs the transfers in one global order, so no pair of ranks can
deadlock.

Receivers write ``dest_dir/.<name>.<16 hex>.part``, fsync it and rename it to
``dest_dir/<name>``: a file under its final name is always complete. A rank killed mid-transfer
leaves only such a ``.part`` file behind; callers remove leftovers with :func:`clean_partials`.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..byteio.durable import copy_durable, fsync_path, remove_quietly, write_all
from ..dcp.read_once.transport import Transport, wire_for
from ..errors import InvalidArgumentError, PeerTransferError
from .tiers.marker import check_name

__all__ = ["PeerTransferError", "TransferReport", "clean_partials", "exchange_files"]

_PART_RE = re.compile(r"^\..+\.[0-9a-f]{16}\.part$")


@dataclass(frozen=True)
class TransferReport:
    """What one rank did in :func:`exchange_files`.

    ``received`` lists every wanted name now in ``dest_dir`` (over the wire
    or satisfied locally); ``local`` is the subset that came from this rank's
    own ``src_dir`` (copied, or already in place when both dirs are the same).
    The byte counts are over-the-wire traffic only.
    """

    received: list[str]
    sent: list[tuple[str, int]]
    bytes_received: int
    bytes_sent: int
    local: list[str] = field(default_factory=list)


def clean_partials(dest_dir: str) -> list[str]:
    """Remove ``.<name>.<hex>.part`` leftovers of interrupted receives in
    ``dest_dir``; returns the removed file names (sorted). A missing
    directory is not an error."""
    try:
        names = os.listdir(dest_dir)
    except FileNotFoundError:
        return []
    removed = []
    for n in sorted(names):
        if _PART_RE.match(n):
            try:
                os.unlink(os.path.join(dest_dir, n))
            except FileNotFoundError:
                continue
            removed.append(n)
    if removed:
        fsync_path(dest_dir)
    return removed


def _local_info(
    src_dir: str | None, available: list[str], dest_dir: str | None, wanted: list[str]
) -> tuple[dict[str, int], list[str]]:
    """(name -> size of what this rank can provide, problems)."""
    problems = []
    for name in available + wanted:
        try:
            check_name(name)
        except InvalidArgumentError as e:
            problems.append(str(e))
    if available and src_dir is None:
        problems.append("files offered as available but src_dir is None")
    if wanted and dest_dir is None:
        problems.append("files wanted but dest_dir is None")
    sizes: dict[str, int] = {}
    if not problems and src_dir is not None:
        for name in available:
            try:
                st = os.stat(os.path.join(src_dir, name))
            except FileNotFoundError:
                continue  # not really here: another rank may still provide it
            sizes[name] = st.st_size
    return sizes, problems


def _schedule(
    avail: list[dict[str, int]], wants: list[list[str]]
) -> tuple[list[tuple[str, int, int, int]], dict[str, list[int]]]:
    """Deterministic plan from the gathered data.

    Returns ``(steps, missing)``: steps are ``(name, provider, requester,
    size)`` in the one global order every rank follows; ``missing`` maps
    unprovidable names to the ranks that want them.
    """
    holders: dict[str, list[int]] = {}
    for r, a in enumerate(avail):
        for name in a:
            holders.setdefault(name, []).append(r)
    load = [(0, 0)] * len(avail)  # (bytes, files) sent by each provider
    missing: dict[str, list[int]] = {}
    plan = []
    for req, names in enumerate(wants):
        for name in names:
            hs = holders.get(name)
            if not hs:
                missing.setdefault(name, []).append(req)
                continue
            if req in hs:
                plan.append((name, req, req, avail[req][name]))
                continue
            prov = min(hs, key=lambda r: (load[r], r))
            size = avail[prov][name]
            load[prov] = (load[prov][0] + size, load[prov][1] + 1)
            plan.append((name, prov, req, size))
    # Rounds: each step goes to the first round after the previous steps of
    # both its ranks, so disjoint pairs run side by side. Per-rank order is
    # kept and every rank sorts the same way: no pair can deadlock.
    nxt = [0] * len(avail)
    keyed = []
    for i, (_name, prov, req, _size) in enumerate(plan):
        if prov == req:
            keyed.append((-1, i, plan[i]))  # local copies first, no peer involved
            continue
        rnd = max(nxt[prov], nxt[req])
        nxt[prov] = nxt[req] = rnd + 1
        keyed.append((rnd, i, plan[i]))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return [k[2] for k in keyed], missing


def _missing_message(missing: dict[str, list[int]]) -> str:
    parts = [
        f"{name!r} (wanted by rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))})"
        for name, rs in sorted(missing.items())
    ]
    return f"{len(missing)} wanted file(s) held by no rank: " + "; ".join(parts)


def _tmp_path(dest_dir: str, name: str) -> tuple[str, int]:
    while True:
        path = os.path.join(dest_dir, f".{name}.{secrets.token_hex(8)}.part")
        try:
            return path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue


def _read_full(f: Any, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            break
        got += n
    return got


def _local_copy(src_dir: str, dest_dir: str, name: str) -> bool:
    """Copy src_dir/name to dest_dir/name (atomically); False if already in place."""
    src = os.path.join(src_dir, name)
    dst = os.path.join(dest_dir, name)
    if os.path.exists(dst) and os.path.samefile(src, dst):
        return False
    tmp, fd = _tmp_path(dest_dir, name)
    os.close(fd)
    try:
        copy_durable(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        remove_quietly(tmp)
        raise
    return True


class _Buffers:
    """Two reusable block buffers (double buffering), grown on demand."""

    def __init__(self) -> None:
        self.bufs = [bytearray(), bytearray()]

    def get(self, i: int, n: int) -> bytearray:
        if len(self.bufs[i]) < n:
            self.bufs[i] = bytearray(n)
        return self.bufs[i]


def _blocks(size: int, block: int) -> list[int]:
    return [min(block, size - off) for off in range(0, size, block)]


def _send_file(
    path: str, size: int, peer: int, group: Any, block: int, bufs: _Buffers
) -> str | None:
    """Stream one file to group rank ``peer``; returns an error message or None."""
    status = torch.ones(1, dtype=torch.uint8)
    err = None
    f = None
    try:
        f = open(path, "rb", buffering=0)
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            err = f"{path}: size changed from {size} to {actual} bytes"
    except OSError as e:
        err = f"{path}: {e}"
    if err is not None or f is None:  # f is set whenever err is not
        if f is not None:
            f.close()
        status.zero_()
        dist.send(status, group=group, group_dst=peer)
        return err
    with f:
        dist.send(status, group=group, group_dst=peer)  # header: the data follows
        pending = None
        for i, n in enumerate(_blocks(size, block)):
            buf = bufs.get(i % 2, n)
            view = memoryview(buf)[:n]
            if err is None:
                try:
                    got = _read_full(f, view)
                    if got < n:
                        err = f"{path}: file shorter than its {size} bytes"
                except OSError as e:
                    err = f"{path}: {e}"
            if err is not None:
                view[:] = bytes(n)  # the receiver expects every block; it drops them
            work = dist.isend(
                torch.frombuffer(buf, dtype=torch.uint8, count=n), group=group, group_dst=peer
            )
            if pending is not None:
                pending.wait()
            pending = work
        if pending is not None:
            pending.wait()
    if err is not None:
        status.zero_()
    dist.send(status, group=group, group_dst=peer)  # trailer: was the data good
    return err


def _recv_file(
    dest_dir: str, name: str, size: int, peer: int, group: Any, block: int, bufs: _Buffers
) -> str | None:
    """Receive one file from group rank ``peer`` into dest_dir/name; returns an error or None."""
    status = torch.zeros(1, dtype=torch.uint8)
    dist.recv(status, group=group, group_src=peer)
    if not status.item():
        return f"rank {peer} could not read {name!r} it offered"
    err = None
    tmp, fd = None, -1
    try:
        tmp, fd = _tmp_path(dest_dir, name)
    except OSError as e:
        err = f"{dest_dir}: cannot create a file for {name!r}: {e}"
    try:
        sizes = _blocks(size, block)
        posted = []

        def post(i: int) -> None:
            buf = bufs.get(i % 2, sizes[i])
            t = torch.frombuffer(buf, dtype=torch.uint8, count=sizes[i])
            posted.append(dist.irecv(t, group=group, group_src=peer))

        for i in range(min(2, len(sizes))):
            post(i)
        for i, n in enumerate(sizes):
            work = posted[i]
            if work is not None:  # None: this rank is not in the group (never, see the caller)
                work.wait()
            if err is None:
                try:
                    write_all(fd, memoryview(bufs.bufs[i % 2])[:n])
                except OSError as e:
                    err = f"{tmp}: {e}"
            if i + 2 < len(sizes):
                post(i + 2)
        dist.recv(status, group=group, group_src=peer)
        if err is None and not status.item():
            err = f"rank {peer} failed while reading {name!r}"
        if err is None and tmp is not None:  # tmp is set whenever err is not
            try:
                os.fsync(fd)
                os.close(fd)
                fd = -1
                os.replace(tmp, os.path.join(dest_dir, name))
                tmp = None
            except OSError as e:
                err = f"{dest_dir}/{name}: {e}"
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp is not None:
            remove_quietly(tmp)
    return err


def exchange_files(
    group: dist.ProcessGroup | None,
    src_dir: str | None,
    available: Iterable[str],
    dest_dir: str | None,
    wanted: Iterable[str],
    *,
    block_bytes: int = 64 << 20,
) -> TransferReport:
    """Collective over ``group`` (None: the default group) moving whole files (see the module
    docstring for the schedule, the transport and the ``.part`` files).

    Each rank offers ``available`` (plain file names in ``src_dir``; names not actually there
    are not offered) and asks for ``wanted`` (written into ``dest_dir``; nothing is skipped, so
    callers pass only what is missing). A requester that holds a file copies it locally;
    otherwise the holder with the least bytes scheduled so far (ties: fewest files, then lowest
    rank) sends it, in blocks of ``block_bytes``.

    Every rank raises the same error for an invalid name on any rank
    (:class:`~ucp_dcp.errors.InvalidArgumentError`, a ``ValueError``) and for a wanted name
    nobody holds (:class:`PeerTransferError`), before anything moves. A provider that cannot
    read a file it offered, or a receiver that cannot write, still completes the schedule (the
    data is dropped), then raises :class:`PeerTransferError`: a provider's failure on both
    ranks (the receiver is told), a receiver's on the receiver alone (the sender is not).

    Without an initialized process group this is a world of one: every wanted file must be in
    ``available`` and is copied from ``src_dir`` to ``dest_dir`` (nothing to do where they are
    the same file).
    """
    if block_bytes <= 0:
        raise InvalidArgumentError(
            f"exchange_files: block_bytes must be positive, got {block_bytes}"
        )
    available = list(dict.fromkeys(available))  # each name once, in order
    wanted = list(dict.fromkeys(wanted))
    sizes, problems = _local_info(src_dir, available, dest_dir, wanted)

    if dist.is_initialized():
        if dist.get_rank(group) < 0:
            raise InvalidArgumentError(
                "exchange_files: this process is not a member of the given group"
            )
        wire = wire_for(group)  # host memory: the group itself, or gloo made from its ranks
        if wire.transport is Transport.NONE:
            raise InvalidArgumentError(
                "exchange_files needs a process group that handles CPU tensors, or gloo to make "
                f"one from its ranks; got {dist.get_backend(group)} and this torch has no gloo"
            )
        group = wire.group
        me = dist.get_rank(group)
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (sizes, wanted, problems), group=group)
    else:
        me, world = 0, 1
        gathered = [(sizes, wanted, problems)]

    bad = [f"rank {r}: {p}" for r, (_, _, ps) in enumerate(gathered) for p in ps]
    if bad:
        raise InvalidArgumentError("exchange_files: " + "; ".join(bad))
    steps, missing = _schedule([g[0] for g in gathered], [g[1] for g in gathered])
    if missing:
        raise PeerTransferError(_missing_message(missing))

    received: list[str] = []
    local: list[str] = []
    sent: list[tuple[str, int]] = []
    nrecv = nsent = 0
    errors: list[str] = []
    wrote = False
    bufs = _Buffers()
    # _local_info refused (on every rank) offering files without src_dir and wanting files
    # without dest_dir: each step of this rank has the directory it needs.
    if wanted and dest_dir is not None:
        try:
            os.makedirs(dest_dir, exist_ok=True)
        except OSError as e:  # the receives below fail one by one, after draining
            errors.append(f"{dest_dir}: {e}")
    for name, prov, req, size in steps:
        if prov == req:
            if req == me:
                assert src_dir is not None and dest_dir is not None
                try:
                    wrote |= _local_copy(src_dir, dest_dir, name)
                except OSError as e:  # keep going: peers wait on this rank's later steps
                    errors.append(f"copying {name!r} locally: {e}")
                    continue
                received.append(name)
                local.append(name)
        elif prov == me:
            assert src_dir is not None
            err = _send_file(os.path.join(src_dir, name), size, req, group, block_bytes, bufs)
            if err is None:
                sent.append((name, req))
                nsent += size
            else:
                errors.append(f"sending {name!r} to rank {req}: {err}")
        elif req == me:
            assert dest_dir is not None
            err = _recv_file(dest_dir, name, size, prov, group, block_bytes, bufs)
            if err is None:
                received.append(name)
                nrecv += size
                wrote = True
            else:
                errors.append(f"receiving {name!r} from rank {prov}: {err}")
    if wrote and dest_dir is not None:
        fsync_path(dest_dir)
    if errors:
        raise PeerTransferError(f"rank {me}: " + "; ".join(errors))
    return TransferReport(
        received=received, sent=sent, bytes_received=nrecv, bytes_sent=nsent, local=local
    )
