"""Tensor kinds DCP's own planners handle, saved and loaded with the UCP classes.

Each multi-rank test saves the same state with DCP's defaults
(``DefaultSavePlanner`` + ``FileSystemWriter``) and with the UCP classes,
loads both back (same layout, and another layout at another world size) and
checks every loaded tensor bit-for-bit against the source and against what
DCP itself loaded, on gloo ranks:

- DTensors on a sub-mesh that not every rank belongs to (a mesh of some
  ranks, a ``mesh["dp"]`` sub-mesh of a 2-D mesh);
- DTensors whose local tensor is a ``LocalShardsWrapper`` (torchrec's uneven
  row/column-wise sharding: several shards per rank at their own offsets);
- tensor subclasses of DCP's checkpointable protocol
  (``__create_write_items__`` / ``__create_chunk_list__`` / ``__get_tensor_shard__``);
- partial loads in one process without a process group (PyTorch's e2e
  ``test_partial_load``).
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import bit_equal, run_ranks
from ucp_dcp import (
    CheckpointManager,
    Piece,
    ReadOptions,
    TensorPieces,
    UCPLoadPlanner,
    UCPSavePlanner,
    UCPStorageReader,
    UCPStorageWriter,
    UnsupportedValueError,
    load_state_dict,
)
from ucp_dcp.byteio.transfer import shares_elements
from ucp_dcp.errors import InvalidArgumentError, InvalidArgumentTypeError, LayoutError, unwrap
from ucp_dcp.manager.snapshot import Snapshotter

ROWS, COLS = 8, 6


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _save_both(sd: dict[str, Any], root: str, **ucp: Any) -> None:
    """Save ``sd`` with DCP's defaults under ``root/dcp`` and the UCP classes under ``root/ucp``."""
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(os.path.join(root, "dcp")), planner=dcp.DefaultSavePlanner())
    dcp.save(sd, storage_writer=UCPStorageWriter(os.path.join(root, "ucp")), planner=UCPSavePlanner(**ucp))


def _load_both(make: Callable[[], dict[str, Any]], root: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two fresh targets from ``make``: one loaded by DCP from its save, one by UCP from its save."""
    by_dcp, by_ucp = make(), make()
    dcp.load(by_dcp, storage_reader=dcp.FileSystemReader(os.path.join(root, "dcp")), planner=dcp.DefaultLoadPlanner())
    dcp.load(by_ucp, storage_reader=UCPStorageReader(os.path.join(root, "ucp")), planner=UCPLoadPlanner())
    return by_dcp, by_ucp


def _boxes(t: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets, data) of every local chunk of ``t`` (a DTensor, wrapper DTensor, CT or plain tensor)."""
    if isinstance(t, DTensor):
        local = t._local_tensor
        if isinstance(local, LocalShardsWrapper):
            return [(tuple(c.offsets), s) for s, c in zip(local.local_shards(), local.local_chunks)]
        if t.device_mesh.get_coordinate() is None:
            return []
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return [(tuple(off), local)]
    if isinstance(t, Checkpointable):
        return [(tuple(t.offsets), t.local)]
    return [((0,) * t.dim(), t)]


def _check(loaded: dict[str, Any], by_dcp: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    """Every chunk this rank holds equals the source's box, and DCP's load, bit for bit."""
    for key, full in want.items():
        mine, theirs = _boxes(loaded[key]), _boxes(by_dcp[key])
        assert [o for o, _ in mine] == [o for o, _ in theirs], key
        for (off, got), (_, ref) in zip(mine, theirs):
            box = tuple(slice(o, o + n) for o, n in zip(off, got.shape))
            assert bit_equal(got, full[box]), (key, off)
            assert bit_equal(got, ref), (key, off)


# ------------------------------------------- LocalShardsWrapper and the protocol


class Checkpointable(torch.Tensor):
    """A tensor subclass that is only DCP's checkpointable protocol: one chunk of a
    global tensor at ``offsets``, stored in ``local``; no tensor operation works on it."""

    local: torch.Tensor
    offsets: torch.Size

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: tuple[int, ...], size: tuple[int, ...]) -> Checkpointable:
        r = torch.Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype, device=local.device)
        r.local, r.offsets = local, torch.Size(offsets)
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} is not supported on Checkpointable")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(self.offsets, self.local.size())]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(self.offsets, self.local.size())
        data = TensorWriteData(chunk, TensorProperties.create_from_tensor(self.local), self.size())
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD, tensor_data=data)]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.local


