"""Placement digests: a load proves it put every element where the save found it.

The digest's definition is checked against a slow reference written from docs/format.md; then
a model + AdamW state saved FSDP2 ``Shard(0)`` on 4 gloo ranks (with ``placement_digests``) is
loaded with ``verify_placement`` into FSDP2, HSDP (replicas), FSDP+TP (strided shards), every
2-D tensor ``Shard(1)`` and plain tensors on every rank: all pass, bit-exact. Wrong placements
fail on every rank naming the tensor: two chunks swapped by a planner that changes read items'
destination offsets, elements swapped in the destination after the reads, a rank's loaded
shard changed before ``Checkpoint.verify_loaded``. A checkpoint without digests says so.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cli_utils import run_cli
from dist_utils import run_ranks
from layouts import build, check_against, columns_target, full_reference, scramble, train_state, train_step
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem

from ucp_dcp import (
    ReadOptions,
    Checkpoint,
    Piece,
    PlacementError,
    TensorPieces,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
)
from ucp_dcp.core.placement_digest import K, M1, M2, MASK64, box_share, combine, digest_hex
from ucp_dcp.dcp.placement import PlacementReport
from ucp_dcp.errors import CheckpointFormatError, unwrap
from ucp_dcp.format import index_digest

WORLD = 4
WATCHDOG_S = 300
BAD = "model.blocks.0.up.weight"  # 50 x 20: four FSDP chunks of 13, 13, 12, 12 rows
# The default run loads HSDP (replicas), Shard(1) and plain tensors; UCP_PLACEMENT_ALL=1 adds
# FSDP2 Shard(0) and FSDP+TP (strided shards), a few seconds more (docs/format.md).
LAYOUTS = ("hsdp2x2", "columns", "plain") + (
    ("dp4", "dp2tp2") if os.environ.get("UCP_PLACEMENT_ALL") else ()
)


def _watchdog() -> None:
    """A rank stuck in a collective fails the test with every thread's stack."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)


# ---------------------------------------------------------------- the definition


def _reference(t: torch.Tensor) -> int:
    """docs/format.md's definition, one element at a time."""

    def fmix(x: int) -> int:
        x ^= x >> 33
        x = x * M1 & MASK64
        x ^= x >> 33
        x = x * M2 & MASK64
        return x ^ (x >> 33)

    raw = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    size, total = t.element_size(), 0
    for i in range(t.numel()):
        v = int.from_bytes(bytes(raw[i * size : (i + 1) * size]), "little")
        if size == 16:
            v = (v & MASK64) ^ ((v >> 64) * M2 & MASK64)
        total += fmix((i * K & MASK64) ^ v)
    return total & MASK64


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex128,
     torch.float8_e4m3fn, torch.uint8],
)
def test_digest_matches_the_definition_and_any_tiling(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 3, generator=g) * 9
    t = x > 0 if dtype == torch.bool else x.abs().to(dtype)
    whole = box_share(t, (0, 0, 0), t.shape)
    assert whole == _reference(t)
    tiles = [
        box_share(t[a:b, c:d], (a, c, 0), t.shape)
        for a, b in ((0, 2), (2, 5))
        for c, d in ((0, 3), (3, 7))
    ]
    assert combine(tiles) == whole
    swapped = t.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert box_share(swapped, (0, 0, 0), t.shape) != whole
    # the same box at another place of the tensor
    assert box_share(t[0:2], (1, 0, 0), t.shape) != box_share(t[0:2], (0, 0, 0), t.shape)


def test_a_scalar_an_empty_tensor_and_long_rows() -> None:
    assert box_share(torch.tensor(2.5), (), ()) == _reference(torch.tensor([2.5]))
    assert box_share(torch.empty(0, 4), (0, 0), (0, 4)) == 0
    # longer than a hashing block (64 Ki elements): rows split into column blocks
    t = torch.arange(150_000, dtype=torch.int32)
    parts = box_share(t[:70_001], (0,), t.shape) + box_share(t[70_001:], (70_001,), t.shape)
    assert box_share(t, (0,), t.shape) == parts & MASK64


# ---------------------------------------------------------------- one process


def _small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 6, generator=g), "n": torch.arange(10), "step": 3}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(8, 6), "n": torch.zeros(10, dtype=torch.int64), "step": 0}


class _SwapRowsAfterRead(UCPLoadPlanner):
    """Puts two rows of ``w`` in each other's place once their read is done."""

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if read_item.dest_index.fqn == "w":
            tensor[[0, 1]] = tensor[[1, 0]]


