"""FSDP1 flat parameters as universal pieces: FSDP1 <-> FSDP2 <-> FSDP1 with real ranks, bit-exact.

Sources are saved once per module: FSDP1 (``use_orig_params=False``, one
unit per Block) on 4 ranks and FSDP2 on 2 ranks, each after 2 AdamW steps,
with the full (gathered) state kept as the reference. Targets are built
with another seed and scrambled, so every compared byte came from the load.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import ShardingStrategy

from dist_utils import bit_equal, run_ranks
from fsdp1_utils import build_fsdp1, fsdp1_full_reference, piece_sets, scramble_pieces
from layouts import Block, build, check_against, full_reference, scramble, train_state, train_step
from ucp_dcp import TensorPieces, UCPLoadPlanner, UCPSavePlanner, UCPStorageReader, UCPStorageWriter
from ucp_dcp.adapters.fsdp1 import fsdp1_apply_loaded, fsdp1_state_dict
from ucp_dcp.adapters.flat import FlatShard
from ucp_dcp.errors import TorchInternalsError, UnsupportedModelError

pytestmark = pytest.mark.multiproc

PARAMS_KEY = "optim.param_groups.0.params"


def _logical_names(sd: dict[str, Any]) -> set[str]:
    """Checkpoint names ``sd`` holds over all ranks (collective): piece names plus plain keys."""
    flat, _ = flatten_state_dict(sd)
    mine = {k for k, v in flat.items() if not isinstance(v, TensorPieces)}
    for ps in piece_sets(sd):
        mine.update(ps.fqns())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(mine))
    return set().union(*map(set, every))


def _save_fsdp1(rank: int, world: int, root: str) -> None:
    model, optim = build_fsdp1(use_orig_params=False)
    for step in range(2):
        train_step(model, optim, step)
    ref = fsdp1_full_reference(model, optim)
    sd = fsdp1_state_dict(model, optim)
    # Names are exactly the keys get_state_dict gives (for FSDP1 here, FSDP2 in the load tests).
    assert _logical_names(sd) == set(ref)
    flat, _ = flatten_state_dict(sd)
    assert flat[PARAMS_KEY] == ref[PARAMS_KEY] and flat["optim.param_groups.0.lr"] == 1e-2
    dcp.save(sd, storage_writer=UCPStorageWriter(os.path.join(root, "fsdp1")), planner=UCPSavePlanner())
    if rank == 0:
        torch.save({"ref": ref}, os.path.join(root, "fsdp1.ref.pt"))


def _save_fsdp2(rank: int, world: int, root: str) -> None:
    model, optim = build("dp2")
    for step in range(2):
        train_step(model, optim, step)
    state = train_state(model, optim)
    ref = full_reference(state)
    dcp.save(state, storage_writer=UCPStorageWriter(os.path.join(root, "fsdp2")), planner=UCPSavePlanner())
    train_step(model, optim, 2)  # where training goes from here, for the continuation check
    after = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"ref": ref, "after": after}, os.path.join(root, "fsdp2.ref.pt"))


@pytest.fixture(scope="module")
def fsdp1_source(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("fsdp1_source"))
    run_ranks(4, _save_fsdp1, root)
    return root


@pytest.fixture(scope="module")
def fsdp2_source(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("fsdp2_source"))
    run_ranks(2, _save_fsdp2, root)
    return root


def _check_full(got: dict[str, Any], ref: dict[str, Any], what: str, params_as_set: bool) -> None:
    assert set(got) == set(ref), f"{what}: keys differ: {set(got) ^ set(ref)}"
    for k, want in ref.items():
        if isinstance(want, torch.Tensor):
            assert bit_equal(got[k], want), f"{what}: {k} differs"
        elif k.endswith(".params") and params_as_set:
            assert sorted(got[k]) == sorted(want), f"{what}: {k}"
        else:
            assert got[k] == want and type(got[k]) is type(want), f"{what}: {k}: {got[k]!r} != {want!r}"


def _load_into_fsdp2(rank: int, world: int, root: str) -> None:
    saved = torch.load(os.path.join(root, "fsdp1.ref.pt"))
    model, optim = build(f"dp{world}", seed=1)
    state = train_state(model, optim)
    scramble(state)
    dcp.load(state, storage_reader=UCPStorageReader(os.path.join(root, "fsdp1")), planner=UCPLoadPlanner())
    check_against(state, saved["ref"], f"rank {rank}: fsdp1 x4 -> fsdp2 x{world}")
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_step(model, optim, 2)
    assert all(float(s["step"]) == 3 for s in optim.state.values())


def _load_into_fsdp1(
    rank: int, world: int, root: str, source: str, use_orig_params: bool, strategy: ShardingStrategy
) -> None:
    saved = torch.load(os.path.join(root, f"{source}.ref.pt"))
    what = f"rank {rank}: {source} -> fsdp1 x{world} (use_orig_params={use_orig_params}, {strategy.name})"
    model, optim = build_fsdp1(use_orig_params, seed=1, strategy=strategy)
    sd = fsdp1_state_dict(model, optim)  # creates the (empty) optimizer state
    scramble_pieces(sd)
    for group in optim.param_groups:
        group["lr"] = 0.5
    dcp.load(sd, storage_reader=UCPStorageReader(os.path.join(root, source)), planner=UCPLoadPlanner())
    fsdp1_apply_loaded(model, optim, sd)
    assert optim.param_groups[0]["lr"] == 1e-2, what
    for ps in piece_sets(sd):
        for f in ps.fill:  # alignment and tail padding is zeroed, not left scrambled
            assert not f.any(), f"{what}: padding of {ps!r} not zeroed"
    got = fsdp1_full_reference(model, optim)
    # FSDP2 orders a group's params like model.parameters(), FSDP1 flat parameter by flat parameter.
    _check_full(got, saved["ref"], what, params_as_set=source != "fsdp1")
    # Training goes on from the loaded state.
    train_step(model, optim, 2)
    got = fsdp1_full_reference(model, optim)
    if "after" in saved:
        for k, want in saved["after"].items():
            torch.testing.assert_close(got[f"model.{k}"], want, rtol=1e-4, atol=1e-5, msg=f"{what}: step 3: {k}")
    steps = [float(s["step"]) for s in optim.state.values() if s["exp_avg"].numel()]
    assert steps and all(s == 3 for s in steps), what
    if use_orig_params:
        # Save again (ranks whose shard misses a param hold a stale step for it: not saved) and
        # load into FSDP1 with flat-parameter optimizer state on the same ranks.
        path = os.path.join(root, f"resaved-{source}-{world}")
        dcp.save(fsdp1_state_dict(model, optim), storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
        model2, optim2 = build_fsdp1(False, seed=2, strategy=strategy)
        sd2 = fsdp1_state_dict(model2, optim2)
        scramble_pieces(sd2)
        dcp.load(sd2, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
        fsdp1_apply_loaded(model2, optim2, sd2)
        _check_full(fsdp1_full_reference(model2, optim2), got, f"{what} -> resaved -> flat", params_as_set=True)


def test_fsdp1_to_fsdp2(fsdp1_source: str) -> None:
    """FSDP1 (flat params, nested units) on 4 ranks -> FSDP2 on 2 ranks, then a training step."""
    run_ranks(2, _load_into_fsdp2, fsdp1_source)


def test_fsdp2_to_fsdp1_use_orig_params(fsdp2_source: str) -> None:
    """FSDP2 x2 -> FSDP1 use_orig_params=True (alignment padding) x4; training continues like FSDP2's;
    the result saved from use_orig_params=True loads into flat-parameter optimizer state bit-exactly."""
    run_ranks(4, _load_into_fsdp1, fsdp2_source, "fsdp2", True, ShardingStrategy.FULL_SHARD)


def test_fsdp1_to_fsdp1_other_world(fsdp1_source: str) -> None:
    """FSDP1 on 4 ranks -> FSDP1 (SHARD_GRAD_OP) on 3 ranks: flat shards cut elsewhere."""
    run_ranks(3, _load_into_fsdp1, fsdp1_source, "fsdp1", False, ShardingStrategy.SHARD_GRAD_OP)


# ------------------------------------------------------------------ errors


def test_rejects_a_module_that_is_not_fsdp1() -> None:
    with pytest.raises(UnsupportedModelError, match=r"is a Linear, not a torch.distributed.fsdp.FullyShardedDataParallel"):
        fsdp1_state_dict(nn.Linear(2, 2))


def _errors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    for strategy, kw in ((ShardingStrategy.NO_SHARD, {}), (ShardingStrategy.HYBRID_SHARD, {"device_mesh": mesh})):
        model, optim = build_fsdp1(use_orig_params=False, strategy=strategy, **kw)
        with pytest.raises(UnsupportedModelError, match=rf"root FSDP unit uses sharding strategy {strategy.name}; supported"):
            fsdp1_state_dict(model, optim)
    model, _ = build_fsdp1(use_orig_params=False)
    stray = nn.Parameter(torch.zeros(3))
    optim = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(UnsupportedModelError, match=r"param group 0, param 3 \(shape \[3\]; not a parameter of the model\) is "
                                         r"neither a FlatParameter"):
        fsdp1_state_dict(model, optim)
    assert not optim.state  # nothing was touched
    fsdp2, optim2 = build("dp2")
    with pytest.raises(UnsupportedModelError, match=r"FSDPModel, not a .*FSDP1.* \(for fully_shard/FSDP2 models use .*get_state_dict"):
        fsdp1_state_dict(fsdp2, optim2)


def test_errors_name_what_is_unsupported() -> None:
    """NO_SHARD / HYBRID_SHARD units, stray optimizer params and FSDP2 models are refused clearly."""
    run_ranks(2, _errors)


def test_wrapper_components_are_stripped_from_names() -> None:
    from ucp_dcp.adapters.fsdp1 import _clean

    name = "_orig_mod._fsdp_wrapped_module.blocks.0._fsdp_wrapped_module._checkpoint_wrapped_module.q.weight"
    assert _clean(name) == "blocks.0.q.weight"
    assert _clean("_fsdp_wrapped_module.tiny") == "tiny" and _clean("") == ""


class _Edges(nn.Module):
    """A root that manages no parameter itself (all are in the wrapped Block), with a persistent
    and a non-persistent buffer and a module FSDP is told to ignore."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.side = nn.Linear(2, 3)
        self.register_buffer("count", torch.arange(3.0))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def _edges(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def wrap(**kw: Any) -> FSDP:
        torch.manual_seed(0)
        inner = _Edges()
        return FSDP(inner, auto_wrap_policy=ModuleWrapPolicy({Block}), ignored_states=[inner.side],
                    device_id=torch.device("cpu"), **kw)

    # A unit over a subgroup: ranks 0 and 1 share one, rank 2 is alone (FSDP makes that NO_SHARD).
    pair, alone = dist.new_group([0, 1]), dist.new_group([2])
    sub = wrap(process_group=pair if rank < 2 else alone)
    expect = r"FSDP unit 'block' shards over a process group of 2 ranks, but the default process group has 3"
    with pytest.raises(UnsupportedModelError, match=expect if rank < 2 else r"uses sharding strategy NO_SHARD"):
        fsdp1_state_dict(sub)

    model = wrap()
    with FSDP.summon_full_params(model), pytest.raises(
        UnsupportedModelError, match=r"FSDP unit 'block''s FlatParameter is not in its sharded state"
    ):
        fsdp1_state_dict(model)
    # No optimizer: only "model"; the root holds no FlatParameter, so there is one FlatShard; the
    # persistent buffer and the ignored module's parameters are plain tensors.
    sd = fsdp1_state_dict(model)
    assert list(sd) == ["model"]
    msd = sd["model"]
    assert sorted(msd) == ["__fsdp1_flat__/0", "count", "side.bias", "side.weight"]
    assert msd["count"] is model.count and bit_equal(msd["side.weight"], model.side.weight)
    assert isinstance(msd["__fsdp1_flat__/0"], FlatShard)

    # A stateless optimizer (SGD) contributes its param groups only.
    sgd = torch.optim.SGD(model.block.parameters(), lr=0.25)
    osd = fsdp1_state_dict(model, sgd)["optim"]
    assert list(osd) == ["param_groups"] and osd["param_groups"][0]["lr"] == 0.25

    optim = torch.optim.AdamW(model.block.parameters(), lr=1e-2)
    sd = fsdp1_state_dict(model, optim)  # creates the state
    (flat,) = optim.param_groups[0]["params"]
    fqns = sd["optim"]["param_groups"][0]["params"]
    optim.state[flat]["bad"] = torch.zeros(2)
    with pytest.raises(UnsupportedModelError, match=rf"optimizer state 'bad' of __fsdp1_flat__/0 \({fqns[0]}, {fqns[1]}, "
                                                     rf"{fqns[2]}, \.\.\.\) has shape \[2\], not the parameter's \[{flat.numel()}\]"):
        fsdp1_state_dict(model, optim)
    del optim.state[flat]["bad"]

    # A plain (non-tensor) state value is saved per original parameter and applied on load.
    optim.state[flat]["note"] = 7
    sd = fsdp1_state_dict(model, optim)
    assert sd["optim"]["state"] == {f: {"note": 7} for f in fqns}
    path = os.path.join(root, "edges")
    dcp.save(sd, storage_writer=UCPStorageWriter(path), planner=UCPSavePlanner())
    optim.state[flat]["note"] = 0
    optim.param_groups[0]["lr"] = 0.5
    sd = fsdp1_state_dict(model, optim)
    dcp.load(sd, storage_reader=UCPStorageReader(path), planner=UCPLoadPlanner())
    fsdp1_apply_loaded(model, optim, sd)
    assert optim.state[flat]["note"] == 7 and optim.param_groups[0]["lr"] == 1e-2

    sd["optim"]["state"][fqns[1]]["note"] = 8
    with pytest.raises(UnsupportedModelError, match=rf"optimizer state 'note' differs between parameters .*'{fqns[1]}'.* "
                                                     r"that share one FlatParameter: \[7, 8, 7"):
        fsdp1_apply_loaded(model, optim, sd)
    with pytest.raises(UnsupportedModelError, match=r"state has 0 param groups, the optimizer 1"):
        fsdp1_apply_loaded(model, optim, {"optim": {"param_groups": []}})
    with pytest.raises(UnsupportedModelError, match=r"loaded param group 0 holds \['block.q.bias', 'block.q.weight'\] that the "
                                                     r"optimizer's group 0 does not share"):
        fsdp1_apply_loaded(model, optim, {"optim": {"param_groups": [{"params": fqns[2:]}]}})

    # FlatParameter metadata laid out otherwise than this code understands (another torch
    # version's): each disagreement is a TorchInternalsError naming the unit, not a wrong layout.
    first = next(i for i, info in enumerate(flat._shard_param_infos) if info.in_shard)
    shifted = list(flat._shard_param_infos)
    shifted[first] = shifted[first]._replace(offset_in_shard=shifted[first].offset_in_shard + 1)
    for attr, value, says in (
        ("_numels", (flat._numels[0] + 1, *flat._numels[1:]), r"FSDP unit 'block': numel of 'q\.weight' disagrees"),
        ("_fqns", (*flat._fqns, "extra"), rf"FSDP unit 'block': FlatParameter metadata lists {len(fqns) + 1} "
                                          rf"parameters, found {len(fqns)}$"),
        ("_shard_param_infos", tuple(shifted), rf"FSDP unit 'block': computed layout of '{fqns[first]}' disagrees "
                                               r"with FSDP's shard metadata"),
    ):
        real = getattr(flat, attr)
        setattr(flat, attr, value)
        try:
            with pytest.raises(TorchInternalsError, match=says):
                fsdp1_state_dict(model)
        finally:
            setattr(flat, attr, real)
    assert list(fsdp1_state_dict(model)) == ["model"]  # the real metadata is understood again


def test_edges_of_the_fsdp1_state(tmp_path: Any) -> None:
    """A root without a FlatParameter, buffers, ignored modules, no or stateless optimizer, plain
    optimizer state saved and applied; subgroups, unsharded FlatParameters, state of another shape,
    param groups that do not match and FlatParameter metadata laid out otherwise are refused,
    naming the unit, state or group."""
    run_ranks(3, _edges, str(tmp_path))