# Row splits of a LocalShardsWrapper per rank: several shards per rank, of
# different sizes, some ranks empty.
ROW_SPLITS = {4: [[(0, 2), (6, 8)], [(2, 3)], [], [(3, 6)]], 3: [[(0, 1), (6, 8)], [], [(1, 6)]]}
# Column splits (2-D column-wise: LocalShardsWrapper concatenates along dim 1).
COL_SPLITS = {4: [[(0, 1), (4, 6)], [(1, 3)], [(3, 4)], []], 3: [[(2, 3)], [(0, 2), (3, 4)], [(4, 6)]]}


def _wrapper(rank: int, world: int, full: torch.Tensor | None, dim: int) -> DTensor:
    splits = (ROW_SPLITS if dim == 0 else COL_SPLITS)[world][rank]
    src = torch.zeros(ROWS, COLS) if full is None else full
    shards = [(src[a:b] if dim == 0 else src[:, a:b]).clone() for a, b in splits]
    offsets = [(a, 0) if dim == 0 else (0, a) for a, _ in splits]
    lsw = LocalShardsWrapper(shards, offsets)
    mesh = init_device_mesh("cpu", (world,))
    return DTensor.from_local(lsw, mesh, [Shard(dim)], run_check=False, shape=torch.Size((ROWS, COLS)),
                              stride=(COLS, 1))


