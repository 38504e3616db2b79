"""Flat-range shards: the arithmetic, random partitions, and ZeRO-style state <-> FSDP2 with real ranks."""

from __future__ import annotations

import math
import os
import re
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from dist_utils import bit_equal, run_ranks
from layouts import build, check_against, full_reference, scramble, train_state, train_step
from ucp_dcp import (
    ReadOptions,
    FlatParam,
    FlatShard,
    Piece,
    TensorPieces,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    flat_partition,
    pack_flat,
)
from ucp_dcp.core.boxes import row_major_strides
from ucp_dcp.core.sharding import flat_range_boxes
from ucp_dcp.errors import InvalidArgumentError, LayoutError

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


# ------------------------------------------------------------------ arithmetic


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_flat_range_boxes_tile_the_range_in_order(data: st.DataObject) -> None:
    shape = data.draw(shapes)
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_range_boxes(shape, start, stop)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    strides = row_major_strides(shape)
    ref = torch.arange(total).reshape(shape) if shape else torch.tensor(0)
    pos = start
    for b in boxes:
        assert b.numel > 0
        # Each box is the contiguous flat range that follows the previous one.
        got = ref[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))].reshape(-1)
        assert got.tolist() == list(range(pos, pos + b.numel))
        assert sum(o * s for o, s in zip(b.offsets, strides)) == pos
        pos += b.numel
    assert pos == stop


def test_flat_range_boxes_rejects_out_of_range() -> None:
    with pytest.raises(LayoutError, match=r"flat range \[3, 13\) is outside a tensor of shape \[3, 4\] \(12 elements\)"):
        flat_range_boxes((3, 4), 3, 13)


def test_pack_flat_aligns_and_partition_pads() -> None:
    params, total = pack_flat([("a", (3, 5)), ("b", (4,)), ("c", ())], align=8)
    assert [(p.offset, p.end) for p in params] == [(0, 15), (16, 20), (24, 25)]
    assert total == 32
    assert [flat_partition(total, 3, r) for r in range(3)] == [(0, 11), (11, 22), (22, 33)]


def test_flat_shard_views_share_memory_and_padding_is_fill() -> None:
    params, total = pack_flat([("a", (3, 5)), ("b", (4,))], align=8)
    buf = torch.arange(total, dtype=torch.float32)
    shard = FlatShard(buf[6:18], params, 6, prefix="m.", suffix=".x")
    assert [(p.fqn, p.offsets, tuple(p.data.shape)) for p in shard.pieces] == [
        ("m.a.x", (1, 1), (1, 4)), ("m.a.x", (2, 0), (1, 5)), ("m.b.x", (0,), (2,)),
    ]
    shard.pieces[0].data.fill_(-1)
    assert buf[6:10].tolist() == [-1.0] * 4
    assert [f.tolist() for f in shard.fill] == [[15.0]]


def test_flat_shard_errors() -> None:
    with pytest.raises(LayoutError, match=r"flat parameters 'a' \[0, 6\) and 'b' \[4, 8\) overlap"):
        FlatShard(torch.zeros(8), [FlatParam("a", (2, 3), 0), FlatParam("b", (4,), 4)], 0)
    with pytest.raises(InvalidArgumentError, match="the local slice must be contiguous"):
        FlatShard(torch.zeros(4, 4).t(), [FlatParam("a", (16,), 0)], 0)
    with pytest.raises(LayoutError, match=r"piece of 'x': a box of size \[2\] at offsets \[3\] does not fit"):
        Piece("x", (4,), (3,), torch.zeros(2))
    with pytest.raises(LayoutError, match=r"two pieces of 'x' start at offsets \[0\]"):
        TensorPieces([Piece("x", (4,), (0,), torch.zeros(2)), Piece("x", (4,), (0,), torch.zeros(1))])
    with pytest.raises(LayoutError, match=re.escape(
            "piece of 'x': global shape [4, 2], offsets [0] and data shape [2] must have the same number of dimensions")):
        Piece("x", (4, 2), (0,), torch.zeros(2))
    with pytest.raises(LayoutError, match=re.escape(
            "TensorPieces(opt): pieces of 'x' disagree on shape/dtype: [4] torch.float32 and [4] torch.float16")):
        TensorPieces([Piece("x", (4,), (0,), torch.zeros(2)), Piece("x", (4,), (2,), torch.zeros(2, dtype=torch.float16))],
                     source="opt")


