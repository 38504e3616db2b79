"""Read-once loads with real ranks (gloo): each needed byte read from storage by one rank.

A model + AdamW state saved FSDP2 ``Shard(0)`` on 4 ranks is loaded into
targets whose ranks overlap: replicated (every rank the whole state),
HSDP (2 replicas x 2 shards) and every 2-D tensor ``Shard(1)`` (pieces of
rows, narrower than a checksum block). Every loaded shard is compared bit
for bit with the saved full tensors; the bytes the ranks read from storage,
summed, must be the unique bytes the job needs, while without read-once
they are a multiple of it.
"""

from __future__ import annotations

import faulthandler
import math
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_utils import bit_equal, run_ranks
from layouts import build, check_against, columns_target, full_reference, scramble, train_state, train_step
from torch.distributed.checkpoint.api import CheckpointException

from ucp_dcp import ReadOptions, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.dcp import read_once as read_once_module
from ucp_dcp.dcp import reader as reader_module
from ucp_dcp.errors import (
    CheckpointFormatError,
    ChecksumError,
    ReadOnceError,
    StorageError,
    UnsupportedValueError,
    unwrap,
)
from ucp_dcp.sources import open_source

pytestmark = pytest.mark.multiproc

WORLD = 4
WATCHDOG_S = 300


def _save(rank: int, world: int, root: str) -> None:
    model, optim = build("dp4")
    for step in range(2):
        train_step(model, optim, step)
    state = train_state(model, optim)
    ref = full_reference(state)
    dcp.save({**state, "step": 2}, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner())
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))



def _cast(ref: dict[str, Any]) -> dict[str, Any]:
    """The reference with every floating-point tensor in bfloat16 (what a cast load gives)."""
    return {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in ref.items()
    }


def _target(layout: str, ref: dict[str, Any]) -> dict[str, Any]:
    if layout == "columns":
        return columns_target(ref)
    if layout == "bf16":  # every rank the whole state, cast on load (the generic sink)
        return {
            k: torch.full_like(v, 13) if isinstance(v, torch.Tensor) else v
            for k, v in _cast(ref).items()
        }
    model, optim = build(layout, seed=1)
    state = train_state(model, optim)
    scramble(state)
    return state


def _watchdog() -> None:
    """A rank stuck in a collective fails the test with every thread's stack, not the suite's
    timeout."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


CASES = [
    ("plain", None),
    ("hsdp2x2", None),
    ("columns", None),
    ("bf16", None),
    ("plain", 16 << 10),
    ("columns", 5000),
]
"""Targets and round sizes (None: the default): small rounds (16 KiB, 5000 bytes) make many rounds
in flight and cut checksum blocks between rounds."""


def _load(rank: int, world: int, root: str, out: str) -> None:
    """Every case of CASES, with and without read-once, checked bit for bit; the counters of
    every rank saved to ``out``."""
    _watchdog()
    ref = torch.load(os.path.join(root, "ref.pt"))
    counts: dict[str, Any] = {}
    # Which of this rank's gathers to the coordinator carried its needs (replicas send theirs
    # once: only the lowest rank with the same needs does).
    carried: list[bool] = []
    gather = read_once_module.dist.gather_object

    def recording_gather(obj: Any, *args: Any, **kwargs: Any) -> Any:
        carried.append(obj is not None)
        return gather(obj, *args, **kwargs)

    read_once_module.dist = types.SimpleNamespace(
        **{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")}
    )
    read_once_module.dist.gather_object = recording_gather
    for layout, round_bytes in CASES:
        reader_module._ROUND_BYTES = round_bytes
        for once in (False, True):
            carried.clear()
            sd = _target(layout, ref)
            reader = UCPStorageReader(root, options=ReadOptions(read_once=once))
            dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
            what = f"rank {rank}: {layout}, read_once={once}"
            if layout == "bf16":
                want = _cast(ref)
                assert all(bit_equal(sd[k], want[k]) for k in want if torch.is_tensor(want[k])), (
                    what
                )
            else:
                flat = sd if layout == "columns" else {"model": sd["model"], "optim": sd["optim"]}
                check_against(flat, ref, what)
            totals = reader.last_load.exchange
            decision = reader.last_load.read_once
            counts[f"{layout}/{round_bytes}/{once}"] = {
                "rounds": None if decision is None else decision.rounds,
                "requested": reader.last_load.bytes_requested,
                "exchanged": None if totals is None else totals.read,
                "received": None if totals is None else totals.received,
                "exchange": decision is not None and decision.exchange,
                "unique": None if decision is None else decision.unique_bytes,
                "groups": None if decision is None else decision.groups,
                "sent_needs": list(carried),
            }
    reader_module._ROUND_BYTES = None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, counts)
    if rank == 0:
        torch.save(gathered, out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("read_once") / "ckpt")
    run_ranks(WORLD, _save, root)
    return root


@pytest.fixture(scope="module")
def loaded(saved: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's counters for every case (one spawn of the ranks for all of them)."""
    out = str(tmp_path_factory.mktemp("read_once_counts") / "counts.pt")
    run_ranks(WORLD, _load, saved, out)
    return torch.load(out)


