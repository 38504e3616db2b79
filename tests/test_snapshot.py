"""Staging a training state into host buffers (ucp_dcp.manager.snapshot), bit for bit.

The staged copy must keep the values of the moment ``stage()`` was called
while the training state changes every tensor in place and mutates its
lists/dicts; buffers must be reused across save cycles; a real FSDP2 state
staged on 2 gloo ranks must save and load back bit-exactly.
"""

from __future__ import annotations

import copy
import math
import os
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.tensor import DTensor

from dist_utils import bit_equal, run_ranks
from layouts import build, full_reference, scramble, train_state, train_step
from ucp_dcp import RankLocal, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.manager.snapshot import NonFiniteError, Snapshotter, StagedState, find_nonfinite
from ucp_dcp.errors import InvalidArgumentError, InvalidStateError, UnsupportedValueError

Pair = namedtuple("Pair", ["a", "b"])


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)  # every bit pattern, NaNs and -0.0 included


def _state() -> dict[str, Any]:
    """A nested training state with every container and leaf kind stage() must handle."""
    w = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    return {
        "model": OrderedDict([("layers.0.weight", w), ("layers.0.bias", _rand((4,), torch.bfloat16, 1))]),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": _rand((6, 4), torch.float32, 2)}},
            "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.95)}],
        },
        "strided": _rand((5, 7), torch.float32, 3).t(),  # non-contiguous source
        "ints": torch.arange(10, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "pair": Pair(_rand((3,), torch.float16, 4), [1, 2]),
        "tup": (torch.ones(2), "x", None, b"raw"),
        "extra": RankLocal({"pos": 7, "seen": [1, 2, 3]}),
        "step": 11,
    }