def test_tensor_pieces_size_and_repr() -> None:
    pieces = [Piece(f"p{k}", (4, 3), (0, 0), torch.zeros(2, 3, dtype=torch.float16)) for k in range(5)]
    assert TensorPieces(pieces[:2], source="zero").nbytes == 2 * 12
    assert repr(TensorPieces(pieces[:2], source="zero")) == "TensorPieces(zero)[2 piece(s) of p0, p1]"
    assert repr(TensorPieces(pieces)) == "TensorPieces[5 piece(s) of p0, p1, p2, p3, ...]"



def test_flat_layout_arguments_out_of_range() -> None:
    """A negative offset or dimension, an alignment below 1, a rank outside the world: each an
    InvalidArgumentError naming the value."""
    with pytest.raises(InvalidArgumentError, match=r"^flat parameter 'a': negative offset -1 or shape \[2\]$"):
        FlatParam("a", (2,), -1)
    with pytest.raises(InvalidArgumentError, match=r"^flat parameter 'b': negative offset 0 or shape \[2, -3\]$"):
        FlatParam("b", (2, -3), 0)
    with pytest.raises(InvalidArgumentError, match=r"^align must be >= 1, got 0$"):
        pack_flat([("a", (2,))], align=0)
    with pytest.raises(InvalidArgumentError, match=r"^rank 4 is outside world size 4$"):
        flat_partition(10, 4, 4)


# --------------------------------------------- random partitions, one process


def _save_nodist(sd: dict[str, Any], path: str) -> None:
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner(), no_dist=True)


def _load_nodist(sd: dict[str, Any], path: str, **reader_kw: Any) -> UCPStorageReader:
    reader = UCPStorageReader(path, options=ReadOptions(**reader_kw))
    dcp.load(sd, storage_reader=reader, planner=UCPLoadPlanner(), no_dist=True)
    return reader


def _cuts(data: st.DataObject, total: int) -> list[tuple[int, int]]:
    """A random partition of [0, total) into contiguous ranges (some empty)."""
    points = sorted(data.draw(st.lists(st.integers(0, total), max_size=5)))
    bounds = [0, *points, total]
    return list(zip(bounds, bounds[1:]))


@given(st.data())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_random_flat_partitions_round_trip_through_boxes(data: st.DataObject) -> None:
    """flat (partition A) -> checkpoint -> full tensors (boxes) and flat (partition B), bit-exact."""
    n = data.draw(st.integers(1, 4))
    named = [(f"p{i}", data.draw(st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple))) for i in range(n)]
    align = data.draw(st.sampled_from([1, 2, 4, 16]))
    params, total = pack_flat(named, align=align)
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    full = {f: (torch.randn(s) * 100).to(dtype) for f, s in named}
    src = torch.zeros(total, dtype=dtype)
    for p in params:
        src[p.offset : p.end] = full[p.fqn].reshape(-1)
    with tempfile.TemporaryDirectory() as d:
        _save_nodist({f"r{i}": FlatShard(src[a:b], params, a, prefix="m.") for i, (a, b) in enumerate(_cuts(data, total))}, d)
        boxes = {"m": {f: torch.full(s, 7).to(dtype) for f, s in named}}
        _load_nodist(boxes, d, verify=True)
        for f in full:
            assert bit_equal(boxes["m"][f], full[f]), f
        dst = torch.full((total,), 7).to(dtype)
        cuts = _cuts(data, total)
        # gap_bytes=0: no coalescing of near ranges, so the count is exact. verify=False: a
        # verified load (the default) reads the whole checksummed blocks its reads touch.
        reader = _load_nodist(
            {f"r{i}": FlatShard(dst[a:b], params, a, prefix="m.") for i, (a, b) in enumerate(cuts)}, d, gap_bytes=0,
            verify=False,
        )
        assert bit_equal(dst, src)  # padding zeroed, parameters exact
        # Exactly the parameters' bytes are read: nothing for padding, nothing twice.
        assert reader.last_load.bytes_requested == sum(p.numel for p in params) * dst.element_size()


# ----------------------------------------------- ZeRO-style AdamW <-> FSDP2


ALIGN = 8  # elements; with world 4 the rank boundaries cut through rows of several parameters


def _zero_layout(model: torch.nn.Module) -> tuple[list[FlatParam], int]:
    return pack_flat([(n, tuple(p.shape)) for n, p in model.named_parameters()], align=ALIGN)