@pytest.mark.parametrize("layout,round_bytes", CASES)
def test_read_once_loads_bit_exact_and_reads_each_byte_once(
    loaded: list[dict[str, Any]], layout: str, round_bytes: int | None
) -> None:
    """Bit-exact on every rank (checked in the ranks), and the job's reads from storage are the
    unique bytes it needs."""
    ranks = loaded
    once = [r[f"{layout}/{round_bytes}/True"] for r in ranks]
    direct = [r[f"{layout}/{round_bytes}/False"] for r in ranks]
    assert all(c["exchange"] for c in once)
    assert not any(c["exchange"] for c in direct)
    unique = once[0]["unique"]
    assert all(c["unique"] == unique for c in once)
    read_once = sum(c["exchanged"] for c in once)
    assert read_once == unique  # every needed byte left storage once
    # Ranks with the same needs are one group of the plan: all 4 when replicated, the 2 replica
    # pairs of HSDP; for columns the needs, rounded out to whole 4 KiB checksum blocks, of ranks
    # 0-2 come out equal here (small tensors: a block holds several ranks' pieces), and rank 3's
    # differ (torch.chunk leaves it no column of the 5-column tensor ``tiny``).
    groups = {"plain": 1, "bf16": 1, "hsdp2x2": 2, "columns": 2}[layout]
    assert [c["groups"] for c in once] == [groups] * WORLD
    # One gather per load, and only the lowest rank of each group put its needs in it: rank 0
    # when replicated; ranks 0 and 1 for HSDP (replica pairs 0-2 and 1-3); 0 and 3 for columns.
    senders = {"plain": [0], "bf16": [0], "hsdp2x2": [0, 1], "columns": [0, 3]}[layout]
    assert [c["sent_needs"] for c in once] == [[r in senders] for r in range(WORLD)]
    assert all(c["sent_needs"] == [] for c in direct)
    if round_bytes is not None:
        assert once[0]["rounds"] > 4
    read_direct = sum(c["requested"] for c in direct)
    assert read_direct >= 1.9 * unique  # without it, replicas read the same bytes again


