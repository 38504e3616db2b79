"""Replicating checkpoint files between ranks (ucp_dcp.manager.peer), with real gloo ranks.

"Nodes" of two ranks each are simulated by per-rank directories; losing a
node is deleting its ranks' directories. Every received file is compared
byte for byte with the original.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch.distributed as dist

from dist_utils import run_ranks
from ucp_dcp.manager.peer import PeerTransferError, TransferReport, clean_partials, exchange_files
from ucp_dcp.errors import InvalidArgumentError

MiB = 1 << 20
BLOCK = 1 * MiB
# rank -> size of its own file: empty, one byte, several blocks with a tail, an exact block multiple
SIZES = {0: 0, 1: 1, 2: 3 * MiB + 12345, 3: 2 * MiB}


def _data(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


def _name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _make_originals(root: str) -> None:
    orig = os.path.join(root, "orig")
    os.makedirs(orig)
    for r, size in SIZES.items():
        with open(os.path.join(orig, _name(r)), "wb") as f:
            f.write(_data(r, size))
        d = os.path.join(root, "local", f"rank{r}")
        os.makedirs(d)
        shutil.copy(os.path.join(orig, _name(r)), d)


def _same(root: str, directory: str, name: str) -> bool:
    with open(os.path.join(root, "orig", name), "rb") as a, open(os.path.join(directory, name), "rb") as b:
        return a.read() == b.read()


def _no_partials(directory: str) -> bool:
    return not any(n.endswith(".part") for n in os.listdir(directory))


# --- replicate to the partner node, lose a node, restore from the partner -----


def _replicate_then_restore(rank: int, world: int, root: str) -> None:
    mine = os.path.join(root, "local", f"rank{rank}")
    node = rank // 2
    partner = [2 * (1 - node), 2 * (1 - node) + 1]

    # 1. replicate: every rank wants the files of both ranks on the partner node
    rep = exchange_files(None, mine, [_name(rank)], mine, [_name(p) for p in partner], block_bytes=BLOCK)
    assert isinstance(rep, TransferReport)
    assert sorted(rep.received) == sorted(_name(p) for p in partner)
    assert rep.local == []
    assert rep.bytes_received == sum(SIZES[p] for p in partner)
    assert sorted(rep.sent) == [(_name(rank), p) for p in partner]
    assert rep.bytes_sent == 2 * SIZES[rank]
    for p in partner:
        assert _same(root, mine, _name(p))
    assert _no_partials(mine)
    dist.barrier()

    # 2. node 0 loses its disk
    if rank == 0:
        for r in (0, 1):
            shutil.rmtree(os.path.join(root, "local", f"rank{r}"))
    dist.barrier()

    # 3. restore: node 0's ranks want everything back; both ranks of node 1 hold
    #    node 0's files, each holds its own
    if node == 0:
        avail, want = [], [_name(rank)] + [_name(p) for p in partner]
    else:
        avail, want = sorted(os.listdir(mine)), []
    rep = exchange_files(None, mine, avail, mine, want, block_bytes=BLOCK)
    if node == 0:
        assert sorted(rep.received) == sorted(want)
        assert rep.sent == [] and rep.bytes_sent == 0
        assert rep.bytes_received == sum(SIZES[int(n[2])] for n in want)
        assert sorted(os.listdir(mine)) == sorted(want)  # no .part leftovers
        for n in want:
            assert _same(root, mine, n)
    else:
        assert rep.received == [] and rep.bytes_received == 0
    reports: list = [None] * world
    dist.all_gather_object(reports, rep)
    # both holders served (load is spread), and what was sent is what was received
    assert all(reports[r].sent for r in (2, 3))
    assert sum(x.bytes_sent for x in reports) == sum(x.bytes_received for x in reports)
    assert sorted(n for x in reports for n, _ in x.sent) == sorted(
        n for r in (0, 1) for n in [_name(r)] + [_name(p) for p in (2, 3)]
    )


# --- refusals: nobody has it, invalid names ----------------------------------


def _refusals(rank: int, world: int, root: str) -> None:
    mine = os.path.join(root, "local", f"rank{rank}")
    other = _name((rank + 1) % world)
    want = [other] + (["ghost.bin"] if rank in (1, 3) else []) + (["phantom.bin"] if rank == 2 else [])
    with pytest.raises(PeerTransferError) as ei:
        exchange_files(None, mine, [_name(rank)], mine, want, block_bytes=BLOCK)
    msg = str(ei.value)
    assert "'ghost.bin' (wanted by ranks 1, 3)" in msg, msg
    assert "'phantom.bin' (wanted by rank 2)" in msg, msg
    msgs: list = [None] * world
    dist.all_gather_object(msgs, msg)
    assert len(set(msgs)) == 1  # the same message everywhere
    assert os.listdir(mine) == [_name(rank)]  # refused before anything moved

    bad = ["../evil"] if rank == 2 else []
    with pytest.raises(InvalidArgumentError, match=r"rank 2: invalid file name '\.\./evil'"):
        exchange_files(None, mine, [_name(rank)], mine, bad, block_bytes=BLOCK)

    # the group still works afterwards: nobody is stuck in a half-done exchange
    rep = exchange_files(None, mine, [_name(rank)], mine, [other], block_bytes=BLOCK)
    assert rep.received == [other] and _same(root, mine, other)


def _four_ranks(rank: int, world: int, root_a: str, root_b: str) -> None:
    _replicate_then_restore(rank, world, root_a)
    _refusals(rank, world, root_b)


@pytest.mark.multiproc
def test_replicate_restore_and_refusals_4_ranks(tmp_path) -> None:
    # one spawn for both scenarios (spawning 4 ranks costs more than the exchanges)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _make_originals(a)
    _make_originals(b)
    run_ranks(4, _four_ranks, a, b)


# --- local copies, a provider that fails mid-file ----------------------------


def _local_and_failure(rank: int, world: int, root: str) -> None:
    import ucp_dcp.manager.peer as peer

    mine = os.path.join(root, "local", f"rank{rank}")
    big = _name(2)  # several blocks; both ranks hold it
    shutil.copy(os.path.join(root, "orig", big), mine)
    dest = os.path.join(root, "dest", f"rank{rank}")

    # each rank wants `big` (it has it: local copy) and the other's own file (wire)
    other = _name(1 - rank)
    rep = exchange_files(None, mine, [_name(rank), big], dest, [big, other], block_bytes=BLOCK)
    assert rep.local == [big]
    assert sorted(rep.received) == sorted([big, other])
    assert rep.sent == [(_name(rank), 1 - rank)]
    assert rep.bytes_sent == SIZES[rank] and rep.bytes_received == SIZES[1 - rank]
    for n in (big, other):
        assert _same(root, dest, n)

    # only local: nothing on the wire anywhere; same src and dest dir: nothing to copy
    rep = exchange_files(None, mine, [big], mine, [big], block_bytes=BLOCK)
    assert rep == TransferReport([big], [], 0, 0, [big])

    # rank 0's reads fail after the first block: both ranks raise, the schedule still
    # completes (rank 1's file reaches rank 0), and no partial file is left behind
    dest2 = os.path.join(root, "dest2", f"rank{rank}")
    if rank == 0:
        real, calls = peer._read_full, [0]

        def flaky(f, view):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(5, "Input/output error")
            return real(f, view)

        peer._read_full = flaky
        avail, want = [big], [_name(3)]
        shutil.copy(os.path.join(root, "orig", _name(3)), os.path.join(root, "local", "rank1"))
    else:
        avail, want = [_name(3)], [big]
    dist.barrier()
    with pytest.raises(PeerTransferError, match="Input/output error" if rank == 0 else "failed while reading"):
        exchange_files(None, mine, avail, dest2, want, block_bytes=BLOCK)
    if rank == 0:
        peer._read_full = real
        assert _same(root, dest2, _name(3))
    else:
        assert os.listdir(dest2) == []


@pytest.mark.multiproc
def test_local_copy_and_provider_failure(tmp_path) -> None:
    _make_originals(str(tmp_path))
    run_ranks(2, _local_and_failure, str(tmp_path))


# --- no process group ---------------------------------------------------------


def test_single_process(tmp_path) -> None:
    assert not dist.is_initialized()
    _make_originals(str(tmp_path))
    src, dest = str(tmp_path / "local" / "rank2"), str(tmp_path / "copy")
    rep = exchange_files(None, src, [_name(2)], dest, [_name(2)], block_bytes=BLOCK)
    assert rep == TransferReport([_name(2)], [], 0, 0, [_name(2)])
    assert _same(str(tmp_path), dest, _name(2)) and os.listdir(dest) == [_name(2)]
    # same directory: already in place
    assert exchange_files(None, src, [_name(2)], src, [_name(2)]).received == [_name(2)]
    # offered but not there, or not offered: nobody has it
    with pytest.raises(PeerTransferError, match=r"'x\.bin' \(wanted by rank 0\)"):
        exchange_files(None, src, ["x.bin"], dest, ["x.bin"])
    with pytest.raises(PeerTransferError, match="__2_0.distcp"):
        exchange_files(None, src, [], dest, [_name(2)])
    for bad in ("/abs", "a/b", "..", ""):
        with pytest.raises(InvalidArgumentError, match="invalid file name"):
            exchange_files(None, src, [_name(2)], dest, [bad])
    # nothing wanted, nothing offered: a no-op
    assert exchange_files(None, None, [], None, []) == TransferReport([], [], 0, 0, [])


def test_clean_partials(tmp_path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for n in (".__0_0.distcp.0123456789abcdef.part", ".hidden", "x.part", "__0_0.distcp"):
        (d / n).write_bytes(b"x")
    assert clean_partials(str(d)) == [".__0_0.distcp.0123456789abcdef.part"]
    assert sorted(os.listdir(d)) == [".hidden", "__0_0.distcp", "x.part"]
    assert clean_partials(str(tmp_path / "missing")) == []


def test_single_process_bad_arguments_and_local_failures(tmp_path) -> None:
    _make_originals(str(tmp_path))
    src, name = str(tmp_path / "local" / "rank1"), _name(1)
    with pytest.raises(InvalidArgumentError, match="block_bytes must be positive, got 0"):
        exchange_files(None, src, [name], src, [name], block_bytes=0)
    with pytest.raises(InvalidArgumentError, match=r"rank 0: files offered as available but src_dir is None"):
        exchange_files(None, None, [name], None, [])
    with pytest.raises(InvalidArgumentError, match=r"rank 0: files wanted but dest_dir is None"):
        exchange_files(None, src, [name], None, [name])

    # the destination's final name is a directory: the copy fails, its .part file is removed
    dest = tmp_path / "dest"
    (dest / name / "sub").mkdir(parents=True)
    with pytest.raises(PeerTransferError, match=rf"rank 0: copying '{name}' locally: .*Is a directory"):
        exchange_files(None, src, [name], str(dest), [name])
    assert sorted(os.listdir(dest)) == [name] and os.path.isdir(dest / name)

    # dest_dir cannot be created (a file is in its way): both failures are reported
    blocked = tmp_path / "file"
    blocked.write_bytes(b"x")
    with pytest.raises(PeerTransferError) as ei:
        exchange_files(None, src, [name], str(blocked / "d"), [name])
    msg = str(ei.value)
    assert msg.startswith(f"rank 0: {blocked / 'd'}: ") and "Not a directory" in msg, msg
    assert f"copying '{name}' locally: " in msg, msg


# --- a file that changed after it was offered, a receiver that cannot write, a non-member ---


def _sender_and_receiver_failures(rank: int, world: int, root: str) -> None:
    mine = os.path.join(root, "local", f"rank{rank}")
    dest = os.path.join(root, "dest", f"rank{rank}")
    os.makedirs(dest)
    fresh, stale = _name(2), _name(1)  # rank 1 holds both: 3 MiB + 12345 bytes, and 1 byte

    # rank 1 offers `link`, a symlink to its dest/<fresh> (1 byte when offered), and replaces
    # that file by a local copy of <fresh> before it sends `link`: the size changed in between
    if rank == 1:
        shutil.copy(os.path.join(root, "orig", fresh), mine)
        shutil.copy(os.path.join(root, "orig", stale), os.path.join(dest, fresh))
        os.symlink(os.path.join(dest, fresh), os.path.join(mine, "link"))
        avail, want = [fresh, "link"], [fresh]
    else:
        avail, want = [], ["link"]
    dist.barrier()
    with pytest.raises(PeerTransferError) as ei:
        exchange_files(None, mine, avail, dest, want, block_bytes=BLOCK)
    if rank == 1:
        expected = (
            f"rank 1: sending 'link' to rank 0: {mine}/link: size changed from "
            f"{SIZES[1]} to {SIZES[2]} bytes"
        )
        assert str(ei.value) == expected
        assert _same(root, dest, fresh)  # the local copy before it was done
    else:
        assert str(ei.value) == "rank 0: receiving 'link' from rank 1: rank 1 could not read 'link' it offered"
        assert os.listdir(dest) == []

    # rank 0 cannot write: its dest/<name> is a non-empty directory (the rename fails), then
    # its dest_dir cannot be created; the sender completes, only the receiver raises
    name = _name(1)
    if rank == 0:
        os.makedirs(os.path.join(dest, name, "sub"))
        blocked = os.path.join(root, "blocked")
        with open(blocked, "wb"):
            pass
        for d, why in ((dest, rf"{dest}/{name}: .*Is a directory"), (os.path.join(blocked, "d"), "cannot create a file for")):
            with pytest.raises(PeerTransferError, match=rf"rank 0: .*receiving '{name}' from rank 1: .*{why}"):
                exchange_files(None, mine, [], d, [name], block_bytes=BLOCK)
        assert sorted(os.listdir(dest)) == [name] and os.path.isdir(os.path.join(dest, name))
    else:
        for _ in range(2):
            rep = exchange_files(None, mine, [name], dest, [], block_bytes=BLOCK)
            assert rep.sent == [(name, 0)] and rep.bytes_sent == SIZES[1]

    # a process outside the group is refused (new_group is collective: every rank calls it)
    only0 = dist.new_group([0])
    if rank == 1:
        with pytest.raises(InvalidArgumentError, match="this process is not a member of the given group"):
            exchange_files(only0, mine, [], dest, [])


@pytest.mark.multiproc
def test_sender_and_receiver_failures(tmp_path) -> None:
    _make_originals(str(tmp_path))
    run_ranks(2, _sender_and_receiver_failures, str(tmp_path))