def test_one_process_save_load_and_a_wrong_placement(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    state = _small_state()
    dcp.save(state, storage_writer=UCPStorageWriter(ckpt, placement_digests=True),
             planner=UCPSavePlanner())
    doc = json.loads((tmp_path / "ckpt" / "ucp_index.json").read_bytes())
    recorded = {k: t["placement_digest"] for k, t in doc["tensors"].items()}
    assert recorded == {
        "w": digest_hex(_reference(state["w"])), "n": digest_hex(_reference(state["n"]))
    }
    target = _blank()
    reader = UCPStorageReader(ckpt, options=ReadOptions(verify_placement=True))
    dcp.load(target, storage_reader=reader, planner=UCPLoadPlanner())
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["n"], state["n"])
    assert reader.last_load.placement is not None
    assert reader.last_load.placement.checked == ("n", "w")
    assert reader.last_load.placement.copies == {"n": 1, "w": 1}

    with pytest.raises(CheckpointException) as ei:
        dcp.load(_blank(), storage_reader=UCPStorageReader(ckpt, options=ReadOptions(verify_placement=True)),
                 planner=_SwapRowsAfterRead())
    err = unwrap(ei.value)
    assert isinstance(err, PlacementError)
    swapped = state["w"].clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert str(err) == (
        f"{ckpt}: the load did not put every element where the save found it, 1 tensor(s): "
        f"'w': its 1 loaded copy hash to {digest_hex(_reference(swapped))}, the save recorded "
        f"{recorded['w']} (elements in the wrong places, or wrong values)"
    )

    # Checkpoint.verify_loaded: a loaded state, a changed one, a cast one.
    with Checkpoint(ckpt) as ck:
        assert ck.placement_digests == 2
        report = ck.verify_loaded(target)
        assert report.checked == ("n", "w")
        target["n"][3] += 1
        with pytest.raises(PlacementError, match=r"^.*1 tensor\(s\): 'n': its 1 loaded copy"):
            ck.verify_loaded(target)
        report = ck.verify_loaded({"w": target["w"].double(), "n": state["n"]})
        assert report.cast == ("w",) and report.checked == ("n",)
        assert ck.verify() == []



def test_partial_loads_pieces_and_tensors_without_a_digest(tmp_path: Path) -> None:
    """A load of part of the checkpoint checks what it loaded; a failed load raises its own
    error, not a placement one; pieces are placed by their offsets; a tensor held in part is
    named; a tensor the index records no digest for is listed as unchecked."""
    ckpt = tmp_path / "ckpt"
    state = _small_state()
    dcp.save(state, storage_writer=UCPStorageWriter(ckpt, placement_digests=True),
             planner=UCPSavePlanner())
    options = ReadOptions(verify_placement=True)

    only_w = {"w": torch.zeros(8, 6)}
    reader = UCPStorageReader(ckpt, options=options)
    dcp.load(only_w, storage_reader=reader, planner=UCPLoadPlanner())
    assert torch.equal(only_w["w"], state["w"])
    assert reader.last_load.placement == PlacementReport(checked=("w",), copies={"w": 1})

    # the reads fail (a data file cut short): that error, not a placement check's
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (data,) = broken.glob("*.safetensors")
    size = data.stat().st_size
    os.truncate(data, size - 8)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_blank(), storage_reader=UCPStorageReader(broken, options=options),
                 planner=UCPLoadPlanner())
    err = unwrap(ei.value)
    assert type(err) is CheckpointFormatError
    assert str(err) == f"{data}: truncated: entries need {size} bytes but the file has {size - 8}"

    with Checkpoint(ckpt) as ck:
        top, bottom = state["w"][:3].clone(), state["w"][3:].clone()
        pieces = TensorPieces([Piece("w", (8, 6), (0, 0), top), Piece("w", (8, 6), (3, 0), bottom)])
        assert ck.verify_loaded({"p": pieces}).checked == ("w",)
        with pytest.raises(PlacementError) as e2:
            ck.verify_loaded({"w": state["w"][:4]})
    assert str(e2.value) == (
        f"{ckpt}: the load did not put every element where the save found it, 1 tensor(s): "
        "'w': the ranks hold 24 of its elements in all, not a whole number of copies of its 48 "
        "(elements missing or held twice)"
    )

    path = ckpt / "ucp_index.json"
    doc = json.loads(path.read_bytes())
    del doc["tensors"]["n"]["placement_digest"], doc["digest"]
    doc["digest"] = index_digest(doc)
    path.write_text(json.dumps(doc))
    reader = UCPStorageReader(ckpt, options=options)
    dcp.load(_blank(), storage_reader=reader, planner=UCPLoadPlanner())
    assert reader.last_load.placement == PlacementReport(
        checked=("w",), copies={"w": 1}, no_digest=("n",)
    )