def _zero_state(model: torch.nn.Module, osd_full: dict[str, Any], bufs: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """A ZeRO-1-style state: each rank's slice of flat fp32 param / exp_avg / exp_avg_sq buffers."""
    params, total = _zero_layout(model)
    start, _ = flat_partition(total, world, rank)
    fqns = [p.fqn for p in params]
    step = bufs["step"]  # one 0-d step shared by every parameter, as in a flat optimizer
    return {
        "model": {"flat": FlatShard(bufs["param"], params, start, prefix="model.")},
        "optim": {
            "flat": {
                key: FlatShard(bufs[key], params, start, prefix="optim.state.", suffix=f".{key}")
                for key in ("exp_avg", "exp_avg_sq")
            },
            "step": TensorPieces([Piece(f"optim.state.{f}.step", (), (), step) for f in fqns], replicated=True),
            "param_groups": osd_full["param_groups"],
        },
    }


def _zero_buffers(model: torch.nn.Module, rank: int, world: int) -> dict[str, torch.Tensor]:
    params, total = _zero_layout(model)
    start, stop = flat_partition(total, world, rank)
    return {k: torch.full((stop - start,), 13.0) for k in ("param", "exp_avg", "exp_avg_sq")} | {"step": torch.tensor(13.0)}


def _fill_zero(bufs: dict[str, torch.Tensor], ref: dict[str, Any], params: list[FlatParam], start: int) -> None:
    """Copy this rank's slice of the full reference into flat buffers (the ZeRO partitioning)."""
    names = {"param": "model.{}", "exp_avg": "optim.state.{}.exp_avg", "exp_avg_sq": "optim.state.{}.exp_avg_sq"}
    for key, fmt in names.items():
        buf = bufs[key]
        buf.zero_()
        for p in params:
            lo, hi = max(p.offset, start), min(p.end, start + buf.numel())
            if lo < hi:
                buf[lo - start : hi - start] = ref[fmt.format(p.fqn)].reshape(-1)[lo - p.offset : hi - p.offset]
    bufs["step"].copy_(ref[f"optim.state.{params[0].fqn}.step"])


def _zero_save(rank: int, world: int, root: str) -> None:
    # Every rank trains the same unsharded model (same data), then keeps only
    # its ZeRO partition: the state a ZeRO-1 job holds, cut mid-row.
    model, optim = build("plain")
    for step in range(2):
        train_step(model, optim, step)
    ref = full_reference(train_state(model, optim))
    params, total = _zero_layout(model)
    start, _ = flat_partition(total, world, rank)
    bufs = _zero_buffers(model, rank, world)
    _fill_zero(bufs, ref, params, start)
    cut = [p.fqn for p in params if p.offset < start < p.end]
    state = _zero_state(model, train_state(model, optim)["optim"], bufs, rank, world)
    dcp.save(state, storage_writer=UCPStorageWriter(os.path.join(root, "zero")), planner=UCPSavePlanner())
    if rank == 0:
        torch.save(ref, os.path.join(root, "zero.ref.pt"))
    cuts = [None] * world
    dist.all_gather_object(cuts, cut)
    if rank == 0:  # the test must really cut parameters mid-row somewhere
        assert any(cuts), cuts


def _fsdp_load_then_save(rank: int, world: int, root: str) -> None:
    model, optim = build(f"dp{world}", seed=1)
    train_step(model, optim, 0)  # creates the optimizer state the load writes into
    state = train_state(model, optim)
    scramble(state)
    dcp.load(state, storage_reader=UCPStorageReader(os.path.join(root, "zero")), planner=UCPLoadPlanner())
    ref = torch.load(os.path.join(root, "zero.ref.pt"), weights_only=False)
    check_against(state, ref, f"zero 4 -> fsdp {world}, rank {rank}")
    # Training continues from it, then FSDP2 saves for the next test.
    train_step(model, optim, 5)
    state = train_state(model, optim)
    ref2 = full_reference(state)
    dcp.save(state, storage_writer=UCPStorageWriter(os.path.join(root, "fsdp")), planner=UCPSavePlanner())
    if rank == 0:
        torch.save(ref2, os.path.join(root, "fsdp.ref.pt"))


def _zero_load(rank: int, world: int, root: str) -> None:
    model, optim = build("plain", seed=1)
    params, total = _zero_layout(model)
    start, _ = flat_partition(total, world, rank)
    bufs = _zero_buffers(model, rank, world)
    osd = train_state(model, optim)["optim"]
    state = _zero_state(model, {"param_groups": osd["param_groups"]}, bufs, rank, world)
    dcp.load(state, storage_reader=UCPStorageReader(os.path.join(root, "fsdp")), planner=UCPLoadPlanner())
    ref = torch.load(os.path.join(root, "fsdp.ref.pt"), weights_only=False)
    want = _zero_buffers(model, rank, world)
    _fill_zero(want, ref, params, start)  # padding is zero in both
    for key in ("param", "exp_avg", "exp_avg_sq", "step"):
        assert bit_equal(bufs[key], want[key]), f"fsdp -> zero {world}, rank {rank}: {key} differs"
    groups, _ = flatten_state_dict({"optim": {"param_groups": state["optim"]["param_groups"]}})
    assert groups == {k: v for k, v in ref.items() if k.startswith("optim.param_groups.")}


@pytest.mark.multiproc
def test_zero_flat_adamw_to_fsdp2_and_back(tmp_path: Any) -> None:
    """ZeRO-style flat AdamW on 4 ranks -> FSDP2 on 3 ranks -> flat on 2 ranks, bit-exact each way."""
    root = str(tmp_path)
    run_ranks(4, _zero_save, root)
    run_ranks(3, _fsdp_load_then_save, root)
    run_ranks(2, _zero_load, root)


def _bad_flat_save(rank: int, world: int, root: str, mode: str) -> None:
    params = [FlatParam("w", (4, 5), 0)]
    if mode == "gap":
        start, local = (0, torch.zeros(8)) if rank == 0 else (12, torch.zeros(8))  # [8, 12) held by no one
    else:
        start, local = (0, torch.zeros(12)) if rank == 0 else (11, torch.zeros(9))  # [11, 12) held twice
    sd = {"w": FlatShard(local, params, start, prefix="model.")}
    with pytest.raises(CheckpointException) as ei:  # DCP wraps the coordinator's error for every rank
        dcp.save(sd, storage_writer=UCPStorageWriter(os.path.join(root, mode)), planner=UCPSavePlanner())
    msg = str(ei.value)
    assert "tensor 'model.w' of shape [4, 5]" in msg, msg
    want = "leaving elements that no rank holds" if mode == "gap" else "so some of them overlap"
    assert want in msg and "the tensor has 20" in msg, msg
    assert not os.path.exists(os.path.join(root, mode, "ucp_index.json"))


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["gap", "overlap"])
def test_flat_partition_gaps_and_overlaps_fail_the_save(tmp_path: Any, mode: str) -> None:
    run_ranks(2, _bad_flat_save, str(tmp_path), mode)