def _corrupt_copy(saved: str, dest: str) -> str:
    """A copy of the checkpoint with one byte flipped in the middle of its largest chunk; the path
    of the data file holding it."""
    shutil.copytree(saved, dest)
    src = open_source(dest)
    fqn = max(src.index.tensors, key=lambda k: math.prod(src.index.tensors[k].shape))
    loc = src.locate(fqn, 0)
    path = src.paths[loc.file]
    with open(path, "r+b") as f:
        f.seek(loc.start + loc.nbytes // 2)
        b = f.read(1)
        f.seek(loc.start + loc.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    return path


def _corrupt_first_byte(saved: str, dest: str) -> None:
    """A copy of the checkpoint with the first byte of its first tensor's data flipped."""
    shutil.copytree(saved, dest)
    src = open_source(dest)
    loc = src.locate(next(iter(src.index.tensors)), 0)
    with open(src.paths[loc.file], "r+b") as f:
        f.seek(loc.start)
        b = f.read(1)
        f.seek(loc.start)
        f.write(bytes([b[0] ^ 0x40]))


def _load_fails(rank: int, world: int, corrupt: str, path: str, root: str) -> None:
    """A flipped byte in ``corrupt``'s file ``path``, then a rank (2) whose reads fail: every rank
    raises, none hangs."""
    _watchdog()
    for where, fail_rank in ((corrupt, None), (root, 2)):
        ref = torch.load(os.path.join(root, "ref.pt"))
        sd = _target("plain", ref)
        reader = UCPStorageReader(where, options=ReadOptions(read_once=True))
        if fail_rank == rank:  # this rank's storage fails mid-read

            def broken(segments: Any) -> None:
                raise StorageError(f"data: injected read failure on rank {rank}")

            def exchange(self: Any, src: Any, source: Any, *a: Any) -> Any:
                source.read = broken
                return UCPStorageReader._exchange(self, src, source, *a)

            reader._exchange = types.MethodType(exchange, reader)  # type: ignore[method-assign]
        with pytest.raises(CheckpointException) as ei:
            dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
        err = unwrap(ei.value)
        if fail_rank is None:
            assert isinstance(err, ChecksumError), err
            assert err.path == path and "read by rank" in err.what, err
        else:
            assert isinstance(err, StorageError) and f"on rank {fail_rank}" in str(err), err


def test_a_flipped_byte_or_a_failing_rank_fails_every_rank_without_hanging(
    saved: str, tmp_path: Path
) -> None:
    """One spawn: a checksum mismatch found by the receivers fails every rank with the
    ChecksumError naming the file and the reading rank; then rank 2's reads fail and every rank
    raises rank 2's StorageError."""
    corrupt = str(tmp_path / "ckpt")
    path = _corrupt_copy(saved, corrupt)
    run_ranks(WORLD, _load_fails, corrupt, path, saved)


def _one_rank_cannot_plan(
    rank: int, world: int, good: str, broken: str, corrupt: str, other: str, copy: str
) -> None:
    """Rank 1 loads a copy whose data file is cut short, then into an expanded view: each time it
    fails before it can say what it needs, raises its own error, and rank 0 raises a
    ReadOnceError naming rank 1."""
    _watchdog()
    sd = {"w": torch.zeros(64, 32)}
    reader = UCPStorageReader(broken if rank == 1 else good, options=ReadOptions(read_once=True))
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    assert sorted(ei.value.failures) == [0, 1]
    err = ei.value.failures[rank][0]  # this rank's own (unwrap gives the lowest rank's)
    (data,) = Path(broken).glob("*.safetensors")
    own = f"{data}: truncated: entries need {data.stat().st_size + 8} bytes but the file has {data.stat().st_size}"
    if rank == 1:
        assert type(err) is CheckpointFormatError and str(err) == own, repr(err)
    else:
        assert type(err) is ReadOnceError, repr(err)
        assert str(err) == f"rank 1 could not take part in the read-once load: CheckpointFormatError: {own}"

    # rank 1's target is an expanded view, refused while it lists what it needs: the same
    sd = {"w": torch.zeros(1, 32).expand(64, 32) if rank == 1 else torch.zeros(64, 32)}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=UCPStorageReader(good, options=ReadOptions(read_once=True)),
                 planner=UCPLoadPlanner())
    assert sorted(ei.value.failures) == [0, 1]
    err = ei.value.failures[rank][0]
    own = (
        "'w': the state dict's tensor is an expanded or overlapping view (shape [64, 32], strides "
        "[0, 1]): several of its elements are one place in memory, so no load can give each its "
        "own value; load into a tensor of its own (.clone() it)"
    )
    if rank == 1:
        assert type(err) is UnsupportedValueError and str(err) == own, repr(err)
    else:
        assert type(err) is ReadOnceError, repr(err)
        assert str(err) == f"rank 1 could not take part in the read-once load: UnsupportedValueError: {own}"

    # a flipped byte in the first of many small rounds: every rank stops after the round that
    # told it, and raises the ChecksumError naming the file and the rank that read the bytes
    reader_module._ROUND_BYTES = 2048
    try:
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"w": torch.zeros(64, 32)}, planner=UCPLoadPlanner(),
                     storage_reader=UCPStorageReader(corrupt, options=ReadOptions(read_once=True)))
    finally:
        reader_module._ROUND_BYTES = None
    err = ei.value.failures[rank][0]
    (data,) = Path(corrupt).glob("*.safetensors")
    assert isinstance(err, ChecksumError) and err.path == str(data) and "read by rank" in err.what, repr(err)

    # rank 1 loads another checkpoint (same tensor, other values): refused on every rank, naming
    # both paths; before, its bytes came from rank 0's checkpoint (silently with verify=False)
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"w": torch.zeros(64, 32)}, planner=UCPLoadPlanner(), storage_reader=UCPStorageReader(
            other if rank == 1 else good, options=ReadOptions(read_once=True, verify=False)))
    assert sorted(ei.value.failures) == [0, 1]
    err = ei.value.failures[rank][0]
    assert type(err) is ReadOnceError and str(err) == (
        f"rank 1 loads another checkpoint than rank 0: {other} holds other files than {good}; a "
        "read-once load exchanges the bytes of one checkpoint between its ranks (load each "
        "checkpoint with read_once=False, or the same one everywhere)"
    ), repr(err)
    # a copy of the same checkpoint at another path (a node's local copy) is one checkpoint
    sd = {"w": torch.zeros(64, 32)}
    reader = UCPStorageReader(copy if rank == 1 else good, options=ReadOptions(read_once=True))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.last_load.read_once is not None and reader.last_load.read_once.exchange
    assert bit_equal(sd["w"], torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_rank_that_fails_before_its_needs_are_known_fails_the_others_naming_it(tmp_path: Path) -> None:
    good, broken = str(tmp_path / "good"), str(tmp_path / "broken")
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    dcp.save({"w": full}, storage_writer=UCPStorageWriter(good), planner=UCPSavePlanner())
    shutil.copytree(good, broken)
    (data,) = Path(broken).glob("*.safetensors")
    os.truncate(data, data.stat().st_size - 8)
    corrupt = str(tmp_path / "corrupt")
    _corrupt_first_byte(good, corrupt)
    other, copy = str(tmp_path / "other"), str(tmp_path / "copy")
    dcp.save({"w": full + 1}, storage_writer=UCPStorageWriter(other), planner=UCPSavePlanner())
    shutil.copytree(good, copy)
    run_ranks(2, _one_rank_cannot_plan, good, broken, corrupt, other, copy)