def test_without_digests_a_load_says_so_and_old_checkpoints_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(tmp_path / "ckpt")
    dcp.save(_small_state(), storage_writer=UCPStorageWriter(ckpt), planner=UCPSavePlanner())
    doc = json.loads((tmp_path / "ckpt" / "ucp_index.json").read_bytes())
    assert not any("placement_digest" in t for t in doc["tensors"].values())
    target = _blank()
    dcp.load(target, storage_reader=UCPStorageReader(ckpt), planner=UCPLoadPlanner())
    assert torch.equal(target["w"], _small_state()["w"])
    expected = (
        f"{ckpt} records no placement digests (saved without "
        "UCPStorageWriter(placement_digests=True), by an older ucp_dcp, or in another format): "
        "nothing to prove the load's placement against. Save with placement_digests=True, or "
        "load without verify_placement"
    )
    with pytest.raises(CheckpointException) as ei:
        dcp.load(_blank(), storage_reader=UCPStorageReader(ckpt, options=ReadOptions(verify_placement=True)),
                 planner=UCPLoadPlanner())
    assert isinstance(unwrap(ei.value), PlacementError) and str(unwrap(ei.value)) == expected
    with Checkpoint(ckpt) as ck, pytest.raises(PlacementError) as e2:
        ck.verify_loaded(target)
    assert str(e2.value) == expected
    rc, out, _ = run_cli(capsys, "verify", ckpt)
    assert rc == 0 and out.rstrip().endswith(
        "; no placement digests (loads cannot use verify_placement)"
    )


def test_verify_reports_a_digest_that_does_not_match_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save(_small_state(), storage_writer=UCPStorageWriter(ckpt, placement_digests=True),
             planner=UCPSavePlanner())
    rc, out, _ = run_cli(capsys, "verify", ckpt)
    assert rc == 0 and out.rstrip().endswith("; placement digests of 2 of 2 tensors match the data")
    # An index edited to record another digest, its own digest fixed: verify names the tensor.
    path = ckpt / "ucp_index.json"
    doc = json.loads(path.read_bytes())
    good = doc["tensors"]["w"]["placement_digest"]
    doc["tensors"]["w"]["placement_digest"] = "0123456789abcdef"
    del doc["digest"]
    doc["digest"] = index_digest(doc)
    path.write_text(json.dumps(doc))
    with Checkpoint(ckpt) as ck:
        assert ck.verify() == [
            f"{ckpt}: tensor 'w': placement digest mismatch (the index records "
            f"0123456789abcdef, the saved data hashes to {good})"
        ]



def test_verify_reports_damaged_data_once_not_as_a_digest_mismatch(tmp_path: Path) -> None:
    """A flipped byte in a tensor with a placement digest: verify names the file, tensor and
    chunk once, as a checksum mismatch; the tensor whose data cannot be read is not hashed again
    for its placement digest."""
    ckpt = tmp_path / "ckpt"
    dcp.save(_small_state(), storage_writer=UCPStorageWriter(ckpt, placement_digests=True),
             planner=UCPSavePlanner())
    with Checkpoint(ckpt) as ck:
        ((_, loc),) = ck.chunks("w")
        name, recorded = ck.index.files[loc.file].name, loc.xxh3
    with open(ckpt / name, "r+b") as f:
        f.seek(loc.start + 5)
        b = f.read(1)
        f.seek(loc.start + 5)
        f.write(bytes([b[0] ^ 1]))
    with Checkpoint(ckpt) as ck:
        (problem,) = ck.verify()
    assert problem.startswith(f"{ckpt / name}: tensor 'w' chunk at [0, 0]: checksum mismatch (recorded {recorded}, ")


# ---------------------------------------------------------------- real ranks


def _save(rank: int, world: int, root: str) -> None:
    model, optim = build("dp4")
    train_step(model, optim, 0)  # optimizer moments exist after a step
    state = train_state(model, optim)
    ref = full_reference(state)
    writer = UCPStorageWriter(root, placement_digests=True)
    dcp.save({**state, "step": 2}, storage_writer=writer, planner=UCPSavePlanner())
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref.pt"))