# ----------------------------------------------------- with CheckpointManager


def test_manager_snapshots_flat_shards(tmp_path: Any) -> None:
    """An async manager save of flat shards holds the values at save(), not later in-place changes."""
    from ucp_dcp import CheckpointManager, NonFiniteError

    params, total = pack_flat([("w", (5, 7)), ("b", (7,))], align=4)
    buf = torch.randn(total)
    want = buf.clone()
    with CheckpointManager(str(tmp_path / "ckpt"), nonfinite="error") as mgr:
        mgr.save(1, {"flat": FlatShard(buf, params, 0, prefix="model.")})
        buf.add_(1.0)  # training changes the buffer while the save runs
        mgr.wait()
        buf[3] = float("nan")
        with pytest.raises(NonFiniteError, match=r"flat\[model\.w@0,0\]"):
            mgr.save(2, {"flat": FlatShard(buf, params, 0, prefix="model.")})
        got = torch.zeros(total)
        assert mgr.load({"flat": FlatShard(got, params, 0, prefix="model.")}) == 1
    for p in params:
        assert bit_equal(got[p.offset : p.end], want[p.offset : p.end]), p.fqn


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_flat_checkpoint_is_a_normal_checkpoint(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Inspected, verified and read by the same tools as any other: nothing flat-specific on disk."""
    from ucp_dcp import Checkpoint
    from ucp_dcp.tools.cli import main

    named = [("w", (9, 7)), ("b", (7,))]
    params, total = pack_flat(named, align=4)
    src = torch.randn(total)
    _save_nodist({f"r{r}": FlatShard(src[a:b], params, a, prefix="model.")
                  for r, (a, b) in enumerate(flat_partition(total, 3, r) for r in range(3))}, str(tmp_path))
    with Checkpoint(tmp_path) as ck:
        assert ck.tensor_names() == ["model.b", "model.w"]
        assert ck.verify() == []
        for p in params:
            assert bit_equal(ck.read_tensor(f"model.{p.fqn}"), src[p.offset : p.end].view(p.shape))
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # 3 ranks' flat ranges cut w = [9, 7] into 2 + 3 + 2 boxes: an ordinary explicit chunk list.
    assert re.search(r"^model\.w\s+float32\s+\[9,7\]\s+explicit 7 chunks", out, re.M), out
    assert main(["verify", str(tmp_path)]) == 0


def _replica_save_load(rank: int, world: int, root: str) -> None:
    # Data-parallel replicas of one ZeRO partition: ranks 0/1 hold the first
    # half of the buffer, ranks 2/3 the second, each pair the same bytes.
    params, total = pack_flat([("w", (6, 5)), ("b", (5,))], align=4)
    full = torch.arange(total, dtype=torch.float32)
    start, stop = flat_partition(total, 2, rank // 2)
    sd = {"flat": FlatShard(full[start:stop].clone(), params, start, prefix="model.")}
    writer = UCPStorageWriter(root)
    dcp.save(sd, storage_writer=writer, planner=UCPSavePlanner())
    out = {"model": {"w": torch.zeros(6, 5), "b": torch.zeros(5)}}
    dcp.load(out, storage_reader=UCPStorageReader(root), planner=UCPLoadPlanner())
    for p in params:
        assert bit_equal(out["model"][p.fqn], full[p.offset : p.end].view(p.shape)), (rank, p.fqn)


@pytest.mark.multiproc
def test_flat_shards_held_by_replicas_are_written_once(tmp_path: Any) -> None:
    """Two data-parallel replicas of each ZeRO partition: each box is written by one rank only."""
    from ucp_dcp import Checkpoint

    run_ranks(4, _replica_save_load, str(tmp_path))
    with Checkpoint(tmp_path) as ck:
        stored = sum(loc.nbytes for name in ck.tensor_names() for _, loc in ck.chunks(name))
    assert stored == (6 * 5 + 5) * 4


def _save_diverged_replicas(rank: int, world: int, path: str) -> None:
    # Both ranks claim the whole flat range of 'w' (as two data-parallel replicas of one
    # partition do) but hold different bytes: a stale replica, or two pipeline stages that
    # saved their own layer under one name.
    sd = {"flat": FlatShard(torch.full((8,), float(rank + 1)), [FlatParam("w", (2, 4), 0)], 0, prefix="model.")}
    with pytest.raises(CheckpointException) as e:
        dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    assert re.search(
        r"InconsistentSaveError: replicated tensor 'model\.w' \(box at offsets \[0, 0\]\) differs across ranks: "
        r"ranks 0 hold one value, ranks 1 another", str(e.value)
    ), str(e.value)[-2000:]
    assert not os.path.exists(os.path.join(path, "ucp_index.json"))


@pytest.mark.multiproc
def test_a_box_two_ranks_save_with_different_bytes_fails_the_save(tmp_path: Any) -> None:
    """A box several ranks save is written once: their bytes must agree, or one rank's data would
    be lost without a word (the save kept rank 0's and dropped rank 1's)."""
    run_ranks(2, _save_diverged_replicas, str(tmp_path / "ckpt"))


def test_a_parameter_of_no_elements_is_recorded(tmp_path: Any) -> None:
    """A zero-size parameter in a flat buffer holds no bytes but is a key of the model: it is
    recorded, so a load into full tensors finds it (it used to be left out, and the load failed
    with a missing key)."""
    from ucp_dcp import load_state_dict

    params = [FlatParam("w", (2, 4), 0), FlatParam("empty", (0, 3), 8)]
    sd = {"flat": FlatShard(torch.arange(8.0), params, 0, prefix="model.")}
    dcp.save(sd, storage_writer=UCPStorageWriter(str(tmp_path)), planner=UCPSavePlanner())
    got = load_state_dict(str(tmp_path))
    assert sorted(got) == ["model.empty", "model.w"]
    assert got["model.empty"].shape == (0, 3) and bit_equal(got["model.w"], torch.arange(8.0).view(2, 4))
    full = {"model": {"w": torch.zeros(2, 4), "empty": torch.zeros(0, 3)}}
    dcp.load(full, storage_reader=UCPStorageReader(str(tmp_path)), planner=UCPLoadPlanner())
    assert bit_equal(full["model"]["w"], torch.arange(8.0).view(2, 4))