def _checkpointable(rank: int, world: int, full: torch.Tensor | None) -> Checkpointable:
    bounds = [ROWS * r // world for r in range(world + 1)]  # 8 rows over 3: 2, 3, 3
    a, b = bounds[rank], bounds[rank + 1]
    local = torch.zeros(b - a, COLS) if full is None else full[a:b].clone()
    return Checkpointable(local, (a, 0), (ROWS, COLS))


# ------------------------------------------------------------------ the state

SEEDS = {"low": 1, "high": 2, "plain": 3, "dp": 4, "rows": 5, "cols": 6, "ct": 7}


def _state(rank: int, world: int, fill: bool) -> dict[str, Any]:
    """Every kind, as this rank of ``world`` holds it (zeros unless ``fill``, in another placement then)."""

    def t(key: str) -> torch.Tensor:
        return _full(SEEDS[key]) if fill else torch.zeros(ROWS, COLS)

    low = DeviceMesh("cpu", [0, 1])  # rank 0 (the coordinator) is in it, the last ranks are not
    high = DeviceMesh("cpu", list(range(world - 2, world)))  # the coordinator is not in it
    sd: dict[str, Any] = {
        "low": distribute_tensor(t("low"), low, [Shard(0)]),
        "high": distribute_tensor(t("high"), high, [Shard(1)] if fill else [Replicate()]),
        "plain": t("plain"),
        "rows": _wrapper(rank, world, t("rows") if fill else None, 0),
        "cols": _wrapper(rank, world, t("cols") if fill else None, 1),
        "ct": _checkpointable(rank, world, t("ct") if fill else None),
    }
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        # A dp sub-mesh per tp rank, each holding the whole tensor.
        sd["dp"] = distribute_tensor(t("dp"), mesh2["dp"], [Shard(0)] if fill else [Shard(1)])
    else:
        sd["dp"] = distribute_tensor(t("dp"), init_device_mesh("cpu", (world,)), [Shard(0)])
    return sd


def _want() -> dict[str, torch.Tensor]:
    return {k: _full(s) for k, s in SEEDS.items()}


def _save_4(rank: int, world: int, root: str) -> None:
    src = _state(rank, world, True)
    _save_both(src, root)
    flat = os.path.join(root, "flat")  # per-chunk plans instead of mesh groups
    dcp.save(src, storage_writer=UCPStorageWriter(flat), planner=UCPSavePlanner(compact_plans=False))
    # Back into the same kinds on the same meshes, in other placements where they have any.
    by_dcp, by_ucp = _load_both(lambda: _state(rank, world, False), root)
    _check(by_ucp, by_dcp, _want())
    by_flat = _state(rank, world, False)
    dcp.load(by_flat, storage_reader=UCPStorageReader(flat), planner=UCPLoadPlanner())
    _check(by_flat, by_dcp, _want())
    # CheckpointManager's staging copies each shard of a LocalShardsWrapper
    # (the protocol subclass it cannot copy is left out: see the refusal test).
    snap = Snapshotter()
    staged = snap.stage({k: v for k, v in src.items() if k != "ct"})
    for key in ("rows", "cols"):
        for (o1, a), (o2, b) in zip(_boxes(staged.state[key]), _boxes(src[key])):
            assert o1 == o2 and bit_equal(a, b) and a.data_ptr() != b.data_ptr(), key
    dcp.save(staged.state, storage_writer=UCPStorageWriter(os.path.join(root, "staged")), planner=UCPSavePlanner())
    snap.release(staged)


def _load_3(rank: int, world: int, root: str) -> None:
    # The same kinds, split otherwise over 3 ranks (sub-meshes of 2 of them).
    by_dcp, by_ucp = _load_both(lambda: _state(rank, world, False), root)
    _check(by_ucp, by_dcp, _want())
    # Plain DTensors and plain tensors from the wrappers and the protocol subclass, and the other way.
    mesh = init_device_mesh("cpu", (world,))

    def plain() -> dict[str, Any]:
        return {
            "rows": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
            "cols": torch.zeros(ROWS, COLS),
            "ct": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "low": torch.zeros(ROWS, COLS),
            "plain": _checkpointable(rank, world, None),
        }

    by_dcp, by_ucp = _load_both(plain, root)
    _check(by_ucp, by_dcp, {k: v for k, v in _want().items() if k in by_ucp})
    # A partial sum has no value to save: refused, naming the key, as a wrapper DTensor too.
    wrapped = LocalShardsWrapper([torch.ones(2, COLS)], [(2 * rank, 0)])
    for key, dt in (
        ("grad", DTensor.from_local(torch.ones(ROWS, COLS), mesh, [Partial()])),
        ("wgrad", DTensor.from_local(wrapped, mesh, [Partial()], run_check=False, shape=(ROWS, COLS), stride=(COLS, 1))),
    ):
        with pytest.raises(CheckpointException) as info:
            dcp.save({key: dt}, storage_writer=UCPStorageWriter(os.path.join(root, key)), planner=UCPSavePlanner())
        err = info.value.failures[rank][0]
        assert isinstance(err, LayoutError) and f"tensor {key!r}: Partial placement" in str(err), err


@pytest.mark.multiproc
def test_tensor_kinds_4_ranks_then_3(tmp_path: Path) -> None:
    """Sub-mesh DTensors, LocalShardsWrapper DTensors and protocol subclasses: saved on 4
    ranks, loaded back on 4 and on 3, bit-exact and equal to DCP's own loads."""
    root = str(tmp_path)
    run_ranks(4, _save_4, root)
    run_ranks(3, _load_3, root)
    offline = load_state_dict(os.path.join(root, "ucp"))
    for k, full in _want().items():
        assert bit_equal(offline[k], full), k
    staged = load_state_dict(os.path.join(root, "staged"))
    assert set(staged) == set(_want()) - {"ct"}
    for k, v in staged.items():
        assert bit_equal(v, _want()[k]), k


# ------------------------------------------------------ no process group


def _train_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(9)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)},
        "optimizer": {
            "state": {"0": {"exp_avg": torch.randn(4, 3, generator=g), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_partial_load_without_process_group(tmp_path: Path) -> None:
    """A subset of keys, keys the checkpoint lacks (allow_partial_load), and DCP's
    ``_load_state_dict_from_keys``, in one process with no process group."""
    assert not dist.is_initialized()
    src = _train_state()
    dcp.save(src, storage_writer=UCPStorageWriter(str(tmp_path)), planner=UCPSavePlanner())

    model = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    dcp.load(model, storage_reader=UCPStorageReader(str(tmp_path)), planner=UCPLoadPlanner())
    assert bit_equal(model["model"]["w"], src["model"]["w"]) and bit_equal(model["model"]["b"], src["model"]["b"])

    extra = {"model": {"w": torch.zeros(4, 3), "extra": torch.full((2,), 5.0)}}
    planner = UCPLoadPlanner(allow_partial_load=True)
    dcp.load(extra, storage_reader=UCPStorageReader(str(tmp_path)), planner=planner)
    assert bit_equal(extra["model"]["w"], src["model"]["w"]) and bit_equal(extra["model"]["extra"], torch.full((2,), 5.0))
    assert planner.missing_keys == ["model.extra"]

    with pytest.raises(CheckpointException, match=r"model\.extra.*allow_partial_load=True"):
        dcp.load({"model": {"extra": torch.zeros(2)}}, storage_reader=UCPStorageReader(str(tmp_path)),
                 planner=UCPLoadPlanner())

    got = _load_state_dict_from_keys("model", storage_reader=UCPStorageReader(str(tmp_path)))
    assert set(got) == {"model"} and bit_equal(got["model"]["w"], src["model"]["w"])
    got = _load_state_dict_from_keys("optimizer.state", storage_reader=UCPStorageReader(str(tmp_path)))
    assert "param_groups" not in got["optimizer"]
    assert bit_equal(got["optimizer"]["state"]["0"]["exp_avg"], src["optimizer"]["state"]["0"]["exp_avg"])


# ------------------------------------------------------------ refused kinds


class _OutOfBounds(Checkpointable):
    """Plans a chunk past the end of its tensor."""

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(torch.Size((ROWS - 1, 0)), self.local.size())
        data = TensorWriteData(chunk, TensorProperties.create_from_tensor(self.local), self.size())
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD, tensor_data=data)]


class _WriteOnly(torch.Tensor):
    """Has ``__create_write_items__`` but no chunk list: cannot be loaded into."""

    @staticmethod
    def __new__(cls, size: tuple[int, ...]) -> _WriteOnly:
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} is not supported on _WriteOnly")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:  # pragma: no cover - never saved
        return []