def _target(layout: str, ref: dict[str, Any]) -> Any:
    if layout == "columns":
        return columns_target(ref)
    model, optim = build(layout, seed=1)
    state = train_state(model, optim)
    scramble(state)
    return {**state, "step": 0}


class _SwapChunks(UCPLoadPlanner):
    """On rank 1 only: the first two read items of :data:`BAD` trade destination offsets (two
    saved chunks land in each other's place), as a planner with an offset bug would."""

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        if self.rank != 1:
            return plan
        items = list(plan.items)
        hits = [i for i, ri in enumerate(items) if ri.dest_index.fqn == BAD]
        a, b = hits[0], hits[1]
        items[a], items[b] = (
            dataclasses.replace(items[a], dest_offsets=items[b].dest_offsets),
            dataclasses.replace(items[b], dest_offsets=items[a].dest_offsets),
        )
        return dataclasses.replace(plan, items=items)


def _save_and_load(rank: int, world: int, root: str, out: str) -> None:
    _watchdog()
    _save(rank, world, root)
    dist.barrier()
    ref = torch.load(os.path.join(root, "ref.pt"))
    copies: dict[str, dict[str, int]] = {}
    for layout in LAYOUTS:
        state = _target(layout, ref)
        reader = UCPStorageReader(root, options=ReadOptions(verify_placement=True))
        dcp.load(state, storage_reader=reader, planner=UCPLoadPlanner())
        check_against({k: v for k, v in state.items() if k != "step"},
                      {k: v for k, v in ref.items()}, f"rank {rank}: {layout}")
        report = reader.last_load.placement
        assert report is not None
        assert set(report.checked) == {k for k, v in ref.items() if isinstance(v, torch.Tensor)}
        copies[layout] = report.copies
        if layout == "hsdp2x2":
            hsdp = state

    # A planner that swaps two chunks (on rank 1 only): every rank fails, naming the tensor.
    state = _target("plain", ref)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(state, storage_reader=UCPStorageReader(root, options=ReadOptions(verify_placement=True)),
                 planner=_SwapChunks())
    err = unwrap(ei.value)
    assert isinstance(err, PlacementError), err
    assert str(err).startswith(
        f"{root}: the load did not put every element where the save found it, 1 tensor(s): "
        f"'{BAD}': its 4 loaded copies hash to "
    ), err

    # The loaded HSDP state, its rank-3 shard changed afterwards: verify_loaded fails on all.
    state = hsdp
    with Checkpoint(root) as ck:
        assert ck.verify_loaded(state).copies[BAD] == 2
        if rank == 3:
            local = state["model"][BAD.removeprefix("model.")].to_local()
            local[[0, 1]] = local[[1, 0]]
        with pytest.raises(PlacementError) as e2:
            ck.verify_loaded(state)
    assert f"1 tensor(s): '{BAD}': its 2 loaded copies hash to " in str(e2.value)
    if rank == 0:
        torch.save(copies, out)


def test_loads_into_every_layout_prove_themselves_and_wrong_ones_fail(
    tmp_path: Path,
) -> None:
    """One spawn saves, one loads every case (see the module docstring)."""
    root = str(tmp_path / "ckpt")
    out = str(tmp_path / "copies.pt")
    run_ranks(WORLD, _save_and_load, root, out)
    copies = torch.load(out)
    assert copies["columns"][BAD] == 1 and copies["columns"]["model.blocks.0.up.bias"] == 4
    assert copies["hsdp2x2"][BAD] == 2 and copies["plain"][BAD] == 4
    if "dp2tp2" in copies:
        assert copies["dp2tp2"][BAD] == 1


def test_a_malformed_digest_in_the_index_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save(_small_state(), storage_writer=UCPStorageWriter(ckpt, placement_digests=True),
             planner=UCPSavePlanner())
    path = ckpt / "ucp_index.json"
    doc = json.loads(path.read_bytes())
    doc["tensors"]["w"]["placement_digest"] = "not hex"
    del doc["digest"]
    doc["digest"] = index_digest(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointFormatError) as ei:
        Checkpoint(ckpt)
    assert str(ei.value) == (
        f"{path}: tensor 'w': field 'placement_digest' must be a 64-bit placement digest "
        "(16 hex digits), got 'not hex'"
    )