def _tensors(obj: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor by dotted path, tuples included (flatten_state_dict keeps tuples whole)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    if isinstance(obj, dict):
        kids: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        kids = enumerate(obj)
    else:
        return {}
    out: dict[str, torch.Tensor] = {}
    for k, v in kids:
        out.update(_tensors(v, f"{path}.{k}" if path else str(k)))
    return out


def _mutate(state: dict[str, Any]) -> None:
    """What a training loop does to the live state after stage() returned."""
    with torch.no_grad():
        for v in _tensors(state).values():
            v.add_(1)
    state["optim"]["param_groups"][0]["lr"] = 99.0
    state["optim"]["param_groups"][0]["params"].append(1)
    state["pair"].b.append(3)
    state["extra"].value["seen"].clear()
    state["extra"].value["pos"] = -1
    state["model"]["new"] = torch.zeros(1)


def test_cpu_isolation_and_structure() -> None:
    """The staged copy keeps the values and structure at the call, whatever happens to the source."""
    state = _state()
    before = {k: v.detach().clone() for k, v in _tensors(state).items()}
    before_pg = copy.deepcopy(state["optim"]["param_groups"])
    snap = Snapshotter()
    staged = snap.stage(state)
    _mutate(state)

    got = staged.state
    # Structure: key order, non-str keys, container types.
    assert list(got) == list(state)
    assert type(got["model"]) is OrderedDict and list(got["model"]) == ["layers.0.weight", "layers.0.bias"]
    assert list(got["optim"]["state"]) == [0]
    assert type(got["pair"]) is Pair and type(got["tup"]) is tuple
    assert got["tup"][1:] == ("x", None, b"raw")
    # Tensors: bit-exact pre-mutation values, plain contiguous CPU tensors of their own.
    staged_t = _tensors(got)
    assert set(staged_t) == set(before)
    for k, want in before.items():
        t = staged_t[k]
        assert bit_equal(t, want), k
        assert type(t) is torch.Tensor and not t.requires_grad and t.is_contiguous() and t.device.type == "cpu", k
        assert t.untyped_storage().data_ptr() != _tensors(state)[k].untyped_storage().data_ptr() or t.numel() == 0, k
    # Non-tensor leaves: deep copies, untouched by the mutation.
    assert got["optim"]["param_groups"] == before_pg
    assert got["pair"].b == [1, 2]
    assert isinstance(got["extra"], RankLocal) and got["extra"].value == {"pos": 7, "seen": [1, 2, 3]}
    assert got["step"] == 11
    assert staged.nbytes == sum(t.numel() * t.element_size() for t in before.values())
    assert snap.buffer_bytes == staged.nbytes
    staged.wait_ready()  # no-op on CPU
    assert isinstance(staged, StagedState)


def test_shared_leaves_stay_shared() -> None:
    """One deepcopy memo per stage(): an object referenced from two leaves stays one object in the copy."""
    shared = {"seen": [1, 2]}
    got = Snapshotter().stage({"a": RankLocal(shared), "b": [RankLocal(shared)]}).state
    assert got["a"].value is got["b"][0].value and got["a"].value is not shared


def test_buffer_reuse() -> None:
    """Same structure after release(): the same host buffers, new values; another structure: new buffers."""
    state = _state()
    snap = Snapshotter()
    first = snap.stage(state)
    ptrs = {k: t.data_ptr() for k, t in _tensors(first.state).items()}
    held = snap.buffer_bytes
    snap.release(first)
    snap.release(first)  # twice: harmless

    with torch.no_grad():
        for v in _tensors(state).values():
            v.mul_(2)
    want = {k: v.detach().clone() for k, v in _tensors(state).items()}
    second = snap.stage(state)
    got = _tensors(second.state)
    assert {k: t.data_ptr() for k, t in got.items()} == ptrs
    assert all(bit_equal(got[k], want[k]) for k in want)
    assert snap.buffer_bytes == held
    snap.release(second)

    # A resized tensor changes the signature: the free set is evicted (max_buffers=1).
    state["optim"]["state"][0]["exp_avg"] = torch.ones(100, 4)
    third = snap.stage(state)
    assert _tensors(third.state)["optim.state.0.exp_avg"].data_ptr() != ptrs["optim.state.0.exp_avg"]
    assert snap.buffer_bytes == held + (100 - 6) * 4 * 4
    snap.close()
    assert snap.buffer_bytes == 0
    with pytest.raises(InvalidStateError, match="closed"):
        snap.stage(state)


def test_max_buffers() -> None:
    """Held copies are separate buffers; one too many raises, a release makes room."""
    state = {"w": torch.randn(8, 8), "meta": {"k": 1}}
    snap = Snapshotter(max_buffers=2)
    a = snap.stage(state)
    with torch.no_grad():
        state["w"].add_(1)
    b = snap.stage(state)
    assert a.state["w"].data_ptr() != b.state["w"].data_ptr()
    assert bit_equal(a.state["w"] + 1, b.state["w"])
    msg = r"all 2 staging buffers are held by in-flight saves; release\(\) one first"
    with pytest.raises(InvalidStateError, match=msg):
        snap.stage(state)
    snap.release(a)
    c = snap.stage(state)
    assert c.state["w"].data_ptr() == a.state["w"].data_ptr()
    with pytest.raises(InvalidArgumentError, match="another Snapshotter"):
        Snapshotter().release(c)
    with pytest.raises(InvalidArgumentError):
        Snapshotter(max_buffers=0)



class _Seq(list):
    """A list subclass with state of its own, as a training loop might keep."""

    tag = "seq"


def test_list_subclass_unstageable_tensors_and_failed_allocation() -> None:
    """A list subclass keeps its type; sparse and meta tensors are refused by path; a buffer
    that cannot be allocated leaves no slot held behind."""
    snap = Snapshotter(max_buffers=1)
    seq = _Seq([torch.arange(3.0), 5])
    seq.tag = "mine"
    got = snap.stage({"seq": seq}).state["seq"]
    assert type(got) is _Seq and got.tag == "mine" and got[1] == 5
    assert bit_equal(got[0], torch.arange(3.0)) and got[0].data_ptr() != seq[0].data_ptr()
    snap.close()

    snap = Snapshotter(max_buffers=1)
    with pytest.raises(UnsupportedValueError, match=r"^opt\.m: cannot stage a torch\.sparse_coo tensor; only dense"):
        snap.stage({"opt": {"m": torch.eye(3).to_sparse()}})
    with pytest.raises(UnsupportedValueError, match=r"^w: a meta tensor holds no data to save$"):
        snap.stage({"w": torch.empty(2, device="meta")})
    # 4 PiB for an expanded (stride 0) view: the allocation fails, its reserved slot is freed
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        snap.stage({"huge": torch.zeros(1).expand(2**50)})
    assert snap.buffer_bytes == 0
    staged = snap.stage({"w": torch.ones(4)})  # max_buffers=1: the failed set holds nothing
    assert bit_equal(staged.state["w"], torch.ones(4))


@pytest.mark.cuda
def test_cuda_pinned_nonblocking() -> None:
    """CUDA sources: pinned buffers, copies ordered before later in-place ops on the same stream."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 1024, generator=g).cuda(), "h": _rand((4096,), torch.bfloat16, 5).cuda()}
    want = {k: v.cpu() for k, v in state.items()}
    snap = Snapshotter(pin_memory=True)
    staged = snap.stage(state)
    for v in state.values():
        v.add_(1)  # same (current) stream: runs after the copy
    staged.wait_ready()
    for k, t in staged.state.items():
        assert t.device.type == "cpu" and t.is_pinned() and bit_equal(t, want[k]), k
    ptrs = {k: t.data_ptr() for k, t in staged.state.items()}
    snap.release(staged)
    again = snap.stage(state)
    again.wait_ready()
    assert {k: t.data_ptr() for k, t in again.state.items()} == ptrs
    assert all(bit_equal(again.state[k], state[k]) for k in state)


def test_find_nonfinite() -> None:
    """NaN/+Inf/-Inf anywhere in floating and complex tensors, sorted dotted paths; integers ignored."""
    e4 = torch.zeros(3, dtype=torch.float8_e4m3fn)  # no isfinite kernel on CPU; no Inf in this format
    e4[1] = float("nan")
    state = {
        "model": {"layers": [{"weight": torch.tensor([1.0, float("nan")])}, {"weight": torch.ones(2)}]},
        "optim": {"state": {3: {"exp_avg": torch.tensor([float("inf")], dtype=torch.bfloat16),
                                "exp_avg_sq": torch.tensor([-float("inf"), 0.0], dtype=torch.float16),
                                "step": torch.tensor(5)}}},
        "a": (torch.tensor([1 + 0j, complex(0, float("inf"))]), torch.tensor([1 + 2j])),
        "f8": e4,
        "ints": torch.tensor([1, 2, 3]),
        "empty": torch.empty(0),
        "other": [float("nan"), "s", None],  # not a tensor: not checked
    }
    assert find_nonfinite(state) == sorted([
        "model.layers.0.weight", "optim.state.3.exp_avg", "optim.state.3.exp_avg_sq", "a.0", "f8",
    ])
    assert find_nonfinite({"w": torch.ones(3), "n": 1}) == []
    assert issubclass(NonFiniteError, ValueError)


# --------------------------------------------------------------------------- multi-process


def _fsdp_stage_save_load(rank: int, world: int, path: str) -> None:
    model, optim = build("dp2")
    train_step(model, optim, 0)
    state = train_state(model, optim)
    sd = {**state, "step": 1, "sched": {"milestones": [1, 2]}}
    ref = full_reference(state)  # values at stage time (full tensors, via collectives)

    snap = Snapshotter()
    staged = snap.stage(sd)
    staged.wait_ready()
    live_flat, _ = flatten_state_dict(sd)
    staged_flat, _ = flatten_state_dict(staged.state)
    n_dtensors = 0
    for k, v in live_flat.items():
        s = staged_flat[k]
        if isinstance(v, DTensor):
            n_dtensors += 1
            assert isinstance(s, DTensor) and s.device_mesh == v.device_mesh and s.placements == v.placements, k
            assert s.shape == v.shape and s.stride() == v.stride() and not s.requires_grad, k
            loc = s.to_local()
            assert loc.is_contiguous() and loc.data_ptr() != v.to_local().data_ptr(), k
    assert n_dtensors > 20

    # Training goes on: every parameter and optimizer tensor changes in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    train_step(model, optim, 1)
    sd["sched"]["milestones"].append(3)
    live = full_reference(state)
    for k in ("model.embed.weight", "model.tiny", "optim.state.head.weight.exp_avg"):
        assert not bit_equal(live[k], ref[k]), f"{k}: the mutation must really change the live state"
    # The local shard check: rank 1 poisons its own shard of "tiny" only.
    if rank == 1:
        sd["model"]["tiny"].to_local().fill_(float("nan"))
    assert find_nonfinite(sd) == (["model.tiny"] if rank == 1 else [])
    assert find_nonfinite(staged.state) == []

    dcp.save(staged.state, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())

    # Buffers are reused by the next cycle (DTensor local shards included).
    ptrs = {k: (v.to_local() if isinstance(v, DTensor) else v).data_ptr()
            for k, v in staged_flat.items() if isinstance(v, torch.Tensor)}
    snap.release(staged)
    again, _ = flatten_state_dict(snap.stage(sd).state)
    assert {k: (again[k].to_local() if isinstance(again[k], DTensor) else again[k]).data_ptr() for k in ptrs} == ptrs

    fresh_model, fresh_optim = build("dp2", seed=1)
    fresh = train_state(fresh_model, fresh_optim)
    scramble(fresh)
    target = {**fresh, "step": 0, "sched": {"milestones": []}}
    dcp.load(target, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    got = full_reference({"model": target["model"], "optim": target["optim"]})
    assert set(got) == set(ref)
    for k, want in ref.items():
        if isinstance(want, torch.Tensor):
            assert bit_equal(got[k], want), f"rank {rank}: {k} differs"
        else:
            assert got[k] == want, k
    assert target["step"] == 1 and target["sched"] == {"milestones": [1, 2]}
    dist.barrier()


@pytest.mark.multiproc
def test_fsdp2_staged_save_load(tmp_path: Any) -> None:
    """Stage an FSDP2 model+optimizer state, mutate the live state, save the copy, load it bit-exactly."""
    run_ranks(2, _fsdp_stage_save_load, os.path.join(str(tmp_path), "ckpt"))