def _rank_error(exc: CheckpointException) -> BaseException:
    """The rank's own error out of DCP's CheckpointException (one rank)."""
    ((err, _),) = exc.failures.values()
    return err


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_checkpointable_tensors_are_refused(tmp_path: Path) -> None:
    """A chunk outside the tensor, or a target without a chunk list: the library's error, naming the key."""
    bad = _OutOfBounds(torch.ones(2, COLS), (0, 0), (ROWS, COLS))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"emb": bad}, storage_writer=UCPStorageWriter(str(tmp_path / "bad")), planner=UCPSavePlanner())
    err = _rank_error(info.value)
    assert isinstance(err, UnsupportedValueError) and "'emb'" in str(err) and "must lie inside" in str(err)

    dcp.save({"emb": _full(1)}, storage_writer=UCPStorageWriter(str(tmp_path / "ok")), planner=UCPSavePlanner())
    with pytest.raises(CheckpointException) as info:
        dcp.load({"emb": _WriteOnly((ROWS, COLS))}, storage_reader=UCPStorageReader(str(tmp_path / "ok")),
                 planner=UCPLoadPlanner())
    err = _rank_error(info.value)
    assert isinstance(err, UnsupportedValueError) and "'emb'" in str(err) and "__create_chunk_list__" in str(err)

    # CheckpointManager cannot copy a protocol subclass into its host buffers.
    mgr = CheckpointManager(str(tmp_path / "mgr"))
    try:
        with pytest.raises(UnsupportedValueError, match=r"model\.emb: a Checkpointable .*cannot be staged"):
            mgr.save(1, {"model": {"emb": Checkpointable(torch.ones(2, COLS), (0, 0), (ROWS, COLS))}})
    finally:
        mgr.close()



class _ChunksOnly(torch.Tensor):
    """Has a chunk list but no ``__create_write_items__``: cannot be saved."""

    @staticmethod
    def __new__(cls, size: tuple[int, ...]) -> _ChunksOnly:
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{func} is not supported on _ChunksOnly")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:  # pragma: no cover - never asked
        return []


class _PlansBytes(Checkpointable):
    """Plans its chunk as a BYTE_IO item."""

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)]


class _OutOfBoundsChunks(Checkpointable):
    """Its chunk list (which loads read) reaches past the end of the tensor."""


class _ShardNotATensor(Checkpointable):
    """Hands DCP a list for its chunk."""

    def __get_tensor_shard__(self, index: MetadataIndex) -> Any:
        return [1.0] * COLS


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpointable_protocol_refusals(tmp_path: Path) -> None:
    """A checkpointable tensor without write items, with a non-tensor item, or whose shard is
    not a tensor: the library's error naming the key and what was expected."""
    cases = [
        (_ChunksOnly((ROWS, COLS)), UnsupportedValueError,
         "tensor 'emb': its _ChunksOnly has __create_chunk_list__ but no __create_write_items__; "
         "a checkpointable tensor must implement both (and __get_tensor_shard__) to be saved"),
        (_PlansBytes(torch.ones(2, COLS), (0, 0), (ROWS, COLS)), UnsupportedValueError,
         "tensor 'emb': its _PlansBytes plans a non-tensor write item (BYTE_IO); only tensor "
         "chunks can be saved from a checkpointable tensor"),
        (_ShardNotATensor(torch.ones(ROWS, COLS), (0, 0), (ROWS, COLS)), InvalidArgumentTypeError,
         "'emb': the save planner resolved its SHARD write item to a list, not a Tensor"),
    ]
    for i, (obj, cls, message) in enumerate(cases):
        with pytest.raises(CheckpointException) as info:
            dcp.save({"emb": obj}, storage_writer=UCPStorageWriter(str(tmp_path / str(i))),
                     planner=UCPSavePlanner())
        err = _rank_error(info.value)
        assert type(err) is cls and str(err) == message, repr(err)
    with pytest.raises(InvalidArgumentError, match="^divergent_values must be 'error' or 'rank_local', got 'warn'$"):
        UCPSavePlanner(divergent_values="warn")

    # a load target whose chunk list reaches past its shape
    dcp.save({"emb": _full(1)}, storage_writer=UCPStorageWriter(str(tmp_path / "ok")), planner=UCPSavePlanner())
    with pytest.raises(CheckpointException) as info:
        dcp.load({"emb": _OutOfBoundsChunks(torch.zeros(2, COLS), (ROWS - 1, 0), (ROWS, COLS))},
                 storage_reader=UCPStorageReader(str(tmp_path / "ok")), planner=UCPLoadPlanner())
    err = _rank_error(info.value)
    assert type(err) is UnsupportedValueError and str(err) == (
        f"'emb': its _OutOfBoundsChunks lists a chunk at offsets [{ROWS - 1}, 0] of size [2, {COLS}], "
        f"outside the tensor's shape [{ROWS}, {COLS}]"
    )



@pytest.mark.filterwarnings("ignore::UserWarning")
def test_empty_shards_and_pieces_write_no_chunk(tmp_path: Path) -> None:
    """A checkpointable tensor's empty shard and an empty piece of a non-empty tensor hold no
    bytes: no chunk is written for them (a tensor no rank holds any of is not recorded)."""
    full = _full(3)
    pieces = TensorPieces([Piece("w", (ROWS, COLS), (0, 0), full), Piece("w", (ROWS, COLS), (ROWS, 0), torch.zeros(0, COLS)),
                           Piece("z", (2, 2), (2, 0), torch.zeros(0, 2))])
    state = {"p": pieces, "e": Checkpointable(torch.zeros(0, COLS), (0, 0), (ROWS, COLS))}
    dcp.save(state, storage_writer=UCPStorageWriter(str(tmp_path)), planner=UCPSavePlanner())
    tensors = json.loads((tmp_path / "ucp_index.json").read_bytes())["tensors"]
    assert list(tensors) == ["w"]
    assert [(c["offsets"], c["sizes"]) for c in tensors["w"]["chunks"]] == [([0, 0], [ROWS, COLS])]
    got = {"w": torch.zeros(ROWS, COLS)}
    dcp.load(got, storage_reader=UCPStorageReader(str(tmp_path)), planner=UCPLoadPlanner())
    assert bit_equal(got["w"], full)


# ------------------------------------------------------------ views whose memory is not their values
def _views() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A conjugate and a negative view (their memory holds the values conjugated, negated), and
    the values they read as."""
    c = torch.tensor([1 + 2j, 3 - 4j, -5 + 0.5j], dtype=torch.complex64)
    f = torch.tensor([1.0, -2.0, 3.0, -0.0, float("nan")])
    views = {"c": c.conj(), "f": torch._neg_view(f)}
    return views, {k: v.resolve_conj().resolve_neg() for k, v in views.items()}


def _into_views(like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"c": torch.zeros_like(like["c"]).conj(), "f": torch._neg_view(torch.zeros_like(like["f"]))}


@pytest.mark.parametrize("verify", [True, False])
def test_conjugate_and_negative_views_save_values_and_load_through(tmp_path: Path, verify: bool) -> None:
    """The UCP writer saves what a conjugate or negative view reads as, and a load into such a
    view writes each value through it (as ``copy_`` does), from UCP and DCP checkpoints alike."""
    views, values = _views()
    dcp.save(views, storage_writer=UCPStorageWriter(tmp_path / "ucp"), planner=UCPSavePlanner())
    dcp.save(values, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"))
    opts = ReadOptions(verify=verify)
    for kind in ("ucp", "dcp"):
        plain = {k: torch.zeros_like(v) for k, v in values.items()}
        dcp.load(plain, storage_reader=UCPStorageReader(tmp_path / kind, options=opts), planner=UCPLoadPlanner())
        into = _into_views(values)
        dcp.load(into, storage_reader=UCPStorageReader(tmp_path / kind, options=opts), planner=UCPLoadPlanner())
        for k, want in values.items():
            assert bit_equal(plain[k], want), (kind, k, plain[k], want)
            assert into[k].is_conj() or into[k].is_neg()
            assert bit_equal(into[k].resolve_conj().resolve_neg(), want), (kind, k, into[k], want)


def _load_views_2_ranks(rank: int, world: int, root: str) -> None:
    views, values = _views()
    if rank == 0:
        dcp.save(views, storage_writer=UCPStorageWriter(root), planner=UCPSavePlanner(), no_dist=True)
    dist.barrier()
    into = _into_views(values)  # both ranks need every byte: read once and exchanged
    reader = UCPStorageReader(root, options=ReadOptions(read_once=True))
    dcp.load(into, storage_reader=reader, planner=UCPLoadPlanner())
    for k, want in values.items():
        assert bit_equal(into[k].resolve_conj().resolve_neg(), want), (rank, k, into[k], want)


@pytest.mark.multiproc
def test_conjugate_and_negative_view_destinations_on_2_ranks_reading_once(tmp_path: Path) -> None:
    """The read-once exchange leaves such destinations to the reads that write through them."""
    run_ranks(2, _load_views_2_ranks, str(tmp_path))


@pytest.mark.parametrize("dest", ["expanded", "overlapping"])
def test_a_destination_whose_elements_share_memory_is_refused(tmp_path: Path, dest: str) -> None:
    """Loading into an expanded view (a stride of 0) or one whose elements overlap would leave
    each shared place with the last value written: refused, naming the key."""
    dcp.save({"w": torch.arange(16.0).reshape(4, 4)}, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner())
    t = torch.zeros(1, 4).expand(4, 4) if dest == "expanded" else torch.zeros(8).as_strided((4, 4), (1, 1))
    with pytest.raises(CheckpointException) as e:
        dcp.load({"w": t}, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner())
    err = unwrap(e.value)
    assert isinstance(err, UnsupportedValueError), e.value
    assert "'w'" in str(err) and "expanded or overlapping view" in str(err) and ".clone()" in str(err)
    assert t.sum().item() == 0  # nothing was written


def test_interleaved_but_disjoint_strides_load_bit_exact(tmp_path: Path) -> None:
    """A view whose strides interleave without sharing an element (as_strided) is loaded into."""
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    dcp.save({"w": src}, storage_writer=UCPStorageWriter(tmp_path), planner=UCPSavePlanner())
    base = torch.zeros(6)
    t = base.as_strided((2, 2), (3, 2))  # elements 0, 2, 3, 5
    dcp.load({"w": t}, storage_reader=UCPStorageReader(tmp_path), planner=UCPLoadPlanner())
    assert bit_equal(t, src) and base[[1, 4]].tolist() == [0.0, 0.0]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 7)), min_size=0, max_size=4))
def test_shares_elements_is_exact(dims: list[tuple[int, int]]) -> None:
    """Against every element's offset, listed."""
    sizes, strides = [n for n, _ in dims], [s for _, s in dims]
    t = torch.zeros(128).as_strided(sizes, strides)
    offsets = [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*[range(n) for n in sizes])]
    assert shares_elements(t) == (len(set(offsets)) < len(offsets)), (sizes, strides)
